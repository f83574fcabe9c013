"""Device-resident federated data: each client's train/test tensors, batches as index draws."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedexp.data.dataset import ArrayDataset
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


def federate(
    data: ArrayDataset,
    partition: Callable[..., list[np.ndarray]],
    num_clients: int,
    test_fraction: float,
    seed: int,
    device: torch.device,
) -> list[ClientData]:
    """Partition ``data`` over clients, split each 80/20 and move the tensors to ``device``."""
    if num_clients < 1:
        raise DataError(f"num_clients={num_clients}: expected at least 1")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction={test_fraction}: expected a value in (0, 1)")
    parts = partition(labels=data.labels, num_clients=num_clients, seed=seed, groups=data.groups)
    if len(parts) != num_clients:
        raise DataError(f"the partition returned {len(parts)} parts for {num_clients} clients")
    x_all = torch.from_numpy(np.ascontiguousarray(data.x))
    y_all = torch.from_numpy(np.ascontiguousarray(data.y))
    clients = []
    for n, idx in enumerate(parts):
        train_idx, test_idx = train_test_split(idx, data.labels, test_fraction, seed, n)
        if len(train_idx) == 0 or len(test_idx) == 0:
            raise DataError(f"client {n} has {len(idx)} sample(s): no train/test split possible")
        tr, te = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
        clients.append(
            ClientData(
                x_all[tr].to(device),
                y_all[tr].to(device),
                x_all[te].to(device),
                y_all[te].to(device),
            )
        )
    return clients
