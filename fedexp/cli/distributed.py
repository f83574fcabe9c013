"""One run over processes something else started: torchrun, or the tasks of a SLURM job.

``torchrun --nproc-per-node P -m fedexp run ...`` starts P copies of ``fedexp run``;
``fedexp run hydra/launcher=slurm distributed.nodes=K distributed.nproc=P ...`` submits one
SLURM job of K nodes × P tasks (submitit), each task running the same job. Either way each
process learns its place from the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: torchrun sets them;
:class:`submitit.helpers.TorchDistributedEnvironment` exports them from SLURM's variables),
joins one torch.distributed group and runs the same config. Rank 0 alone tracks, shows
progress, writes the run's files (in the folder it chose, sent to the others as JSON) and
prints the end of the run; the others print errors only. ``distributed.nproc=P`` started by
fedexp itself on one machine: :mod:`fedexp.engine.processes.launch`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import re
import signal
import socket
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fedexp.engine.processes.place import Place
from fedexp.engine.processes.place import env_place
from fedexp.errors import ConfigError
from fedexp.errors import FedexpError

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from fedexp.engine.processes.ranks import Ranks

log = logging.getLogger("fedexp")

#: Exit status of a refused setting (as :data:`fedexp.cli.USAGE`).
USAGE = 2

#: Hydra overrides of ranks ≥ 1 under torchrun: no run folder, no ``.hydra/``, no log file
#: (Hydra's run folder is the working directory, which exists; warnings and errors go to
#: stderr through Python's last-resort handler). Rank 0's folder is the run's.
FOLLOWER_OVERRIDES = ("hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none")

#: A value Hydra sweeps over (``1,2``, ``range(1,3)``, ``choice(1,2)``).
_SWEPT = re.compile(r",|^\s*\w+\(")


#: How long a rank that did not print a group's line waits for the one that does.
_SAY_WAIT_S = 10.0
#: The sockets of :func:`say_once` this process holds: their names go when it ends.
_held: list[socket.socket] = []


def say_once(line: str) -> None:
    """Print ``line`` to stderr once for this machine's processes of a group.

    Every rank of a group meets the same refusal; whichever reaches it first prints it (not
    rank 0 by rule: the starter stops the others as soon as one exits, so a rank that waited
    for rank 0 could be stopped with nothing said). The marks are Linux's abstract socket
    names, named after the group (:func:`_group_name`), which no file holds: the kernel
    lets a name go as its process ends, however it ends (SIGKILL too), so nothing outlives
    the run. The first rank binds the group's name, prints, then binds its own "said" name;
    a later rank waits until one of the group's "said" names is bound (at most
    :data:`_SAY_WAIT_S` seconds), so no rank exits before the line is out, then binds its
    own, so that the mark lasts while any rank that knows the line lives, and checks in
    with the first. Before the group is joined every rank meets the line: the first waits
    for the others' check-in (at most :data:`_SAY_WAIT_S` seconds), so that none comes
    after its marks went with it and says the line again. A first rank that died before
    the line was out lets the name go: a later one prints it. One process, or no abstract
    sockets (not Linux): a plain print.
    """
    place = env_place()
    name = _group_name() if place is not None and place.local_size > 1 else None
    claimed = _hold(name) if name is not None else None
    if claimed is None:
        print(line, file=sys.stderr, flush=True)
        return
    assert place is not None and name is not None
    said = [f"{name}-said-{r}" for r in range(place.local_size)]
    deadline = time.monotonic() + _SAY_WAIT_S
    while claimed is False:  # (None: such names failed now: print)
        if any(_bound(n) for n in said):  # out: this rank knows it too, while it lives
            _hold(said[place.local_rank])
            _bound(name)  # (checked in with the first)
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)
        claimed = _hold(name)
    first = _held[-1]
    print(line, file=sys.stderr, flush=True)
    _hold(said[place.local_rank])
    if not _joined():
        _checked_in(first, place.local_size - 1, time.monotonic() + _SAY_WAIT_S)


def _joined() -> bool:
    """Whether this process joined its group (then the others need not meet the same line)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _checked_in(sock: socket.socket, others: int, deadline: float) -> None:
    """Wait until ``others`` ranks connected to ``sock`` (:func:`say_once`), or ``deadline``."""
    while others > 0:
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.accept()[0].close()
        except OSError:  # (the deadline: socket.timeout)
            return
        others -= 1


