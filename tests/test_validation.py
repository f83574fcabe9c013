"""Every bad value: one clear line naming the key, the value and what was expected (issue 12).

The run settings' ranges are checked by :func:`fedexp.config.schema.validate` right after
compose, before torch or the runner is imported (through the CLI here); the values that need
the data (batch size, classes per shard), pFedNet's k and the CSV contents through the
functions that check them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from omegaconf import open_dict

from fedexp.config.schema import validate
from fedexp.data import partitions as P
from fedexp.data.tabular import csv_table
from fedexp.errors import ConfigError
from fedexp.errors import DataError
from helpers import ROOT
from helpers import compose_config
from helpers import run_cli
from helpers import without_hydra_logging

FAST = ["progress=none", "tracker=none", "device=cpu", "checkpoint_every=0"]


@pytest.fixture(scope="module")
def base():
    """The default config, composed once (tests change copies of it)."""
    return compose_config(*FAST)


def _with(cfg, **values):
    out = cfg.copy()
    with open_dict(out):
        for key, value in values.items():
            out[key] = value
    return out


# ---------------------------------------------------------------------- through the CLI


@pytest.mark.parametrize(
    "override,needle",
    [
        ("lr=0", "lr=0.0: expected > 0"),
        ("local_steps=0", "local_steps=0: expected ≥ 1"),
        ("batch_size=-5", "batch_size=-5: expected ≥ 1, or 0 / -1"),
        ("participation=1.5", "participation=1.5: expected a fraction in (0, 1]"),
        ("rounds=0", "rounds=0: expected ≥ 1"),
    ],
    ids=["lr", "local_steps", "batch_size", "participation", "rounds"],
)
def test_cli_reports_a_bad_value_in_one_line_before_building(tmp_path, override, needle):
    out = tmp_path / "run"
    proc = run_cli("run", *FAST, override, f"hydra.run.dir={out}", cwd=tmp_path)
    assert proc.returncode == 2  # a refused setting: nothing ran
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    # nothing of a run was written: no checkpoint, no metrics, no results
    assert not (out / "checkpoints").exists()
    assert not list(out.glob("*.csv")) and not list(out.glob("*.png"))


def test_bad_value_is_reported_before_the_heavy_imports(tmp_path):
    """The CLI refuses ``lr=-1`` without importing the runner (nor torch)."""
    code = textwrap.dedent(
        f"""
        import sys
        from fedexp.cli import main
        sys.argv = ["fedexp", "run", "lr=-1", "tracker=none", "hydra.run.dir={tmp_path / "o"}"]
        try:
            main()
        except SystemExit as exc:
            print("exit", exc.code)
        print("runner", "fedexp.engine.runner" in sys.modules)
        print("torch", "torch" in sys.modules)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.split() == ["exit", "2", "runner", "False", "torch", "False"], (
        proc.stdout + proc.stderr[-2000:]
    )
    assert "lr=-1.0: expected > 0" in proc.stderr


# --------------------------------------------------------------- the ranges (validate)


@pytest.mark.parametrize(
    "values,needle",
    [
        ({"num_clients": 0}, "num_clients=0: expected ≥ 1"),
        ({"participation": 0.0}, "participation=0.0: expected a fraction in (0, 1]"),
        ({"local_epochs": -1.0}, "local_epochs=-1.0: expected > 0"),
        ({"local_epochs": 0.0}, "local_epochs=0.0: expected > 0"),
        ({"lr": float("nan")}, "lr=nan: expected > 0"),
        ({"lr": float("inf")}, "lr=inf: expected > 0"),
        ({"eval_every": 0}, "eval_every=0: expected ≥ 1"),
        ({"checkpoint_every": -1}, "checkpoint_every=-1: expected ≥ 0"),
        ({"test_fraction": 0.0}, "test_fraction=0.0: expected a fraction in (0, 1)"),
        ({"test_fraction": 1.0}, "test_fraction=1.0: expected a fraction in (0, 1)"),
        ({"progress": "fancy"}, "progress='fancy': expected one of auto, bar, log, none"),
        ({"threads": -2}, "threads=-2: expected ≥ 0"),
        ({"batch_size": -2}, "batch_size=-2: expected ≥ 1, or 0 / -1"),
        ({"seed": -1}, "seed=-1: expected an integer ≥ 0"),
        ({"sampling": "bogus"}, "sampling='bogus': expected one of shuffle, replacement"),
    ],
)
def test_validate_names_the_key_the_value_and_the_range(base, values, needle):
    with pytest.raises(ConfigError) as info:
        validate(_with(base, **values))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_validate_accepts_the_edges_of_the_ranges(base):
    validate(base)
    for values in (
        {"batch_size": 0},
        {"batch_size": -1},
        {"participation": 1.0},
        {"checkpoint_every": 0},
        {"local_steps": 0, "local_epochs": 0.5},  # local_steps is unused with local_epochs
        {"rounds": 1, "num_clients": 1},
        {"seed": 0},
    ):
        validate(_with(base, **values))


