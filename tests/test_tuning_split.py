"""The validation split (``val_fraction``): carved out of each client's training data, the
train/test split untouched, and nothing at all changed with val_fraction = 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedexp.config.instantiate import instantiate_checked
from fedexp.config.schema import override_errors
from fedexp.config.schema import validate
from fedexp.data.federated import federate
from fedexp.data.federated import validation_split
from fedexp.data.partitions import ClientSplit
from fedexp.errors import ConfigError
from fedexp.errors import DataError
from helpers import compose_config

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------
# A frozen copy of federate()'s split as it was before val_fraction (commit 9b2ef9c): the
# reference the new code must reproduce bit for bit with val_fraction = 0.
def _reference_train_test_split(indices, labels, test_fraction, seed, client):
    rng = np.random.default_rng([seed, 21, client])
    test = []
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


def _reference_federate(data, partition, num_clients, test_fraction, seed):
    """(x_train, y_train, x_test, y_test) per client, as federate() built them before."""
    split = ClientSplit.of(
        partition(labels=data.labels, num_clients=num_clients, seed=seed, groups=data.groups)
    )
    x_all = torch.from_numpy(np.ascontiguousarray(data.x))
    y_all = torch.from_numpy(np.ascontiguousarray(data.y))
    out = []
    for n, idx in enumerate(split.parts):
        train_idx, test_idx = _reference_train_test_split(idx, data.labels, test_fraction, seed, n)
        tr, te = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
        x_train, x_test = x_all[tr], x_all[te]
        if n in split.zero_channels:
            x_train[:, list(split.zero_channels[n])] = 0.0
            x_test[:, list(split.zero_channels[n])] = 0.0
        out.append((x_train, y_all[tr], x_test, y_all[te]))
    return out


# ------------------------------------------------------------------------------------------
def _data_and_partition(dataset: str, partition: str):
    cfg = compose_config(f"dataset={dataset}", f"partition={partition}")
    data = instantiate_checked(cfg.dataset, "dataset")
    return data, instantiate_checked(cfg.partition, "partition")


CASES = [
    ("breast_cancer", "label_imbalance", 5),
    ("breast_cancer", "dirichlet", 7),
    ("breast_cancer", "iid", 3),
    ("synthetic", "natural", 10),
    ("digits", "shards", 6),
    ("digits", "missing_channel", 4),
]


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def get(dataset, partition):
        if (dataset, partition) not in cache:
            cache[dataset, partition] = _data_and_partition(dataset, partition)
        return cache[dataset, partition]

    return get


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize(("dataset", "partition", "num_clients"), CASES)
@pytest.mark.parametrize("seed", [0, 3])
def test_val_fraction_zero_is_bit_identical_to_the_old_split(
    loaded, dataset, partition, num_clients, seed
):
    data, part = loaded(dataset, partition)
    old = _reference_federate(data, part, num_clients, 0.2, seed)
    for new in (
        federate(data, part, num_clients, 0.2, seed, CPU),  # the default
        federate(data, part, num_clients, 0.2, seed, CPU, val_fraction=0.0),
    ):
        assert len(new) == len(old)
        for c, (x_tr, y_tr, x_te, y_te) in zip(new, old, strict=True):
            assert _same(c.x_train, x_tr) and _same(c.y_train, y_tr)
            assert _same(c.x_test, x_te) and _same(c.y_test, y_te)
            assert c.x_val is None and c.y_val is None and c.num_val == 0


def _rows(x: torch.Tensor) -> list[bytes]:
    """The rows of ``x`` as bytes, sorted: a multiset of examples."""
    return sorted(r.numpy().tobytes() for r in x.reshape(len(x), -1))


@pytest.mark.parametrize(("dataset", "partition", "num_clients"), CASES)
def test_val_split_is_carved_from_training_data_and_test_is_unchanged(
    loaded, dataset, partition, num_clients
):
    data, part = loaded(dataset, partition)
    base = federate(data, part, num_clients, 0.2, 1, CPU)
    split = federate(data, part, num_clients, 0.2, 1, CPU, val_fraction=0.25)
    for b, s in zip(base, split, strict=True):
        # the test split: the very same examples, in the same order
        assert _same(s.x_test, b.x_test) and _same(s.y_test, b.y_test)
        # train + val = the old training data; validation non-empty, training non-empty
        assert s.num_val >= 1 and s.num_train >= 1
        assert s.num_train + s.num_val == b.num_train
        assert abs(s.num_val - 0.25 * b.num_train) <= 1 + 0.5 * len(torch.unique(b.y_train))
        assert _rows(torch.cat([s.x_train, s.x_val])) == _rows(b.x_train)
        assert torch.equal(
            torch.sort(torch.cat([s.y_train, s.y_val])).values, torch.sort(b.y_train).values
        )


def test_train_val_test_are_disjoint_by_index():
    """On sample indices (not values, which may repeat): the three splits never overlap."""
    labels = np.repeat(np.arange(3), 40)
    idx = np.random.default_rng(0).permutation(120)[:90]
    from fedexp.data.federated import train_test_split

    for seed in range(4):
        train, test = train_test_split(idx, labels, 0.2, seed, 2)
        tr, va = validation_split(train, labels, 0.2, seed, 2)
        assert not set(tr) & set(va) and not set(tr) & set(test) and not set(va) & set(test)
        assert sorted([*tr, *va, *test]) == sorted(idx)
        assert list(tr) == sorted(tr) and list(va) == sorted(va)
        # stratified: every class keeps training samples and is in validation
        assert set(labels[va]) == set(labels[tr]) == {0, 1, 2}
        assert len(va) == sum(round(0.2 * np.sum(labels[train] == c)) for c in range(3))


def test_validation_split_edge_sizes():
    labels = np.array([0, 1, 0, 1, 1])
    # two training samples: one each side, whatever the fraction
    for frac in (0.01, 0.5, 0.99):
        tr, va = validation_split(np.array([0, 1]), labels, frac, 0, 0)
        assert len(tr) == 1 and len(va) == 1
    # one training sample: nothing to carve
    tr, va = validation_split(np.array([3]), labels, 0.5, 0, 0)
    assert list(tr) == [3] and len(va) == 0
    # a tiny fraction still gives one validation sample
    tr, va = validation_split(np.arange(5), labels, 1e-6, 0, 0)
    assert len(va) == 1 and len(tr) == 4
    # a large fraction keeps one training sample per class
    tr, va = validation_split(np.arange(5), labels, 0.99, 0, 0)
    assert set(labels[tr]) == {0, 1} and len(va) == 3


def test_different_clients_and_seeds_draw_different_validation_splits():
    labels = np.zeros(200, dtype=int)
    idx = np.arange(200)
    va = {
        (seed, n): tuple(validation_split(idx, labels, 0.2, seed, n)[1])
        for seed in (0, 1)
        for n in (0, 1)
    }
    assert len(set(va.values())) == 4
    assert validation_split(idx, labels, 0.2, 0, 0)[1].tolist() == list(va[0, 0])  # repeatable


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_val_fraction_out_of_range_is_a_config_error(loaded, bad):
    data, part = loaded("breast_cancer", "iid")
    with pytest.raises(ConfigError, match=rf"val_fraction={bad}: expected a fraction in \[0, 1\)"):
        federate(data, part, 3, 0.2, 0, CPU, val_fraction=bad)
    with pytest.raises(ConfigError, match=r"val_fraction=.*expected a fraction in \[0, 1\)"):
        validate({"val_fraction": bad})
    assert any(e.startswith("val_fraction=") for e in override_errors([f"val_fraction={bad}"]))


def test_val_fraction_is_a_run_setting_with_default_zero():
    cfg = compose_config()
    assert cfg.val_fraction == 0.0
    validate(compose_config("val_fraction=0.3"))  # in range: no error
    assert override_errors(["val_fraction=0.3"]) == []


def test_validation_view_swaps_the_test_split_for_the_validation_split(loaded):
    data, part = loaded("breast_cancer", "iid")
    (c, *_) = federate(data, part, 3, 0.2, 0, CPU, val_fraction=0.2)
    view = c.validation()
    # the same stored values (pooled fields read as new views of one array): nothing copied
    for a, b in ((view.x_test, c.x_val), (view.y_test, c.y_val), (view.x_train, c.x_train)):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
    (plain, *_) = federate(data, part, 3, 0.2, 0, CPU)
    with pytest.raises(DataError, match="no validation split"):
        plain.validation()


def test_zeroed_channels_are_zero_in_the_validation_split_too(loaded):
    data, part = loaded("digits", "missing_channel")
    clients = federate(data, part, 4, 0.2, 0, CPU, val_fraction=0.3)
    for n in (0, 1):  # the partition's clients lacking channel 0 (the only one of digits)
        assert clients[n].num_val and not clients[n].x_val[:, 0].any()
    assert clients[2].x_val[:, 0].any()


def test_a_switch_that_is_not_true_or_false_is_named_before_compose():
    """Boolean run settings (``figures``, ``eval_participants``, ``resume_unsealed``,
    ``conv_gemm``) read only true or false, in one line naming the key, before Hydra's own
    type error."""
    for key in ("figures", "eval_participants", "resume_unsealed", "conv_gemm"):
        assert override_errors([f"{key}=maybe"]) == [f"{key}='maybe': expected true or false"]
        assert override_errors([f"{key}=false"]) == override_errors([f"{key}=true"]) == []
    assert override_errors(["figures=1"]) == ["figures=1: expected true or false"]
