"""Device-resident federated data: each client's train/test tensors, batches as index draws."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedexp.data.dataset import ArrayDataset
from fedexp.data.partitions import ClientSplit
from fedexp.errors import DataError


@dataclass
class ClientData:
    """One client's data on the device.

    Attributes:
        x_train, y_train: training inputs and targets.
        x_test, y_test: the client's own test split.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_train(self) -> int:
        """Number of training samples."""
        return int(self.y_train.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test samples."""
        return int(self.y_test.shape[0])

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A minibatch drawn uniformly with replacement; ``size <= 0`` is the full batch."""
        if size <= 0:
            return self.x_train, self.y_train
        idx = torch.randint(self.num_train, (size,), generator=generator)
        idx = idx.to(self.y_train.device)
        return self.x_train[idx], self.y_train[idx]


def train_test_split(
    indices: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int, client: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-client split, stratified by label where every class has two samples (pFedNet §VI).

    At least one sample goes to each side.
    """
    rng = np.random.default_rng([seed, 21, client])
    test: list[np.ndarray] = []
    y = labels[indices]
    classes, counts = np.unique(y, return_counts=True)
    if counts.min() >= 2:
        for c in classes:
            idx = rng.permutation(indices[y == c])
            test.append(idx[: int(round(test_fraction * len(idx)))])
        test_idx = np.concatenate(test)
    else:
        perm = rng.permutation(indices)
        test_idx = perm[: int(round(test_fraction * len(perm)))]
    if len(test_idx) == 0:
        test_idx = rng.permutation(indices)[:1]
    train_idx = np.setdiff1d(indices, test_idx)
    if len(train_idx) == 0:
        train_idx, test_idx = test_idx[:1], test_idx[1:]
    return np.sort(train_idx), np.sort(test_idx)


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
) -> list[ClientData]:
    """Partition ``data`` over clients, split each 80/20 and move the tensors to ``device``.

    The partition returns index arrays or a :class:`ClientSplit`; the channels it lists for a
    client are set to zero in that client's training and test inputs (MATH §9, "lack #c").
    """
    if num_clients < 1:
        raise DataError(f"num_clients={num_clients}: expected at least 1")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction={test_fraction}: expected a value in (0, 1)")
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
    zero = _zeroing(split, data.x.shape)
    x_all = torch.from_numpy(np.ascontiguousarray(data.x))
    y_all = torch.from_numpy(np.ascontiguousarray(data.y))
    labels = data.labels
    clients = []
    for n, idx in enumerate(parts):
        train_idx, test_idx = train_test_split(idx, labels, test_fraction, seed, n)
        if len(train_idx) == 0 or len(test_idx) == 0:
            raise DataError(f"client {n} has {len(idx)} sample(s): no train/test split possible")
        tr, te = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
        x_train, x_test = x_all[tr], x_all[te]  # copies: zeroing never touches data.x
        if n in zero:
            x_train[:, zero[n]] = 0.0
            x_test[:, zero[n]] = 0.0
        clients.append(
            ClientData(
                x_train.to(device),
                y_all[tr].to(device),
                x_test.to(device),
                y_all[te].to(device),
            )
        )
    return clients
