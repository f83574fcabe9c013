"""How many intra-op threads torch takes in a run: its cores over the processes sharing them.

Two processes each running as many OpenMP threads as there are cores make their threads wait
on each other at every parallel region: on a 2-core machine a small 3-D convolution ran 9x
slower with two threads than with one while another process was busy. A run therefore
divides the cores it may use (its CPU affinity, capped by a cgroup CPU quota) among the
processes that share them: the parallel launcher's sweep jobs (``hydra/launcher=parallel``,
joblib's ``n_jobs``) and the run's own ranks (``distributed.nproc``, or torchrun's ranks on
this machine). ``threads=N`` overrides the choice. :func:`choose_threads` is the rule (a pure
function); :func:`apply_threads` applies it to a run's config and torch, and the CLI logs its
one line (``threads: 1 (2 cores shared by 2 sweep jobs)``).

A run of one process (no parallel sweep jobs, no ranks, not a stacked group) also follows
the machine's load (issue 70, item 1): where other processes already fill some of its cores,
OpenMP threads wait on each other at every parallel region (``make demo-imaging`` printed no
round in 11 minutes at 2 threads on a busy 2-core machine; at 1 thread a round took 42 s).
:func:`fit_to_load` is the rule: the cores the 1-minute load average says other processes
fill are taken away from the run's share. It is applied at the start (the line says
``...; load 4.1 on 2 cores: 1 thread, rechecked between rounds``) and between rounds
(:class:`LoadFollower`, a round callback: one read of ``/proc/loadavg``, at most one change a
minute, one log line ``threads: 2 -> 1 after round 7 (load 3.2 on 2 cores)``). A run's
floating-point reductions may depend on its thread count, so two runs at different loads
may differ in their last bits: ``threads=N`` fixes the count, whatever the load (the line
then says when the machine is busy, :func:`busy_note`), and a run that must be reproduced
bit for bit sets it. Runs of several processes keep the share the cores give them, and the
line names the load when it is high.
"""

from __future__ import annotations

import contextvars
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("fedexp")

#: Seconds between two changes of a run's threads: the 1-minute load average needs about
#: that long to show what the last change did.
SETTLE_S = 60.0


@dataclass(frozen=True)
class ThreadChoice:
    """A run's torch threads and why.

    Attributes:
        threads: torch's intra-op threads.
        reason: what they were chosen from, e.g. "2 cores shared by 2 sweep jobs".
        idle: cores beyond one a process (the sweep's jobs at once times the run's ranks),
            which the run's Python work leaves idle (its figures are drawn there:
            :mod:`fedexp.figures.drawer`).
    """

    threads: int
    reason: str
    idle: int = 0

    def line(self) -> str:
        """The log line: ``threads: 1 (2 cores shared by 2 sweep jobs)``."""
        return f"threads: {self.threads} ({self.reason})"


def _sharers(jobs: int, ranks: int) -> str:
    parts = []
    if jobs > 1:
        parts.append(f"{jobs} sweep jobs")
    if ranks > 1:
        parts.append(f"{ranks} ranks")
    return " × ".join(parts)


def _cores(cores: int) -> str:
    return f"{cores} core{'s' if cores != 1 else ''}"


