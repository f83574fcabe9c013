"""Sweeps you can read ("The researcher's loop, round two", items 1, 2, 3 and 8).

1. A sweep prints one line per job (80 columns, basic and joblib launchers); the per-round
   lines are in each job's own log file; on a terminal one live display.
2. In MLflow: short child names, value first (``local δ=2 s1``); the varying keys as params
   and tags; a colour per run; the parent run logs the sweep's summary; the printed link opens
   the sweep grouped by the varying keys (a shared view stored with the experiment).
3. A single run is named by what its command line changes (at most 40 characters).
8. Ctrl-C stops the jobs, ends their runs KILLED, prints the summary; a sweep that recorded
   nothing leaves nothing in MLflow.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from fedexp import sweep
from fedexp.engine.files.progress import PROGRESS_FILE
from fedexp.engine.files.progress import RoundProgress
from fedexp.engine.files.progress import job_label
from fedexp.sweep import JobStatus
from fedexp.sweep import LiveSweep
from fedexp.sweep import SweepCallback
from fedexp.sweep import SweepInfo
from fedexp.sweep import child_name
from fedexp.sweep import group_keys
from fedexp.sweep import metric_label
from fedexp.sweep import run_color
from fedexp.sweep import run_name
from fedexp.sweep import sweep_size
from fedexp.sweep import sweep_values
from fedexp.sweep import write_status
from fedexp.tracking.links import SHARE_PARAM
from fedexp.tracking.links import SHARE_TAG_PREFIX
from fedexp.tracking.links import compress_state
from fedexp.tracking.links import group_id
from fedexp.tracking.links import read_shared_view
from fedexp.tracking.links import shared_view
from fedexp.tracking.links import sweep_view_url
from helpers import mlflow_db
from helpers import run_cli

pytestmark = pytest.mark.slow  # several processes or whole CLI runs: make test-slow

TINY = ["rounds=1", "num_clients=3", "device=cpu", "checkpoint_every=0"]
ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "80", "LINES": "24"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _fedexp(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``fedexp`` in a subprocess, its terminal 80 columns wide, its streams unbuffered (where
    the jobs' lines would interleave if a line took more than one write)."""
    env = {"COLUMNS": "80", "LINES": "24", "PYTHONUNBUFFERED": "1"}
    return run_cli(*args, cwd=cwd, timeout=timeout, env=env)


def _rows(text: str, width: int = 80) -> int:
    """Terminal rows ``text`` takes at ``width`` columns (long lines wrap)."""
    return sum(max(1, math.ceil(len(line) / width)) for line in text.splitlines())


# ---- 1. one line per job ---------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["basic", "parallel"])
def test_a_sweep_prints_one_line_per_job_at_80_columns(tmp_path, launcher):
    proc = _fedexp(
        "run",
        "-m",
        "algorithm=fedavg,local",
        "seed=0,1",
        *TINY,
        "rounds=2",
        "tracker=none",
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={tmp_path}/sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]
    out = proc.stdout
    body, _, summary = out.partition("\nsweep done, ")
    lines = body.splitlines()
    assert lines[0].startswith("sweep: 4 jobs over algorithm, seed"), out
    jobs = [re.match(r"\[job (\d)\] ", ln) for ln in lines[1:]]
    assert all(jobs) and sorted(m.group(1) for m in jobs) == list("0123"), out
    assert all(len(ln) <= 80 for ln in lines), out
    # at 80 columns: one row per job, plus the header and the summary (ok, best, MLflow)
    assert _rows(body) == 1 + 4 and summary.count("\n") <= 4, out
    assert not re.search(r"round \d/", out), out
    for n in range(4):  # each job's rounds are in its own log file (Hydra's <job>/cli.log)
        log = (tmp_path / "sweep" / str(n) / "cli.log").read_text()
        assert f"[job {n}] round 1/2" in log and f"[job {n}] round 2/2" in log, log


def test_quiet_job_logs_rounds_to_its_file_and_warnings_to_the_terminal(tmp_path):
    terminal, path = io.StringIO(), tmp_path / "job.log"
    stream, file = logging.StreamHandler(terminal), logging.FileHandler(path)
    root = logging.getLogger()
    root.addHandler(stream)
    root.addHandler(file)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        with job_label("job 2", quiet=True, folder=tmp_path):
            with RoundProgress(3, mode="auto") as progress:
                assert progress.mode == "log"
                for t in (1, 2, 3):
                    progress.update(t, {"acc/mean": 0.5 + t / 10})
            logging.getLogger("fedexp").warning("disk almost full")
        logging.getLogger("fedexp").info("after the job")
    finally:
        root.removeHandler(stream)
        root.removeHandler(file)
        root.setLevel(level)
        file.close()
    shown, logged = terminal.getvalue(), path.read_text()
    assert "round" not in shown and "[job 2] disk almost full" in shown
    assert "after the job" in shown  # the filter goes with the job
    assert "[job 2] round 3/3 acc/mean=0.8" in logged
    progress = json.loads((tmp_path / PROGRESS_FILE).read_text())
    assert progress["round"] == 3 and progress["total"] == 3


