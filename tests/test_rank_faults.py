"""A rank of ``distributed.nproc=2`` that dies, Ctrl-C, SIGTERM: one line, no scratch left.

Issue 44, items 8 and 9. The faults come at a known round: ``tests/rank_signal`` (a
``sitecustomize`` on ``PYTHONPATH``, imported by every process of the run, the spawned rank
too) makes a rank send a signal as that round starts. Whatever the fault, the user reads one
``fedexp: ...`` line that names it and the resume command, no rank prints a traceback, the
exit status is not 0, and no ``store=disk`` folder is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fedexp.cli.output import describe_stop
from fedexp.engine.clients import states
from fedexp.engine.clients.states import OWNER_FILE
from fedexp.engine.clients.states import SCRATCH_PREFIX
from fedexp.engine.clients.states import reap_scratch
from fedexp.engine.clients.states import remove_scratch
from fedexp.engine.clients.states import scratch_folder
from fedexp.engine.processes.launch import _death
from fedexp.engine.processes.launch import _exit_code
from fedexp.engine.processes.launch import _how
from fedexp.engine.processes.ranks import peer_left
from fedexp.errors import RankDied
from helpers import compose_config

HOOK = Path(__file__).parent / "rank_signal"
#: Round 3 of 50: the fault comes before the end, after round 2's checkpoint.
RUN = [
    "dataset=synthetic",
    "num_clients=4",
    "rounds=50",
    "checkpoint_every=1",
    "progress=none",
    "tracker=none",
    "device=cpu",
    "distributed.nproc=2",
    "store=disk",
]
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:21698: Connection reset by peer. This is typically caused by a remote worker "
    "hanging or bugs in the application."
)


def _sigint_default() -> None:
    """In the run's process before it starts: SIGINT's default (Python's KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _fault_run(tmp_path: Path, fault: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``fedexp run`` of :data:`RUN` in its own session, ``FEDEXP_TEST_SIGNAL=fault``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.pop("MLFLOW_TRACKING_URI", None)
    path = os.pathsep.join(p for p in (str(HOOK), env.get("PYTHONPATH")) if p)
    env.update(PYTHONWARNINGS="ignore", PYTHONPATH=path, FEDEXP_TEST_SIGNAL=fault)
    store = tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, "-c", "from fedexp.cli import entry; entry()", "run", *RUN]
        + [f"store_dir={store}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # its own process group: ``:group`` signals only the run
        # Ctrl-C as a terminal's, whatever this process inherited: a job started in the
        # background (``cmd &``, a CI runner) ignores SIGINT, and Python keeps ignoring it
        preexec_fn=_sigint_default,
    )
    return proc, store


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "code", "said"),
    [
        ("1:3:SIGKILL", 1, "rank 1 died (signal 9, SIGKILL) in round 3"),
        ("0:3:SIGKILL", None, "rank 0 died (signal 9, SIGKILL) in round 3"),
        ("1:3:SIGTERM", 1, "rank 1 died (signal 15, SIGTERM) in round 3"),
        ("0:3:SIGINT:group", 130, "interrupted"),  # Ctrl-C: the terminal signals every process
        ("0:3:SIGTERM", 128 + signal.SIGTERM, "terminated (SIGTERM)"),
    ],
)
def test_a_rank_that_dies_is_one_line_and_leaves_no_scratch(tmp_path, fault, code, said):
    proc, store = _fault_run(tmp_path, fault)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-4000:]  # no traceback, from any rank
    assert lines[0].startswith(f"fedexp: {said}; checkpoint kept: fedexp run "), lines[0]
    if code is None:  # rank 0 killed: its exit status is the signal's; rank 1 said the line
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == code
    resume = re.search(r" resume=(\S+)$", lines[0])
    assert resume and (Path(resume.group(1)) / "last.safetensors").is_file(), lines[0]
    assert "distributed.nproc=2" in lines[0]
    assert not [p.name for p in store.iterdir()]  # every rank's store=disk folder is gone


def test_gloo_losing_a_peer_is_recognised():
    """gloo's error when the other end went away is a plain RuntimeError, not a DistError."""
    assert peer_left(RuntimeError(GLOO_RESET))
    assert peer_left(RuntimeError("[../gloo/transport/tcp/pair.cc:598] Connection closed by peer"))
    assert not peer_left(RuntimeError("a bug"))


