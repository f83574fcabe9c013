"""Every client's training data in one tensor, for gathering a cohort's minibatches at once.

Issue 14: the lockstep backend padded the cohort's training sets into one ``[m, n_max, ...]``
tensor at every call. The pool concatenates the clients' training inputs and targets once per
run and makes each client's tensors views into it (no second copy stays alive); a cohort's
step then gathers its ``m × B`` minibatch rows with one index: ``offset[client] + index``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedexp.data.federated import ClientData


class TrainPool:
    """The clients' training sets, concatenated.

    Args:
        clients: every client's data; their ``x_train`` / ``y_train`` are rebound to views of
            the concatenation (the same values).

    Attributes:
        x, y: all training inputs / targets, client after client.
        offset: int64 [N] first row of each client.
        size: int64 [N] each client's training-set size.
    """

    def __init__(self, clients: Sequence[ClientData]) -> None:
        self._row = {id(c): n for n, c in enumerate(clients)}
        self.size = torch.tensor([c.num_train for c in clients], dtype=torch.int64)
        self.offset = torch.cumsum(self.size, 0) - self.size
        total = int(self.size.sum())
        first = clients[0]
        adopted = (
            _consecutive_views([c.x_train for c in clients]),
            _consecutive_views([c.y_train for c in clients]),
        )
        if adopted[0] is not None and adopted[1] is not None:  # already one buffer: no copy
            self.x, self.y = adopted
            self._ptr = [(c.x_train.data_ptr(), c.y_train.data_ptr()) for c in clients]
            dev = self.x.device
            self.offset, self.size = self.offset.to(dev), self.size.to(dev)
            return
        self.x = first.x_train.new_empty((total, *first.x_train.shape[1:]))
        self.y = first.y_train.new_empty((total, *first.y_train.shape[1:]))
        # client by client, so that each original can be freed as soon as it is copied
        for c, a, n in zip(clients, self.offset.tolist(), self.size.tolist(), strict=True):
            same = c.x_test is c.x_train and c.y_test is c.y_train  # evaluated on its data
            self.x[a : a + n] = c.x_train
            self.y[a : a + n] = c.y_train
            c.x_train, c.y_train = self.x[a : a + n], self.y[a : a + n]
            if same:  # keep one copy
                c.x_test, c.y_test = c.x_train, c.y_train
        self._ptr = [(c.x_train.data_ptr(), c.y_train.data_ptr()) for c in clients]
        dev = self.x.device
        self.offset, self.size = self.offset.to(dev), self.size.to(dev)

    def rows(self, data: Sequence[ClientData]) -> torch.Tensor | None:
        """The pool rows (client ids) of ``data``, or None if one is not a pooled client.

        A client's data count as pooled while their tensors are still the pool's views (an
        algorithm may hand ``Context.train`` other data, e.g. a drawn minibatch).
        """
        rows = []
        for d in data:
            n = self._row.get(id(d))
            if n is None or (d.x_train.data_ptr(), d.y_train.data_ptr()) != self._ptr[n]:
                return None
            rows.append(n)
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