def test_live_display_prints_finished_jobs_and_shows_running_ones(tmp_path):
    from rich.console import Console

    info = SweepInfo("s1", ["algorithm", "seed"], started=time.time() - 60, live=True)
    folder = tmp_path / "sweep"
    write_status(
        folder / "0",
        JobStatus(0, "ok", name="fedavg s0", metrics={"acc/mean": 0.8}, sweep_id="s1"),
    )
    running = folder / "1"
    (running / ".hydra").mkdir(parents=True)
    (running / ".hydra" / "overrides.yaml").write_text("- algorithm=local\n- seed=1\n")
    (running / PROGRESS_FILE).write_text(json.dumps({"round": 3, "total": 10, "info": ""}))
    console = Console(width=80, record=True, force_terminal=True, color_system=None)
    live = LiveSweep(str(folder), info, total=4, console=console)
    live.poll()
    text = console.export_text(clear=False)
    assert "[job 0] fedavg s0  acc/mean=0.8000" in text
    screen = Console(width=80, record=True, color_system=None)
    screen.print(live._render())
    shown = screen.export_text()
    assert re.search(r"sweep .* 1/4 jobs  1 running  ETA 00:0[23]:\d\d", shown), shown
    assert "job 1   local s1  round 3/10" in shown, shown


# ---- 2. names, params, tags, the parent's summary, the link -----------------------------------


def test_child_names_are_short_and_value_first():
    job = ["seed=1", "partition.delta=2", "algorithm=local", "rounds=5", "tracker=none"]
    name = child_name(job, ["algorithm", "seed", "partition.delta"])
    assert name == "local δ=2 s1"
    long = ["algorithm=fedprox", "partition=dirichlet", "partition.alpha=0.3", "seed=2"]
    varying = ["partition", "partition.alpha", "algorithm", "seed"]
    assert child_name([*long, "algorithm.mu=0.01"], [*varying, "algorithm.mu"]) == (
        "fedprox dirichlet α=0.3 μ=0.01 s2"
    )
    assert len(child_name([*long, "algorithm.mu=0.01"], [*varying, "algorithm.mu"])) <= 34
    # other keys: the last part of their name (whole where two would read alike), values cut
    odd = ["compressor.uplink.transforms.0.gamma=2", "dataset.path=/data/very/long/bc_table.csv"]
    assert child_name(odd, ["compressor.uplink.transforms.0.gamma", "dataset.path"]) == (
        "gamma=2 path=bc_table.csv"
    )
    assert child_name(["a.lr=1", "b.lr=2"], ["a.lr", "b.lr"]) == "a.lr=1 b.lr=2"
    assert child_name(["lr=0.1"], ["lr"]) == "lr=0.1"


def test_single_run_names_say_what_differs_from_the_defaults():
    assert run_name(["partition=dirichlet", "num_clients=20"], "fedavg") == "fedavg dirichlet N=20"
    assert run_name(["seed=3", "algorithm=local", "lr=0.01"], "local") == "local lr=0.01 s3"
    # settings that change no result are not in the name: the default run keeps its own
    quiet = ["progress=none", "device=cpu", "tracker.uri=sqlite:///m.db", "hydra.run.dir=/x"]
    assert run_name([*quiet, "checkpoint_every=0", "tracker=none"], "fedavg") is None
    long = ["dataset=csv", "dataset.path=bc.csv", "dataset.label=target", "model=mlp"]
    name = run_name([*long, "partition=natural", "num_clients=10", "lr=0.05"], "ditto")
    assert name.startswith("ditto csv path=bc.csv") and len(name) <= 40 and name.endswith("…")


