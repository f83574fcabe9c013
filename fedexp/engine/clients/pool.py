"""Every client's training data in one tensor, for gathering a cohort's minibatches at once.

Before issue 14 a cohort's training sets were padded into one ``[m, n_max, ...]`` tensor at
every call. The pool concatenates the clients' training inputs and targets once per
run and the clients' training fields then hold their rows of it (:class:`PoolRows`, read as
views: no second copy and no view object stays alive); a cohort's step gathers its ``m × B``
minibatch rows with one index: ``offset[client] + index``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import numpy as np
import torch

from fedexp.data.client import ClientData
from fedexp.data.client import PoolRows
from fedexp.engine.clients import hugepages
from fedexp.engine.processes.share import Share
from fedexp.transfer import to_device

#: ``Tensor.numpy`` as torch defines it: :func:`take_rows` reads a CPU tensor's own memory,
#: which :class:`fedexp.engine.round.census.Census` (it patches the method while it counts)
#: must not count as a host read, as no device would wait on it.
_AS_ARRAY = torch.Tensor.numpy
#: dtypes NumPy holds as they are (not bfloat16, nor the quantised and complex-half ones)
_NUMPY_DTYPES = frozenset(
    {torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16}
    | {torch.int32, torch.int64, torch.bool}
)


def take_rows(t: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, flat)``: the rows ``flat`` of ``t``, the same values and dtype.

    On the CPU with one torch thread (a stacked or parallel sweep's runs, the benchmarks,
    every test) NumPy's ``take`` copies them: about twice as fast as ``index_select`` for a
    cohort's minibatch rows (32,000 rows of 30 floats from a 12 MB pool and their targets,
    fresh indices each time: 0.3-0.4 ms against 0.75-0.85 ms, `scripts/bench_peers.py`'s
    logistic regression at 1,000 clients). ``flat`` holds row numbers in [0, len(t)).
    With more threads torch's kernel shares the rows among them and is the faster; on a
    device it is the only one.
    """
    if _by_numpy(t, flat):
        return _numpy_take(t, flat)
    return t.index_select(0, flat)


def _by_numpy(t: torch.Tensor, at: torch.Tensor) -> bool:
    """Whether :func:`take_rows` copies ``t``'s rows ``at`` by NumPy's ``take``."""
    return (
        t.device.type == "cpu"
        and at.device.type == "cpu"
        and t.dtype in _NUMPY_DTYPES
        and not t.requires_grad
        and torch.get_num_threads() == 1
    )