def _group_name() -> str:
    """The abstract socket name of this machine's ranks of a group (one user's)."""
    env = os.environ
    group = f"{os.getuid()}|{os.getppid()}|" + "|".join(  # a machine's ranks: one starter
        env.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID",
                  "SLURM_STEP_ID", "MASTER_ADDR", "MASTER_PORT")
    )  # fmt: skip
    return f"fedexp-say-{zlib.crc32(group.encode()):08x}"


def _hold(name: str) -> bool | None:
    """Bind abstract socket ``name`` and listen: True; False: bound already; None: no such names."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        sock.bind("\0" + name)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        return False if exc.errno == errno.EADDRINUSE else None
    _held.append(sock)
    return True


def _bound(name: str) -> bool:
    """Whether a live process listens on abstract socket ``name``."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            sock.connect("\0" + name)
    except BlockingIOError:  # its queue is full: it listens
        return True
    except OSError:
        return False
    return True


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        return None


def place_errors(nproc: Any, nodes: Any, place: Place) -> list[str]:
    """``distributed.nproc``/``nodes`` against the group that was started (1: take the group's).

    ``nproc`` counts processes per machine, ``nodes`` machines; a value left at 1 is ignored
    (torchrun or the SLURM job decides), any other must equal what was started.
    """
    errors = []
    per_node = "processes" if place.starter == "torchrun" else "tasks"
    n = _as_int(nproc)
    if n is not None and n not in (1, place.local_size):
        errors.append(
            f"distributed.nproc={n} disagrees with {place.starter}'s {place.local_size} "
            f"{per_node} per node (LOCAL_WORLD_SIZE={place.local_size}): leave "
            f"distributed.nproc at 1 (the group decides) or make them equal"
        )
    k = _as_int(nodes)
    if k is not None and k not in (1, place.nodes):
        errors.append(
            f"distributed.nodes={k} disagrees with {place.starter}'s {place.nodes} node(s) "
            f"(WORLD_SIZE={place.size}, LOCAL_WORLD_SIZE={place.local_size}): leave "
            "distributed.nodes at 1 (the group decides) or make them equal"
        )
    return errors


def _given(args: Sequence[str]) -> dict[str, str]:
    """The command line's values of ``distributed.<key>`` (``{"nodes": "2"}``)."""
    out = {}
    for arg in args:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key.startswith("distributed."):
            out[key.split(".", 1)[1]] = value
    return out


def launcher_option(args: Sequence[str]) -> str | None:
    """The option of a ``hydra/launcher=OPTION`` override, or None."""
    for arg in args:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "hydra/launcher":
            return value
    return None


def prepare_argv(args: list[str]) -> tuple[list[str], str | None, int]:
    """The command line after ``run`` as Hydra gets it, or the one line that refuses it.

    ``hydra/launcher=slurm`` where ``sbatch`` is missing is refused (exit 1). Under torchrun
    (``WORLD_SIZE`` > 1): a sweep is refused, ``distributed.*`` must agree with the group
    (:func:`place_errors`), and ranks ≥ 1 get :data:`FOLLOWER_OVERRIDES`. Otherwise
    ``distributed.nodes=K`` > 1 needs the SLURM launcher, and is then submitted as a sweep of
    one job (``-m`` is added) of K nodes × ``distributed.nproc`` tasks
    (``conf/hydra/launcher/slurm.yaml``); the number of nodes is never swept.

    Args:
        args: the command line after ``run``.

    Returns:
        (the command line, None, 0), or (the command line, the error, the exit status).
    """
    launcher = launcher_option(args)
    if launcher is not None:
        from fedexp.sweep import NO_SLURM
        from fedexp.sweep import slurm_missing

        if slurm_missing(launcher):
            return args, NO_SLURM, 1
    args, error = _distributed_argv(args, launcher)
    return args, error, USAGE if error else 0


