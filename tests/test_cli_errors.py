"""Bad input gives one clear line naming what is wrong (no traceback), and loses nothing."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml

from helpers import CONF
from helpers import run_cli

FAST = ["rounds=2", "progress=none", "tracker=none", "device=cpu", "checkpoint_every=0"]


def _csv(tmp_path, **columns):
    path = tmp_path / "table.csv"
    pd.DataFrame(columns).to_csv(path, index=False)
    return path


def _assert_clean_error(proc, *needles):
    assert proc.returncode != 0
    err = proc.stderr
    assert "Traceback" not in err, err[-2000:]
    for needle in needles:
        assert needle in err, err[-2000:]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("csv")
    rng = np.random.default_rng(0)
    n = 120
    return _csv(
        tmp,
        age=rng.normal(50, 10, n),
        chol=rng.normal(200, 30, n),
        site=rng.integers(0, 3, n),
        chd=rng.integers(0, 2, n),
    )


@pytest.mark.parametrize(
    "args,needles",
    [
        (["roundz=3"], ["roundz"]),
        (["rounds=many"], ["rounds", "many"]),
        (["+algorithm.server_lrr=1"], ["algorithm.server_lrr"]),
        (["algorithm.server_lr=fast"], ["algorithm.server_lr", "float"]),
        (
            ["dataset=csv", "dataset.path=/nonexistent/chd.csv", "dataset.label=chd"],
            ["/nonexistent/chd.csv", "not found"],
        ),
        (
            ["dataset=synthetic", "dataset.num_classes=3", "partition=label_imbalance"],
            ["binary", "[0, 1, 2]"],
        ),
        (
            ["num_clients=200", "partition=label_imbalance", "partition.delta=7"],
            ["client", "num_clients"] and ["client", "at least 2"],
        ),
        (["partition=dirichlet", "partition.alpha=0.001", "num_clients=100"], ["alpha=0.001"]),
        (["lr=1e38"], ["diverged", "client"]),
        (["device=cuda:7"], ["device", "cuda:7"]),
        (["algorithm=fedavg,dito"], ["algorithm=dito: no such option", "ditto", "pfednet"]),
        (["figures=maybe"], ["figures='maybe'", "expected true or false"]),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "unknown-group-key",
        "wrong-group-type",
        "csv-missing",
        "imbalance-non-binary",
        "too-many-clients",
        "dirichlet-empty",
        "nan-loss",
        "no-gpu",
        "unknown-option",
        "not-a-bool",
    ],
)
@pytest.mark.slow
def test_bad_input_is_one_clear_line(tmp_path, args, needles):
    if args == ["device=cuda:7"]:
        import torch

        if torch.cuda.device_count() > 7:
            pytest.skip("this machine has that GPU")
    proc = run_cli("run", *FAST, *args, cwd=tmp_path)
    _assert_clean_error(proc, *needles)


@pytest.mark.slow
def test_csv_without_label_column(tmp_path, table):
    proc = run_cli(
        "run",
        *FAST,
        "dataset=csv",
        f"dataset.path={table}",
        "dataset.label=TenYearCHD",
        cwd=tmp_path,
    )
    _assert_clean_error(proc, str(table), "TenYearCHD", "chd")


@pytest.mark.slow
def test_csv_with_non_numeric_feature(tmp_path):
    path = _csv(tmp_path, age=[50, 60, "old", 40] * 10, chd=[0, 1] * 20)
    proc = run_cli(
        "run",
        *FAST,
        "dataset=csv",
        f"dataset.path={path}",
        "dataset.label=chd",
        "num_clients=2",
        cwd=tmp_path,
    )
    _assert_clean_error(proc, "'age'", "not numeric", "'old'")


@pytest.mark.slow
def test_csv_dataset_runs_with_missing_values_and_sites(tmp_path, table):
    frame = pd.read_csv(table)
    frame.loc[::7, "chol"] = np.nan
    frame.to_csv(table, index=False)
    proc = run_cli(
        "run",
        *FAST,
        "dataset=csv",
        f"dataset.path={table}",
        "dataset.label=chd",
        "dataset.group=site",
        "partition=natural",
        "num_clients=3",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Per-client results" in proc.stdout


@pytest.mark.slow
def test_interrupted_run_prints_how_to_resume_and_resumes(tmp_path):
    import shlex
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    args = [
        "rounds=100000",
        "checkpoint_every=2",
        "tracker=none",
        "progress=none",
        "device=cpu",
        f"hydra.run.dir={out}",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from fedexp.cli import entry; entry()", "run", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a test run started in the background by a non-interactive shell inherits SIGINT
        # ignored, and so would the child (Python then installs no KeyboardInterrupt handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "last.safetensors").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    line = next(ln for ln in err.splitlines() if "resume=" in ln)
    command = shlex.split(line.split("checkpoint kept: ", 1)[1])
    assert command[:2] == ["fedexp", "run"]
    resumed = [a if not a.startswith("rounds=") else "rounds=4" for a in command[2:]]
    done = run_cli("run", *resumed, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Per-client results" in done.stdout


@pytest.mark.parametrize(
    "args,said",
    [
        (["rounds", "10"], "'rounds 10': overrides are written key=value, e.g. rounds=10"),
        (["--rounds=10"], "'--rounds=10': overrides are written key=value, e.g. rounds=10"),
        (["--rounds", "10"], "'--rounds 10': overrides are written key=value, e.g. rounds=10"),
        (["seed"], "'seed': overrides are written key=value, e.g. seed=<value>"),
    ],
)
def test_an_override_not_written_key_value_is_one_line(args, said):
    """``rounds 10`` or ``--rounds=10``: one ``fedexp:`` line, exit 2, not Hydra's parser
    error or its usage text (issue 43); Hydra's own flags and sweeps pass."""
    from fedexp.cli.overrides import override_shape_errors

    assert override_shape_errors(args) == [said]
    fine = ["rounds=2", "-m", "seed=0,1", "--cfg", "job", "--info", "plugins", "~tracker", "+a=1"]
    assert override_shape_errors(fine) == []


