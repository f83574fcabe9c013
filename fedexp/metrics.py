"""Metrics per client and across clients (MATH §10).

Classification: accuracy (the paper's), balanced accuracy and AUC (which matter under label
imbalance). Across clients: the test-sample-weighted mean (the paper's), the unweighted mean,
the worst client and the standard deviation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from sklearn.metrics import balanced_accuracy_score, roc_auc_score

#: Metrics whose worst client is the one with the largest value.
LOWER_IS_BETTER = frozenset({"loss"})


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Class probabilities (n, C) from logits; one logit means a binary sigmoid model."""
    if logits.shape[-1] == 1:
        p1 = torch.sigmoid(logits[:, 0])
        return torch.stack([1 - p1, p1], dim=1)
    return torch.softmax(logits, dim=-1)


def classification_metrics(
    logits: torch.Tensor, y: torch.Tensor, num_classes: int
) -> dict[str, float]:
    """Accuracy, balanced accuracy and (one-vs-rest) AUC of one client's test split.

    AUC is NaN when the client's test split holds a single class.
    """
    prob = probabilities(logits.detach().float()).cpu().numpy()
    y_np = y.cpu().numpy()
    pred = prob.argmax(axis=1)
    out = {
        "acc": float((pred == y_np).mean()),
        "bal_acc": float(balanced_accuracy_score(y_np, pred)),
    }
    present = np.unique(y_np)
    if len(present) < 2:
        out["auc"] = math.nan
    elif num_classes == 2:
        out["auc"] = float(roc_auc_score(y_np, prob[:, 1]))
    else:
        sub = prob[:, present] / prob[:, present].sum(axis=1, keepdims=True)
        out["auc"] = float(
            roc_auc_score(
                y_np, sub if len(present) > 2 else sub[:, 1], multi_class="ovr", labels=present
            )
        )
    return out


def aggregate(
    per_client: Sequence[Mapping[str, float]], weights: Sequence[float]
) -> dict[str, float]:
    """Across clients: ``<m>/weighted`` (by test samples), ``/mean``, ``/worst``, ``/std``.

    NaN client values (e.g. AUC of a one-class test split) are left out of that metric.
    """
    out: dict[str, float] = {}
    w_all = np.asarray(weights, dtype=np.float64)
    for key in per_client[0]:
        v = np.asarray([m[key] for m in per_client], dtype=np.float64)
        ok = np.isfinite(v)
        if not ok.any():
            continue
        v, w = v[ok], w_all[ok]
        out[f"{key}/weighted"] = float((v * w).sum() / w.sum())
        out[f"{key}/mean"] = float(v.mean())
        out[f"{key}/worst"] = float(v.max() if key in LOWER_IS_BETTER else v.min())
        out[f"{key}/std"] = float(v.std())
    return out
