"""One client's data (:class:`ClientData`), its fields possibly rows of a pooled array.

A bottom module of the data layer: the engine's pool (``fedexp.engine.clients.pool``) and the
federated split (``fedexp.data.federated``) both build on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedexp.errors import DataError
from fedexp.transfer import to_device


def client_ids(clients: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``clients`` (ids) as an int64 tensor.

    Through numpy: ``torch.tensor`` of a list of 10^4 Python ints takes ~1 ms, five times
    numpy's conversion, and a round converts its cohort several times. To a GPU without a
    host wait (:func:`fedexp.transfer.to_device`).
    """
    ids = torch.from_numpy(np.asarray(clients, dtype=np.int64).reshape(-1))
    return ids if device is None else to_device(ids, device)


class PoolRows:
    """Rows ``[start, stop)`` of a pool's ``x`` and ``y`` (a client's pooled training set).

    What a pooled :class:`ClientData` field holds instead of a tensor view: a view object
    costs ~600 bytes (two or four a client, 120-240 MB at 100,000 clients); this one is
    shared by the client's fields and the view is made when read.
    """

    __slots__ = ("pool", "row", "start", "stop")

    def __init__(self, pool: object, row: int, start: int, stop: int) -> None:
        self.pool, self.row, self.start, self.stop = pool, row, start, stop


class _Tensor:
    """A ClientData tensor field that may hold :class:`PoolRows` (read as a view of the pool).

    The value lives in the slot ``_<name>`` (ClientData has no per-instance dict).
    """

    def __init__(self, part: str, optional: bool = False) -> None:
        self.part = part  # "x" or "y": which of the pool's tensors a PoolRows value reads
        self.optional = optional  # a field that may be None (its dataclass default)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj: object, objtype: type | None = None) -> torch.Tensor | None:
        if obj is None:
            if self.optional:
                return None  # dataclasses: the field's default
            raise AttributeError(self.name)  # dataclasses: a field without a default
        value = getattr(obj, self.slot)
        if type(value) is PoolRows:
            return getattr(value.pool, self.part)[value.start : value.stop]
        return value

    def __set__(self, obj: object, value: torch.Tensor | PoolRows | None) -> None:
        setattr(obj, self.slot, value)


@dataclass
class ClientData:
    """One client's data on the device.

    Attributes:
        x_train, y_train: training inputs and targets.
        x_test, y_test: the client's own test split.
        x_val, y_val: the validation split carved out of the client's training data
            (``val_fraction``, for tuning); None when there is none.

    The run's training pool (``fedexp.engine.clients.pool.TrainPool``) may set the training fields
    (and the test ones when they are the same tensors) to :class:`PoolRows`; they still read
    as tensors (views of the pool made on access). Slots, no instance dict: ~200 bytes a
    client less (issue 14's 100,000 clients).
    """

    __slots__ = ("_x_train", "_y_train", "_x_test", "_y_test", "_x_val", "_y_val")

    x_train: torch.Tensor = _Tensor("x")
    y_train: torch.Tensor = _Tensor("y")
    x_test: torch.Tensor = _Tensor("x")
    y_test: torch.Tensor = _Tensor("y")
    x_val: torch.Tensor | None = _Tensor("x", optional=True)
    y_val: torch.Tensor | None = _Tensor("y", optional=True)

    @property
    def num_train(self) -> int:
        """Number of training samples."""
        rows = self._y_train
        if type(rows) is PoolRows:
            return rows.stop - rows.start
        return int(rows.shape[0])

    def pooled(self, pool: object = None) -> PoolRows | None:
        """The pool rows this client's training set is, or None when it is not pooled.

        Args:
            pool: the pool it must be in (None: any pool).
        """
        x = self._x_train
        if type(x) is PoolRows and x is self._y_train and (pool is None or x.pool is pool):
            return x
        return None

    @property
    def num_test(self) -> int:
        """Number of test samples."""
        rows = self._y_test
        if type(rows) is PoolRows:
            return rows.stop - rows.start
        return int(rows.shape[0])

    @property
    def num_val(self) -> int:
        """Number of validation samples (0 without a validation split)."""
        rows = self._y_val
        if type(rows) is PoolRows:
            return rows.stop - rows.start
        return 0 if rows is None else int(rows.shape[0])

    def validation(self) -> ClientData:
        """This client with its validation split in the place of its test split.

        What evaluation reads is the test split; this view makes it read the validation
        examples instead (the training data are the same tensors, nothing is copied).

        Raises:
            DataError: the client has no validation split.
        """
        if self.x_val is None or self.y_val is None or self.num_val == 0:
            raise DataError("this client has no validation split (set val_fraction > 0)")
        return ClientData(self._x_train, self._y_train, self._x_val, self._y_val)  # type: ignore[arg-type]

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """The next minibatch of ``generator``'s stream; ``size <= 0`` is the full batch.

        A client's round stream (:class:`fedexp.engine.solver.passes.Stream`, which numbers its
        draws) gives its counter-based indices (shuffled passes or with replacement, as the
        stream's ``sampling``; the same a cohort draw gives); any other generator draws
        uniformly with ``randint``. The stream is known by its ``indices`` method, not by its
        class: this module imports nothing of the engine (``tests/test_imports.py``).
        """
        if size <= 0:
            return self.x_train, self.y_train
        dev = self.y_train.device
        if callable(indices := getattr(generator, "indices", None)):
            idx = indices(size, self.num_train, dev)
        else:
            idx = torch.randint(self.num_train, (size,), generator=generator).to(dev)
        return self.x_train[idx], self.y_train[idx]