def test_single_run_name_in_the_cli_keeps_the_default_for_the_default_run():
    from fedexp.cli.job import run_name as cli_run_name

    def hc(task: list[str]):
        choices = {"algorithm": "fedavg", "dataset": "breast_cancer", "model": "logreg"}
        return OmegaConf.create({"runtime": {"choices": choices}, "overrides": {"task": task}})

    cfg = OmegaConf.create({"seed": 0})
    assert cli_run_name(cfg, hc([])) == "fedavg · breast_cancer · logreg · seed 0"
    assert cli_run_name(cfg, hc(["progress=none"])) == "fedavg · breast_cancer · logreg · seed 0"
    assert cli_run_name(cfg, hc(["partition=dirichlet", "num_clients=20"])) == (
        "fedavg dirichlet N=20"
    )


def test_sweep_values_sizes_colours_and_group_keys():
    task = ["algorithm=fedavg,local", "seed=0,1,2", "partition.delta=1,2,4,7", "rounds=5"]
    values = sweep_values(task)
    assert values["partition.delta"] == ["1", "2", "4", "7"] and values["rounds"] == ["5"]
    assert sweep_size(values) == 24
    assert sweep_size(sweep_values(["lr=interval(0.01,1)"])) is None
    varying = ["algorithm", "seed", "partition.delta"]
    jobs = [
        [f"algorithm={a}", f"seed={s}", f"partition.delta={d}"]
        for a in ("fedavg", "local")
        for s in "012"
        for d in "1247"
    ]
    colours = {run_color(job, varying, values) for job in jobs}
    assert len(colours) == 24 and all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in colours)
    keys = group_keys(varying, ["algorithm", "partition", "dataset"])
    assert keys == [
        {"mode": "tag", "groupByData": "choice.algorithm"},
        {"mode": "param", "groupByData": "partition.delta"},
    ]
    assert metric_label("local δ=2") == "local δ:2" and metric_label("lr=1e+38") == "lr:1e_38"


def _inflate(text: str) -> dict:
    """A compressed view state as MLflow 3.17's UI reads it: ``deflate;``, base64, zlib, JSON."""
    assert text.startswith("deflate;")  # the UI's own prefix (pako's deflate: a zlib stream)
    return json.loads(zlib.decompress(base64.b64decode(text[len("deflate;") :], validate=True)))


def test_shared_view_is_mlflows_saved_view():
    group = [{"mode": "param", "groupByData": "lr"}, {"mode": "tag", "groupByData": "choice.x"}]
    key, value = shared_view(
        "sweep",
        "abc123",
        group,
        ["metrics.`acc/mean`"],
        created_ms=5,
        order_by="metrics.`acc/mean`",
        collapsed=[("0.1", "a"), ("1", None)],
    )
    assert key == f"{SHARE_TAG_PREFIX}abc123" == "mlflow.sharedViewState.abc123"
    envelope = json.loads(value)  # MLflow 3.17's saved view: a named envelope ...
    assert envelope["name"] == "sweep" and envelope["createdAt"] == envelope["updatedAt"] == 5
    state = _inflate(envelope["state"])  # ... its state compressed as the UI compresses it
    assert state == read_shared_view(value)
    for view in (state, envelope):  # ... and the state itself, plain, at the top (earlier MLflow 3)
        assert view["searchFilter"] == "tags.`mlflow.parentRunId` = 'abc123'"
        assert view["groupBy"] == {"aggregateFunction": "average", "groupByKeys": group}
        assert view["runsHiddenMode"] == "SHOW_ALL" and view["useGroupedValuesInCharts"] is True
        assert view["selectedColumns"] == ["metrics.`acc/mean`"]
        assert view["orderByKey"] == "metrics.`acc/mean`" and view["orderByAsc"] is False
        assert view["groupsExpanded"] == {  # MLflow's group ids: <mode>.<key>.<value>, joined
            "param.lr.0.1,tag.choice.x.a": False,
            "param.lr.1,tag.choice.x.null": False,
        }
    url = sweep_view_url("http://h:5000", "7", "abc123")
    assert url == (  # the runs tab: the bare experiment route drops the share key
        "http://h:5000/#/experiments/7/runs?workflowType=machine_learning"
        f"&{SHARE_PARAM}=abc123&compareRunsMode=CHART"
    )
    _, ungrouped = shared_view("sweep", "abc123", [])
    assert read_shared_view(ungrouped)["groupBy"] is None and "selectedColumns" not in ungrouped
    assert group_id([{"mode": "tag", "groupByData": "choice.algorithm"}], ["local"]) == (
        "tag.choice.algorithm.local"
    )


