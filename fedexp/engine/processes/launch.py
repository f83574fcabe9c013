"""``distributed.nproc=P``: the run's other P − 1 processes, started from the first.

The process the user started becomes rank 0 (it keeps the tracker, the progress display and
the run's files); it starts ranks 1 … P−1 with :mod:`torch.multiprocessing` (spawn), each with
the same resolved config, and they join one torch.distributed process group over a local TCP
port. What each rank runs: :mod:`fedexp.engine.processes.ranks`. Every socket of the run
listens on loopback alone: the group's store (torch's, with no authentication, would listen on
every interface) and gloo's (:func:`_join`).

When a rank ends while the others still need it (SIGKILL, the OOM killer, a crash), the
survivors' collectives fail with gloo's "Connection reset by peer"; the run then ends with
one line and the resume command, no traceback (:func:`lost`): rank 0 names the rank that
ended and how (it is their parent and knows their exit status); a rank ≥ 1 that outlives
rank 0 says that rank 0 died. Ranks ≥ 1 ignore Ctrl-C (the terminal sends it to every
process of the run: rank 0 stops the run, says so, and ends them) and end on SIGTERM
quietly, at once, even inside a collective; every exit a rank can handle removes its
``store=disk`` scratch folder, and the survivors remove a killed rank's
(:func:`~fedexp.engine.clients.states.reap_scratch`).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig
from omegaconf import OmegaConf
from omegaconf import open_dict

from fedexp.engine.clients.states import reap_scratch
from fedexp.engine.clients.states import remove_scratch
from fedexp.engine.processes.group_pids import dead_sibling
from fedexp.engine.processes.group_pids import gone_siblings
from fedexp.engine.processes.group_pids import is_zombie
from fedexp.engine.processes.group_pids import nodes
from fedexp.engine.processes.group_pids import peer_closed
from fedexp.engine.processes.ranks import TIMEOUT
from fedexp.engine.processes.ranks import Ranks
from fedexp.engine.processes.ranks import keep_on_loopback
from fedexp.engine.processes.ranks import listen
from fedexp.engine.processes.ranks import make_store
from fedexp.engine.processes.ranks import peer_left
from fedexp.errors import FedexpError
from fedexp.errors import RankDied

if TYPE_CHECKING:
    from fedexp.engine.round.engine import Engine

log = logging.getLogger("fedexp")

#: The first line of the config a started rank gets: the command line's overrides (JSON), for
#: the resume command it prints if rank 0 dies (a YAML comment: the config reads as before).
_OVERRIDES = "# fedexp-overrides: "
#: Seconds rank 0 waits for a rank to end after a collective failed because a rank left.
_END_WAIT_S = 10.0
#: Seconds a rank ≥ 1 waits to learn whether rank 0 died (else rank 0 says why the run ended).
_PARENT_WAIT_S = 2.0
#: Seconds a rank ≥ 1 waits for a dead rank 0 to become a zombie (its exit status then reads).
_ZOMBIE_WAIT_S = 2.0
#: This process's rank when :func:`rank_main` started it, else None.
_started_rank: int | None = None
#: The socket pair SIGTERM wakes :func:`_watch` through (:func:`end_quietly`), once set.
_wakeup: tuple[socket.socket, socket.socket] | None = None
#: The signals that end this rank (:func:`end_quietly`), and what it says first, if anything.
_ending: set[int] = set()
_last_word: Callable[[], None] | None = None
#: Signals that stop a whole group (torchrun passes on the one it got to every rank).
_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class _PeerLost(Exception):
    """In a rank ≥ 1: a collective failed because another rank left, ``where`` in the run."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


class GroupLost(RuntimeError):
    """In a group started from outside (torchrun, a SLURM job): a process of it left, ``where``.

    ``who``: which, where this machine knows it (``rank 1 died (signal 9, SIGKILL)``: a rank
    of this machine whose process is gone,
    :func:`~fedexp.engine.processes.group_pids.dead_sibling`), else "". Not a
    :class:`~fedexp.errors.FedexpError`: the CLI's group code says it
    (:mod:`fedexp.cli.distributed`), with the command that resumes the whole group.
    """

    def __init__(self, where: str, who: str = "") -> None:
        super().__init__(f"{who or 'a process of the group stopped'} {where}".rstrip())
        self.where = where
        self.who = who


def _free_port() -> int:
    """A free port of 127.0.0.1 (tests; a run binds its store's socket itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


def _threads(size: int) -> None:
    """Split this machine's cores among the ranks (unless ``threads`` set them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // size))