def _distributed_argv(args: list[str], launcher: str | None) -> tuple[list[str], str | None]:
    """:func:`prepare_argv`'s ``distributed.*`` part: (the command line, the error or None)."""
    values = _given(args)
    bad = [
        f"distributed.{key}={values[key]}: expected an integer in [1, 1024]"
        for key in ("nproc", "nodes")
        if key in values and (n := _as_int(values[key])) is not None and not 1 <= n <= 1024
    ]
    if bad:  # before Hydra makes a folder (validate() says the same after composing)
        return args, "; ".join(bad)
    sweep = any(a in ("-m", "--multirun") for a in args)
    place = env_place()
    if place is not None:
        if sweep:
            return args, (
                "-m: a sweep cannot run under torchrun (its jobs would share one process "
                "group); start one torchrun per run, or sweep with hydra/launcher=slurm "
                "distributed.nproc=P (each job gets P SLURM tasks)"
            )
        errors = place_errors(values.get("nproc"), values.get("nodes"), place)
        if errors:
            return args, "; ".join(errors)
        return (args if place.leader else [*args, *FOLLOWER_OVERRIDES]), None
    nodes = values.get("nodes")
    if nodes is None:
        return args, None
    if _SWEPT.search(nodes):
        return args, (
            f"distributed.nodes={nodes}: the number of nodes cannot be swept (a sweep's jobs "
            "share one SLURM allocation shape); run one sweep per value"
        )
    k = _as_int(nodes)
    if k is None or k == 1:
        return args, None  # not an integer: validate() names it
    if launcher is None or "slurm" not in launcher:
        return args, (
            f"distributed.nodes={k}: more than one machine needs hydra/launcher=slurm (one "
            f"SLURM job of {k} nodes × distributed.nproc tasks each), or torchrun on each node"
        )
    if _SWEPT.search(values.get("nproc", "")):
        return args, (
            f"distributed.nproc={values['nproc']}: not swept across nodes (every job of the "
            "sweep gets the same tasks per node); run one sweep per value"
        )
    return (args if sweep else ["-m", *args]), None


def check_place(cfg: DictConfig) -> None:
    """The composed config against the group the environment describes (or its absence).

    Raises:
        ConfigError: ``distributed.nodes`` > 1 with no group started from outside, a
            ``distributed.nproc``/``nodes`` that disagrees with it (:func:`place_errors`), or
            NCCL without CUDA.
    """
    spread = cfg.get("distributed") or {}
    nodes = spread.get("nodes", 1)
    place = env_place()
    if place is None:
        if isinstance(nodes, int) and nodes > 1:
            raise ConfigError(
                f"distributed.nodes={nodes}: more than one machine needs hydra/launcher=slurm "
                "or torchrun on each node"
            )
        return
    errors = place_errors(spread.get("nproc", 1), nodes, place)
    if spread.get("backend") == "nccl":
        import torch

        if not torch.cuda.is_available():
            errors.append("distributed.backend=nccl: CUDA is not available (use auto or gloo)")
    if errors:
        raise ConfigError("; ".join(errors))


def export_submitit_env() -> Any:
    """In a task of a submitit job of several tasks: export torch.distributed's variables.

    :class:`submitit.helpers.TorchDistributedEnvironment` reads SLURM's (``SLURM_PROCID``,
    ``SLURM_NTASKS``, ``SLURM_LOCALID``, ``SLURM_JOB_NODELIST``, ...; submitit's local
    executor has its own) and exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` (the first node) and ``MASTER_PORT`` (drawn from the
    job id unless set). ``CUDA_VISIBLE_DEVICES`` is left alone: :func:`join` picks
    ``cuda:LOCAL_RANK``.

    Returns:
        The environment it exported, or None (not a submitit job, or a job of one task).
    """
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    from submitit.helpers import TorchDistributedEnvironment

    env = TorchDistributedEnvironment()
    if env.world_size < 2:
        return None
    return env.export(set_cuda_visible_devices=False, overwrite=True)