def test_cli_says_how_to_write_an_override(tmp_path):
    proc = run_cli("run", "rounds", "10", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "fedexp: error: 'rounds 10': overrides are written key=value, e.g. rounds=10"
    )
    assert list(tmp_path.iterdir()) == []


def _checkpointless_run(tmp_path):
    run = tmp_path / "outputs" / "2026-01-01" / "00-00-00"
    (run / "checkpoints").mkdir(parents=True)
    return run


@pytest.mark.parametrize(
    "args,said",
    [
        (
            ["dataset=brats", "dataset.path=/nope"],
            "fedexp: error: dataset.path='/nope': /nope does not exist; the prepared BraTS "
            "arrays are made by `python -m data_prep.brats --root RAW --out /nope`",
        ),
        (["dataset=brats"], "dataset.path='prepared/brats': prepared/brats does not exist"),
        (["resume=nope"], "fedexp: error: resume=nope: no such file or folder; expected a run"),
        (["resume=."], "resume=.: no checkpoint found (expected last.safetensors, or a run's"),
        (
            ["resume=outputs/2026-01-01/00-00-00"],
            "resume=outputs/2026-01-01/00-00-00: outputs/2026-01-01/00-00-00/checkpoints holds "
            "no checkpoint (last.safetensors)",
        ),
    ],
    ids=["data-path", "data-default-path", "resume-nothing", "resume-no-checkpoint", "no-first"],
)
def test_a_path_that_is_not_there_is_refused_before_hydra_makes_a_folder(tmp_path, args, said):
    """Issue 70, item 2: ``dataset.path=/nope`` and ``resume=<folder without a checkpoint>``
    exited 1 after the run started (torch, the threads line), leaving a stub run folder
    (``.hydra``, ``cli.log``); now one line, exit 2, and nothing new on disk."""
    _checkpointless_run(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    proc = run_cli("run", "tracker=none", *args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(tmp_path.rglob("*")) == before  # no run folder, no outputs/<date>


def test_every_data_set_names_a_missing_path_before_hydra(tmp_path):
    """Each dataset option with a ``path`` says what it expected there (its loader's own line),
    unless it fetches what is missing (``dataset.download=true``) or the path is there."""
    from fedexp.cli.overrides import CONFIG_DIR
    from fedexp.config.keys import dataset_path_errors

    nope = str(tmp_path / "nope")
    options = sorted(p.stem for p in (CONF / "dataset").glob("*.yaml"))
    with_path = [
        o for o in options if "path" in yaml.safe_load((CONF / "dataset" / f"{o}.yaml").read_text())
    ]
    assert {"brats", "luna16", "mnist", "cifar10", "cifar100", "tiny_imagenet", "csv"} <= set(
        with_path
    )
    for option in with_path:
        (said,) = dataset_path_errors([f"dataset={option}", f"dataset.path={nope}"], CONFIG_DIR)
        assert said.startswith(f"dataset.path={nope!r}: ") and "not" in said, said
        assert (
            dataset_path_errors([f"dataset={option}", f"dataset.path={tmp_path}"], CONFIG_DIR) == []
        )
    fetched = ["dataset=mnist", f"dataset.path={nope}", "dataset.download=true"]
    assert dataset_path_errors(fetched, CONFIG_DIR) == []
    assert dataset_path_errors([f"dataset.path={nope}"], CONFIG_DIR) == []  # breast_cancer: none
    assert dataset_path_errors(["+experiment=pfednet_brats"], CONFIG_DIR) == []  # its own path
    on_slurm = ["dataset=brats", f"dataset.path={nope}", "hydra/launcher=slurm"]
    assert dataset_path_errors(on_slurm, CONFIG_DIR) == []  # the nodes' to see


def test_a_mistyped_group_option_gets_the_closest(tmp_path):
    """Issue 70, item 4: ``algorithm=fedavgg`` listed the options without the closest one."""
    proc = run_cli("run", "algorithm=fedavgg", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        "fedexp: error: algorithm=fedavgg: no such option; did you mean fedavg, "
    ), proc.stderr
    assert "(expected one of: apfl, ditto, " in proc.stderr
    assert list(tmp_path.iterdir()) == []
