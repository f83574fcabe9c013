"""A sweep on the terminal (issue 13), through the real CLI: a parallel sweep where two of three
jobs fail (exit 1, the summary, one line per job with its id, a parent MLflow run with nested
child runs named by what varies), and a sweep where every job succeeds (exit 0)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from mlflow.tracking import MlflowClient

from helpers import run_cli

pytestmark = pytest.mark.slow  # several processes or whole CLI runs: make test-slow

TINY = ["rounds=1", "num_clients=3", "device=cpu", "checkpoint_every=0"]


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """``lr=0.1,1e38,-1`` on two joblib workers: job 0 finishes, job 1 diverges in round 1
    (a FAILED child run), job 2 is refused by the range check (no run at all)."""
    tmp = tmp_path_factory.mktemp("failing")
    uri = f"sqlite:///{tmp}/m.db"
    proc = run_cli(
        "run",
        "-m",
        "lr=0.1,1e38,-1",
        *TINY,
        "progress=log",
        "hydra/launcher=parallel",
        f"tracker.uri={uri}",
        f"hydra.sweep.dir={tmp}/sweep",
        cwd=tmp,
    )
    return proc, uri, tmp


def test_a_failed_job_makes_the_sweep_exit_1_with_a_summary(failing):
    proc, uri, tmp = failing
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Callback" not in proc.stderr, proc.stderr[-3000:]
    out = proc.stdout
    assert "sweep done, 3 jobs: 1 ok, 2 failed" in out, out[-3000:]
    failed = [ln for ln in out.splitlines() if ln.startswith("  failed: ")]
    assert len(failed) == 2, out[-3000:]
    assert failed[0].startswith("  failed: [job 1 lr=1e+38] client 0: training loss is nan")
    assert failed[1] == "  failed: [job 2 lr=-1] lr=-1.0: expected > 0"
    experiment = re.search(r"^MLflow experiment: (fedexp/lr \S+ \S+) \(parent run", out, re.M)
    assert experiment, out[-3000:]
    tables = next(ln for ln in out.splitlines() if ln.startswith("tables: "))
    command = shlex.split(tables.removeprefix("tables: "))
    assert command == [
        "fedexp",
        "report",
        "--uri",
        uri,
        "--experiment",
        experiment.group(1),
        "--rows",
        "lr",
    ]


def test_the_report_command_of_the_summary_runs(failing, capsys):
    from fedexp.report import main as report

    proc, _, tmp = failing
    tables = next(ln for ln in proc.stdout.splitlines() if ln.startswith("tables: "))
    report(shlex.split(tables.removeprefix("tables: "))[2:])
    out = capsys.readouterr().out
    done = json.loads((tmp / "sweep" / "0" / "fedexp_status.json").read_text())
    percent = f"{100 * done['metrics']['acc/mean']:.2f}"  # the finished job's acc/mean, in %
    assert re.search(rf"\b0\.1\b.*{re.escape(percent)}", out), out


def test_each_job_prints_one_line_and_every_log_line_carries_its_job_id(failing):
    proc, _, _ = failing
    out, err = proc.stdout, proc.stderr
    assert "Per-client results" not in out  # no per-client table per job
    assert re.search(r"^\[job 0\] lr=0\.1  acc/mean=0\.\d{4}  run [0-9a-f]{32}$", out, re.M)
    # the per-round lines go to each job's own log file, not to the terminal
    assert "round 1/1" not in out + err, out[-3000:]
    log = (failing[2] / "sweep" / "0" / "cli.log").read_text()
    rounds = [ln for ln in log.splitlines() if "round 1/1" in ln]
    assert rounds and all("[job 0] round 1/1" in ln for ln in rounds), log[-3000:]
    errors = [ln for ln in err.splitlines() if "fedexp: error" in ln]
    assert sorted(ln[:30] for ln in errors) == [
        "[job 1] fedexp: error: client ",
        "[job 2] fedexp: error: lr=-1.0",
    ]


def test_parent_run_with_nested_children_named_by_what_varies(failing):
    proc, uri, tmp = failing
    client = MlflowClient(uri)
    name = re.search(r"^MLflow experiment: (.+) \(parent run (\w+)\)$", proc.stdout, re.M)
    exp = client.get_experiment_by_name(name.group(1))
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.run_id == name.group(2)
    parent = parents[0]
    assert parent.info.run_name.startswith("lr=0.1,1e38,-1 rounds=1 ")
    assert parent.info.status == "FAILED"
    assert parent.data.tags["fedexp.sweep.summary"] == "3 jobs: 1 ok, 2 failed"
    assert "lr=-1.0: expected > 0" in parent.data.tags["mlflow.note.content"]
    artifacts = [a.path for a in client.list_artifacts(parent.info.run_id)]
    assert "fedexp_summary.txt" in artifacts
    children = {r.info.run_name: r for r in runs if r is not parent}
    assert sorted(children) == ["lr=0.1", "lr=1e+38"]  # job 2 never started a run
    assert children["lr=0.1"].info.status == "FINISHED"
    assert children["lr=1e+38"].info.status == "FAILED"
    for child in children.values():
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id


def test_every_job_records_its_outcome_in_its_folder(failing):
    proc, _, tmp = failing
    status = [
        json.loads((tmp / "sweep" / str(n) / "fedexp_status.json").read_text()) for n in range(3)
    ]
    assert [s["status"] for s in status] == ["ok", "failed", "failed"]
    assert [s["name"] for s in status] == ["lr=0.1", "lr=1e+38", "lr=-1"]
    assert status[0]["run_id"] in proc.stdout and status[0]["error"] == ""
    assert set(status[0]["metrics"]) == {"acc/mean"}
    assert status[1]["run_id"] and "diverged" in status[1]["error"]
    assert status[2]["run_id"] is None and status[2]["error"] == "lr=-1.0: expected > 0"
    assert "lr=-1" in status[2]["overrides"]


def test_a_sweep_where_every_job_succeeds_exits_0(tmp_path):
    proc = run_cli(
        "run",
        "-m",
        "algorithm=fedavg,local",
        *TINY,
        "progress=none",
        "tracker=none",
        f"hydra.sweep.dir={tmp_path}/sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sweep done, 2 jobs: 2 ok, 0 failed" in proc.stdout
    assert re.search(r"^\[job 1\] local  acc/mean=", proc.stdout, re.M)
    assert "nothing recorded (tracker=none)" in proc.stdout and "tables:" not in proc.stdout
    assert "Callback" not in proc.stderr, proc.stderr[-3000:]