def _join(
    rank: int, size: int, port: int, backend: str, listener: socket.socket | None = None
) -> Ranks:
    """Join the group of ``size`` ranks on this machine, every socket on loopback.

    The group's store on ``127.0.0.1:port`` alone (rank 0 serves it through ``listener``,
    bound already, else binds the port: :func:`~fedexp.engine.processes.ranks.make_store`),
    and the backend's own sockets on the loopback interface
    (:func:`~fedexp.engine.processes.ranks.keep_on_loopback`).
    """
    keep_on_loopback()
    store = make_store(rank, size, "127.0.0.1", port, listener)
    dist.init_process_group(
        _backend(backend), store=store, rank=rank, world_size=size, timeout=TIMEOUT
    )
    ranks = Ranks.current()
    assert ranks is not None
    return ranks


def rank_main(
    rank: int, size: int, port: int, config: str, backend: str, job: Callable[[DictConfig], Any]
) -> None:
    """A rank ≥ 1: join the group and run ``job`` on the config.

    ``job`` is the runner's run, without tracker or files. It builds its share of the clients
    while rank 0 builds its own. A user's error (:class:`FedexpError`: a setting, the data) is
    left to rank 0 to print, as under torchrun: every rank builds from the same config and
    data, so rank 0 meets it too. So is a collective, or the group's start, that fails because
    another rank left first (:func:`~fedexp.engine.processes.ranks.peer_left`): rank 0 says
    which and how, unless rank 0 itself is the one that died: then this rank says so
    (:func:`_say_if_rank_0_died`). Anything else is printed with its traceback.

    Ctrl-C is ignored (rank 0 stops the run and ends the others); SIGTERM ends the rank
    quietly. Every way out removes the rank's ``store=disk`` folder.
    """
    global _started_rank
    _started_rank = rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (also inherited from start(): from birth)
    end_quietly(signal.SIGTERM)
    logging.getLogger("fedexp").setLevel(logging.WARNING)
    overrides = _overrides_of(config)
    cfg = OmegaConf.create(config)
    if not cfg.get("threads"):
        _threads(size)
    try:
        _join(rank, size, port, backend)
        job(cfg)
        dist.barrier()  # with rank 0's stop(): every rank done before the group goes
    except _PeerLost as exc:  # (from the runner: where in the run it happened)
        _say_if_rank_0_died(exc.where, cfg, overrides)
        _quit(1)
    except FedexpError:  # a setting or the data: rank 0 meets it too and alone says it
        _quit(1)
    except BaseException as exc:  # noqa: BLE001 - reported, and the group torn down for rank 0
        if peer_left(exc):  # another rank left first: rank 0 says why, or this one if rank 0
            _say_if_rank_0_died("", cfg, overrides)
            _quit(1)
        traceback.print_exc(file=sys.stderr)
        _quit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _leave()


def _overrides_of(config: str) -> list[str]:
    """The command line's overrides that :func:`start` put in ``config``'s first line."""
    first = config.split("\n", 1)[0]
    if not first.startswith(_OVERRIDES):
        return []
    try:
        return [str(o) for o in json.loads(first[len(_OVERRIDES) :])]
    except (ValueError, TypeError):
        return []


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a closed stream, a reentrant call)
            stream.flush()


def _quit(code: int) -> None:
    """End a rank ≥ 1 that failed: its scratch folder removed, without Python's exit."""
    remove_scratch()
    _flush()
    os._exit(code)


def end_quietly(*signums: int, last_word: Callable[[], None] | None = None) -> None:
    """``signums`` (SIGTERM) end this rank ≥ 1 at once and quietly, even inside a collective.

    Python runs a signal's handler in the main thread between two bytecodes, which never
    comes while the thread waits in a gloo collective for a rank that stopped (up to
    :data:`~fedexp.engine.processes.ranks.TIMEOUT`); the collective releases the GIL, so a
    thread woken by the signal (``signal.set_wakeup_fd``) ends the rank instead: its scratch
    folder removed, exit status 128 + the signal (:func:`_quit`). Rank 0 says why the run
    stopped; ``last_word`` is called first (a line rank 0 cannot say: it died first).
    """
    global _wakeup, _last_word
    _ending.update(int(s) for s in signums)
    _last_word = last_word or _last_word
    for signum in signums:  # (Python's C handler writes the signal's number)
        signal.signal(signum, _noted)
    if _wakeup is not None:
        return
    _wakeup = socket.socketpair()
    _wakeup[1].setblocking(False)
    signal.set_wakeup_fd(_wakeup[1].fileno(), warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(_wakeup[0],), daemon=True, name="sigterm").start()


