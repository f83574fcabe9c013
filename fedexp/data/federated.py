"""Device-resident federated data: each client's train/val/test splits, as one table.

:class:`ClientData` and :class:`PoolRows` live in :mod:`fedexp.data.client` (re-exported).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedexp.data.client import ClientData
from fedexp.data.client import PoolRows
from fedexp.data.dataset import ArrayDataset
from fedexp.data.partitions import ClientSplit
from fedexp.engine.clients.pool import ClientTable
from fedexp.errors import ConfigError
from fedexp.errors import DataError

if TYPE_CHECKING:
    from fedexp.engine.processes.share import Share

__all__ = [
    "ClientData",
    "PoolRows",
    "clients_for_batch",
    "federate",
    "train_test_split",
    "validation_split",
]


def _by_label(indices: np.ndarray, labels: np.ndarray) -> tuple[list, list[list]]:
    """A client's indices as a list, and one list per label (ascending) of its indices.

    Lists, not arrays: the splits below run once per client, and on a client of a few dozen
    samples numpy's per-call overhead (``np.unique``, ``np.setdiff1d``) is most of the work.
    Shuffling a list with ``Generator.shuffle`` makes the same draws, and the same order, as
    ``Generator.permutation`` of an array of its length.
    """
    values = np.asarray(indices).tolist()
    groups: dict = {}
    for v, c in zip(values, np.asarray(labels)[indices].tolist(), strict=True):
        if c in groups:
            groups[c].append(v)
        else:
            groups[c] = [v]
    return values, [groups[c] for c in sorted(groups)]


def _draw(
    values: list, groups: list[list], rng: np.random.Generator, take: Callable[[list, bool], int]
) -> list:
    """The indices a split moves out of ``values`` (at least one).

    ``take(group, True)`` of each label's group when every label has two samples, else
    ``take(values, False)`` of them all; each group (or a copy of ``values``) is shuffled
    first, in order, from ``rng``.
    """
    if min(len(g) for g in groups) >= 2:
        drawn: list = []
        for g in groups:
            rng.shuffle(g)
            drawn += g[: take(g, True)]
    else:
        perm = values.copy()
        rng.shuffle(perm)
        drawn = perm[: take(perm, False)]
    if not drawn:
        perm = values.copy()
        rng.shuffle(perm)
        drawn = perm[:1]
    return drawn


def train_test_split(
    indices: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int, client: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-client split, stratified by label where every class has two samples (pFedNet §VI).

    At least one sample goes to each side. Returns (training, test) indices, each sorted; the
    training indices without repeats.
    """
    rng = np.random.default_rng([seed, 21, client])
    dtype = np.asarray(indices).dtype
    values, groups = _by_label(indices, labels)
    test = _draw(values, groups, rng, lambda g, _: int(round(test_fraction * len(g))))
    train = sorted(set(values).difference(test))
    if not train:
        train, test = test[:1], test[1:]
    return np.array(train, dtype=dtype), np.array(sorted(test), dtype=dtype)


def validation_split(
    train_idx: np.ndarray, labels: np.ndarray, val_fraction: float, seed: int, client: int
) -> tuple[np.ndarray, np.ndarray]:
    """Carve a validation split out of one client's training indices.

    Stratified by label where every class of the training indices has two samples (each class
    keeps at least one training sample), else a plain random share. With ``val_fraction > 0``
    and at least two training samples, at least one goes to validation and at least one stays
    in training. The draw has its own stream (``[seed, 22, client]``), so the train/test split
    before it is the same whatever ``val_fraction`` is.

    Args:
        train_idx: the client's training indices (after :func:`train_test_split`).
        labels: every sample's label (the stratification key).
        val_fraction: share of the training indices moved to validation, in [0, 1).
        seed: the run's seed.
        client: the client's index.

    Returns:
        (training indices, validation indices), each sorted; with ``val_fraction == 0`` (or
        fewer than two training samples) ``train_idx`` unchanged and an empty array.
    """
    empty = train_idx[:0]
    if val_fraction <= 0 or len(train_idx) < 2:
        return train_idx, empty
    rng = np.random.default_rng([seed, 22, client])
    dtype = np.asarray(train_idx).dtype
    values, groups = _by_label(train_idx, labels)

    def take(g: list, by_label: bool) -> int:
        count = np.int64(len(g)) if by_label else len(g)  # (np.unique's counts were int64)
        return min(int(round(val_fraction * count)), len(g) - 1)  # one stays in training

    val = _draw(values, groups, rng, take)
    train = sorted(set(values).difference(val))
    return np.array(train, dtype=dtype), np.array(sorted(val), dtype=dtype)


def _zeroing(split: ClientSplit, x_shape: tuple[int, ...]) -> dict[int, list[int]]:
    """Check the split's channels to zero against the inputs' shape (n, C, ...)."""
    if not split.zero_channels:
        return {}
    if len(x_shape) < 3:
        raise DataError(
            f"the partition zeroes input channels {dict(split.zero_channels)}, but the data "
            f"has no channel axis (input shape {list(x_shape[1:])}); use an image dataset "
            "such as dataset=brats"
        )
    for n, channels in split.zero_channels.items():
        bad = [c for c in channels if not 0 <= c < x_shape[1]]
        if bad:
            raise DataError(
                f"partition.channel={bad[0]}: client {n} would lack channel {bad[0]} but the "
                f"data has {x_shape[1]} channel(s) (expected 0..{x_shape[1] - 1})"
            )
    return {n: list(c) for n, c in split.zero_channels.items()}


