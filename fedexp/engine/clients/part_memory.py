"""What a lossy channel remembers per client: error-feedback residuals, replicas, references.

STC-style error feedback (Sattler et al., "Robust and communication-efficient federated
learning from non-i.i.d. data", 2019) keeps, for every client and message part, what the
codec has not sent yet; a "model" part sent as a change keeps the receiver's replica (and,
without error feedback, the sender's last message). At 10^5-10^6 clients a dict of one
tensor per (client, part) costs a Python object per entry and cannot live on disk, so each
part's memories are rows of :class:`fedexp.engine.clients.states.ClientStates` columns instead: in
memory, memory-mapped files with ``store=disk``, and over several processes a rank's own
clients only.

:class:`PartMemory` reads as the mapping ``(client, part) -> tensor`` the channel code and
the checkpoints use; :meth:`PartMemory.stack` / :meth:`PartMemory.write_stack` read and write a
cohort's rows as one ``[m, ...]`` tensor (one gather and one scatter, whatever the cohort), and
:meth:`PartMemory.has` says on the host which clients hold a memory (no device read).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedexp.contract import CohortStates
from fedexp.engine.clients.states import ClientStates
from fedexp.engine.clients.states import merge_exports
from fedexp.engine.processes.share import ALONE
from fedexp.engine.processes.share import Share

#: (client, part name); the part of a bare-tensor message is named "".
PartKey = tuple[int, str]


class PartMemory(MutableMapping[PartKey, torch.Tensor]):
    """One kind of channel memory in one direction: a tensor per (client, part).

    Args:
        size: N, the number of clients.
        device: where the memories are read to.
        folder: where each part's columns go (memory-mapped files); None: in memory.
        share: this process's place among the processes: its clients only
            (:class:`ClientStates`); None: every client's.
    """

    def __init__(
        self,
        size: int,
        device: torch.device | str = "cpu",
        folder: Path | None = None,
        share: Share | None = None,
    ) -> None:
        self._size, self._device, self._folder, self._share = size, device, folder, share
        self._parts: dict[str, ClientStates] = {}
        #: part -> bool [N] on the host: the clients holding a memory of it (bookkeeping that
        #: spares the round a device read of the columns' masks)
        self._held: dict[str, np.ndarray] = {}

    def _part(self, name: str, make: bool = False) -> ClientStates | None:
        """The columns of part ``name`` (made when ``make``; else None if never written)."""
        part = self._parts.get(name)
        if part is None and make:
            folder = None if self._folder is None else self._folder / f"part{len(self._parts)}"
            part = ClientStates(
                self._size, lambda n: {}, self._device, folder, self._share, shared_init=True
            )
            self._parts[name] = part
            self._held[name] = np.zeros(self._size, dtype=bool)
        return part

    def has(self, clients: Sequence[int], name: str) -> np.ndarray:
        """Whether each client holds a memory of part ``name`` (bool ``[m]``, on the host)."""
        held = self._held.get(name)
        if held is None:
            return np.zeros(len(clients), dtype=bool)
        return held[np.asarray(clients, dtype=np.int64)]

    def stack(self, clients: Sequence[int], name: str) -> torch.Tensor | None:
        """The clients' memories of part ``name`` as one ``[m, ...]`` tensor, in their order.

        Rows of clients without one (:meth:`has`) are zeros; None when no client ever had one.
        A fixed number of tensor ops for any number of clients (one gather of the column).
        """
        part = self._part(name)
        if part is None or not len(clients):
            return None
        states = part.rows(clients)
        return states.stacks.get("v")

    def write_stack(self, clients: Sequence[int], name: str, values: torch.Tensor) -> None:
        """Set the clients' memories of part ``name`` to the rows of ``values`` (copied in).

        One scatter into the part's column, whatever the number of clients.
        """
        if len(clients):
            part = self._part(name, make=True)
            part.write(clients, CohortStates(len(clients), {"v": values}))
            self._held[name][np.asarray(clients, dtype=np.int64)] = True

    def rows(self, clients: Sequence[int], name: str) -> list[torch.Tensor | None]:
        """Each client's memory of part ``name`` (None where it has none), in their order.

        A tensor a client (ops per client): the cohort's code reads :meth:`stack`.
        """
        part = self._part(name)
        if part is None:
            return [None] * len(clients)
        return [s.get("v") for s in part.rows(clients)]

    def write(self, clients: Sequence[int], name: str, values: Sequence[torch.Tensor]) -> None:
        """Set the clients' memories of part ``name`` (copied in; a list, one per client)."""
        if len(clients):
            self._part(name, make=True).write(clients, [{"v": v} for v in values])
            self._held[name][np.asarray(clients, dtype=np.int64)] = True

    def export(self) -> dict[str, Any]:
        """Each part's :meth:`ClientStates.export`, keyed ``"~<part>"``.

        What a checkpoint saves: each part's rows stacked, a few tensors, not one a client.
        """
        return {f"~{name}": part.export() for name, part in self._parts.items()}

    def load(self, tree: dict[str, Any]) -> None:
        """Write what :meth:`export` gave (a rank keeps its own clients of it)."""
        for key, part in tree.items():
            if not key.startswith("~"):
                raise ValueError(f"channel memory {key!r}: expected a part key '~<name>'")
            self._part(key[1:], make=True).load(part)
            ids = [int(n) for n in part.get("rows", {}).get("v", torch.zeros(0)).tolist()]
            ids += [int(n) for n, state in part.get("loose", {}).items() if "v" in state]
            own = (self._share or ALONE).mine(ids)
            self._held[key[1:]][np.asarray(own, dtype=np.int64)] = True

    def __getitem__(self, key: PartKey) -> torch.Tensor:
        n, name = key
        value = self.rows([n], name)[0]
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: PartKey, value: torch.Tensor) -> None:
        n, name = key
        self.write([n], name, [value])

    def __delitem__(self, key: PartKey) -> None:
        if key not in self:
            raise KeyError(key)
        n, name = key
        self._parts[name].write([n], [{}])
        self._held[name][n] = False

    def items(self) -> Iterator[tuple[PartKey, torch.Tensor]]:  # type: ignore[override]
        """Every (client, part) and its memory, part by part in client order.

        One read of each part's rows, not one a client.
        """
        for name, part in self._parts.items():
            tree = part.export()
            ids, values = tree["rows"].get("v"), tree["values"].get("v")
            if ids is not None:
                for n, v in zip(ids.tolist(), values, strict=True):
                    yield (n, name), v
            for n, state in tree["loose"].items():  # (a value of another shape)
                if "v" in state:
                    yield (int(n), name), state["v"]

    def __iter__(self) -> Iterator[PartKey]:
        return (key for key, _ in self.items())

    def __len__(self) -> int:
        return sum(1 for _ in self)


def merge_memories(exports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One :meth:`PartMemory.export` of several processes' clients (the ranks')."""
    parts: dict[str, list[dict[str, Any]]] = {}
    for tree in exports:
        for key, part in tree.items():
            parts.setdefault(key, []).append(part)
    return {key: merge_exports(trees) for key, trees in parts.items()}