def _noted(signum: int, frame: object) -> None:
    """A stop signal's Python handler in the main thread: nothing; :func:`_watch` ends it."""


def _watch(wakeup: socket.socket) -> None:
    """The thread of :func:`end_quietly`: ends the rank when one of its signals comes."""
    while True:
        try:
            got = wakeup.recv(64)
        except OSError:
            return
        if not got:
            return
        for signum in got:
            if signum in _ending:
                if _last_word is not None:
                    with contextlib.suppress(Exception):  # (its line, then the end regardless)
                        _last_word()
                _quit(128 + signum)


def _death(pid: int) -> str:
    """How process ``pid`` ended, `` (signal 9, SIGKILL)``, while it is a zombie; else "".

    A rank ≥ 1 is not rank 0's parent and cannot wait for it; ``/proc/<pid>/stat`` still
    holds the exit status (its 52nd field) until rank 0's own parent (the shell) reaps it.
    A dying process closes its files (the pipe this rank watches) before it becomes a
    zombie, so its state is read again for up to :data:`_ZOMBIE_WAIT_S` until it is one.
    """
    deadline = time.monotonic() + _ZOMBIE_WAIT_S
    while True:
        code = _zombie_code(pid)
        if code is not None:
            return _how(code)
        if not Path(f"/proc/{pid}").exists() or time.monotonic() > deadline:
            return ""  # reaped already (or no /proc): the signal is not known here
        time.sleep(0.01)


def _exit_code(status: int) -> int:
    """A wait status as :attr:`multiprocessing.Process.exitcode` says it (−signal, or code)."""
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def _signal_of(code: int) -> int:
    """The signal that ended a rank of exit code ``code`` (−9; 143: a rank's SIGTERM), or 0."""
    if code < 0:
        return -code
    return code - 128 if code - 128 in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) else 0


def _how(code: int) -> str:
    """`` (signal 9, SIGKILL)`` for −9, `` (signal 15, SIGTERM)`` for 143, `` (exit code 1)``."""
    sig = _signal_of(code)
    if not sig:
        return f" (exit code {code})"
    try:
        return f" (signal {sig}, {signal.Signals(sig).name})"
    except ValueError:
        return f" (signal {sig})"


