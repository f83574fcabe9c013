"""A misspelt or foreign key gets one line with the closest valid keys, before Hydra composes.

Issue "The researcher's loop, round two", item 4 (and the hardening corpus's last unclear
cases): ``algorithm.lamda=0.1`` or ``algorithm.mu=0.1`` on FedAvg got Hydra's multi-line struct
error and a HYDRA_FULL_ERROR hint. :func:`fedexp.config.keys.unknown_key_errors` checks every
plain override against the chosen options' files.
"""

from __future__ import annotations

import pytest

from fedexp.cli.overrides import CONFIG_DIR
from fedexp.config.keys import added_or_removed_errors
from fedexp.config.keys import unknown_key_errors
from helpers import run_cli


def errors(*args: str) -> list[str]:
    return unknown_key_errors(list(args), CONFIG_DIR)


def test_a_misspelt_group_key_names_the_closest():
    (line,) = errors("algorithm=ditto", "algorithm.lamda=0.1")
    assert line.startswith("algorithm.lamda: ditto (algorithm=ditto) has no such key")
    assert "did you mean algorithm.lam?" in line and "personal_steps" in line


def test_a_key_of_another_option_names_the_options_that_have_it():
    (line,) = errors("algorithm.mu=0.1")  # the default algorithm is FedAvg
    assert line.startswith("algorithm.mu: fedavg (algorithm=fedavg) has no such key")
    assert "algorithm=fednova|fedprox|fedprox_ft|moon|superfed have it" in line


def test_every_option_of_a_swept_group_is_checked():
    (line,) = errors("-m", "algorithm=fedavg,ditto", "algorithm.lam=0.1")
    assert line.startswith("algorithm.lam: fedavg (algorithm=fedavg)")
    assert errors("-m", "algorithm=ditto,pfedme", "algorithm.lam=0.1") == []


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["roundz=3"], "roundz: no such setting; did you mean rounds?"),
        (
            ["compressor=topk_zlib", "compressor.uplink.codec.level=3"],
            "compressor.uplink.codec.level:",
        ),
        (["dataset=mnist", "dataset.root=x"], "dataset.root: mnist (dataset=mnist)"),
        (["lr.x=1"], "lr.x: lr is a plain setting"),
        (["compressor=cer_stc", "compressor.uplink.transforms.1.gamma=0"], "compressor.uplink"),
    ],
)
def test_unknown_keys(args, start):
    (line,) = errors(*args)
    assert line.startswith(start), line


@pytest.mark.parametrize(
    "args",
    [
        ["algorithm=pfednet", "algorithm.lam=0.1", "rounds=3"],
        ["compressor=cer_stc", "compressor.uplink.transforms.0.gamma=0.1"],
        ["+algorithm.new_key=1", "~tracker.uri", "hydra.run.dir=x", "hydra/launcher=parallel"],
        ["+experiment=pfednet_tables", "algorithm.anything=1"],  # left to Hydra
        ["dataset=csv", "dataset.label=y", "model.personal=[head.*]", "hparams_search=lr"],
    ],
)
def test_valid_or_unchecked_command_lines_pass(args):
    assert errors(*args) == []


def test_the_cli_prints_one_line_and_exits_2(tmp_path):
    proc = run_cli("run", "algorithm=ditto", "algorithm.lamda=0.1", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedexp: error: algorithm.lamda:"), lines
    assert "HYDRA_FULL_ERROR" not in proc.stderr and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["~rounds"], "~rounds: a run setting cannot be removed; set it instead (rounds=<value>"),
        (["~algorithm"], "~algorithm: a run cannot do without its algorithm; choose one instead"),
        (["~tracker"], "~tracker: a run cannot do without its tracker; choose one instead"),
        (["+rounds=3"], "+rounds=3: rounds is already a setting; write rounds=3"),
        (["+algorithm=ditto"], "+algorithm=ditto: algorithm is chosen in the defaults already"),
        (["+hparams_search=lr"], "+hparams_search=lr: hparams_search is chosen in the defaults"),
        (["++algorithm=ditto"], "++algorithm=ditto: ++ cannot add a config group; write algo"),
        (["++experiment=cer_stc"], "++experiment=cer_stc: ++ cannot add a config group; write +"),
        (["+rouns=3"], "+rouns=3: no such setting; did you mean rounds?"),
        (["++rouns=3"], "++rouns=3: no such setting; did you mean rounds?"),
        (["+experiment=cer_stc", "+rouns=3"], "+rouns=3: no such setting"),  # experiments too
    ],
)
def test_a_top_level_key_added_or_removed_that_the_run_cannot_take(args, start):
    """``~rounds`` failed with a traceback after the run started, ``+rouns=3`` was ignored
    (the run took its 50 rounds), ``+rounds=3`` got Hydra's four lines."""
    (line,) = added_or_removed_errors(args, CONFIG_DIR)
    assert line.startswith(start), line


def test_adding_and_removing_that_hydra_takes_pass():
    fine = [
        "+experiment=pfednet_tables",  # a group the defaults do not name
        "++rounds=3",  # force-add of a setting: an override
        "+algorithm.new_key=1",  # nested: Hydra's (and the algorithm's own check)
        "~tracker.uri",
        "~hydra.sweeper.params.lr",
        "+backend=sequential",  # removed: named by schema.override_errors
        "rounds=3",
        "-m",
    ]
    assert added_or_removed_errors(fine, CONFIG_DIR) == []


def test_the_cli_refuses_a_removal_in_one_line_before_anything_runs(tmp_path):
    proc = run_cli("run", "~rounds", "tracker=none", cwd=tmp_path)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("fedexp: error: ~rounds: a run setting cannot be removed")
    assert not (tmp_path / "outputs").exists()


def test_several_values_without_multirun_are_one_line(tmp_path):
    """``seed=0,1`` without ``-m`` got Hydra's five lines ("Ambiguous value ...") and its
    HYDRA_FULL_ERROR hint; a quoted value is one string, and ``-m`` sweeps."""
    from fedexp.cli.overrides import sweep_without_multirun

    (line,) = sweep_without_multirun(["seed=0,1", "rounds=2"])
    assert line == (
        "seed=0,1: several values are a sweep, run with -m (fedexp run -m seed=0,1); "
        "a list is written seed=[...]"
    )
    (line,) = sweep_without_multirun(["lr=range(0.1,0.3,0.1)"])
    assert line.startswith("lr=range(0.1,0.3,0.1): several values are a sweep")
    assert sweep_without_multirun(["-m", "seed=0,1"]) == []
    assert sweep_without_multirun(["dataset.label='a,b'", "model.personal=[head.*]"]) == []
    proc = run_cli("run", "algorithm=fedavg,ditto", "tracker=none", cwd=tmp_path)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("fedexp: error: algorithm=fedavg,ditto: several values")
    assert "HYDRA_FULL_ERROR" not in proc.stderr and not (tmp_path / "outputs").exists()