def test_a_dead_rank_is_said_with_its_signal_and_the_resume_command(tmp_path):
    assert _how(_exit_code(signal.SIGKILL)) == " (signal 9, SIGKILL)"  # a wait status
    assert _how(_exit_code(3 << 8)) == " (exit code 3)"
    assert _how(128 + signal.SIGTERM) == " (signal 15, SIGTERM)"  # a rank that SIGTERM ended
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.safetensors").write_bytes(b"")
    cfg = compose_config("distributed.nproc=2", output_dir=out)
    hc = OmegaConf.create({"overrides": {"task": ["distributed.nproc=2"]}})
    line = describe_stop(RankDied("rank 1 died (signal 9, SIGKILL) in round 17"), cfg, hc)
    assert line == (
        "rank 1 died (signal 9, SIGKILL) in round 17; checkpoint kept: fedexp run "
        f"distributed.nproc=2 resume={out / 'checkpoints'}"
    )


def _dead_pid() -> int:
    """The pid of a process that has ended (and was waited for)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _left(where: Path, pid: int, host: str | None = None, name: str | None = None) -> Path:
    folder = where / (name or f"{SCRATCH_PREFIX}{pid}-abc123")
    (folder / "states").mkdir(parents=True)
    owner = {"host": host or socket.gethostname(), "pid": pid, "started": states._started(pid)}
    (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


def test_the_next_run_removes_the_scratch_folders_of_dead_runs(tmp_path):
    """A run killed by SIGKILL cannot remove its folder; the next one made there does, and
    keeps those of live processes, of other machines, and of an older fedexp."""
    dead = _left(tmp_path, _dead_pid())
    live = _left(tmp_path, os.getpid())
    elsewhere = _left(tmp_path, _dead_pid(), host="another-machine")
    older = _left(tmp_path, 1, name=f"{SCRATCH_PREFIX}k2j4h5")
    made = scratch_folder("disk", str(tmp_path), torch.device("cpu"))
    assert made is not None and made.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
    assert json.loads((made / OWNER_FILE).read_text())["pid"] == os.getpid()
    assert not dead.exists()
    assert live.is_dir() and elsewhere.is_dir() and older.is_dir()
    assert reap_scratch(tmp_path) == []  # the live ones again: kept
    remove_scratch()  # what a rank that ends by os._exit or a signal calls first
    assert not made.exists() and live.is_dir()


def test_a_dying_rank_0s_signal_is_read_once_it_is_a_zombie():
    """A rank ≥ 1 learns that rank 0 died when its pipe closes, which a dying process does
    before it becomes a zombie: the signal is read once it is one (CI once printed "rank 0
    died in round 3" without it). Here the process is still alive when asked."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, time; time.sleep(0.3); os.kill(os.getpid(), 9)"]
    )
    try:
        assert _death(child.pid) == " (signal 9, SIGKILL)"
    finally:
        child.wait()
    assert _death(child.pid) == ""  # reaped: nothing to read


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _torchrun(tmp_path: Path, fault: str, starter: list[str]) -> tuple[str, int]:
    """A two-rank ``fedexp run`` started by torchrun (``starter``) with ``fault`` injected
    (``FEDEXP_TEST_SIGNAL``, tests/rank_signal), TMPDIR its own: stderr and the exit status."""
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.pop("MLFLOW_TRACKING_URI", None)
    path = os.pathsep.join(p for p in (str(HOOK), env.get("PYTHONPATH")) if p)
    env.update(
        PYTHONWARNINGS="ignore",
        PYTHONPATH=path,
        FEDEXP_TEST_SIGNAL=fault,
        TMPDIR=str(tmp_path / "tmp"),
    )
    command = [*starter, "--standalone", "--nproc-per-node=2", "--max-restarts=0", "-m"]
    run_args = [a for a in RUN if a != "distributed.nproc=2"]
    proc = subprocess.Popen(
        [*command, "fedexp", "run", *run_args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return err, proc.returncode


@pytest.mark.slow
def test_torchrun_rank_killed_is_named_by_the_survivor_and_leaves_no_scratch(tmp_path):
    """torchrun's agent, seeing rank 1 die, sends SIGTERM to rank 0, often before its
    collective fails: rank 0 still names rank 1's death with the torchrun resume command
    (not "terminated (SIGTERM)"), and rank 1's ``store=disk`` folder is removed."""
    err, code = _torchrun(tmp_path, "1:3:SIGKILL", [TORCHRUN])
    ours = [line for line in err.splitlines() if line.startswith("fedexp: ")]
    assert len(ours) == 1, err[-4000:]  # one line, from rank 0 (none from the dead rank 1)
    assert re.match(r"fedexp: rank 1 died( \(signal 9, SIGKILL\))? in round 3; ", ours[0])
    assert "checkpoint kept: torchrun --standalone --nproc-per-node=2 " in ours[0], ours[0]
    assert "terminated" not in ours[0]
    resume = re.search(r" resume=(\S+)$", ours[0])
    assert resume and (Path(resume.group(1)) / "last.safetensors").is_file(), ours[0]
    assert code != 0
    assert not list((tmp_path / "tmp").glob(f"{SCRATCH_PREFIX}*")), err[-2000:]
    assert not list((tmp_path / "tmp").glob("fedexp-*"))  # nor a mark of the line said once
    import psutil

    left = [p for p in psutil.process_iter(["environ"]) if _of_run(p, str(tmp_path / "tmp"))]
    assert not left  # no rank, no agent outlives the run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "said"),
    [  # kill <torchrun>, Ctrl-C on it: its agent passes the signal on to every rank
        ("0:3:SIGTERM:parent", r"terminated \(SIGTERM\)"),
        ("0:3:SIGINT:parent", "interrupted"),
        ("0:3:SIGKILL", r"rank 0 died( \(signal 9, SIGKILL\))? in round 3"),  # rank 1 says it
    ],
)
def test_torchrun_stopped_is_one_line_for_the_group(tmp_path, fault, said):
    """torchrun's agent stops every rank with the signal it got (or SIGTERM once rank 0 died):
    one ``fedexp:`` line for the group, with the resume command (rank 0's; rank 1's when rank
    0 died), no rank's traceback (rank 1 printed one on Ctrl-C), never a rank that the same
    stop ended named as one that died (rank 0 raced rank 1's end: "rank 1 died (signal 15,
    SIGTERM)"), and nothing left in TMPDIR but torchrun's own logs: no ``store=disk``
    folder (rank 1's, which SIGTERM's default left), no mark of the line said once."""
    err, code = _torchrun(tmp_path, fault, [sys.executable, "-m", "torch.distributed.run"])
    tmp = tmp_path / "tmp"
    ours = [line for line in err.splitlines() if "fedexp: " in line]
    assert len(ours) == 1, err[-4000:]
    assert re.match(f"fedexp: {said}; checkpoint kept: torchrun --standalone ", ours[0]), ours[0]
    resume = re.search(r" resume=(\S+)$", ours[0])
    assert resume and (Path(resume.group(1)) / "last.safetensors").is_file(), ours[0]
    assert "[rank" not in err and "fedexp/" not in err, err[-4000:]  # no rank's traceback
    assert code != 0
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchelastic_")] == []
    import psutil

    assert not [p for p in psutil.process_iter(["environ"]) if _of_run(p, str(tmp))]


def _of_run(proc, tmpdir: str) -> bool:  # noqa: ANN001 - a psutil.Process
    try:
        return (proc.info.get("environ") or {}).get("TMPDIR") == tmpdir
    except Exception:  # noqa: BLE001 - gone, no access
        return False


def test_a_survivor_names_a_rank_of_its_machine_that_died(monkeypatch, tmp_path):
    """The pids each rank recorded as the group joined: a killed one (a zombie: its signal
    is read), a reaped one, and siblings alive (a plain SIGTERM stays one)."""
    from fedexp.cli.group_lost import lost_line
    from fedexp.engine.processes import group_pids
    from fedexp.engine.processes import launch
    from fedexp.engine.processes.place import Place

    host = socket.gethostname()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = {"host": host, "parent": os.getppid()}  # (its siblings: the same parent)
        me = {"pid": os.getpid(), "at": states._started(os.getpid()), **mine}
        other = {"pid": alive.pid, "at": states._started(alive.pid), **mine}
        gone = {"pid": killed.pid, "at": states._started(killed.pid), **mine}
        elsewhere = {**gone, "host": "another-machine"}
        another_node = {**gone, "parent": os.getppid() + 1}  # another agent on this host
        monkeypatch.setattr(group_pids, "_group", [me, other, elsewhere, another_node, gone])
        monkeypatch.setattr(launch, "peer_closed", lambda: False)
        assert group_pids.dead_sibling() is None
        assert launch.group_lost(KeyboardInterrupt()) is None  # every rank alive: SIGTERM
        killed.kill()
        for _ in range(200):  # until it is a zombie (not waited for)
            if group_pids.is_zombie(killed.pid):
                break
            subprocess.run(["sleep", "0.01"])
        assert group_pids.dead_sibling() == (4, killed.pid)
        assert launch._sibling_died() == "rank 4 died (signal 9, SIGKILL)"
        lost = launch.group_lost(KeyboardInterrupt())
        assert lost is not None and lost.who == "rank 4 died (signal 9, SIGKILL)"
        killed.wait()
        assert launch._sibling_died() == "rank 4 died"  # reaped: the signal is not known
    finally:
        alive.kill()
        alive.wait()
        killed.kill()
        killed.wait()
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.safetensors").write_bytes(b"")
    cfg = compose_config("rounds=50", output_dir=out)
    lost = launch.GroupLost("in round 3", "rank 1 died (signal 9, SIGKILL)")
    agent = ["python", "torchrun", "--standalone", "--nproc-per-node=2", "-m", "fedexp", "run"]
    from fedexp.cli.group_lost import starter_command

    monkeypatch.setattr("fedexp.cli.group_lost._relaunch", lambda place: starter_command(agent))
    line = lost_line(lost, cfg, ["rounds=50"], Place(0, 2, 0, 2))
    assert line == (
        "rank 1 died (signal 9, SIGKILL) in round 3; checkpoint kept: torchrun --standalone "
        f"--nproc-per-node=2 -m fedexp run rounds=50 resume={out / 'checkpoints'}"
    )


def _terminated_in_round_3(context: BaseException | None) -> BaseException:
    """A SIGTERM raised inside the runner's frame (its ``engine`` as round 3 runs)."""
    from types import SimpleNamespace

    engine = SimpleNamespace(round=2, ctx=SimpleNamespace(round=2))  # noqa: F841 - read back
    try:
        try:
            if context is not None:
                raise context
        finally:
            raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        return exc


def test_a_sigterm_as_the_group_breaks_is_the_group_lost(monkeypatch):
    """Every rank of this machine alive: a SIGTERM that comes while a collective's failure
    (a process that left) is handled, or over several nodes once a connection of this rank
    was closed by its other end, is the group lost (where: the runner's round); a SIGTERM
    with the group whole stays one."""
    from fedexp.engine.processes import group_pids
    from fedexp.engine.processes import launch

    me = {"pid": os.getpid(), "host": socket.gethostname(), "parent": os.getppid(), "at": None}
    monkeypatch.setattr(group_pids, "_group", [me, {**me, "parent": -1}])  # two nodes
    monkeypatch.setattr(launch, "peer_closed", lambda: False)
    monkeypatch.setattr(launch, "reap_scratch", lambda: [])
    assert launch.group_lost(_terminated_in_round_3(None)) is None
    lost = launch.group_lost(_terminated_in_round_3(RuntimeError(GLOO_RESET)))
    assert lost is not None and (lost.where, lost.who) == ("in round 3", "")
    monkeypatch.setattr(launch, "peer_closed", lambda: True)
    lost = launch.group_lost(_terminated_in_round_3(None))
    assert lost is not None and lost.where == "in round 3"
    monkeypatch.setattr(group_pids, "_group", [me, me])  # one node: its pids alone decide
    assert launch.group_lost(_terminated_in_round_3(None)) is None


_CLOSE_WAIT = """
import socket, time
from fedexp.engine.processes.group_pids import peer_closed

with socket.create_server(("127.0.0.1", 0)) as server:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    seen = [peer_closed()]
    accepted.close()  # the other end goes: this one waits in CLOSE_WAIT
    for _ in range(200):
        if peer_closed():
            break
        time.sleep(0.01)
    seen.append(peer_closed())
    client.close()
    seen.append(peer_closed())
print(seen)
"""


def test_a_connection_closed_by_its_other_end_is_seen():
    """In a process of its own (no connection of another test's): open, closed by the other
    end (CLOSE_WAIT), then closed here too."""
    got = subprocess.run([sys.executable, "-c", _CLOSE_WAIT], capture_output=True, text=True)
    assert got.stdout.strip() == "[False, True, False]", got.stderr[-2000:]