def test_read_shared_view_takes_what_mlflow_takes():
    state = {"searchFilter": "x", "groupBy": None}
    assert _inflate(compress_state(json.dumps(state))) == state
    # an envelope with a plain or a compressed state; a bare state, plain or compressed
    plain = json.dumps({"name": "v", "createdAt": 1, "state": json.dumps(state)})
    packed = json.dumps({"name": "v", "createdAt": 1.5, "state": compress_state(json.dumps(state))})
    for value in (plain, packed, json.dumps(state), compress_state(json.dumps(state))):
        assert read_shared_view(value) == state
    not_an_envelope = {"name": "v", "createdAt": "1", "state": "{}"}  # createdAt: not a number
    assert read_shared_view(json.dumps(not_an_envelope)) == not_an_envelope
    for bad in ("", "[1]", "deflate;!!", json.dumps({"name": "v", "createdAt": 1, "state": "{"})):
        with pytest.raises(ValueError, match="not a shared view state"):
            read_shared_view(bad)


def test_a_sweep_in_mlflow_names_groups_colours_and_summarises(tmp_path):
    """``algorithm=fedavg,local seed=0,1`` into a SQLite store (4 jobs, one test: each
    xdist worker would run a shared fixture again)."""
    uri = mlflow_db(tmp_path / "m.db")
    proc = _fedexp(
        "run",
        "-m",
        "algorithm=fedavg,local",
        "seed=0,1",
        *TINY,
        "rounds=2",
        "progress=log",
        f"tracker.uri={uri}",
        f"hydra.sweep.dir={tmp_path}/sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(uri)
    found = re.search(r"^MLflow experiment: (.+) \(parent run (\w+)\)$", proc.stdout, re.M)
    assert found, proc.stdout[-3000:]
    exp = client.get_experiment_by_name(found.group(1))
    runs = client.search_runs([exp.experiment_id])
    pid = found.group(2)
    parent = next(r for r in runs if r.info.run_id == pid)
    children = {r.info.run_name: r for r in runs if r is not parent}
    body = proc.stdout.partition("\nsweep done")[0]
    assert _rows(body) == 1 + 4 and "round 2/" not in proc.stdout  # a row per job, run ids too

    # short names, value first; the varying keys as params (a config group: its tag)
    assert sorted(children) == ["fedavg s0", "fedavg s1", "local s0", "local s1"]
    for name, run in children.items():
        algorithm, seed = name.split()
        assert run.data.tags["mlflow.parentRunId"] == pid
        assert run.data.params["seed"] == run.data.tags["sweep.seed"] == seed[1:]
        assert run.data.tags["choice.algorithm"] == run.data.tags["sweep.algorithm"] == algorithm
        assert run.info.status == "FINISHED"
    assert len({r.data.tags["mlflow.runColor"] for r in children.values()}) == 4

    # the parent run: per configuration the final and best headline, mean over the seeds
    metrics = parent.data.metrics
    assert metrics["jobs/ok"] == 4 and metrics["jobs/failed"] == 0
    for algorithm in ("fedavg", "local"):
        final = sum(children[f"{algorithm} s{s}"].data.metrics["acc/mean"] for s in "01") / 2
        assert metrics[f"final acc/mean/{algorithm}"] == pytest.approx(final)
        assert metrics[f"best acc/mean/{algorithm}"] >= final - 1e-12
    note = parent.data.tags["mlflow.note.content"]
    assert "| configuration | seeds | final acc/mean" in note and "| local | 2 |" in note
    assert parent.data.tags["fedexp.sweep.best"].startswith("best: ")
    assert parent.data.params["rounds"] == "2" and parent.data.params["num_clients"] == "3"
    artifacts = {a.path for a in client.list_artifacts(pid)}
    assert {"sweep_summary.json", "fedexp_summary.txt"} <= artifacts

    # the link opens a view stored with the experiment; the line says what it groups by
    view = next(ln for ln in proc.stdout.splitlines() if ln.startswith("view: "))
    assert f"/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning" in view
    assert f"&viewStateShareKey={pid}&compareRunsMode=CHART" in view
    assert view.endswith("(opens grouped by algorithm, mean of seeds)")
    stored = client.get_experiment(exp.experiment_id).tags[f"{SHARE_TAG_PREFIX}{pid}"]
    state = _inflate(json.loads(stored)["state"])
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "choice.algorithm"}]
    assert state["groupsExpanded"] == {  # a collapsed row per configuration, best first
        "tag.choice.algorithm.fedavg": False,
        "tag.choice.algorithm.local": False,
    }
    assert state["orderByKey"] == "metrics.`acc/mean`" and state["orderByAsc"] is False
    shown = client.search_runs([exp.experiment_id], filter_string=state["searchFilter"])
    assert {r.info.run_name for r in shown} == set(children)  # MLflow's search takes the filter


