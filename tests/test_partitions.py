"""Partition properties: disjoint, complete, δ ratios, deterministic per seed, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from fedexp.config.instantiate import instantiate_checked
from fedexp.data import partitions as P
from fedexp.data.federated import train_test_split
from fedexp.errors import DataError
from helpers import compose_config

rng = np.random.default_rng(0)
BINARY = (rng.random(1000) < 0.35).astype(np.int64)
MULTI = rng.integers(0, 5, size=1000)
GROUPS = rng.integers(0, 7, size=1000).astype(str)

CASES = [
    ("iid", P.iid, BINARY, {}),
    ("label_imbalance", P.label_imbalance, BINARY, {"delta": 3.0}),
    ("dirichlet", P.dirichlet, MULTI, {"alpha": 0.3}),
    ("dirichlet_balance", P.dirichlet, MULTI, {"alpha": 0.3, "balance": True}),
    ("shards", P.shards, MULTI, {"classes_per_client": 2}),
    ("natural", P.natural, MULTI, {}),
]


@pytest.mark.parametrize("name,fn,labels,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("num_clients", [1, 5, 7])
def test_disjoint_complete_deterministic(name, fn, labels, kw, num_clients):
    parts = fn(labels=labels, num_clients=num_clients, seed=3, groups=GROUPS, **kw)
    assert len(parts) == num_clients
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx)), "a sample is used twice"
    assert sorted(allidx.tolist()) == list(range(len(labels))), "a sample is unused"
    again = fn(labels=labels, num_clients=num_clients, seed=3, groups=GROUPS, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    if name != "natural" and num_clients > 1:
        other = fn(labels=labels, num_clients=num_clients, seed=4, groups=GROUPS, **kw)
        assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_label_imbalance_fractions_match_authors_table():
    f = P.label_imbalance_fractions(5, 2.0)
    expected = [(0.30, 0.15), (0.30, 0.15), (0.10, 0.10), (0.15, 0.30), (0.15, 0.30)]
    np.testing.assert_allclose(f, expected, atol=1e-12)
    np.testing.assert_allclose(P.label_imbalance_fractions(4, 1.0), 0.25)


@pytest.mark.parametrize("num_clients", [2, 5, 8, 11])
@pytest.mark.parametrize("delta", [1.0, 2.0, 4.0, 7.0])
def test_label_imbalance_ratios(num_clients, delta):
    labels = np.array([0] * 3000 + [1] * 3000)
    parts = P.label_imbalance(labels, num_clients, seed=0, delta=delta)
    f = P.label_imbalance_fractions(num_clients, delta)
    np.testing.assert_allclose(f.sum(axis=0), 1.0)
    for n, part in enumerate(parts):
        neg, pos = (labels[part] == 0).sum(), (labels[part] == 1).sum()
        # equal pools: count ratio = share ratio (δ, 1 or 1/δ), up to rounding
        assert neg / pos == pytest.approx(f[n, 0] / f[n, 1], rel=0.02)
    half = num_clients // 2
    assert all((labels[p] == 0).sum() >= (labels[p] == 1).sum() for p in parts[:half])
    assert all((labels[p] == 1).sum() >= (labels[p] == 0).sum() for p in parts[-half:])


def test_label_imbalance_rejects_non_binary_labels():
    with pytest.raises(DataError, match="binary.*use partition=dirichlet or partition=shards"):
        P.label_imbalance(MULTI, 5, seed=0, delta=2.0)
    # one class (3-D BraTS crops, each around its tumour): nothing to imbalance, nor to split by
    with pytest.raises(DataError, match=r"classes \[1\]; use partition=iid or partition=natural"):
        P.label_imbalance(np.ones(40, dtype=np.int64), 5, seed=0, delta=2.0)


def test_label_imbalance_rejects_delta_below_one():
    with pytest.raises(DataError, match="delta=0.5"):
        P.label_imbalance(BINARY, 5, seed=0, delta=0.5)


def test_too_many_clients_is_a_clear_error():
    with pytest.raises(DataError, match="client .* only"):
        P.label_imbalance(BINARY[:30], 25, seed=0, delta=7.0)
    with pytest.raises(DataError, match="alpha=0.001"):
        P.dirichlet(MULTI[:50], 20, seed=0, alpha=0.001, max_tries=5)
    with pytest.raises(DataError, match="num_clients=9"):
        P.natural(MULTI, 9, seed=0, groups=GROUPS)


def test_shards_give_few_classes_per_client():
    labels = np.repeat(np.arange(10), 100)
    parts = P.shards(labels, 10, seed=0, classes_per_client=2)
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)


def test_train_test_split_is_stratified_disjoint_and_complete():
    idx = np.arange(200)
    labels = np.array([0] * 150 + [1] * 50)
    train, test = train_test_split(idx, labels, 0.2, seed=0, client=0)
    assert len(np.intersect1d(train, test)) == 0
    assert sorted(np.concatenate([train, test]).tolist()) == idx.tolist()
    assert len(test) == 40 and (labels[test] == 1).sum() == 10


def _dirichlet_before_balance(labels, num_clients, seed, alpha, min_size=2, max_tries=100):
    """``P.dirichlet`` as it was before ``balance`` (its code, verbatim but for the errors)."""
    rng = np.random.default_rng([seed, 13])
    for _ in range(max_tries):
        parts = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha))
            for n, chunk in enumerate(P._split_by_fractions(idx, props)):
                parts[n].append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    return None


@pytest.mark.parametrize("num_clients", [1, 5, 20])
@pytest.mark.parametrize("alpha", [0.1, 0.5, 2.0])
@pytest.mark.parametrize("min_size", [2, 20])
def test_dirichlet_without_balance_is_the_partition_of_before(num_clients, alpha, min_size):
    for labels, seed in ((MULTI, 0), (MULTI, 3), (np.repeat(np.arange(10), 60), 1)):
        old = _dirichlet_before_balance(labels, num_clients, seed, alpha, min_size)
        if old is None:
            with pytest.raises(DataError, match="in 100 draws"):
                P.dirichlet(labels, num_clients, seed, alpha=alpha, min_size=min_size)
            continue
        new = P.dirichlet(labels, num_clients, seed, alpha=alpha, min_size=min_size)
        assert all(np.array_equal(a, b) for a, b in zip(old, new, strict=True))


def test_dirichlet_redraws_identically_until_min_size_holds():
    # the first draw leaves a client short, a later one does not: the retry path is compared
    with pytest.raises(DataError, match="fewer than 20 samples in 1 draws"):
        P.dirichlet(MULTI, 20, 0, alpha=0.5, min_size=20, max_tries=1)
    new = P.dirichlet(MULTI, 20, 0, alpha=0.5, min_size=20)
    old = _dirichlet_before_balance(MULTI, 20, 0, 0.5, 20)
    assert all(np.array_equal(a, b) for a, b in zip(old, new, strict=True))
    assert min(len(p) for p in new) >= 20


# 200 classes of 25 (Tiny ImageNet's class count) over 100 clients at FedDWA's α = 0.07
MANY = np.repeat(np.arange(200), 25)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dirichlet_balance_caps_clients_at_n_over_N(seed):
    n, clients, cap = len(MANY), 100, len(MANY) / 100
    plain = P.dirichlet(MANY, clients, seed, alpha=0.07, min_size=0)
    capped = P.dirichlet(MANY, clients, seed, alpha=0.07, min_size=10, balance=True)
    allidx = np.concatenate(capped)
    assert sorted(allidx.tolist()) == list(range(n)), "disjoint and complete"
    sizes = np.array([len(p) for p in capped])
    assert sizes.min() >= 10
    # a client only receives a class while it holds < n/N, so it ends below n/N plus the
    # chunk of the last class it received (classes are dealt in label order)
    for part in capped:
        counts = np.bincount(MANY[part], minlength=200)
        last = np.flatnonzero(counts)[-1]
        assert len(part) - counts[last] < cap
    assert sizes.max() <= cap + 25
    assert max(len(p) for p in plain) > 2 * sizes.max(), "the cap should matter at α = 0.07"
    assert np.std([len(p) for p in plain]) > 2 * sizes.std()


def test_balance_cap_renormalises_and_falls_back_to_open_clients():
    props = np.array([0.5, 0.3, 0.2])
    np.testing.assert_allclose(P._cap_full_clients(props, np.array([9, 1, 1]), 5.0), [0, 0.6, 0.4])
    np.testing.assert_allclose(P._cap_full_clients(props, np.array([0, 0, 0]), 5.0), props)
    # all the drawn mass on full clients: the class goes equally to the open ones
    np.testing.assert_allclose(
        P._cap_full_clients(np.array([1.0, 0.0, 0.0]), np.array([9, 1, 1]), 5.0), [0, 0.5, 0.5]
    )


def test_dirichlet_config_keys():
    cfg = compose_config("partition=dirichlet")
    assert cfg.partition.balance is False and cfg.partition.min_size == 2
    cfg = compose_config("partition=dirichlet", "partition.alpha=0.07", "partition.balance=true")
    partition = instantiate_checked(cfg.partition, "partition")
    parts = partition(labels=MANY, num_clients=100, seed=0, groups=None)
    direct = P.dirichlet(MANY, 100, 0, alpha=0.07, balance=True)
    assert all(np.array_equal(a, b) for a, b in zip(parts, direct, strict=True))
