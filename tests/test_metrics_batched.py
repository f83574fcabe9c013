"""Classification metrics of a padded batch of clients in torch, checked against scikit-learn."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score
from sklearn.metrics import roc_auc_score

from fedexp.metrics import classification_metrics
from fedexp.metrics import classification_metrics_batched
from fedexp.metrics import probabilities
from fedexp.models.task import ClassificationTask

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _sklearn(logits: torch.Tensor, y: torch.Tensor, num_classes: int) -> dict[str, float]:
    """The metrics as fedexp computed them with scikit-learn, on float64 probabilities."""
    if len(y) == 0:
        return {"acc": math.nan, "bal_acc": math.nan, "auc": math.nan}
    prob = probabilities(logits.double()).numpy()
    y_np = y.numpy()
    pred = prob.argmax(axis=1)
    with warnings.catch_warnings():  # "y_pred contains classes not in y_true"
        warnings.simplefilter("ignore", UserWarning)
        bal_acc = float(balanced_accuracy_score(y_np, pred))
    out = {"acc": float((pred == y_np).mean()), "bal_acc": bal_acc}
    present = np.unique(y_np)
    if len(present) < 2:
        out["auc"] = math.nan
    elif num_classes == 2:
        out["auc"] = float(roc_auc_score(y_np, prob[:, 1]))
    else:
        sub = prob[:, present] / prob[:, present].sum(axis=1, keepdims=True)
        score = sub if len(present) > 2 else sub[:, 1]
        out["auc"] = float(roc_auc_score(y_np, score, multi_class="ovr", labels=present))
    return out


def _batch(
    c: int, num_classes: int, ties: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clients of every kind in one padded batch: lengths 0, 1, 2 and up to 40; one class
    only; some classes absent; garbage (huge, inf, NaN logits, out-of-range labels) as
    padding. ``ties``: logits drawn from a few distinct rows rounded to one decimal."""
    g = torch.Generator().manual_seed(seed)
    n = 40
    lengths = [0, 1, 2, 5, 17, 40, 40, 33, 40, 12, 40, 40]
    m = len(lengths)
    logits = torch.randn(m, n, c, generator=g) * 2
    if ties:
        pool = (torch.randn(m, 5, c, generator=g) * 2).round(decimals=1)
        logits = torch.gather(pool, 1, torch.randint(0, 5, (m, n, 1), generator=g).expand(m, n, c))
    y = torch.randint(0, num_classes, (m, n), generator=g)
    y[6] = 1  # one class only
    y[7] = 0
    y[8] = torch.tensor([0, num_classes - 1])[torch.randint(0, 2, (n,), generator=g)]
    if num_classes > 3:  # three of five present, classes 0 and 1 absent
        y[9] = torch.randint(2, num_classes, (n,), generator=g)
    for i, k in enumerate(lengths):  # garbage padding
        logits[i, k:] = torch.tensor([1e30, -math.inf, math.nan, math.inf])[
            torch.randint(0, 4, (n - k, c), generator=g)
        ]
        y[i, k:] = torch.randint(-7, 99, (n - k,), generator=g)
    return logits.float(), y, torch.tensor(lengths, dtype=torch.int64)


def _close(a: dict[str, float], b: dict[str, float]) -> bool:
    return list(a) == list(b) and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or abs(a[k] - b[k]) <= 1e-6 for k in a
    )