def choose_threads(cores: int, jobs: int = 1, ranks: int = 1, override: int = 0) -> ThreadChoice:
    """The torch threads of one process of a run.

    Args:
        cores: the cores the run may use (:func:`available_cores`).
        jobs: sweep jobs running at the same time on these cores (1: a single run or a
            sequential sweep).
        ranks: the run's processes on these cores (``distributed.nproc``; torchrun's ranks
            on this machine).
        override: ``threads=N`` (> 0) wins; 0 chooses.

    Returns:
        ``override`` if set, else ``cores // (jobs × ranks)``, at least 1; and the cores
        beyond ``jobs × ranks``.
    """
    cores, jobs, ranks = max(1, cores), max(1, jobs), max(1, ranks)
    shared = _sharers(jobs, ranks)
    where = f"{_cores(cores)} shared by {shared}" if shared else f"{_cores(cores)}, one process"
    idle = max(0, cores - jobs * ranks)
    if override > 0:
        return ThreadChoice(override, f"threads={override}; {where}", idle)
    return ThreadChoice(max(1, cores // (jobs * ranks)), where, idle)


def launcher_jobs(n_jobs: int | None, cores: int) -> int:
    """Sweep jobs a launcher runs at once on this machine's cores.

    Args:
        n_jobs: the launcher's ``n_jobs`` (joblib's: ``-1`` every core, ``-2`` all but one);
            None for a launcher that runs one job at a time (Hydra's basic launcher) or
            each job on an allocation of its own (SLURM).
        cores: the cores available (joblib counts the negative values from them).
    """
    if n_jobs is None or n_jobs == 0:
        return 1
    if n_jobs < 0:
        return max(1, cores + 1 + n_jobs)
    return n_jobs


def _quota_cores(cpu_max: str) -> int | None:
    """Cores of a cgroup v2 ``cpu.max`` ("200000 100000": 2; "max 100000": no quota)."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota = _quota_cores(Path("/sys/fs/cgroup/cpu.max").read_text())
    except OSError:
        quota = None
    return max(1, min(cores, quota) if quota else cores)


def machine_cores() -> int:
    """The machine's cores, all of them (those the load average counts)."""
    return os.cpu_count() or 1


def busy_note(load: float | None, cores: int, threads: int) -> str:
    """A remark for the log line when other processes already fill the cores.

    Args:
        load: the 1-minute load average at the run's start (None: unknown).
        cores: the cores available.
        threads: the threads chosen.

    Returns:
        ``"; the machine is busy (load 4.1 on 2 cores): threads=1 avoids OpenMP threads
        waiting on each other"``, or "" when it is not or one thread was chosen.
    """
    if load is None or threads <= 1 or load < cores:
        return ""
    return (
        f"; the machine is busy (load {load:.1f} on {_cores(cores)}): threads=1 avoids "
        "OpenMP threads waiting on each other"
    )


def _local_ranks(cfg: DictConfig) -> tuple[int, int | None]:
    """(the run's processes on this machine, a SLURM task's CPUs or None).

    Torchrun's or a SLURM job's group (``WORLD_SIZE`` > 1): its ranks on this machine
    (``LOCAL_WORLD_SIZE``), and for a SLURM task not started by torchrun its
    ``SLURM_CPUS_PER_TASK`` (its own cores). Otherwise ``distributed.nproc``.
    """
    from fedexp.engine.processes.place import env_place

    place = env_place()
    if place is not None:
        cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
        if cpus.isdigit() and int(cpus) > 0 and place.starter != "torchrun":
            return 1, int(cpus)
        return place.local_size, None
    return int((cfg.get("distributed") or {}).get("nproc", 1) or 1), None


def apply_threads(cfg: DictConfig, jobs: int = 1) -> ThreadChoice:
    """Choose this run's threads, set torch's, and record them in ``cfg.threads``.

    Recorded in the config, the number reaches the ranks a ``distributed.nproc`` run starts
    (each applies ``cfg.threads``: :func:`fedexp.engine.runner.run`) and the run's
    ``config.yaml`` and MLflow params.

    Args:
        cfg: the run's config (``threads``, ``distributed``); ``threads`` is set here.
        jobs: sweep jobs sharing the cores (:func:`launcher_jobs`).

    A single process on the whole machine with ``threads=0`` also fits the choice to the
    load (:func:`fit_to_load`) and leaves a :class:`LoadFollower` for its rounds
    (:func:`round_callbacks`); any other run names a high load in its line
    (:func:`busy_note`).

    Returns:
        The choice; its :meth:`ThreadChoice.line` is the log line.
    """
    import torch
    from omegaconf import open_dict

    from fedexp.engine.round.stacking import current

    ranks, cpus = _local_ranks(cfg)
    cores = cpus or available_cores()
    override = int(cfg.get("threads") or 0)
    choice = choose_threads(cores, jobs, ranks, override)
    load = load_average()
    # the load average counts the whole machine's processes: it tells of the run's cores only
    # where they are all of them (not a SLURM task's, an affinity's or a container's share)
    whole = cpus is None and cores == machine_cores()
    alone = override == 0 and jobs * ranks == 1 and current.get() is None and whole
    follower = None
    if alone:  # one process: the load decides within the cores' share
        follower = LoadFollower(cores, choice.threads, load_average)
        threads = fit_to_load(choice.threads, cores, load)
        note = ""
        if threads != choice.threads:
            note = f"; load {load:.1f} on {_cores(cores)}: {_threads(threads)}, rechecked "
            note += "between rounds"
        follower.threads = threads
        choice = ThreadChoice(threads, choice.reason + note, choice.idle)
    else:
        choice = ThreadChoice(
            choice.threads, choice.reason + busy_note(load, cores, choice.threads), choice.idle
        )
    _follower.set(follower)
    torch.set_num_threads(choice.threads)
    with open_dict(cfg):
        cfg.threads = choice.threads
    return choice


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def load_average() -> float | None:
    """The machine's 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def fit_to_load(share: int, cores: int, others: float | None) -> int:
    """A single process's threads when other processes already fill some of its cores.

    Args:
        share: its threads on an idle machine (:func:`choose_threads`).
        cores: the cores available.
        others: the load of the other processes (the load average less the run's own
            threads; at the start, the load average); None: unknown.

    Returns:
        ``share`` less the cores the others fill (their load rounded, half up), at least 1:
        on 2 cores, 2 at a load below 0.5, 1 above.
    """
    if others is None:
        return share
    busy = min(cores, max(0, math.floor(others + 0.5)))
    return max(1, min(share, cores - busy))


class LoadFollower:
    """The round callback of a single-process run whose threads follow the load.

    After each round it reads the load average (one read of ``/proc/loadavg``; no torch, no
    host synchronisation: the round is over), subtracts the run's own threads (each busy,
    they count in it) and applies :func:`fit_to_load`; a change waits :data:`SETTLE_S` after
    the last one, and a raise needs the others' load a quarter of a core below the rounding
    point (no flapping at the boundary). One log line a change.

    Args:
        cores: the cores available.
        share: the threads on an idle machine.
        read_load: the load average reader (:func:`load_average`; tests give their own).
        clock: seconds, monotonic (tests give their own).
    """

    def __init__(
        self,
        cores: int,
        share: int,
        read_load: Callable[[], float | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores, self.share, self.read_load, self.clock = cores, share, read_load, clock
        self.threads = share
        self.changed_at = clock()

    def __call__(self, engine: Any, metrics: dict[str, float]) -> None:
        """Between two rounds: follow the load (``engine`` unused: the callback's form)."""
        now = self.clock()
        if now - self.changed_at < SETTLE_S:
            return
        load = self.read_load()
        if load is None:
            return
        others = load - self.threads
        target = fit_to_load(self.share, self.cores, others)
        if target > self.threads:  # raise only clear of the boundary
            target = max(self.threads, fit_to_load(self.share, self.cores, others + 0.25))
        if target == self.threads:
            return
        import torch

        log.info(
            "threads: %d -> %d after round %d (load %.1f on %s)",
            self.threads,
            target,
            int(metrics.get("round", 0)),
            load,
            _cores(self.cores),
        )
        torch.set_num_threads(target)
        self.threads, self.changed_at = target, now


#: The running single-process run's :class:`LoadFollower` (:func:`apply_threads` sets it).
_follower: contextvars.ContextVar[LoadFollower | None] = contextvars.ContextVar(
    "fedexp_thread_follower", default=None
)


def round_callbacks() -> list[LoadFollower]:
    """The round callbacks :func:`apply_threads` asked for: ``[LoadFollower]`` or ``[]``."""
    follower = _follower.get()
    return [] if follower is None else [follower]
