"""Every client's training data in one tensor, for gathering a cohort's minibatches at once.

Before issue 14 a cohort's training sets were padded into one ``[m, n_max, ...]`` tensor at
every call. The pool concatenates the clients' training inputs and targets once per
run and the clients' training fields then hold their rows of it (:class:`PoolRows`, read as
views: no second copy and no view object stays alive); a cohort's step gathers its ``m × B``
minibatch rows with one index: ``offset[client] + index``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedexp.data.federated import ClientData, PoolRows


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
    """

    @classmethod
    def of(cls, clients: Sequence[ClientData]) -> TrainPool:
        """The pool of ``clients``.

        Theirs if :meth:`clients_of` made them (in this order), else a new one (which copies
        or adopts their tensors and rebinds their fields).
        """
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
        self.offset, self.size = self.offset.to(dev), self.size.to(dev)

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
        return torch.tensor(rows, dtype=torch.int64, device=self.x.device)

    def gather(self, rows: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``[m, B, ...]`` of each row's client-local indices ``[m, B]``."""
        flat = (self.offset[rows][:, None] + idx).reshape(-1)
        shape = idx.shape
        # index_select: several times faster than advanced indexing on the CPU
        return (
            self.x.index_select(0, flat).reshape(*shape, *self.x.shape[1:]),
            self.y.index_select(0, flat).reshape(*shape, *self.y.shape[1:]),
        )


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