def federate(
    data: ArrayDataset,
    partition: Callable[..., ClientSplit | list[np.ndarray]],
    num_clients: int,
    test_fraction: float,
    seed: int,
    device: torch.device,
    val_fraction: float = 0.0,
    folder: Path | None = None,
    share: Share | None = None,
) -> Sequence[ClientData]:
    """Partition ``data`` over clients, split each 80/20 and move the tensors to ``device``.

    The clients come as a :class:`fedexp.engine.clients.pool.ClientTable`: each split of every
    client in one array (memory-mapped files in ``folder`` when one is given, CPU only).

    The partition returns index arrays or a :class:`ClientSplit`; the channels it lists for a
    client are set to zero in that client's training, validation and test inputs (pFedNet's
    "lack #c").

    With ``val_fraction > 0``, :func:`validation_split` then moves that share of each client's
    training data to a validation split (for tuning without looking at the test split); the
    test split, and with ``val_fraction = 0`` everything, is the same as without it.

    With a ``share`` (``distributed.nproc``: rank r of P) the table holds the rows of that
    rank's clients only (n mod P == r) and every client's sizes: the partition and the
    splits are drawn for all clients as in one process.

    Raises:
        DataError: no train/test split is possible, or the partition is malformed.
        ConfigError: ``val_fraction`` outside [0, 1).
    """
    split, splits = _split(data, partition, num_clients, test_fraction, seed, val_fraction)
    zero = _zeroing(split, data.x.shape)
    x_all = torch.from_numpy(np.ascontiguousarray(data.x))
    y_all = torch.from_numpy(np.ascontiguousarray(data.y))
    # copies: zeroing never touches data.x
    return ClientTable.build(x_all, y_all, splits, device, folder, zero, share)


_Splits = tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]


def _split(
    data: ArrayDataset,
    partition: Callable[..., ClientSplit | list[np.ndarray]],
    num_clients: int,
    test_fraction: float,
    seed: int,
    val_fraction: float,
) -> tuple[ClientSplit, _Splits]:
    """The partition and each client's (training, test, validation) indices, as federate draws them.

    Raises:
        DataError: no train/test split is possible, or the partition is malformed.
        ConfigError: ``val_fraction`` outside [0, 1).
    """
    if num_clients < 1:
        raise DataError(f"num_clients={num_clients}: expected at least 1")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction={test_fraction}: expected a value in (0, 1)")
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(
            f"val_fraction={val_fraction}: expected a fraction in [0, 1) of each client's "
            "training data (0: no validation split)"
        )
    split = ClientSplit.of(
        partition(labels=data.labels, num_clients=num_clients, seed=seed, groups=data.groups)
    )
    parts = split.parts
    if len(parts) != num_clients:
        raise DataError(f"the partition returned {len(parts)} parts for {num_clients} clients")
    for n, idx in enumerate(parts):
        if idx.size and (
            not np.issubdtype(idx.dtype, np.integer) or idx.min() < 0 or idx.max() >= len(data.y)
        ):
            raise DataError(
                f"the partition gives client {n} sample indices outside [0, {len(data.y)}) "
                f"(dtype {idx.dtype}); expected integer indices into the {len(data.y)} samples"
            )
    labels = data.labels
    splits: _Splits = ([], [], [])
    for n, idx in enumerate(parts):
        train_idx, test_idx = train_test_split(idx, labels, test_fraction, seed, n)
        if len(train_idx) == 0 or len(test_idx) == 0:
            raise DataError(f"client {n} has {len(idx)} sample(s): no train/test split possible")
        train_idx, val_idx = validation_split(train_idx, labels, val_fraction, seed, n)
        for kept, rows in zip(splits, (train_idx, test_idx, val_idx), strict=True):
            kept.append(rows)
    return split, splits


def clients_for_batch(
    data: ArrayDataset,
    partition: Callable[..., ClientSplit | list[np.ndarray]],
    batch_size: int,
    num_clients: int,
    test_fraction: float,
    seed: int,
    val_fraction: float = 0.0,
) -> int | None:
    """The most clients, fewer than ``num_clients``, whose largest has ``batch_size`` samples.

    What a run refused for a ``batch_size`` larger than every client's training data can
    use instead (the README's ``num_clients=100 batch_size=8`` on 569 samples: 100 clients
    of at most 6 training samples). The partition and the splits are drawn as
    :func:`federate` draws them, indices only (no tensors), for a bisection of the number of
    clients (the largest client shrinks as clients are added, up to the partition's draws).

    Returns:
        A number of clients at which the largest client has at least ``batch_size`` training
        samples, or None when not even one client has (the data set is too small).
    """

    def fits(n: int) -> bool:
        try:
            _, (train, _, _) = _split(data, partition, n, test_fraction, seed, val_fraction)
        except (DataError, ConfigError):  # a partition that cannot make n clients
            return False
        return max(len(t) for t in train) >= batch_size

    low, high = 1, num_clients - 1  # one client holding every sample is the most there is
    if high < 1 or not fits(low):
        return None
    while low < high:  # invariant: fits(low)
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
