"""The list-based ``train_test_split`` / ``validation_split`` give exactly the old arrays.

The references are the two functions as they were before (verbatim, renamed): the old
validation split below, the old train/test split frozen in tests/test_tuning_split.py.
Recorded golden results depend on every array they return.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_tuning_split import _reference_train_test_split  # the old split, frozen there

from fedexp.data.federated import train_test_split
from fedexp.data.federated import validation_split


def _reference_validation_split(
    train_idx: np.ndarray, labels: np.ndarray, val_fraction: float, seed: int, client: int
) -> tuple[np.ndarray, np.ndarray]:
    """Carve a validation split out of one client's training indices.

    Stratified by label where every class of the training indices has two samples (each class
    keeps at least one training sample), else a plain random share. With ``val_fraction > 0``
    and at least two training samples, at least one goes to validation and at least one stays
    in training. The draw has its own stream (``[seed, 22, client]``), so the train/test split
    before it is the same whatever ``val_fraction`` is.

    Args:
        train_idx: the client's training indices (after :func:`_reference_train_test_split`).
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
    y = labels[train_idx]
    classes, counts = np.unique(y, return_counts=True)
    if counts.min() >= 2:
        parts = []
        for c, count in zip(classes, counts, strict=True):
            idx = rng.permutation(train_idx[y == c])
            parts.append(idx[: min(int(round(val_fraction * count)), count - 1)])
        val_idx = np.concatenate(parts)
    else:
        perm = rng.permutation(train_idx)
        val_idx = perm[: min(int(round(val_fraction * len(perm))), len(perm) - 1)]
    if len(val_idx) == 0:
        val_idx = rng.permutation(train_idx)[:1]
    return np.setdiff1d(train_idx, val_idx), np.sort(val_idx)


def _same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> bool:
    return all(
        type(g) is type(w) and g.dtype == w.dtype and np.array_equal(g, w)
        for g, w in zip(got, want, strict=True)
    )


SEEDS = (0, 1, 7, 2024, 2**31, 2**32 - 1, 2**32 + 5)  # the last: the default_rng fallback
CLIENTS = (0, 1, 5, 1023, 1024, 2047, 99_999, 2**32 - 1)


def _case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random (indices, labels): 1..60 samples, 1..5 skewed classes, assorted index layouts."""
    n = int(rng.integers(1, 61))
    k = int(rng.integers(1, 6))
    pool = n + int(rng.integers(0, 3 * n + 1))  # unpicked positions: gaps
    classes = rng.choice(10, size=k, replace=False)  # not necessarily 0..k-1
    weights = rng.dirichlet(np.full(k, 0.5))
    dtype = (np.int64, np.int32)[int(rng.integers(2))]
    labels = rng.choice(classes, size=pool, p=weights).astype(dtype)
    indices = np.sort(rng.choice(pool, size=n, replace=False)).astype(np.int64)
    if k > 1 and rng.random() < 0.3:
        labels[indices[int(rng.integers(n))]] = classes[0] + 10  # a class of one sample
    layout = int(rng.integers(4))
    if layout == 1:
        indices = rng.permutation(indices)  # unsorted
    elif layout == 2:
        indices = np.arange(n, dtype=np.int64)  # no gaps
    elif layout == 3 and n > 1:  # duplicates (and unsorted)
        dup = rng.integers(n, size=int(rng.integers(1, n + 1)))
        indices = rng.permutation(np.concatenate([indices, indices[dup]]))
    return indices, labels


def test_shuffling_a_list_draws_as_permuting_an_array() -> None:
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(0, 80))
        values = rng.integers(0, 10**6, n).tolist()
        seed = rng.integers(0, 2**32, 3).tolist()
        a, b = np.random.default_rng(seed), np.random.default_rng(seed)
        shuffled = values.copy()
        a.shuffle(shuffled)
        assert shuffled == b.permutation(np.array(values, dtype=np.int64)).tolist()
        assert a.bit_generator.state == b.bit_generator.state


def test_splits_match_the_reference_on_random_clients() -> None:
    rng = np.random.default_rng(0)
    branches = set()
    for i in range(2500):
        indices, labels = _case(rng)
        test_fraction = float(rng.choice([0.1, 0.2, 0.5, 0.9]))
        val_fraction = float(rng.choice([0.0, 0.1, 0.25, 0.5]))
        # mostly runs of clients (as in federate), some clients one by one
        seed = SEEDS[i // 300 % len(SEEDS)]
        client = 900 + i if i % 5 else int(rng.choice(CLIENTS))
        args = (test_fraction, seed, client)
        want = _reference_train_test_split(indices, labels, *args)
        got = train_test_split(indices, labels, *args)
        assert _same(got, want), (indices, labels, args)
        counts = np.unique(labels[indices], return_counts=True)[1]
        branches.add((counts.min() >= 2, len(np.unique(indices)) == len(indices)))
        # on the split's training indices (as federate does), and on the raw indices
        for train in (want[0], indices):
            args = (val_fraction, seed, client)
            want_val = _reference_validation_split(train, labels, *args)
            got_val = validation_split(train, labels, *args)
            assert _same(got_val, want_val), (train, labels, args)
    assert branches == {(True, True), (True, False), (False, True), (False, False)}


@pytest.mark.parametrize(
    ("indices", "labels", "val_fraction"),
    [
        (np.arange(300) * 2, np.arange(600) % 7, 0.2),  # a large client: the general path
        (np.arange(40, dtype=np.int32), np.arange(40) % 3, 0.2),  # int32 indices
        (np.arange(40), (np.arange(40) % 3).astype(np.uint8), 0.3),  # uint8 labels
        (np.arange(40), np.arange(40) % 4 - 2, 0.3),  # negative labels
        (np.arange(40), (np.arange(40) % 3).astype(np.float64), 0.3),  # float labels
        (np.arange(40), np.arange(40) % 3, np.float32(0.3)),  # a float32 fraction
        (np.arange(40), np.arange(40) % 3, 0.999),
        (np.arange(2), np.arange(2), 0.5),
        (np.array([5]), np.arange(6), 0.5),
    ],
)
def test_splits_match_the_reference_on_odd_inputs(
    indices: np.ndarray, labels: np.ndarray, val_fraction: float
) -> None:
    for seed, client in ((0, 0), (3, 1500)):
        for test_fraction in (0.1, 0.5, 0.9):
            args = (test_fraction, seed, client)
            want = _reference_train_test_split(indices, labels, *args)
            assert _same(train_test_split(indices, labels, *args), want)
        for train in (want[0], indices):
            want = _reference_validation_split(train, labels, val_fraction, seed, client)
            assert _same(validation_split(train, labels, val_fraction, seed, client), want)


def test_edge_cases_behave_as_before() -> None:
    labels = np.arange(10) % 2
    idx = np.arange(6)
    for frac in (0.0, -0.5):
        train, val = validation_split(idx, labels, frac, 0, 0)
        assert train is idx and val.size == 0 and val.dtype == idx.dtype
    with pytest.raises(ValueError):
        _reference_train_test_split(idx[:0], labels, 0.2, 0, 0)
    with pytest.raises(ValueError):
        train_test_split(idx[:0], labels, 0.2, 0, 0)
    with pytest.raises(ValueError):  # SeedSequence rejects negative seeds, as ever
        train_test_split(idx, labels, 0.2, -1, 0)