def _say_if_rank_0_died(where: str, cfg: DictConfig, overrides: list[str]) -> None:
    """In a rank ≥ 1 whose collective failed: if rank 0 (its parent) died, say so in one line.

    Rank 0 that is alive says itself why the run ended (and ends this rank). One that died
    (SIGKILL, the OOM killer) cannot: this rank prints ``fedexp: rank 0 died … in round N;
    checkpoint kept: fedexp run … resume=…`` and removes rank 0's scratch folder.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    parent.join(_PARENT_WAIT_S)  # (its end closes the pipe: as soon as it died)
    if parent.is_alive():
        return
    how = _death(int(parent.pid or 0))  # (once rank 0 is a zombie: then its folder is reaped)
    reap_scratch()
    line = f"rank 0 died{how} {where}".rstrip()
    try:
        from fedexp.cli.output import describe_stop

        hc = OmegaConf.create({"overrides": {"task": overrides}})
        line = describe_stop(RankDied(line), cfg, hc)
    except Exception:  # noqa: BLE001 - a config without output_dir (tests): the line alone
        pass
    print(f"fedexp: {line}", file=sys.stderr, flush=True)


def _where(engine: Engine | None) -> str:
    """Where a run is, for a line on a rank that died: ``in round 17``.

    The round under way (its training, its evaluation or its checkpoint): ``ctx.round`` is
    set as a round starts, ``round`` advanced as its training ends.
    """
    if engine is None:
        return "while the run was being set up"
    done = engine.round
    return f"in round {done + 1 if engine.ctx.round == done else done}"


def lost(exc: BaseException, procs: list[Any], engine: Engine | None) -> BaseException | None:
    """What a run over started ranks raises when ``exc`` is a rank that left, else None.

    On rank 0 (``procs``: the ranks it started): the first of them to end (a signal first),
    as :class:`~fedexp.errors.RankDied` (``rank 1 died (signal 9, SIGKILL) in round 17``),
    once it has ended (at most :data:`_END_WAIT_S` seconds); its scratch folder is removed.
    On a started rank: :class:`_PeerLost` with where the run was (:func:`rank_main` says it if
    rank 0 is the one that died); in a group started from outside: :class:`GroupLost`, once
    the scratch folders of this machine's killed ranks are removed. None otherwise: the error
    stands as it is.
    """
    if not peer_left(exc):
        return None
    if not procs:
        if _started_rank is not None:
            return _PeerLost(_where(engine))
        if not dist.is_initialized():
            return None
        who = _sibling_died(_ZOMBIE_WAIT_S)  # (before the reap: a zombie's signal first)
        reap_scratch()  # a rank of this machine that was killed: its store=disk folder
        return GroupLost(_where(engine), who)
    ready = wait([p.sentinel for p in procs], timeout=_END_WAIT_S)
    ended = []
    for rank, p in enumerate(procs, start=1):
        if p.sentinel in ready:
            p.join(timeout=1)  # (its pipe closes a moment before its exit status is there)
        if p.exitcode is not None:  # a rank that a signal ended first, then the lowest
            ended.append((not _signal_of(p.exitcode), rank, p.exitcode))
    if not ended:
        return None
    _, rank, code = min(ended)
    reap_scratch()
    said = "died" if _signal_of(code) else "left the run" if code == 0 else "failed"
    return RankDied(f"rank {rank} {said}{_how(code) if code else ''} {_where(engine)}")


def _sibling_died(wait: float = 0.0) -> str:
    """``rank 1 died (signal 9, SIGKILL)``: a rank of this machine that is gone, or "".

    :func:`~fedexp.engine.processes.group_pids.dead_sibling`, with its signal while it is a
    zombie (:func:`_death`; torchrun's agent reaps it soon: then none).
    """
    found = dead_sibling(wait)
    if found is None:
        return ""
    rank, pid = found
    return f"rank {rank} died{_death(pid) if is_zombie(pid) else ''}"


def group_lost(exc: BaseException) -> GroupLost | None:
    """SIGTERM in a group, when a rank of this machine died or the group broke: that, else None.

    A :class:`GroupLost`, which names the rank of this machine that died
    (:func:`~fedexp.engine.processes.group_pids.dead_sibling`; its scratch folder removed).
    The group broke, too, when a collective had failed because a process left as the
    SIGTERM came (``exc``'s context), or, in a group over several nodes, when a connection
    of this rank was closed by its other end (a node that died: its survivor's agent may
    send SIGTERM before a collective fails). A plain SIGTERM (every rank alive, the group
    whole) stays one; so does one that every rank got (torchrun's agent, stopped, passes it
    on): a rank of one machine that the same stop ended first (SIGTERM, SIGINT, SIGHUP: its
    exit status read while it is a zombie, which torchrun's agent leaves it while it waits
    for rank 0 to end) is no rank that died.

    Where the run was is read from the frames ``exc`` passed through (the runner's
    ``engine``), as :func:`lost` has it.
    """
    broke = _peer_left_before(exc) or (nodes() > 1 and peer_closed())
    gone = gone_siblings(_ZOMBIE_WAIT_S if broke else 0.0)  # (a dying rank: gone soon)
    who = _died_first(gone)
    if not who and (not broke or (gone and nodes() == 1)):
        return None
    reap_scratch()
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    engine = _engine_in(frames)
    return GroupLost(_where(engine) if engine is not None else "", who)


def _died_first(gone: list[tuple[int, int]]) -> str:
    """``rank 1 died (signal 9, SIGKILL)``: the first of ``gone`` that no stop signal ended.

    ``gone``: (rank, pid) of ranks of this machine that are gone; one whose exit status
    (readable while it is a zombie) is a stop signal's (:data:`_STOPS`) is left out.
    """
    for rank, pid in gone:
        code = _zombie_code(pid)
        if code is None or _signal_of(code) not in _STOPS:
            return f"rank {rank} died{'' if code is None else _how(code)}"
    return ""


def _zombie_code(pid: int) -> int | None:
    """Process ``pid``'s exit code (−signal, or its code) while it is a zombie, else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return _exit_code(int(fields[49])) if fields[0] == "Z" else None
    except (OSError, IndexError, ValueError):
        return None


def _engine_in(frames: list[Any]) -> Any:
    """The innermost of ``frames`` (outermost first) with the runner's ``engine``, or None."""
    engine = None
    for frame in frames:
        found = frame.f_locals.get("engine")
        if found is not None and hasattr(found, "ctx") and hasattr(found, "round"):
            engine = found
    return engine


def death_before_stop() -> GroupLost | None:
    """In a rank ≥ 1 a stop signal is ending: a rank of this machine that died first, or None.

    torchrun's agent stops the others with SIGTERM once a rank died; when rank 0 is the one
    (SIGKILL, the OOM killer), no other rank says so, and this one does
    (:func:`fedexp.cli.distributed.group_job`). Where: the main thread's round, read from
    its frames. A rank that the same stop ended (:func:`_died_first`) is none.
    """
    who = _died_first(gone_siblings())
    if not who:
        return None
    reap_scratch()
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    frames = []
    while frame is not None:
        frames.insert(0, frame)
        frame = frame.f_back
    engine = _engine_in(frames)
    return GroupLost(_where(engine) if engine is not None else "", who)


def _peer_left_before(exc: BaseException) -> bool:
    """Whether ``exc`` came while a collective's failure (a process that left) was handled."""
    seen = exc.__context__
    while seen is not None:
        if isinstance(seen, GroupLost) or peer_left(seen):
            return True
        seen = seen.__context__
    return False


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ctrl-C ignored while ranks are started: they inherit it, and ignore it from birth."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are left alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _command_overrides() -> list[str]:
    """The command line's overrides (Hydra's), for a started rank's resume command."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return [str(o) for o in HydraConfig.get().overrides.task]
    except Exception:  # noqa: BLE001 - no Hydra run (the API): none
        pass
    return []


def _leave() -> None:
    """End a rank ≥ 1 that finished: Python's exit handlers run, the C++ runtime's do not.

    Its results are with rank 0 by now. Python's handlers remove what the rank made (a
    ``store=disk`` scratch folder, through its finalizer) and flush its logs; then the process
    ends without the C++ static destructors, where gloo's threads beside interpreter teardown
    could abort it ("terminate called without an active exception") after a good run.
    """
    gc.collect()
    atexit._run_exitfuncs()  # (weakref.finalize's, logging's, multiprocessing's)
    remove_scratch()
    _flush()
    os._exit(0)


def start(cfg: DictConfig, output_dir: str, entry: Callable[..., None]) -> tuple[Ranks, list[Any]]:
    """Start ranks 1 … P−1 of ``cfg`` and join the group as rank 0.

    Args:
        cfg: the run's config (``distributed.nproc`` = P > 1).
        output_dir: the run's folder (rank 0's; the others write nothing).
        entry: a module-level function ``(rank, size, port, config, backend)`` that calls
            :func:`rank_main` with the job (the runner's, which this module cannot import).

    Returns:
        (this process's :class:`Ranks`, the started processes: :func:`stop` them).
    """
    size = int(cfg.distributed.nproc)
    backend = str(cfg.distributed.get("backend", "auto"))
    child = cfg.copy()
    with open_dict(child):
        child.output_dir = output_dir
        child.progress = "none"
    config = _OVERRIDES + json.dumps(_command_overrides()) + "\n"
    config += OmegaConf.to_yaml(child, resolve=True)
    listener = listen("127.0.0.1")  # the group's store: bound before the ranks look for it
    port = int(listener.getsockname()[1])
    context = mp.get_context("spawn")
    procs = [
        context.Process(target=entry, args=(r, size, port, config, backend), daemon=True)
        for r in range(1, size)
    ]
    with _sigint_ignored():  # Ctrl-C reaches every process of the run: rank 0 handles it
        for p in procs:
            p.start()
    if not cfg.get("threads"):
        _threads(size)
    try:
        ranks = _join(0, size, port, backend, listener)
    except BaseException:
        listener.close()  # (unless the store took it)
        stop(procs, failed=True)
        raise
    log.info("distributed: %d processes (%s)", size, dist.get_backend())
    return ranks, procs


def stop(procs: list[Any], *, failed: bool = False) -> None:
    """Wait for the other ranks (or end them, when the run failed) and leave the group.

    A failed run sends them SIGTERM (each removes its scratch folder and ends at once, inside
    a collective too: :func:`end_quietly`) and leaves the group; a rank that has not
    ended within 60 s is killed, and the folders of killed ranks are removed.
    """
    if not failed and dist.is_initialized():
        dist.barrier()
    if failed:
        for p in procs:
            if p.is_alive():
                p.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
    for rank, p in enumerate(procs, start=1):
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        elif not failed and p.exitcode:  # after the last barrier: the run's results are whole
            log.warning("rank %d ended with exit code %s after the run finished", rank, p.exitcode)
    if failed:
        reap_scratch()  # a rank killed before it could remove its own
    if dist.is_initialized():
        dist.destroy_process_group()
