"""The sweep's callback and its helpers in-process (issue 13): which keys vary, the names of
the child runs and of an ad-hoc sweep's experiment, the `fedexp report` command, the parent
run's start and end, jobs that left no status, SLURM without SLURM."""

from __future__ import annotations

import json
import shlex

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

import fedexp.sweep as sweep
from fedexp.sweep import NO_SLURM
from fedexp.sweep import JobStatus
from fedexp.sweep import SweepCallback
from fedexp.sweep import SweepInfo
from fedexp.sweep import child_name
from fedexp.sweep import experiment_name
from fedexp.sweep import report_command
from fedexp.sweep import varying_keys
from fedexp.sweep import write_status
from helpers import mlflow_db

BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
MLFLOW = "fedexp.tracking.mlflow_tracker.MLflowTracker"


@pytest.mark.parametrize(
    ("task", "params", "expected"),
    [
        (["algorithm=fedavg,ditto", "seed=0,1,2", "rounds=5"], None, ["algorithm", "seed"]),
        (["+algorithm.mu=0.01,0.1", "seed=range(3)", "lr=0.1"], None, ["algorithm.mu", "seed"]),
        (["seed=0", "lr=0.1,0.1"], None, []),  # one value, even written as a list
        (  # an experiment file's sweep; the command line fixes the seed, adds a sweep
            ["seed=0", "algorithm=pfednet,ditto"],
            {"algorithm": "fedavg,fedprox", "partition.delta": "1,2,3,4", "seed": "0,1,2"},
            ["partition.delta", "algorithm"],
        ),
        (  # Optuna's search space varies too
            ["algorithm=ditto"],
            {"lr": "tag(log, interval(0.0001, 1))", "algorithm.lam": "choice(0.01, 0.1, 1)"},
            ["lr", "algorithm.lam"],
        ),
    ],
    ids=["command-line", "prefix-and-range", "constant", "sweeper-params", "optuna"],
)
def test_varying_keys(task, params, expected):
    assert varying_keys(task, params) == expected


def test_child_name_is_short_value_first_without_the_constant_keys():
    job = ["seed=2", "algorithm=ditto", "rounds=5", "tracker.uri=sqlite\\:///m.db", "+x.y=1"]
    assert child_name(job, ["algorithm", "seed"]) == "ditto s2"
    assert child_name(job, ["x.y"]) == "y=1"
    assert child_name(job, []) == ""


def test_experiment_name_of_an_ad_hoc_sweep_is_readable():
    when = "2026-11-22 10:00:00"
    assert (
        experiment_name(["algorithm", "seed"], when) == "fedexp/algorithm,seed 2026-11-22 10:00:00"
    )
    assert experiment_name([], when) == "fedexp/sweep 2026-11-22 10:00:00"


@pytest.mark.parametrize(
    ("uri", "varying", "metric", "expected"),
    [
        (
            None,
            ["algorithm", "seed", "partition.delta"],
            "acc/mean",
            "--experiment E --rows choice.algorithm --cols partition.delta",
        ),
        (
            "sqlite:///x.db",
            ["lr", "algorithm.mu", "dataset"],
            "iou/mean",
            "--uri sqlite:///x.db --experiment E --rows lr --cols algorithm.mu choice.dataset "
            "--metric iou/mean",
        ),
        (None, ["seed"], None, "--experiment E --rows choice.algorithm"),
    ],
    ids=["algorithm-rows", "uri-metric", "seeds-only"],
)
def test_report_command(uri, varying, metric, expected):
    groups = ["algorithm", "dataset", "model", "hydra/launcher"]
    command = report_command("E", uri, varying, groups, metric)
    assert command == f"fedexp report {expected}"


def _config(tmp_path, task, *, tracker=None, launcher=BASIC, params=None):
    """The parts of a composed multirun config the callback reads."""
    return OmegaConf.create(
        {
            "tracker": tracker or {"_target_": "fedexp.tracking.base.NullTracker"},
            "hydra": {
                "overrides": {"task": task},
                "sweeper": {"params": params},
                "launcher": {"_target_": launcher},
                "runtime": {"choices": {"algorithm": "fedavg", "hydra/launcher": "basic"}},
                "sweep": {"dir": str(tmp_path / "sweep")},
            },
        }
    )