def _threads(place: Place) -> None:
    """A SLURM task's CPUs (``SLURM_CPUS_PER_TASK``), else the cores split among local ranks."""
    import torch

    from fedexp.engine.processes import launch

    cpus = _as_int(os.environ.get("SLURM_CPUS_PER_TASK", ""))
    if cpus and place.starter != "torchrun":
        torch.set_num_threads(cpus)
    else:
        launch._threads(place.local_size)


def _device(cfg: DictConfig, place: Place) -> None:
    """With CUDA, this rank's GPU: ``cuda:LOCAL_RANK`` (modulo the visible GPUs).

    Untested here (no GPU on the machines the tests run on). NCCL's buffers live on the
    current device, so it is set before the group is joined; ``device=auto``/``cuda`` become
    ``cuda:<local rank>``, an explicit ``cuda:N`` or ``cpu`` is kept.
    """
    import torch

    if not torch.cuda.is_available():
        return
    local = place.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(local)
    if str(cfg.get("device", "auto")) in ("auto", "cuda"):
        cfg.device = f"cuda:{local}"


def join(cfg: DictConfig, hc: DictConfig, place: Place) -> Ranks:
    """Threads, device, the group (``init_from_env``), and rank 0's output folder everywhere."""
    import torch.distributed as dist
    from omegaconf import open_dict

    from fedexp.engine.processes.ranks import init_from_env
    from fedexp.engine.processes.ranks import keep_on_loopback

    if int(cfg.get("threads") or 0) <= 0:
        _threads(place)
    _device(cfg, place)
    if place.nodes == 1:  # one machine: gloo's sockets on loopback (the user's choice kept)
        keep_on_loopback()
    ranks = init_from_env(str(cfg.distributed.get("backend", "auto")))
    if ranks is None:
        raise ConfigError(f"WORLD_SIZE={place.size}: no process group could be joined")
    from fedexp.engine.processes.group_pids import note_group

    note_group(ranks)  # every rank's pid: a survivor names the one that died (SIGTERM)
    mine = str(cfg.get("output_dir") or hc.runtime.output_dir) if ranks.leader else None
    with open_dict(cfg):
        cfg.output_dir = ranks.gather_json(mine)[0]  # JSON bytes: nothing is unpickled
    log.info(
        "distributed: %d processes on %d node(s), started by %s (%s)",
        place.size,
        place.nodes,
        place.starter,
        dist.get_backend(),
    )
    return ranks


