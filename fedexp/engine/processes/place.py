"""A process's place in a group started from outside: torchrun, or the tasks of a SLURM job.

Each process learns it from the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``: torchrun sets them; submitit's ``TorchDistributedEnvironment`` exports
them from SLURM's variables) before any process group exists: the command line reads it to
start and stop such a run (:mod:`fedexp.cli.distributed`), the engine to choose its threads
(:mod:`fedexp.engine.threads`). Imports nothing of fedexp.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Place:
    """This process's place in a group started from outside (torchrun or a SLURM job).

    Attributes:
        rank: its rank among ``size`` (``RANK``).
        size: the processes of the run (``WORLD_SIZE``).
        local_rank: its rank on its machine (``LOCAL_RANK``).
        local_size: the processes on each machine (``LOCAL_WORLD_SIZE``).
        starter: what started the processes, for messages ("torchrun", "the SLURM job").
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    starter: str = "torchrun"

    @property
    def nodes(self) -> int:
        """The machines of the run."""
        return max(1, self.size // max(1, self.local_size))

    @property
    def leader(self) -> bool:
        """Rank 0: the one that tracks, prints and writes."""
        return self.rank == 0


def env_place(environ: Mapping[str, str] | None = None) -> Place | None:
    """The place the environment describes (``WORLD_SIZE`` > 1), else None (one process)."""
    env = os.environ if environ is None else environ
    try:
        size = int(env.get("WORLD_SIZE", "1"))
        if size < 2:
            return None
        rank = int(env.get("RANK", "0"))
        local_size = int(env.get("LOCAL_WORLD_SIZE", str(size)))
        local_rank = int(env.get("LOCAL_RANK", str(rank % max(1, local_size))))
    except ValueError:
        return None
    executor = env.get("SUBMITIT_EXECUTOR", "")
    starter = {"": "torchrun", "slurm": "the SLURM job"}.get(executor, f"the {executor} job")
    return Place(rank, size, local_rank, local_size, starter)