def _job(tmp_path, num, info, status, **fields):
    folder = tmp_path / "sweep" / str(num)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(f"- seed={num}\n")
    if status is not None:
        write_status(folder, JobStatus(num, status, sweep_id=info.sweep_id, **fields))


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One SQLite MLflow store for the module (creating one costs seconds)."""
    return mlflow_db(tmp_path_factory.mktemp("mlflow") / "m.db")


def test_parent_run_summary_and_outcome(tmp_path, capsys, uri):
    tracker = {"_target_": MLFLOW, "uri": uri, "experiment": "my-study"}
    cfg = _config(tmp_path, ["seed=0,1,2", "rounds=2"], tracker=tracker)
    callback = SweepCallback()
    callback.on_multirun_start(cfg)
    info = SweepInfo.read(tmp_path / "sweep")
    assert info.varying == ["seed"] and info.experiment == "my-study"  # tracker.experiment wins
    assert callback.__getstate__()["_parent"] is None  # picklable into joblib workers
    _job(tmp_path, 0, info, "ok", name="seed=0", run_id="r0", metrics={"acc/mean": 0.8})
    _job(tmp_path, 1, info, "failed", name="seed=1", error="lr=-1.0: expected > 0\nmore")
    _job(tmp_path, 2, info, None)  # killed before it could record its end
    callback.on_multirun_end(cfg)
    out = capsys.readouterr().out
    assert "sweep done, 3 jobs: 1 ok, 2 failed" in out
    assert "  failed: [job 1 seed=1] lr=-1.0: expected > 0\n" in out
    assert "  failed: [job 2 s2] no status recorded" in out
    tables = next(ln for ln in out.splitlines() if ln.startswith("tables: "))
    expected = ["--uri", uri, "--experiment", "my-study", "--rows", "choice.algorithm"]
    assert shlex.split(tables)[3:] == expected
    assert sweep.last is not None and [j.job for j in sweep.last.failed] == [1, 2]
    run = MlflowClient(uri).get_run(info.parent_run_id)
    assert run.info.run_name == "seed=0,1,2 rounds=2"
    assert run.info.status == "FAILED"
    assert run.data.tags["fedexp.sweep.varying"] == "seed"
    assert run.data.tags["fedexp.sweep.summary"] == "3 jobs: 1 ok, 2 failed"


def test_no_parent_run_with_tracker_none_and_stale_statuses_ignored(tmp_path, capsys):
    old = tmp_path / "sweep" / "7"
    write_status(old, JobStatus(7, "failed", sweep_id="an-earlier-sweep"))
    cfg = _config(tmp_path, ["seed=0,1"])
    callback = SweepCallback()
    callback.on_multirun_start(cfg)
    info = json.loads((tmp_path / "sweep" / "fedexp_sweep.json").read_text())
    assert info["parent_run_id"] is None and info["experiment"] is None
    for n in range(2):
        _job(tmp_path, n, SweepInfo.read(tmp_path / "sweep"), "ok", name=f"seed={n}")
    callback.on_multirun_end(cfg)
    out = capsys.readouterr().out
    assert "sweep done, 2 jobs: 2 ok, 0 failed" in out and "tables:" not in out
    assert sweep.last is not None and sweep.last.failed == []


def test_slurm_launcher_without_slurm_is_one_line_before_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    cfg = _config(tmp_path, ["seed=0,1"], launcher=SLURM)
    with pytest.raises(SystemExit) as exit_:
        SweepCallback().on_multirun_start(cfg)
    assert exit_.value.code == 1
    assert capsys.readouterr().err == f"fedexp: error: {NO_SLURM}\n"
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_stopped_before_its_end_is_still_summarised(tmp_path, capsys, uri):
    tracker = {"_target_": MLFLOW, "uri": uri, "experiment": None}
    cfg = _config(tmp_path, ["algorithm=fedavg,ditto", "seed=0,1"], tracker=tracker)
    callback = SweepCallback()
    callback.on_multirun_start(cfg)
    info = SweepInfo.read(tmp_path / "sweep")
    assert info.experiment.startswith("fedexp/algorithm,seed 20")  # ad hoc: named by what varies
    _job(tmp_path, 0, info, "ok", name="algorithm=fedavg,seed=0", metrics={"acc/mean": 0.8})
    summary = sweep.end_unfinished("interrupted", "KILLED")  # Hydra never called on_multirun_end
    assert summary is not None and sweep.end_unfinished("again") is None
    out = capsys.readouterr().out
    assert "sweep stopped before its end (interrupted); 1 job: 1 ok, 0 failed so far" in out
    assert MlflowClient(uri).get_run(info.parent_run_id).info.status == "KILLED"


def test_report_command_of_a_tuning_sweep_selects_on_validation():
    groups = ["algorithm", "hparams_search"]
    command = report_command("E", None, ["lr", "algorithm.mu"], groups, "acc/mean", tuning=True)
    assert command == (
        "fedexp report --experiment E --rows choice.algorithm --select-by val/acc/mean"
    )
    seg = report_command("E", None, ["lr"], groups, "iou/mean", tuning=True)
    assert seg.endswith("--metric iou/mean --select-by val/iou/mean")