def test_the_parent_summary_averages_seeds_per_configuration():
    def job(n: int, algorithm: str, delta: int, seed: int, final: float, best: float):
        overrides = [f"algorithm={algorithm}", f"partition.delta={delta}", f"seed={seed}"]
        return JobStatus(
            n, "ok", overrides=overrides, metrics={"acc/mean": final}, best={"acc/mean": best}
        )

    jobs = [
        job(0, "fedavg", 1, 0, 0.6, 0.7),
        job(1, "fedavg", 1, 1, 0.8, 0.8),
        job(2, "local", 2, 0, 0.9, 0.95),
        JobStatus(3, "failed", overrides=["algorithm=local", "partition.delta=2", "seed=1"]),
    ]
    metric, configs = sweep.summarise(jobs, ["algorithm", "seed", "partition.delta"])
    assert metric == "acc/mean"
    assert [(c.name, c.final, c.best) for c in configs] == [
        ("fedavg δ=1", [0.6, 0.8], [0.7, 0.8]),
        ("local δ=2", [0.9], [0.95]),
    ]
    row = configs[0].row(metric)
    assert row["final acc/mean mean"] == pytest.approx(0.7)
    assert row["final acc/mean std"] == pytest.approx(0.1414, abs=1e-4)
    summary = sweep.SweepSummary(jobs, "sweep", metric=metric, configs=configs)
    assert summary.best_line() == "best: local δ=2  acc/mean 0.9000 over 1 seed (best round 0.9500)"
    assert summary.counts() == "4 jobs: 3 ok, 1 failed"


# ---- 8. Ctrl-C ---------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", ["basic", "parallel"])
def test_ctrl_c_ends_the_jobs_killed_and_prints_the_summary(tmp_path, launcher):
    uri = mlflow_db(tmp_path / "m.db")
    args = ["run", "-m", "algorithm=fedavg,local", "seed=0,1", *TINY, "rounds=100000"]
    args += ["eval_every=1000", f"tracker.uri={uri}", f"hydra/launcher={launcher}"]
    args += [f"hydra.sweep.dir={tmp_path}/sweep"]
    proc = subprocess.Popen(  # noqa: S603 - our own CLI
        [sys.executable, "-c", "from fedexp.cli import entry; entry()", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,  # its own process group, as a shell's foreground job
        # a test run started in the background by a non-interactive shell inherits SIGINT
        # ignored, and so would the child (Python then installs no KeyboardInterrupt handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    log = tmp_path / "sweep" / "0" / "cli.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "round 2/" not in (
        log.read_text() if log.exists() else ""
    ):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert re.search(r"^sweep stopped before its end \(interrupted\); \d jobs?: ", out, re.M), out
    assert re.search(r"^  stopped: \[job 0 fedavg s0\] ", out, re.M), out
    client = MlflowClient(uri)
    exp = client.search_experiments(filter_string="name LIKE 'fedexp/%'")[0]
    runs = client.search_runs([exp.experiment_id])
    assert runs and {r.info.status for r in runs} == {"KILLED"}, [
        (r.info.run_name, r.info.status) for r in runs
    ]
    assert any(r.info.run_name == "fedavg s0" for r in runs)


def test_a_sweep_stopped_before_any_run_leaves_nothing_in_mlflow(tmp_path, capsys):
    from mlflow.entities import ViewType

    uri = mlflow_db(tmp_path / "m.db")
    tracker = {"_target_": sweep.MLFLOW_TARGET, "uri": uri, "experiment": None}
    cfg = OmegaConf.create(
        {
            "tracker": tracker,
            "hydra": {
                "overrides": {"task": ["seed=0,1"]},
                "sweeper": {"params": None},
                "launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.X"},
                "runtime": {"choices": {"algorithm": "fedavg"}},
                "sweep": {"dir": str(tmp_path / "sweep")},
            },
        }
    )
    SweepCallback().on_multirun_start(cfg)
    summary = sweep.end_unfinished("interrupted", "KILLED")
    out = capsys.readouterr().out
    assert summary is not None and summary.deleted
    assert "MLflow: nothing recorded (the sweep stopped before any job started a run" in out
    client = MlflowClient(uri)
    assert [e.name for e in client.search_experiments()] == ["Default"]
    deleted = client.search_experiments(view_type=ViewType.DELETED_ONLY)
    assert [e.name for e in deleted] == [summary.experiment]