def test_validate_reports_every_bad_key_in_one_line(base):
    with pytest.raises(ConfigError) as info:
        validate(_with(base, rounds=0, lr=-0.1))
    assert str(info.value) == "rounds=0: expected ≥ 1; lr=-0.1: expected > 0"


# ------------------------------------------------------- values that need the data / N


def test_pfednet_k_must_be_below_the_number_of_clients():
    validate(compose_config("algorithm=pfednet", "num_clients=4"))  # k=3 links every pair
    with pytest.raises(ConfigError, match=r"algorithm\.k=3: expected < num_clients=3"):
        validate(compose_config("algorithm=pfednet", "num_clients=3"))


def test_batch_larger_than_every_client_is_refused(base):
    clients = [SimpleNamespace(num_train=n) for n in (40, 91, 57)]
    validate(_with(base, batch_size=91), clients)
    with pytest.raises(ConfigError) as info:
        validate(_with(base, batch_size=92), clients)
    assert "batch_size=92" in str(info.value) and "n_train=91" in str(info.value)


def test_build_engine_refuses_a_batch_larger_than_the_data(small_cfg):
    from fedexp.engine.runner import build_engine

    with pytest.raises(ConfigError, match=r"batch_size=100000: .*largest client has n_train="):
        build_engine(small_cfg("batch_size=100000"))


def test_a_batch_larger_than_every_client_names_how_many_clients_would_do(small_cfg):
    """Issue 43 item 1: README's num_clients=100 batch_size=8 (569 samples: at most 6 a
    client) is refused saying both ways out, a batch ≤ 6 or at most N clients; N works."""
    from fedexp.engine.runner import build_engine

    with pytest.raises(ConfigError) as info:
        build_engine(small_cfg("num_clients=100", "batch_size=8"))
    message = str(info.value)
    assert message.startswith("batch_size=8: larger than every client's training data")
    assert "n_train=6); expected ≤ 6, or 0 / -1 for the full batch, or num_clients ≤ " in message
    most = int(message.split("num_clients ≤ ")[1].split()[0])
    assert 1 < most < 100 and message.endswith(f"num_clients ≤ {most} to keep batch_size=8")
    clients = build_engine(small_cfg(f"num_clients={most}", "batch_size=8")).clients
    assert max(c.num_train for c in clients) >= 8


def test_clients_for_batch_bisects_the_number_of_clients():
    from fedexp.data.dataset import ArrayDataset
    from fedexp.data.federated import clients_for_batch

    y = np.arange(40) % 2
    data = ArrayDataset("t", np.zeros((40, 3), np.float32), y, 2)
    # an IID split of 40 samples, 25 % of each client's for testing: 30/n training samples
    most = clients_for_batch(data, P.iid, 10, 20, 0.25, seed=0)
    assert most == 3  # 3 clients: 10, 9, 9 training samples; 4 clients: 7-8
    assert clients_for_batch(data, P.iid, 31, 20, 0.25, seed=0) is None  # not even 1 client
    assert clients_for_batch(data, P.iid, 8, 1, 0.25, seed=0) is None  # no fewer clients


def test_a_refused_run_leaves_no_empty_output_folder(tmp_path, monkeypatch, capsys):
    """The data-dependent refusal happens after Hydra made the run's folder: the folder (and
    the outputs/<date> folders made for it) go again, and the error is one line, exit 2."""
    from fedexp.cli import main

    without_hydra_logging(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys, "argv", ["fedexp", "run", "num_clients=100", "batch_size=8", "tracker=none"]
    )
    with pytest.raises(SystemExit) as exc:
        main()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("fedexp: error: batch_size=8: larger than every client's") and (
        "num_clients ≤ " in line
    )
    assert "Traceback" not in err
    assert not (tmp_path / "outputs").exists(), list(tmp_path.rglob("*"))


def test_shards_with_more_classes_per_client_than_the_data_has():
    labels = np.repeat(np.arange(3), 20)
    assert len(P.shards(labels, 4, seed=0, classes_per_client=3)) == 4
    with pytest.raises(DataError, match=r"classes_per_client=4: the data has only 3 classes"):
        P.shards(labels, 4, seed=0, classes_per_client=4)


@pytest.mark.parametrize(
    "call,needle",
    [
        (lambda y: P.dirichlet(y, 3, 0, alpha=float("nan")), "partition.alpha=nan"),
        (lambda y: P.dirichlet(y, 3, 0, max_tries=0), "partition.max_tries=0"),
        (lambda y: P.label_imbalance(y, 3, 0, delta=float("nan")), "partition.delta=nan"),
    ],
    ids=["alpha-nan", "no-tries", "delta-nan"],
)
def test_partition_parameters(call, needle):
    with pytest.raises(DataError, match=needle):
        call(np.repeat([0, 1], 30))