CASES = [  # (logits per sample, num_classes)
    (1, 2),
    (2, 2),
    (3, 3),
    (5, 5),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("c,num_classes", CASES, ids=[f"C{c}-K{k}" for c, k in CASES])
def test_batched_metrics_equal_sklearn_per_client(c, num_classes, ties, device):
    logits, y, lengths = _batch(c, num_classes, ties, seed=10 * c + ties)
    rows = classification_metrics_batched(
        logits.to(device), y.to(device), lengths.to(device), num_classes
    )
    assert len(rows) == len(lengths)
    checked_auc = 0
    for i, row in enumerate(rows):
        k = int(lengths[i])
        want = _sklearn(logits[i, :k], y[i, :k], num_classes)
        assert _close(row, want), (i, row, want)
        checked_auc += math.isfinite(want["auc"])
    assert checked_auc >= 6  # most clients have an AUC: the rank formula is exercised
    assert all(math.isnan(v) for v in rows[0].values())  # no sample: NaN everywhere


def test_heavy_ties_of_a_rounded_binary_logit_equal_sklearn():
    g = torch.Generator().manual_seed(3)
    logits = (torch.rand(4, 200, 1, generator=g) * 2 - 1).round(decimals=1)  # 21 values
    y = torch.randint(0, 2, (4, 200), generator=g)
    lengths = torch.tensor([200, 150, 3, 90])
    for i, row in enumerate(classification_metrics_batched(logits, y, lengths, 2)):
        k = int(lengths[i])
        assert _close(row, _sklearn(logits[i, :k], y[i, :k], 2)), i


def test_auc_ranks_logits_not_saturated_float32_probabilities():
    # float32 sigmoid is 1.0 for 30, 40 and 50: those would tie; the logits rank them
    logits = torch.tensor([[30.0], [40.0], [50.0], [-1.0]])
    y = torch.tensor([0, 1, 1, 0])
    assert torch.sigmoid(logits[:3]).unique().tolist() == [1.0]
    assert classification_metrics(logits, y, 2)["auc"] == 1.0
    assert roc_auc_score(y.numpy(), torch.sigmoid(logits[:, 0]).numpy()) == 0.75


def test_single_client_wrapper_equals_the_batched_row():
    logits, y, lengths = _batch(3, 3, ties=True, seed=5)
    rows = classification_metrics_batched(logits, y, lengths, 3)
    for i, row in enumerate(rows):
        k = int(lengths[i])
        single = classification_metrics(logits[i, :k], y[i, :k], 3)
        assert list(single) == ["acc", "bal_acc", "auc"]
        assert _close(single, row), i


def test_a_non_finite_logit_gives_nan_auc_for_that_client_only():
    logits, y, lengths = _batch(1, 2, ties=False, seed=2)
    logits[5, 3, 0] = math.nan
    rows = classification_metrics_batched(logits, y, lengths, 2)
    assert math.isnan(rows[5]["auc"])
    assert math.isfinite(rows[10]["auc"])


@pytest.mark.parametrize("c,num_classes", [(1, 3), (2, 3), (4, 3)])
def test_logits_that_do_not_match_the_classes_are_refused(c, num_classes):
    with pytest.raises(ValueError, match=f"got {c} logits per sample for num_classes=3"):
        classification_metrics_batched(
            torch.zeros(2, 4, c), torch.zeros(2, 4, dtype=torch.int64), torch.tensor([4, 2]), 3
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c,num_classes", [(1, 2), (3, 3)])
def test_evaluate_batch_is_evaluate_plus_the_loss_of_the_unpadded_client(c, num_classes, device):
    task = ClassificationTask(num_classes)
    logits, y, lengths = _batch(c, num_classes, ties=False, seed=7)
    rows = task.evaluate_batch(logits.to(device), y.to(device), lengths.to(device))
    for i, row in enumerate(rows):
        k = int(lengths[i])
        assert list(row) == ["acc", "bal_acc", "auc", "loss"]
        want = task.evaluate(logits[i, :k], y[i, :k])
        assert _close({key: row[key] for key in want}, want), i
        loss = float(task.loss(logits[i, :k], y[i, :k]))
        if k == 0:
            assert math.isnan(row["loss"]) and math.isnan(loss)
        else:
            assert row["loss"] == pytest.approx(loss, rel=1e-6, abs=1e-6), i
            assert math.isfinite(row["loss"])  # the garbage padding never leaks in


def test_evaluate_batch_keeps_gradients_out():
    logits = torch.randn(2, 5, 3, requires_grad=True)
    rows = ClassificationTask(3).evaluate_batch(
        logits, torch.randint(0, 3, (2, 5)), torch.tensor([5, 3])
    )
    assert all(isinstance(v, float) for row in rows for v in row.values())


def test_the_metrics_module_does_not_import_sklearn():
    code = "import sys, fedexp.metrics; sys.exit('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
