"""No orphaned RUNNING runs (issue "Hardening, round two", item 6), and unusable local store
paths in one line (item 9).

A run whose process was killed before it could end it (SIGKILL, the OOM killer, power loss)
is ended KILLED by the next run that starts or resumes against the same store, in whatever
experiment, with the reason in a tag and in the run's description; runs of live processes
(told from a later process that got the same pid by its start time) and of other hosts are
left alone. A ``sqlite:///`` path that is blocked by a file, names a folder, or lies in a
folder that cannot be written is a TrackerError naming the path.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from fedexp.errors import TrackerError
from fedexp.tracking.mlflow_tracker import HOST_TAG
from fedexp.tracking.mlflow_tracker import NOTE_TAG
from fedexp.tracking.mlflow_tracker import PID_TAG
from fedexp.tracking.mlflow_tracker import REAPED_TAG
from fedexp.tracking.mlflow_tracker import STARTED_TAG
from fedexp.tracking.mlflow_tracker import MLflowTracker
from fedexp.tracking.mlflow_tracker import _started
from fedexp.tracking.mlflow_tracker import check_sqlite_path
from helpers import mlflow_db
from helpers import run_cli

HOST = socket.gethostname()


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """One SQLite store for the module (creating one costs seconds)."""
    uri = mlflow_db(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    MlflowClient(uri).search_experiments()  # create it now, not inside a test or a child
    return uri


@pytest.fixture
def client(db):
    return MlflowClient(db)


def _tracker(uri: str, experiment: str) -> MLflowTracker:
    return MLflowTracker(uri, experiment, system_metrics=False)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _orphan(client, experiment: str, host: str = HOST, pid: int | None = None, **tags) -> str:
    """A RUNNING run as a killed fedexp process leaves it (in ``experiment``, created if new)."""
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    pid = _dead_pid() if pid is None else pid
    tags = {HOST_TAG: host, PID_TAG: str(pid), STARTED_TAG: _started(pid), **tags}
    return client.create_run(
        exp_id, tags={k: v for k, v in tags.items() if v is not None}
    ).info.run_id


def _assert_reaped(client, run_id: str, by: str, detail: str | None = None) -> None:
    """Ended KILLED, the reason in the tag and the note; ``detail``: the tag's words after
    "no longer exists" (a zombie, a reused pid), None for none."""
    r = client.get_run(run_id)
    pid = r.data.tags[PID_TAG]
    assert r.info.status == "KILLED" and r.info.end_time is not None
    reason = r.data.tags[REAPED_TAG]
    if detail is None:
        assert reason == f"process {pid} on {HOST} no longer exists, found by run {by}"
    else:
        assert reason.startswith(f"process {pid} on {HOST} no longer exists ({detail}"), reason
        assert reason.endswith(f"), found by run {by}"), reason
    note = r.data.tags[NOTE_TAG]
    assert f"Process {pid} on host {HOST} ended without closing this run" in note
    assert "SIGKILL" in note and f"by run {by}" in note
    assert " UTC " in note and "Marked KILLED at 20" in note


def _start_and_end(uri: str, experiment: str, resume_run_id: str | None = None) -> str:
    tracker = _tracker(uri, experiment)
    run_id = tracker.start("next", {}, {}, resume_run_id=resume_run_id)
    tracker.end()
    return run_id


# --- item 6: orphaned RUNNING runs ------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, time
    from fedexp.tracking.mlflow_tracker import MLflowTracker
    tracker = MLflowTracker(sys.argv[1], sys.argv[2], system_metrics=False)
    print(tracker.start("victim", {"rounds": "200"}, {}), flush=True)
    time.sleep(600)  # "training", before the first checkpoint
    """
)


def test_sigkilled_run_is_reaped_by_a_run_of_another_experiment(db, client):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, db, "reap-victim"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        run_id = child.stdout.readline().strip()  # the run exists once its id is printed
        assert run_id, "the child created no run"
        child.send_signal(signal.SIGKILL)  # no handler, no atexit: the run stays RUNNING
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    left = client.get_run(run_id)
    assert left.info.status == "RUNNING"
    assert left.data.tags[PID_TAG] == str(child.pid) and left.data.tags[HOST_TAG] == HOST
    assert float(left.data.tags[STARTED_TAG]) > 0
    by = _start_and_end(db, "reap-elsewhere")  # another experiment of the same store
    _assert_reaped(client, run_id, by)