def test_federate_refuses_indices_outside_the_data():
    import torch

    from fedexp.data.dataset import ArrayDataset
    from fedexp.data.federated import federate

    data = ArrayDataset("t", np.zeros((10, 2), np.float32), np.repeat([0, 1], 5), 2)

    def bad(labels, num_clients, seed, groups):
        return [np.arange(0, 5), np.arange(5, 11)]

    with pytest.raises(DataError, match=r"client 1 sample indices outside \[0, 10\)"):
        federate(data, bad, 2, 0.2, 0, torch.device("cpu"))


# ------------------------------------------------------------------------ CSV contents


def _write(tmp_path, text: str | bytes, name: str = "t.csv"):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


ROWS = "".join(f"{i},{i % 7},{i % 2}\n" for i in range(20))


@pytest.mark.parametrize(
    "content,needles",
    [
        ("a,b,y\n" + ROWS + "1,inf,0\n", ["'b'", "infinite value (inf)", "row 21", "line 22"]),
        ("a,b,y\n" + ROWS + "-Infinity,2,1\n", ["'a'", "infinite value (-inf)"]),
        ("a,b,y\n" + ROWS + "3,1e400,1\n", ["'b'", "infinite"]),
        ("a,b,y\n1e31,2,0\n" + ROWS, ["'a'", "magnitude above 1e+30", "row 1"]),
        ("a,b,y\n", ["a header but no data rows"]),
        ("", ["the file is empty"]),
        (
            ("a,b,y\n" + ROWS + "é,1,0\n").encode("latin-1"),
            ["not UTF-8", "line 22", "expected UTF-8 text"],
        ),
    ],
    ids=["inf", "minus-infinity", "overflow", "huge", "header-only", "empty", "latin-1"],
)
def test_csv_contents_name_the_file_and_the_column(tmp_path, content, needles):
    path = _write(tmp_path, content)
    with pytest.raises(DataError) as info:
        csv_table(str(path), label="y")
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    for needle in needles:
        assert needle in message


def test_csv_path_that_is_a_folder(tmp_path):
    with pytest.raises(DataError, match=r"is a folder; expected a CSV file") as info:
        csv_table(str(tmp_path), label="y")
    assert str(tmp_path) in str(info.value)


def test_csv_with_missing_values_and_large_finite_values_loads(tmp_path):
    path = _write(tmp_path, "a,b,y\n" + ROWS + "1e29,,1\n")
    data = csv_table(str(path), label="y")
    assert data.x.shape == (21, 2) and np.isfinite(data.x).all()


def test_csv_group_equal_to_label(tmp_path):
    path = _write(tmp_path, "a,b,y\n" + ROWS)
    with pytest.raises(DataError, match="dataset.group and dataset.label are both 'y'"):
        csv_table(str(path), label="y", group="y")


@pytest.mark.slow
def test_csv_cli_reports_the_column(tmp_path):
    path = _write(tmp_path, "a,b,y\n" + ROWS * 3 + "1,inf,0\n")
    frame = pd.read_csv(path)  # pandas reads the value as inf: the loader must refuse it
    assert np.isinf(frame["b"]).any()
    proc = run_cli(
        "run", *FAST, "rounds=1", "dataset=csv", f"dataset.path={path}", "dataset.label=y",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "feature column 'b' has an infinite value" in proc.stderr


def test_override_errors_checks_only_plain_run_settings():
    """The CLI's check before Hydra: literal top-level values only; sweeps, experiment files,
    group keys and local_steps (it depends on local_epochs) are left to validate()."""
    from fedexp.config.schema import override_errors

    assert (
        override_errors(["lr=0.1", "rounds=3", "seed=1,2", "+experiment=x", "algorithm=fedavg"])
        == []
    )
    assert override_errors(["local_steps=0", "lr=${oc.env:LR}", "participation=0.5"]) == []
    assert override_errors(["lr=-1", "batch_size=-5", "progress=fancy"]) == [
        "batch_size=-5: expected ≥ 1, or 0 / -1 for the full batch",
        "lr=-1.0: expected > 0",
        "progress='fancy': expected one of auto, bar, log, none",
    ]


def test_a_removed_setting_is_named_with_what_to_do_instead():
    """``backend`` went with issue 22 (every run takes the one path): an old command's
    ``backend=lockstep`` gets one line saying so, before Hydra composes anything."""
    from fedexp.config.schema import override_errors

    for given in ("backend=lockstep", "+backend=sequential"):
        (message,) = override_errors(["lr=0.1", given])
        assert message.startswith("backend: the setting was removed") and "one path" in message
    assert override_errors(["lr=0.1"]) == []


def test_the_cli_refuses_a_removed_setting_in_one_line(tmp_path):
    from helpers import run_cli

    out = run_cli("run", "backend=lockstep", "tracker=none", cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedexp: error: backend: the setting was")
    assert not (tmp_path / "outputs").exists()  # nothing ran, nothing written