def _numpy_take(t: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The rows ``at`` (any shape) of the CPU tensor ``t``: ``[*at.shape, *t.shape[1:]]``."""
    return torch.from_numpy(np.take(_AS_ARRAY(t), _AS_ARRAY(at), axis=0))


class TrainPool:
    """The clients' training sets, concatenated.

    Args:
        clients: every client's data; their ``x_train`` / ``y_train`` (and ``x_test`` /
            ``y_test`` when they are the same tensors) are rebound to their rows of the
            concatenation (the same values), adopted without a copy when they already tile
            one buffer.

    Attributes:
        x, y: all training inputs / targets, client after client.
        offset: int64 [N] first row of each client.
        size: int64 [N] each client's training-set size.
        sizes: the same on the host (NumPy int64 [N]): what the round's host bookkeeping
            reads (aggregation weights) without reading the device.
        elsewhere: when it holds the rows of a rank's own clients only (a
            :class:`ClientTable`'s over ``distributed.nproc``), what the others' rows read
            as (:class:`Elsewhere`, with the rank's ``share``); else None.
    """

    elsewhere: Elsewhere | None = None
    #: (x, y, their NumPy views): made by :meth:`take` once for the tensors they view
    _arrays: tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray] | None = None

    @classmethod
    def of(cls, clients: Sequence[ClientData]) -> TrainPool:
        """The pool of ``clients``.

        Theirs if :meth:`clients_of` made them (in this order), else a new one (which copies
        or adopts their tensors and rebinds their fields).
        """
        if isinstance(clients, ClientTable):
            return clients.pool
        first = clients[0].pooled()
        if first is not None and isinstance(first.pool, cls):
            pool = first.pool
            if len(clients) == len(pool.size) and all(
                (r := c.pooled(pool)) is not None and r.row == n for n, c in enumerate(clients)
            ):
                return pool
        return cls(clients)

    @classmethod
    def clients_of(
        cls,
        x: torch.Tensor,
        y: torch.Tensor,
        sizes: Sequence[int],
        tests: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[ClientData]:
        """Clients whose training sets are consecutive blocks of rows of ``x`` and ``y``.

        The way to hand over data that already live in one array: no tensor (view) is made
        per client (each costs ~600 bytes); the engine's pool is this one (:meth:`of`).

        Args:
            x: every client's training inputs, client after client.
            y: their targets.
            sizes: each client's number of rows.
            tests: each client's test split (default: its training set).
        """
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows, y {y.shape[0]}: expected as many")
        if sum(sizes) > x.shape[0]:
            raise ValueError(f"sizes sum to {sum(sizes)}: more than x's {x.shape[0]} rows")
        pool = cls.__new__(cls)
        pool.x, pool.y = x, y
        size = torch.tensor(list(sizes), dtype=torch.int64)
        offset = torch.cumsum(size, 0) - size
        clients = []
        for n, (a, k) in enumerate(zip(offset.tolist(), size.tolist(), strict=True)):
            rows = PoolRows(pool, n, a, a + k)
            test = (rows, rows) if tests is None else tests[n]
            clients.append(ClientData(rows, rows, *test))  # type: ignore[arg-type]
        pool.offset, pool.size = offset.to(x.device), size.to(x.device)
        pool.sizes = size.numpy()
        return clients

    def __init__(self, clients: Sequence[ClientData]) -> None:
        self.size = torch.tensor([c.num_train for c in clients], dtype=torch.int64)
        self.offset = torch.cumsum(self.size, 0) - self.size
        total = int(self.size.sum())
        first = clients[0]
        adopted = (
            _consecutive_views([c.x_train for c in clients]),
            _consecutive_views([c.y_train for c in clients]),
        )
        copy = adopted[0] is None or adopted[1] is None
        if copy:
            self.x = first.x_train.new_empty((total, *first.x_train.shape[1:]))
            self.y = first.y_train.new_empty((total, *first.y_train.shape[1:]))
        else:  # already one buffer: no copy
            self.x, self.y = adopted
        # client by client, so that each original can be freed as soon as it is copied; the
        # fields then hold rows of the pool (ClientData reads them as views)
        for n, (c, a, k) in enumerate(
            zip(clients, self.offset.tolist(), self.size.tolist(), strict=True)
        ):
            # evaluated on its own training data: the same stored values (a pooled field
            # reads as a new view each time, so compare what the fields hold)
            same = c._x_test is c._x_train and c._y_test is c._y_train
            if copy:
                self.x[a : a + k] = c.x_train
                self.y[a : a + k] = c.y_train
            rows = PoolRows(self, n, a, a + k)
            c.x_train = c.y_train = rows
            if same:  # keep one copy
                c.x_test = c.y_test = rows
        dev = self.x.device
        self.sizes = self.size.numpy()
        self.offset, self.size = self.offset.to(dev), self.size.to(dev)

    def fills(self, size: int) -> bool:
        """Whether every client's training set is whole batches of ``size``.

        Then no epoch ends in a short batch. One reduction of the host's sizes the first time
        a size is asked, then remembered.
        """
        cache: dict[int, bool] = self.__dict__.setdefault("_fills", {})  # either constructor
        if size not in cache:
            cache[size] = bool((self.sizes % size == 0).all())
        return cache[size]

    def rows(self, data: Sequence[ClientData]) -> torch.Tensor | None:
        """The pool rows (client ids) of ``data``, or None if one is not a pooled client.

        A client's data count as pooled while their training fields still hold the pool's
        rows (data built from other tensors, e.g. a drawn minibatch, do not).
        """
        rows = []
        for d in data:
            found = d.pooled(self)
            if found is None:
                return None
            rows.append(found.row)
        return to_device(rows, self.x.device, torch.int64)

    def gather(self, rows: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``[m, B, ...]`` of each row's client-local indices ``[m, B]``.

        ``rows`` on the host (a cohort's) or on the pool's device.
        """
        return self.take(self.offset[to_device(rows, self.offset.device)][:, None] + idx)

    def host_size(self, rows: torch.Tensor) -> torch.Tensor:
        """The training-set sizes of the host ``rows`` (int64, on the host: :attr:`sizes`)."""
        return torch.from_numpy(self.sizes)[rows]

    def take(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``[*at.shape, ...]`` of the pool's rows ``at`` (any shape)."""
        if _by_numpy(self.x, at) and _by_numpy(self.y, at):
            # NumPy's take keeps the index's shape: no reshapes (three ops a local step); the
            # pool's NumPy views made once and the index's read once (three more: each
            # ``Tensor.numpy`` dispatches a ``detach``)
            held = self._arrays
            if held is None or held[0] is not self.x or held[1] is not self.y:
                held = self._arrays = (self.x, self.y, _AS_ARRAY(self.x), _AS_ARRAY(self.y))
            rows = _AS_ARRAY(at)
            return (
                torch.from_numpy(np.take(held[2], rows, axis=0)),
                torch.from_numpy(np.take(held[3], rows, axis=0)),
            )
        flat, shape = at.reshape(-1), at.shape
        # one index (take_rows): several times faster than advanced indexing on the CPU
        return (
            take_rows(self.x, flat).reshape(*shape, *self.x.shape[1:]),
            take_rows(self.y, flat).reshape(*shape, *self.y.shape[1:]),
        )


def padded(rows: Sequence[PoolRows]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Clients' rows of one pool padded to ``[m, n_max, ...]`` by one index, and their lengths.

    A split of each client (training, test or validation: :class:`PoolRows`) gathered at once:
    a fixed number of ops for any m, where padding the clients' views costs ops per client.
    Rows past a client's length repeat its last row (padding, which the batched metrics and
    losses leave out by the lengths). None when the rows are not all non-empty rows of one
    pool (the caller pads the clients' tensors instead).

    Returns:
        (inputs ``[m, n_max, ...]``, targets ``[m, n_max, ...]``, lengths int64 ``[m]``).
    """
    first = rows[0] if len(rows) else None
    if first is None or not all(
        type(r) is PoolRows and r.pool is first.pool and r.stop > r.start for r in rows
    ):
        return None
    pool = first.pool
    starts = torch.as_tensor([r.start for r in rows], dtype=torch.int64)
    lengths = torch.as_tensor([r.stop - r.start for r in rows], dtype=torch.int64)
    longest = max(r.stop - r.start for r in rows)
    index = (starts[:, None] + torch.arange(longest).minimum(lengths[:, None] - 1)).to(
        pool.x.device
    )
    xs, ys = pool.take(index)
    return xs, ys, lengths


def _consecutive_views(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor that ``parts`` tile, in order, as contiguous views of one buffer; else None."""
    base = parts[0]._base
    if base is None or not base.is_contiguous():
        return None
    row = base[0].numel() * base.element_size() if base.numel() else 0
    pos = base.data_ptr()
    for p in parts:
        if p._base is not base or not p.is_contiguous() or p.data_ptr() != pos:
            return None
        pos += p.shape[0] * row
    rows = (pos - base.data_ptr()) // row if row else 0
    return base[:rows]


#: Rows copied into a pooled split at a time (bounds the temporary copy of a large data set).
_CHUNK = 1 << 16


def mapped_empty(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, folder: Path | None, name: str
) -> torch.Tensor:
    """An uninitialised tensor: in memory, or (CPU, with ``folder``) a shared mapped file.

    In memory on the CPU, a large one is on huge pages (:mod:`fedexp.engine.clients.hugepages`).
    """
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    if folder is None:
        return hugepages.empty(shape, dtype)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.bin"
    path.unlink(missing_ok=True)
    count = math.prod(shape)
    return torch.from_file(str(path), shared=True, size=max(count, 1), dtype=dtype)[:count].view(
        shape
    )


class Elsewhere:
    """The pool of clients whose rows another rank holds (``distributed.nproc``).

    Their :class:`ClientData` keep their sizes (weights, evaluation and the outputs read
    them); reading their rows is a bug in the caller, reported here rather than as some
    other client's values.
    """

    def __init__(self, name: str, share: Share) -> None:
        self.name, self.share = name, share

    def _refuse(self, part: str) -> torch.Tensor:
        raise RuntimeError(
            f"read {part} of the {self.name} rows of another rank's client: {self.share.holds()}"
        )

    @property
    def x(self) -> torch.Tensor:
        """Refused: the inputs are on another rank."""
        return self._refuse("x")

    @property
    def y(self) -> torch.Tensor:
        """Refused: the targets are on another rank."""
        return self._refuse("y")


def _split(
    x: torch.Tensor,
    y: torch.Tensor,
    parts: Sequence[np.ndarray],
    device: torch.device,
    folder: Path | None,
    name: str,
    share: Share | None = None,
) -> TrainPool:
    """Rows ``parts[n]`` of ``x``/``y`` for every client n, concatenated (a pool of one split).

    With a ``share`` (rank r of P) only the rows of clients n with n mod P == r are
    stored; every client's size is kept (the others' start at 0 and read as
    :class:`Elsewhere`).
    """
    sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    held = sizes
    if share is not None:
        held = np.where(share.owns(np.arange(len(parts))), sizes, 0)
        parts = [p for n, p in enumerate(parts) if held[n]]
    index = np.concatenate(parts) if len(parts) else np.zeros(0, dtype=np.int64)
    total = len(index)
    pool = TrainPool.__new__(TrainPool)
    pool.x = mapped_empty((total, *x.shape[1:]), x.dtype, device, folder, f"{name}_x")
    pool.y = mapped_empty((total, *y.shape[1:]), y.dtype, device, folder, f"{name}_y")
    for a in range(0, total, _CHUNK):
        rows = torch.from_numpy(index[a : a + _CHUNK].astype(np.int64, copy=False))
        pool.x[a : a + len(rows)] = x[rows].to(device)
        pool.y[a : a + len(rows)] = y[rows].to(device)
    starts = np.cumsum(held) - held
    starts[held != sizes] = 0  # another rank's client: no rows here
    size, offset = torch.from_numpy(sizes), torch.from_numpy(starts)
    pool.size, pool.offset = size.to(device), offset.to(device)
    pool.starts = starts  # read when a client's data are made
    pool.sizes = sizes
    pool.elsewhere = None if share is None else Elsewhere(name, share)
    return pool


#: Populations up to this many clients keep the ClientData objects their table made.
_KEEP = 1 << 17
#: ClientData's slots of the (training, test, validation) splits' inputs and targets.
_SLOTS = (("_x_train", "_y_train"), ("_x_test", "_y_test"), ("_x_val", "_y_val"))


class ClientTable(Sequence[ClientData]):
    """Every client's data as pooled splits; client n's :class:`ClientData` made when read.

    A list of N ClientData objects costs a few hundred bytes a client besides the data; the
    table holds each split (training, test, validation) as one array with each client's
    offset and size, so a population of 10^6 clients costs its data and four int64 arrays,
    and with a folder the arrays are memory-mapped files (only the pages a round reads stay
    in memory). The training split is the engine's :class:`TrainPool`.

    Args:
        train, test: the splits' pools (``_split``).
        val: the validation split's, or None.
    """

    def __init__(self, train: TrainPool, test: TrainPool, val: TrainPool | None) -> None:
        self.pool, self.test, self.val = train, test, val
        # up to _KEEP clients (~300 bytes each) the objects made are kept for the next read
        size = len(train.sizes)
        self._made: list[ClientData | None] | None = [None] * size if size <= _KEEP else None

    @classmethod
    def build(
        cls,
        x: torch.Tensor,
        y: torch.Tensor,
        splits: tuple[Sequence[np.ndarray], Sequence[np.ndarray], Sequence[np.ndarray]],
        device: torch.device,
        folder: Path | None = None,
        zero: dict[int, list[int]] | None = None,
        share: Share | None = None,
    ) -> ClientTable:
        """The table of every client's (training, test, validation) rows of ``x`` and ``y``.

        Args:
            x: the data set's inputs.
            y: its targets.
            splits: per client, its training, test and validation sample indices.
            device: where the splits live.
            folder: where their files go (memory-mapped, CPU only); None: in memory.
            zero: per client, input channels set to zero in all its splits.
            share: this process's place among P (rank r): hold the rows of clients n with
                n mod P == r only (``distributed.nproc``: a rank's own clients); every
                client's sizes are kept. None: every client's rows.
        """
        train, test, val = splits
        pools = [
            _split(x, y, p, device, folder, name, share)
            for p, name in ((train, "train"), (test, "test"))
        ]
        has_val = any(len(v) for v in val)
        table = cls(*pools, _split(x, y, val, device, folder, "val", share) if has_val else None)
        for n, channels in (zero or {}).items():
            if share is not None and not share.owns(n):
                continue
            for pool in (table.pool, table.test, table.val):
                if pool is not None:
                    a = int(pool.starts[n])
                    pool.x[a : a + int(pool.sizes[n]), channels] = 0.0
        return table

    def __len__(self) -> int:
        return len(self.pool.sizes)

    @overload
    def __getitem__(self, n: int) -> ClientData: ...

    @overload
    def __getitem__(self, n: slice) -> list[ClientData]: ...

    def __getitem__(self, n: int | slice) -> ClientData | list[ClientData]:
        size = len(self.pool.sizes)
        if isinstance(n, slice):
            return self.many(range(size)[n])
        if not -size <= n < size:
            raise IndexError(f"client {n} of {size}")
        return self.many([n % size])[0]

    def many(self, clients: Sequence[int]) -> list[ClientData]:
        """The data of ``clients``, in their order (made at once: a round's cohort)."""
        made = self._made
        if made is not None and all(made[n] is not None for n in clients):
            return [made[n] for n in clients]  # type: ignore[misc]
        ids = np.asarray(clients, dtype=np.int64)
        away = self.pool.elsewhere
        here = None if away is None else away.share.owns(ids).tolist()
        fields = []
        for pool in (self.pool, self.test, self.val):
            if pool is None:
                fields.append(None)
                continue
            starts, sizes = pool.starts[ids], pool.sizes[ids]
            fields.append(
                (pool, pool.elsewhere, starts.tolist(), (starts + sizes).tolist(), sizes.tolist())
            )
        out = []
        for i, n in enumerate(ids.tolist()):
            c = ClientData.__new__(ClientData)  # its slots set directly: a cohort's worth fast
            for field, (x_slot, y_slot) in zip(fields, _SLOTS, strict=True):
                rows = None
                if field is not None and field[4][i]:
                    rows = PoolRows.__new__(PoolRows)
                    rows.pool = field[0] if here is None or here[i] else field[1]
                    rows.row, rows.start, rows.stop = n, field[2][i], field[3][i]
                setattr(c, x_slot, rows)
                setattr(c, y_slot, rows)
            out.append(c)
        if made is not None:
            for n, c in zip(ids.tolist(), out, strict=True):
                made[n] = made[n] or c
            return [made[n] for n in ids.tolist()]  # type: ignore[misc]
        return out

    def __iter__(self) -> Iterator[ClientData]:
        return (self[n] for n in range(len(self)))