def test_resume_reaps_the_whole_store(db, client):
    first = _start_and_end(db, "reap-resumed")
    orphan = _orphan(client, "reap-resume-victim")
    assert _start_and_end(db, "reap-resumed", resume_run_id=first) == first
    _assert_reaped(client, orphan, first)
    assert REAPED_TAG not in client.get_run(first).data.tags


def test_a_reused_pid_or_a_zombie_is_gone_but_live_runs_and_other_hosts_are_left(db, client):
    me = os.getpid()
    live = _orphan(client, "reap-mixed", pid=me)  # this very process: alive
    live_old = _orphan(client, "reap-mixed", pid=me, **{STARTED_TAG: None})  # an older fedexp's
    elsewhere = _orphan(client, "reap-mixed", host="some-other-host")  # its pid is dead here
    untagged = client.create_run(client.get_experiment_by_name("reap-mixed").experiment_id)
    untagged = untagged.info.run_id  # not fedexp's run
    reused = _orphan(client, "reap-mixed", pid=me, **{STARTED_TAG: "1000000000.00"})
    zombie_proc = subprocess.Popen(["sleep", "60"])
    try:
        zombie_proc.send_signal(signal.SIGKILL)  # killed, not waited for: a zombie
        deadline = time.monotonic() + 10
        while psutil.Process(zombie_proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "no zombie"
            time.sleep(0.02)
        os.kill(zombie_proc.pid, 0)  # its pid still exists
        zombie = _orphan(client, "reap-mixed", pid=zombie_proc.pid)
        by = _start_and_end(db, "reap-mixed-next")
    finally:
        zombie_proc.wait()
    _assert_reaped(client, reused, by, "its pid now names another process, started 20")
    _assert_reaped(client, zombie, by, "a zombie: killed, not yet waited for")
    assert "(a zombie: killed, not yet waited for)." in client.get_run(zombie).data.tags[NOTE_TAG]
    for run_id in (live, live_old, elsewhere, untagged):
        r = client.get_run(run_id)
        assert r.info.status == "RUNNING", run_id
        assert REAPED_TAG not in r.data.tags and NOTE_TAG not in r.data.tags


def test_the_note_keeps_an_earlier_description(db, client):
    orphan = _orphan(client, "reap-noted", **{NOTE_TAG: "lr sweep, first try"})
    by = _start_and_end(db, "reap-noted-next")
    _assert_reaped(client, orphan, by)
    assert client.get_run(orphan).data.tags[NOTE_TAG].endswith("\n\nlr sweep, first try")


def test_one_search_for_the_runs_of_every_experiment(db, client, monkeypatch):
    orphans = [_orphan(client, f"reap-many-{i}") for i in range(4)]
    tracker = _tracker(db, "reap-many-next")
    searches = []
    search_runs = tracker.client.search_runs

    def counted(experiment_ids, *args, **kwargs):
        searches.append(list(experiment_ids))
        return search_runs(experiment_ids, *args, **kwargs)

    monkeypatch.setattr(tracker.client, "search_runs", counted)
    by = tracker.start("next", {}, {})
    tracker.end()
    assert len(searches) == 1 and len(searches[0]) >= 5, searches
    for run_id in orphans:
        _assert_reaped(client, run_id, by)


def test_a_store_that_cannot_list_experiments_still_reaps_the_runs_own(db, client, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no listing here")

    mine, other = _orphan(client, "reap-unlisted"), _orphan(client, "reap-unlisted-other")
    tracker = _tracker(db, "reap-unlisted")
    monkeypatch.setattr(tracker.client, "search_experiments", broken)
    by = tracker.start("next", {}, {})
    tracker.end()
    _assert_reaped(client, mine, by)
    assert client.get_run(other).info.status == "RUNNING"
    client.set_terminated(other, "KILLED")


def test_a_run_made_running_again_since_the_search_is_left_alone(db, client):
    orphan = _orphan(client, "reap-raced")
    seen = client.get_run(orphan).data.tags
    client.set_tag(orphan, PID_TAG, str(os.getpid()))  # resumed meanwhile by a live process
    tracker = _tracker(db, "reap-raced")
    tracker.run_id = "finder"
    assert not tracker._end_orphan(orphan, seen, "why")
    assert client.get_run(orphan).info.status == "RUNNING"
    client.set_terminated(orphan, "KILLED")


def test_reaping_never_fails_a_run(db, client, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("store hiccup")

    orphan = _orphan(client, "reap-broken")
    tracker = _tracker(db, "reap-broken")
    monkeypatch.setattr(tracker.client, "set_terminated", broken)
    run_id = tracker.start("unharmed", {"a": "1"}, {})
    monkeypatch.undo()
    tracker.end()
    assert client.get_run(run_id).data.params == {"a": "1"}
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_run(orphan).info.status == "RUNNING"  # the next run will try again
    client.set_terminated(orphan, "KILLED")


# --- item 9: unusable local store paths ------------------------------------------------------


def _blocked(tmp_path):
    (tmp_path / "mlflow.db.lock").write_text("")  # the lock file beside a store
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.db").write_text("not a database\n")
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "m.db.lock").mkdir()


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("mlflow.db.lock/x.db", "mlflow.db.lock is a file, expected a folder to hold the database"),
        ("mlflow.db.lock/a/b/x.db", "mlflow.db.lock is a file, expected a folder"),
        ("folder", "folder is a folder, expected the database file (e.g. folder/mlflow.db)"),
        ("notes.db", "notes.db is not a SQLite database"),
        ("locked/m.db", "locked/m.db.lock is not a file, expected the lock file"),
    ],
    ids=["parent-is-a-file", "ancestor-is-a-file", "db-is-a-folder", "not-sqlite", "lock-dir"],
)
def test_unusable_store_path_is_a_tracker_error(tmp_path, monkeypatch, path, needle):
    _blocked(tmp_path)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{path}"
    with pytest.raises(TrackerError) as err:
        _tracker(uri, "x")
    message = str(err.value)
    assert message.startswith(f"tracker.uri={uri}: ") and needle in message, message
    assert "\n" not in message
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(TrackerError, match=f"^MLFLOW_TRACKING_URI={uri}: "):
        MLflowTracker(None, "x", system_metrics=False)


