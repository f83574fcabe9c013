"""Every client's state, stacked by key: rows of ``[N, ...]`` tensors, in memory or on disk.

A run of 10^6 clients with personal models cannot keep a dict of tensors per client (each
tensor object alone costs ~600 bytes), and a population whose states outgrow the machine's
memory needs them in files. :class:`ClientStates` keeps, for each state key, one ``[N, ...]``
column; client n's state is its row of every column it has. Clients never written hold their
algorithm's initial state, made when read (``Algorithm.init_client`` is deterministic), so a
run allocates nothing per client before the client trains.

With a folder, the columns are memory-mapped files there (``torch.from_file``, shared): the
operating system keeps in memory the pages the round touches and writes the rest back, so
the resident memory follows the sampled cohort, not N. A value whose shape or dtype differs
from its column's (a state that changes shape) is kept aside, per client.

Reads return rows as views: the hooks treat states as read-only and return new ones, which
:meth:`ClientStates.write` copies in.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import torch

from fedexp.data.client import client_ids
from fedexp.engine import hugepages
from fedexp.errors import ConfigError

State = dict[str, torch.Tensor]


class ClientStates(Sequence[State]):
    """The clients' states, read and written as ``{key: tensor}`` per client.

    Args:
        size: N, the number of clients.
        init: client n's initial state (read for clients never written).
        device: where states are read to (the columns live there too unless on disk).
        folder: where the columns' files go (memory-mapped); None keeps them in memory.
    """

    def __init__(
        self,
        size: int,
        init: Callable[[int], State],
        device: torch.device | str = "cpu",
        folder: str | Path | None = None,
    ) -> None:
        self._size, self._init = size, init
        self.device = torch.device(device)
        self.folder = None if folder is None else Path(folder)
        self._cols: dict[str, torch.Tensor] = {}
        self._has: dict[str, torch.Tensor] = {}  # key -> bool [N]: client n's row is set
        self._written = torch.zeros(size, dtype=torch.bool)
        self._loose: dict[int, State] = {}  # values that do not fit their column

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, n: int) -> State: ...

    @overload
    def __getitem__(self, n: slice) -> list[State]: ...

    def __getitem__(self, n: int | slice) -> State | list[State]:
        if isinstance(n, slice):
            return self.rows(list(range(self._size))[n])
        if not -self._size <= n < self._size:
            raise IndexError(f"client {n} of {self._size}")
        return self.rows([n % self._size])[0]

    def __setitem__(self, n: int, state: State) -> None:
        self.write([n], [state])

    def __iter__(self) -> Iterator[State]:
        block = 4096  # rows read together, a block at a time
        for start in range(0, self._size, block):
            yield from self.rows(list(range(start, min(start + block, self._size))))

    @property
    def nbytes(self) -> int:
        """Bytes of the columns (in memory or in their files)."""
        return sum(c.numel() * c.element_size() for c in self._cols.values())

    def rows(self, clients: Sequence[int]) -> list[State]:
        """The states of ``clients``, in their order."""
        if not len(clients):
            return []
        ids = client_ids(list(clients))
        written = self._written[ids].tolist()
        out: list[State] = [
            {} if w else self._init(int(n)) for n, w in zip(clients, written, strict=True)
        ]
        if not any(written):
            return out
        for key, col in self._cols.items():
            has = self._has[key][ids].tolist()  # (set only by a write, which marks written)
            if not any(has):
                continue
            values = col[ids.to(col.device)]
            if values.device != self.device:
                values = values.to(self.device)
            for i, h in enumerate(has):
                if h:
                    out[i][key] = values[i]
        if self._loose:
            for i, n in enumerate(clients):
                if written[i] and n in self._loose:
                    out[i].update(self._loose[n])
        return out

    def write(self, clients: Sequence[int], states: Sequence[State]) -> None:
        """Set the states of ``clients`` (their rows of each key; a missing key is unset)."""
        if len(clients) != len(states):
            raise ValueError(f"{len(clients)} clients but {len(states)} states")
        if not len(clients):
            return
        ids = client_ids(list(clients))
        for n in clients:
            self._loose.pop(n, None)
        for has in self._has.values():
            has[ids] = False
        keys = list(dict.fromkeys(k for s in states for k in s))
        for key in keys:
            fits, values = [], []
            for n, s in zip(clients, states, strict=True):
                v = s.get(key)
                if v is None:
                    continue
                col = self._cols.get(key) if key in self._cols else self._column(key, v)
                if v.shape == col.shape[1:] and v.dtype == col.dtype:
                    fits.append(n)
                    values.append(v)
                else:
                    self._loose.setdefault(n, {})[key] = v.detach().to(self.device).clone()
            if fits:
                col = self._cols[key]
                where = torch.as_tensor(fits, dtype=torch.int64)
                col[where.to(col.device)] = torch.stack(values).detach().to(col.device)
                self._has[key][where] = True
        self._written[ids] = True

    def _column(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A new zero column ``[N, *like.shape]`` for ``key``: in memory, or a mapped file."""
        if "/" in key:
            raise ValueError(f"client state key {key!r}: expected a name without '/'")
        shape = (self._size, *like.shape)
        if self.folder is None and self.device.type == "cpu":  # large ones on huge pages
            col = hugepages.zeros(shape, like.dtype)
        elif self.folder is None:
            col = torch.zeros(shape, dtype=like.dtype, device=self.device)
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{len(self._cols)}-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.bin"
            path.unlink(missing_ok=True)  # a stale file of an earlier run: start from zeros
            count = 1
            for s in shape:
                count *= s
            flat = torch.from_file(str(path), shared=True, size=max(count, 1), dtype=like.dtype)
            col = flat[:count].view(shape)
        self._cols[key] = col
        self._has[key] = torch.zeros(self._size, dtype=torch.bool)
        return col

    # ------------------------------------------------------------------ saving and moving
    def export(self, clients: Sequence[int] | None = None) -> dict[str, Any]:
        """The written states of ``clients`` (default: all) as a nested dict of tensors.

        ``{"written": ids, "rows": {key: ids}, "values": {key: [m, ...]}, "loose": {n: state}}``
        (CPU tensors): what a checkpoint holds and what ranks exchange; :meth:`load` reads it.
        """
        ids = torch.arange(self._size) if clients is None else client_ids(list(clients))
        ids = ids[self._written[ids]]
        out: dict[str, Any] = {"written": ids.clone(), "rows": {}, "values": {}, "loose": {}}
        for key, col in self._cols.items():
            have = ids[self._has[key][ids]]
            if len(have):
                out["rows"][key] = have
                out["values"][key] = col[have.to(col.device)].cpu()
        chosen = set(ids.tolist()) if self._loose else set()
        for n, state in self._loose.items():
            if n in chosen:
                out["loose"][str(n)] = {k: v.cpu() for k, v in state.items()}
        return out

    def load(self, tree: dict[str, Any]) -> None:
        """Write what :meth:`export` gave (other clients keep their states)."""
        written = tree.get("written")
        if written is None or not len(written):
            return
        written = written.to(torch.int64)
        states: dict[int, State] = {n: {} for n in written.tolist()}
        for key, rows in tree.get("rows", {}).items():
            values = tree["values"][key]
            for n, v in zip(rows.tolist(), values, strict=True):
                states[n][key] = v
        for n, state in tree.get("loose", {}).items():
            states[int(n)].update(state)
        self.write(list(states), list(states.values()))

    def load_per_client(self, tree: dict[str, State]) -> None:
        """Write states saved one client at a time (``{"<n>": state}``; older checkpoints)."""
        clients = sorted(int(n) for n in tree)
        self.write(clients, [tree[str(n)] for n in clients])


def scratch_folder(store: str, store_dir: str | None, device: torch.device) -> Path | None:
    """A new folder for ``store=disk``'s memory-mapped files, or None (``store=memory``).

    Raises:
        ConfigError: ``store=disk`` on a GPU device, or a ``store_dir`` that cannot be made.
    """
    if store != "disk":
        return None
    if device.type != "cpu":
        raise ConfigError(
            f"store=disk: the clients' files are memory-mapped CPU tensors, but device={device} "
            "keeps the clients on the accelerator; use store=memory there"
        )
    try:
        if store_dir:
            Path(store_dir).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="fedexp-store-", dir=store_dir or None))
    except OSError as exc:
        raise ConfigError(
            f"store_dir={store_dir}: cannot make a folder there ({exc.strerror or exc}); "
            "expected a writable folder"
        ) from None