def _leave(clean: bool) -> None:
    """Leave the group: after a barrier when this rank finished, at once when it failed.

    A failed rank tears its side down without waiting, so that the others' collectives fail
    instead of waiting out the timeout; a barrier that fails because another rank left is
    no error of this one.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        if clean:
            dist.barrier()
    except RuntimeError:
        pass
    finally:
        dist.destroy_process_group()


def _follow(cfg: DictConfig, hc: DictConfig, place: Place, single: bool) -> bool:
    """Rank ≥ 1: the run with no tracker, no progress, no files; its errors as one line.

    A refused setting is rank 0's to name (every rank has the same); a collective that fails
    because another rank left says so in one line, not a traceback: once a node, with the
    command that resumes the run (:func:`fedexp.cli.group_lost.lost_line`).

    Returns:
        Whether the run finished (a failed sweep job's task returns; a single run exits).
    """
    from omegaconf import open_dict

    from fedexp.cli.group_lost import lost_line
    from fedexp.engine.processes.launch import GroupLost
    from fedexp.engine.processes.ranks import peer_left
    from fedexp.engine.runner import run
    from fedexp.tracking.base import NullTracker

    with open_dict(cfg):
        cfg.progress = "none"
    try:
        run(cfg, tracker=NullTracker())
    except GroupLost as exc:  # one line a surviving node, with the command that resumes
        say_once(f"fedexp: {lost_line(exc, cfg, _task(hc), place)}")
        if single:
            sys.exit(1)
        return False
    except (FedexpError, RuntimeError) as exc:
        if not isinstance(exc, FedexpError) and not peer_left(exc):
            raise  # a bug: its traceback
        said = f"error: {exc}" if isinstance(exc, FedexpError) else _PEER_LEFT
        if isinstance(exc, ConfigError):  # the same settings on every rank: one says it
            say_once(f"fedexp: {said}")
        else:
            print(f"fedexp: rank {place.rank}: {said}", file=sys.stderr, flush=True)
        if single:
            sys.exit(USAGE if isinstance(exc, ConfigError) else 1)
        return False
    return True


_PEER_LEFT = "stopped: another process of the run left the group (its error says why)"


def _task(hc: DictConfig) -> list[str]:
    """The command line's overrides, without those a follower adds (:data:`FOLLOWER_OVERRIDES`)."""
    return [str(o) for o in hc.overrides.task if str(o) not in FOLLOWER_OVERRIDES]


def _lead(
    job: Callable[[DictConfig, DictConfig], float],
    cfg: DictConfig,
    hc: DictConfig,
    place: Place,
    single: bool,
) -> float:
    """Rank 0: ``job``; a process of the group that left is one line (``lost_line``)."""
    from fedexp.cli.group_lost import lost_line
    from fedexp.engine.processes.launch import GroupLost

    try:
        return job(cfg, hc)
    except GroupLost as exc:
        say_once(f"fedexp: {lost_line(exc, cfg, _task(hc), place)}")
        if single:
            sys.exit(1)
        return math.nan


def _end_when_stopped(cfg: DictConfig, hc: DictConfig, place: Place) -> None:
    """Rank ≥ 1 under torchrun: SIGTERM and SIGINT end it at once, quietly, its scratch removed.

    torchrun's agent passes the signal it got (``kill``, Ctrl-C: SIGINT) to every rank, and
    sends SIGTERM once a rank ended: rank 0 says why the run stopped, with the resume
    command; this rank ends without a line (a default SIGTERM left its ``store=disk`` folder,
    Ctrl-C printed its traceback), inside a collective too
    (:func:`~fedexp.engine.processes.launch.end_quietly`). Unless rank 0 died first: then
    this rank says so (:func:`~fedexp.engine.processes.launch.death_before_stop`).
    """
    from fedexp.cli.group_lost import lost_line
    from fedexp.engine.processes.launch import death_before_stop
    from fedexp.engine.processes.launch import end_quietly

    def last_word() -> None:
        lost = death_before_stop()
        if lost is not None:
            say_once(f"fedexp: {lost_line(lost, cfg, _task(hc), place)}")

    with contextlib.suppress(ValueError):  # (not the main thread: signals left alone)
        end_quietly(signal.SIGTERM, signal.SIGINT, last_word=last_word)


def group_job(
    cfg: DictConfig,
    hc: DictConfig,
    job: Callable[[DictConfig, DictConfig], float],
    checked: Callable[[DictConfig], None],
) -> float:
    """Run ``job`` (the CLI's single run or sweep job), joining a group if one was started.

    Without one (no ``WORLD_SIZE`` > 1, no submitit job of several tasks) this is ``job``.
    With one, every rank checks the config first (``checked``; a bad one: rank 0 reports it
    through ``job``, exit 2 or the sweep job's failed status, the others leave quietly, and
    nobody joins), then joins (:func:`join`); rank 0 runs ``job``, the others
    :func:`_follow`.
    """
    from hydra.types import RunMode

    single = hc.mode != RunMode.MULTIRUN
    if not single:
        export_submitit_env()
    place = env_place()
    if place is None:
        return job(cfg, hc)
    if not place.leader:
        logging.getLogger("fedexp").setLevel(logging.WARNING)
    try:
        checked(cfg)
    except ConfigError as exc:
        if place.leader and not single:
            return job(cfg, hc)  # the sweep job's failed status
        if single:
            say_once(f"fedexp: error: {exc}")
            sys.exit(USAGE)
        return math.nan
    if not place.leader and place.starter == "torchrun":
        _end_when_stopped(cfg, hc, place)
    join(cfg, hc, place)
    clean = False
    try:
        if place.leader:
            value = _lead(job, cfg, hc, place, single)
            clean = single or not math.isnan(value)  # a failed sweep job returns NaN
            return value
        clean = _follow(cfg, hc, place, single)
        return math.nan
    finally:
        _leave(clean)
