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

Over several processes (``share``: rank r of P, a :class:`Share`) a rank holds the rows of its
own clients only (n mod P == r, row n // P): the population's states are split over the ranks,
not copied to each, and reading another rank's client is refused (a bug in the caller). A
checkpoint gathers every rank's :meth:`ClientStates.export` and :meth:`ClientStates.load` keeps
a rank's own clients of it, so a run resumes on any number of processes.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch

from fedexp.contract import CohortStates
from fedexp.engine.clients import hugepages
from fedexp.engine.processes.share import ALONE
from fedexp.engine.processes.share import Share
from fedexp.errors import ConfigError

State = dict[str, torch.Tensor]


class ClientStates(Sequence[State]):
    """The clients' states, read and written as ``{key: tensor}`` per client.

    Args:
        size: N, the number of clients.
        init: client n's initial state (read for clients never written).
        device: where states are read to (the columns live there too unless on disk).
        folder: where the columns' files go (memory-mapped); None keeps them in memory.
        share: this process's place among P (rank r): hold the clients n with n mod P == r
            only; None: all.
        shared_init: ``init(n)`` is the same for every n (read once, broadcast); false: made
            per client for the rows never written.
    """

    def __init__(
        self,
        size: int,
        init: Callable[[int], State],
        device: torch.device | str = "cpu",
        folder: str | Path | None = None,
        share: Share | None = None,
        shared_init: bool = False,
    ) -> None:
        self._size, self._init, self.share = size, init, share
        self.shared_init = shared_init
        self._start: State | None = None  # the shared initial state, [1, ...] per key
        self.device = torch.device(device)
        self.folder = None if folder is None else Path(folder)
        self._held = len(self.own())  # rows: the clients this process holds
        self._cols: dict[str, torch.Tensor] = {}
        # which rows are set: host bookkeeping (NumPy: no tensor op, never a device read)
        self._has: dict[str, np.ndarray] = {}  # key -> bool per row: the client's row is set
        self._written = np.zeros(self._held, dtype=bool)
        self._loose: dict[int, State] = {}  # values that do not fit their column

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, n: int) -> State: ...

    @overload
    def __getitem__(self, n: slice) -> list[State]: ...

    def __getitem__(self, n: int | slice) -> State | list[State]:
        if isinstance(n, slice):
            return list(self.rows(list(range(self._size))[n]))
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

    def own(self) -> range:
        """The clients whose rows this process holds."""
        return (self.share or ALONE).own(self._size)

    def _rows(self, clients: Sequence[int]) -> np.ndarray:
        """The rows of ``clients`` (int64, NumPy: host bookkeeping).

        Raises:
            RuntimeError: a client of another rank (reading it is a bug in the caller).
        """
        ids = np.asarray(list(clients), dtype=np.int64)
        share = self.share
        if share is None:
            return ids
        foreign = ~share.owns(ids)
        if foreign.any():
            n = int(ids[foreign][0])
            raise RuntimeError(f"client {n}'s state is on rank {share.owner(n)}: {share.holds()}")
        return share.row(ids)

    def rows(self, clients: Sequence[int]) -> CohortStates:
        """The states of ``clients``, in their order, stacked by key (:class:`CohortStates`).

        A fixed number of tensor ops per key, whatever the number of clients: one gather of
        the key's column and one ``where`` putting the initial value in the rows never written
        (with a per-client initial state, ``shared_init`` false, the initial states of the rows
        never written are made one by one). States kept aside (a value whose shape changed)
        are read row by row.
        """
        m = len(clients)
        if not m:
            return CohortStates(0)
        ids = self._rows(clients)
        written = self._written[ids]
        init = {} if self._loose or written.all() else self._initial(clients, written)
        if self._loose or any(
            k in self._cols and v.shape[1:] != self._cols[k].shape[1:] for k, v in init.items()
        ):  # values kept aside, or an initial value of another shape than its column's
            return CohortStates.of_rows(self._each(clients))
        stacks: dict[str, torch.Tensor] = {}
        present: dict[str, torch.Tensor] = {}
        dev = self.device
        index = torch.from_numpy(ids)
        for key in dict.fromkeys([*self._cols, *init]):
            col, start = self._cols.get(key), init.get(key)
            has = self._has[key][ids] if col is not None else np.zeros(m, dtype=bool)
            if has.all():  # every row has it (known on the host): one gather
                stacks[key] = col[index.to(col.device)].to(dev)  # type: ignore[index]
                continue
            if col is None:  # no client has written it: the initial value, in unwritten rows
                stacks[key] = start.expand(m, *start.shape[1:])  # type: ignore[union-attr]
            else:
                values = col[index.to(col.device)].to(dev)
                mask = torch.from_numpy(has).to(dev).view(m, *[1] * (values.dim() - 1))
                fill = torch.zeros((), dtype=values.dtype) if start is None else start
                stacks[key] = torch.where(mask, values, fill.to(values.dtype))
            rows = has | ~written if start is not None else has
            if not rows.all():
                present[key] = torch.from_numpy(rows).to(dev)
        return CohortStates(m, stacks, present)

    def _initial(self, clients: Sequence[int], written: torch.Tensor) -> State:
        """The initial state of the rows of ``clients`` never written, by key.

        ``[1, ...]`` (broadcast over the rows) with a shared initial state; else ``[m, ...]``
        with the rows never written made one by one (zeros elsewhere).
        """
        if self.shared_init:
            if self._start is None:
                self._start = {k: v.to(self.device)[None] for k, v in self._init(0).items()}
            return self._start
        fresh = np.flatnonzero(~written).tolist()
        if not fresh:
            return {}
        made = {i: self._init(int(clients[i])) for i in fresh}
        out: State = {}
        for key in dict.fromkeys(k for st in made.values() for k in st):
            like = next(st[key] for st in made.values() if key in st)
            stack = torch.zeros((len(clients), *like.shape), dtype=like.dtype, device=self.device)
            for i, st in made.items():
                if key in st:
                    stack[i] = st[key]
            out[key] = stack
        return out

    def _each(self, clients: Sequence[int]) -> list[State]:
        """The states of ``clients`` one by one (with values kept aside, :attr:`_loose`)."""
        ids = self._rows(clients)
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
            values = col[torch.from_numpy(ids).to(col.device)]
            if values.device != self.device:
                values = values.to(self.device)
            for i, h in enumerate(has):
                if h:
                    out[i][key] = values[i]
        for i, n in enumerate(clients):
            if written[i] and n in self._loose:
                out[i].update(self._loose[n])
        return out

    def write(self, clients: Sequence[int], states: Sequence[State]) -> None:
        """Set the states of ``clients`` (their rows of each key; a missing key is unset).

        ``states``: a :class:`CohortStates` (one scatter per key) or a list of dicts.
        """
        if len(clients) != len(states):
            raise ValueError(f"{len(clients)} clients but {len(states)} states")
        if not len(clients):
            return
        ids = self._rows(clients)
        if self._loose:
            for n in clients:
                self._loose.pop(n, None)
        for has in self._has.values():
            has[ids] = False
        if isinstance(states, CohortStates):
            self._write_stacks(clients, ids, states)
        else:
            self._write_each(clients, ids, states)
        self._written[ids] = True

    def _write_stacks(self, clients: Sequence[int], ids: np.ndarray, states: CohortStates) -> None:
        """:meth:`write` of stacked states: each key's rows scattered into its column at once."""
        for key, value in states.stacks.items():
            col = self._cols.get(key)
            if col is None:
                col = self._column(key, value.shape[1:], value.dtype)
            mask = states.present.get(key)
            if value.shape[1:] != col.shape[1:] or value.dtype != col.dtype:
                rows = [{key: v} for v in value]  # a changed shape: kept aside, per client
                if mask is not None:
                    rows = [r if h else {} for r, h in zip(rows, mask.tolist(), strict=True)]
                self._write_each(clients, ids, rows)
                continue
            col[torch.from_numpy(ids).to(col.device)] = value.detach().to(col.device)
            self._has[key][ids] = True if mask is None else mask.cpu().numpy()

    def _write_each(self, clients: Sequence[int], ids: np.ndarray, states: Sequence[State]) -> None:
        """:meth:`write` of a list of per-client states."""
        keys = list(dict.fromkeys(k for s in states for k in s))
        for key in keys:
            fits, values = [], []
            for i, (n, s) in enumerate(zip(clients, states, strict=True)):
                v = s.get(key)
                if v is None:
                    continue
                col = self._cols[key] if key in self._cols else self._column(key, v.shape, v.dtype)
                if v.shape == col.shape[1:] and v.dtype == col.dtype:
                    fits.append(i)
                    values.append(v)
                else:
                    self._loose.setdefault(n, {})[key] = v.detach().to(self.device).clone()
            if fits:
                col = self._cols[key]
                where = ids[np.asarray(fits, dtype=np.int64)]
                index = torch.from_numpy(where).to(col.device)
                col[index] = torch.stack(values).detach().to(col.device)
                self._has[key][where] = True

    def _column(self, key: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A new zero column ``[rows, *shape]`` for ``key``: in memory, or a mapped file."""
        if "/" in key:
            raise ValueError(f"client state key {key!r}: expected a name without '/'")
        shape = (self._held, *shape)
        if self.folder is None and self.device.type == "cpu":  # large ones on huge pages
            col = hugepages.zeros(shape, dtype)
        elif self.folder is None:
            col = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"{len(self._cols)}-{re.sub(r'[^A-Za-z0-9_.-]', '_', key)}.bin"
            path.unlink(missing_ok=True)  # a stale file of an earlier run: start from zeros
            count = 1
            for s in shape:
                count *= s
            flat = torch.from_file(str(path), shared=True, size=max(count, 1), dtype=dtype)
            col = flat[:count].view(shape)
        self._cols[key] = col
        self._has[key] = np.zeros(self._held, dtype=bool)
        return col

    # ------------------------------------------------------------------ saving and moving
    def export(self, clients: Sequence[int] | None = None) -> dict[str, Any]:
        """The written states of ``clients`` (default: all this process holds) as tensors.

        ``{"written": ids, "rows": {key: ids}, "values": {key: [m, ...]}, "loose": {n: state}}``
        (CPU tensors): what a checkpoint holds and what ranks exchange; :meth:`load` reads it.
        """
        ids = np.asarray(list(self.own() if clients is None else clients), dtype=np.int64)
        rows = self._rows(ids)
        kept = self._written[rows]
        ids, rows = ids[kept], rows[kept]
        out: dict[str, Any] = {
            "written": torch.from_numpy(ids.copy()),
            "rows": {},
            "values": {},
            "loose": {},
        }
        for key, col in self._cols.items():
            has = self._has[key][rows]
            if has.any():
                out["rows"][key] = torch.from_numpy(ids[has].copy())
                out["values"][key] = col[torch.from_numpy(rows[has]).to(col.device)].cpu()
        chosen = set(ids.tolist()) if self._loose else set()
        for n, state in self._loose.items():
            if n in chosen:
                out["loose"][str(n)] = {k: v.cpu() for k, v in state.items()}
        return out

    def load(self, tree: dict[str, Any]) -> None:
        """Write what :meth:`export` gave (other clients keep their states).

        With a ``share``, the clients of other ranks in ``tree`` are left out: a tree of
        every client's states (a checkpoint) loads on any number of processes.
        """
        written = tree.get("written")
        if written is None or not len(written):
            return
        written = written.to(torch.int64)
        mine = (self.share or ALONE).mine(written.tolist())
        states: dict[int, State] = {n: {} for n in mine}
        for key, rows in tree.get("rows", {}).items():
            values = tree["values"][key]
            for n, v in zip(rows.tolist(), values, strict=True):
                if n in states:
                    states[n][key] = v
        for n, state in tree.get("loose", {}).items():
            if int(n) in states:
                states[int(n)].update(state)
        self.write(list(states), list(states.values()))

    def load_per_client(self, tree: dict[str, State]) -> None:
        """Write states saved one client at a time (``{"<n>": state}``; older checkpoints)."""
        clients = sorted(int(n) for n in tree)
        self.write(clients, [tree[str(n)] for n in clients])


def merge_exports(exports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One :meth:`ClientStates.export` of several processes' clients, in client order.

    What one process that held every client would export (a checkpoint's, over ranks).
    """
    out: dict[str, Any] = {"written": [], "rows": {}, "values": {}, "loose": {}}
    for tree in exports:
        if "written" in tree:
            out["written"].append(tree["written"].to(torch.int64))
        for key, ids in tree.get("rows", {}).items():
            out["rows"].setdefault(key, []).append(ids.to(torch.int64))
            out["values"].setdefault(key, []).append(tree["values"][key])
        out["loose"].update(tree.get("loose", {}))
    written = torch.cat(out["written"]) if out["written"] else torch.zeros(0, dtype=torch.int64)
    out["written"] = written.sort().values
    for key, parts in out["rows"].items():
        ids = torch.cat(parts)
        order = ids.argsort()
        out["rows"][key] = ids[order]
        out["values"][key] = torch.cat(out["values"][key])[order]
    out["loose"] = {n: out["loose"][n] for n in sorted(out["loose"], key=int)}
    return out


#: The name of a scratch folder (``store=disk``'s, or rank 0's shared data set's):
#: ``fedexp-store-<owner pid>-<random>``.
SCRATCH_PREFIX = "fedexp-store-"
#: The file in a scratch folder naming its owner: ``{"host", "pid", "started"}`` (JSON).
OWNER_FILE = "owner.json"
#: Seconds two start times of one pid may differ and still be one process (clock-tick rounding).
_START_TOLERANCE_S = 2.0
#: The scratch folders this process made (removed by :func:`remove_scratch`).
_MADE: list[Path] = []


def _started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None if psutil cannot tell."""
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - no such process, no access: unknown
        return None


def _owner_gone(folder: Path, host: str) -> bool:
    """Whether the process that made scratch ``folder`` on ``host`` is gone.

    Gone: no process of the folder's pid, a zombie (killed, not yet waited for), or a later
    process that reused the pid (another start time). Unsure means not gone: a folder of an
    older fedexp (no pid in its name), of another machine (a shared ``store_dir``), or one
    whose owner file is not written yet or cannot be read.
    """
    match = re.fullmatch(re.escape(SCRATCH_PREFIX) + r"(\d+)-\w+", folder.name)
    if match is None:
        return False
    import json

    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
        if owner.get("host") != host or int(owner["pid"]) != int(match.group(1)):
            return False
        started = float(owner["started"]) if owner.get("started") is not None else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    import psutil

    try:
        proc = psutil.Process(int(match.group(1)))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        return started is not None and abs(proc.create_time() - started) > _START_TOLERANCE_S
    except psutil.NoSuchProcess:
        return True
    except Exception:  # noqa: BLE001 - no access (another user's, alive), a race: not gone
        return False


def reap_scratch(where: str | Path | None = None) -> list[Path]:
    """Remove the ``store=disk`` scratch folders in ``where`` whose process is gone.

    A process killed by SIGKILL (or the OOM killer) cannot remove its folder, which may hold
    gigabytes; the next run that makes one in the same place, or the rank that outlived it,
    removes it here (:func:`_owner_gone` decides; unsure means kept).

    Args:
        where: the folder to look in; None: the folders holding this process's own scratch
            folders, else the temporary folder.

    Returns:
        The folders removed.
    """
    import shutil
    import socket

    places = {Path(where)} if where else {p.parent for p in _MADE}
    places = places or {Path(tempfile.gettempdir())}
    host, removed = socket.gethostname(), []
    for place in places:
        try:
            found = [p for p in place.iterdir() if p.name.startswith(SCRATCH_PREFIX)]
        except OSError:
            continue
        for folder in found:
            if folder.is_dir() and _owner_gone(folder, host):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def remove_scratch() -> None:
    """Remove every scratch folder this process made: for exits that skip its finalizers.

    A run's folder goes with its engine (``weakref.finalize``) or at the interpreter's exit;
    a process that ends by ``os._exit`` or on a signal (a rank of ``distributed.nproc``) calls
    this first.
    """
    import shutil

    for folder in list(_MADE):  # (a signal's thread and the main thread may both get here)
        shutil.rmtree(folder, ignore_errors=True)
    _MADE.clear()


def scratch_folder(store: str, store_dir: str | None, device: torch.device) -> Path | None:
    """A new folder for ``store=disk``'s memory-mapped files, or None (``store=memory``).

    Named after this process (``fedexp-store-<pid>-…``, with an :data:`OWNER_FILE` naming the
    host and the pid's start time), so that a later run can tell it from a live run's; the
    folders of dead runs in the same place are removed first (:func:`reap_scratch`).

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
        return owned_folder(store_dir)
    except OSError as exc:
        raise ConfigError(
            f"store_dir={store_dir}: cannot make a folder there ({exc.strerror or exc}); "
            "expected a writable folder"
        ) from None


def owned_folder(where: str | None) -> Path:
    """A new scratch folder in ``where`` (None: the temp folder) that names its owner.

    ``fedexp-store-<pid>-…`` with an :data:`OWNER_FILE` (host, pid, the pid's start time),
    so that a later run can tell it from a live run's; the folders of dead runs in the same
    place are removed first (:func:`reap_scratch`), and this process's own at its exit, even
    by a signal (:func:`remove_scratch`).

    Raises:
        OSError: the folder cannot be made or written.
    """
    import json
    import os
    import socket

    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
    reap_scratch(where or tempfile.gettempdir())
    pid = os.getpid()
    folder = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{pid}-", dir=where or None))
    _MADE.append(folder)
    owner = {"host": socket.gethostname(), "pid": pid, "started": _started(pid)}
    (folder / OWNER_FILE).write_text(json.dumps(owner))
    return folder


def release_scratch(folder: Path) -> None:
    """Remove one of this process's scratch folders (:func:`owned_folder`) now."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    if folder in _MADE:
        _MADE.remove(folder)
