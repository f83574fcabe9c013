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

The choice depends on the machine, never on its momentary load: a run's floating-point
reductions depend on its thread count, so a rerun or a resume on the same machine takes the
same threads and computes the same numbers. When the machine is already busy the line says
so (:func:`busy_note`), and ``threads=1`` is the remedy.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig


@dataclass(frozen=True)
class ThreadChoice:
    """A run's torch threads and why.

    Attributes:
        threads: torch's intra-op threads.
        reason: what they were chosen from, e.g. "2 cores shared by 2 sweep jobs".
        idle: cores beyond one a process (the sweep's jobs at once times the run's ranks),
            which the run's Python work leaves idle (its figures are drawn there:
            :mod:`fedexp.drawer`).
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
    from fedexp.cli_distributed import env_place

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

    Returns:
        The choice; its :meth:`ThreadChoice.line` (with :func:`busy_note`) is the log line.
    """
    import torch
    from omegaconf import open_dict

    ranks, cpus = _local_ranks(cfg)
    cores = cpus or available_cores()
    choice = choose_threads(cores, jobs, ranks, int(cfg.get("threads") or 0))
    torch.set_num_threads(choice.threads)
    with open_dict(cfg):
        cfg.threads = choice.threads
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    reason = choice.reason + busy_note(load, cores, choice.threads)
    return ThreadChoice(choice.threads, reason, choice.idle)