def test_a_good_store_path_is_created(tmp_path):
    assert check_sqlite_path(f"sqlite:///{tmp_path}/a/b/m.db") == tmp_path / "a/b/m.db"
    assert (tmp_path / "a/b").is_dir()
    assert check_sqlite_path("http://127.0.0.1:5000") is None


UNWRITABLE = textwrap.dedent(
    """
    import sys
    from fedexp.errors import TrackerError
    from fedexp.tracking.mlflow_tracker import check_sqlite_path
    for uri in sys.argv[1:]:
        try:
            check_sqlite_path(uri)
            print("no error")
        except TrackerError as exc:
            print(exc)
    """
)


def test_unwritable_folder_is_a_tracker_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    uris = [f"sqlite:///{ro}/m.db", f"sqlite:///{ro}/sub/m.db"]
    command = [sys.executable, "-c", UNWRITABLE, *uris]  # one interpreter for both: imports
    if os.geteuid() == 0:  # root writes anywhere: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv")
        command = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        ro.chmod(0o755)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0] == (
        f"tracker.uri={uris[0]}: the folder {ro} is not writable (Permission denied), "
        "expected one where the database, its journal and its lock file can be written"
    )
    assert lines[1] == (
        f"tracker.uri={uris[1]}: cannot create the folder {ro}/sub for the database in {ro} "
        "(Permission denied), expected a folder that can be written"
    )
    assert not (ro / "sub").exists()


@pytest.mark.slow
def test_cli_names_the_file_in_the_way_in_one_line(tmp_path):
    (tmp_path / "mlflow.db.lock").write_text("")
    uri = "sqlite:///mlflow.db.lock/x.db"
    proc = run_cli(
        "run", f"tracker.uri={uri}", "rounds=1", "progress=none", "device=cpu", cwd=tmp_path
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"fedexp: error: tracker.uri={uri}: mlflow.db.lock is a file")
    assert not (tmp_path / "mlflow.db.lock").is_dir()
