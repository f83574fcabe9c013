"""Hardening (issue 12, part F): a run whose process was SIGKILLed (``kill -9``, the OOM
killer) stays RUNNING; the next run of the experiment on the same host ends it KILLED."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from fedexp.engine.runner import run
from fedexp.tracking import mlflow_tracker
from fedexp.tracking.mlflow_tracker import HOST_TAG
from fedexp.tracking.mlflow_tracker import PID_TAG
from fedexp.tracking.mlflow_tracker import REAPED_TAG
from fedexp.tracking.mlflow_tracker import MLflowTracker
from helpers import mlflow_db

pytestmark = pytest.mark.usefixtures("one_thread")

CLI = [sys.executable, "-c", "from fedexp.cli import entry; entry()", "run"]


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """One SQLite MLflow store for the module (creating one costs seconds)."""
    uri = mlflow_db(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    MlflowClient(uri).search_experiments()  # create it now, not inside a test or a child
    return uri


@pytest.fixture
def store(db, request):
    """``(uri, experiment)``: the module's store, an experiment of this test's own."""
    return db, request.node.name


def _cfg(small_cfg, store, *overrides):
    cfg = small_cfg(*overrides)
    with open_dict(cfg):
        cfg.tracker.uri, cfg.tracker.experiment = store
    return cfg


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _running(client, experiment_id):
    return client.search_runs([experiment_id], "attributes.status = 'RUNNING'")


def test_runs_are_tagged_with_host_and_pid_also_when_resumed(store, monkeypatch):
    tracker = MLflowTracker(*store)
    run_id = tracker.start("tagged", {}, {})
    tracker.end("KILLED")
    client = MlflowClient(store[0])
    tags = client.get_run(run_id).data.tags
    assert tags[HOST_TAG] == socket.gethostname() and tags[PID_TAG] == str(os.getpid())
    fake_os = SimpleNamespace(getpid=lambda: 4242, kill=os.kill)  # "a new process"
    monkeypatch.setattr(mlflow_tracker, "os", fake_os)
    again = MLflowTracker(*store)
    assert again.start("tagged", {}, {}, resume_run_id=run_id) == run_id
    again.end()
    assert client.get_run(run_id).data.tags[PID_TAG] == "4242"


def test_new_run_reaps_only_dead_runs_of_this_host(small_cfg, store):
    client = MlflowClient(store[0])
    exp = client.create_experiment(store[1])
    host = socket.gethostname()
    dead_pid = _dead_pid()
    dead, live, elsewhere = (
        client.create_run(exp, tags={HOST_TAG: h, PID_TAG: str(pid)}).info.run_id
        for h, pid in ((host, dead_pid), (host, os.getpid()), ("some-other-host", dead_pid))
    )
    untagged = client.create_run(exp).info.run_id  # not fedexp's, or an older fedexp's
    res = run(_cfg(small_cfg, store, "rounds=1"))
    r = client.get_run(dead)
    assert r.info.status == "KILLED" and r.info.end_time is not None
    assert r.data.tags[REAPED_TAG] == (
        f"process {dead_pid} on {host} no longer exists, found by run {res.run_id}"
    )
    assert {x.info.run_id for x in _running(client, exp)} == {live, elsewhere, untagged}
    for run_id in (live, elsewhere, untagged):
        assert REAPED_TAG not in client.get_run(run_id).data.tags
    assert client.get_run(res.run_id).info.status == "FINISHED"


def test_reaping_never_fails_a_run(store, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("store hiccup")

    tracker = MLflowTracker(*store)
    monkeypatch.setattr(tracker.client, "search_runs", broken)
    run_id = tracker.start("unharmed", {"a": "1"}, {})
    tracker.end()
    assert MlflowClient(store[0]).get_run(run_id).data.params == {"a": "1"}


@pytest.mark.slow
def test_kill_9_of_a_cli_run_is_reaped_by_the_next_run(small_cfg, store, tmp_path):
    uri, name = store
    args = ["rounds=100000", "progress=none", "device=cpu", "checkpoint_every=0"]
    args += [f"tracker.uri={uri}", f"tracker.experiment={name}", f"hydra.run.dir={tmp_path}/a"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    child = subprocess.Popen(
        CLI + args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    client = MlflowClient(uri)
    try:
        deadline, killed = time.monotonic() + 60, []
        while not killed and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.3)
            try:
                exp = client.get_experiment_by_name(name)
                killed = _running(client, exp.experiment_id) if exp else []
            except Exception:  # noqa: BLE001 - the child may hold the database for a moment
                continue
        assert killed, f"no RUNNING run within 60 s: {child.stderr.read().decode()[-2000:]}"
        child.send_signal(signal.SIGKILL)  # no handler, no atexit: the run stays RUNNING
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stderr.close()
    (left,) = killed
    assert left.data.tags[PID_TAG] == str(child.pid)
    assert client.get_run(left.info.run_id).info.status == "RUNNING"
    res = run(_cfg(small_cfg, store, "rounds=1"))
    r = client.get_run(left.info.run_id)
    assert r.info.status == "KILLED"
    assert r.data.tags[REAPED_TAG].startswith(f"process {child.pid} on {socket.gethostname()}")
    assert r.data.tags[REAPED_TAG].endswith(f"found by run {res.run_id}")
