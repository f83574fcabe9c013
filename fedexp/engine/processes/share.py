"""A process's place among the run's processes: rank r of P, and the clients that are its.

Over several processes (``distributed.nproc``, torchrun, SLURM) client n belongs to rank
n mod P: a rank runs, stores and scores its own clients only, in row n // P of what it holds.
:class:`Share` is that place as plain data, with the arithmetic every holder of per-client
rows needs (the training table, the clients' states, the channels' memories); ``None`` in its
place means one process, which holds every client. :class:`fedexp.engine.processes.ranks.Ranks`
adds the exchanges between the processes (``Ranks.share`` is its :class:`Share`); this
module imports nothing (not torch.distributed), so that the client stores may use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

N = TypeVar("N")


@dataclass(frozen=True)
class Share:
    """Rank ``rank`` of ``size`` processes, which owns the clients n with n mod size == rank.

    Attributes:
        rank: this process's rank, in ``[0, size)``.
        size: P, the number of processes.
    """

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of {self.size}: expected 0 <= rank < size")

    def owner(self, client: int) -> int:
        """The rank that owns ``client``."""
        return client % self.size

    def owns(self, clients: N) -> N:
        """Whether this rank owns ``clients``: a bool, or one per entry of an integer array."""
        return clients % self.size == self.rank  # type: ignore[operator]

    def row(self, clients: N) -> N:
        """Where this rank holds its clients' rows: n // size (of an int or an integer array)."""
        return clients // self.size  # type: ignore[operator]

    def mine(self, clients: Iterable[int]) -> list[int]:
        """This rank's clients among ``clients``, in their order."""
        return [n for n in clients if n % self.size == self.rank]

    def own(self, num_clients: int) -> range:
        """This rank's clients among the first ``num_clients``."""
        return range(self.rank, num_clients, self.size)

    def holds(self) -> str:
        """What this rank holds, for a message: "rank r of P holds those of clients ... only"."""
        r, p = self.rank, self.size
        return f"rank {r} of {p} holds those of clients n with n mod {p} == {r} only"


#: One process: it owns every client (what ``None`` means where a :class:`Share` is asked for).
ALONE = Share(0, 1)
