"""Metrics per client and across clients (MATH §10).

Classification: accuracy (the paper's), balanced accuracy and AUC (which matter under label
imbalance). Segmentation: IoU (mean over classes, background included, the paper's "IoU"),
label IoU (the foreground's), Dice and pixel accuracy, all pooled over the client's test pixels.
Across clients: the test-sample-weighted mean (the paper's), the unweighted mean, the worst
client and the standard deviation.
"""

from __future__ import annotations

import math
import warnings
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
    with warnings.catch_warnings():  # a one-class test split is fine: recall of that class
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
        out["auc"] = float(
            roc_auc_score(
                y_np, sub if len(present) > 2 else sub[:, 1], multi_class="ovr", labels=present
            )
        )
    return out


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Pixel counts ``M[i, j]`` of true class i predicted as j, pooled over all pixels.

    Args:
        pred: predicted class per pixel, any shape.
        target: true class per pixel, the same shape.
        num_classes: number of classes C.

    Returns:
        int64 tensor (C, C) on ``pred``'s device.
    """
    t, p = target.reshape(-1).long(), pred.reshape(-1).long()
    return torch.bincount(t * num_classes + p, minlength=num_classes**2).view(
        num_classes, num_classes
    )


def iou_per_class(confusion: torch.Tensor) -> torch.Tensor:
    """IoU_c = TP / (TP + FP + FN) per class from a confusion matrix (MATH §10).

    A class absent from both the truth and the prediction has no IoU: NaN.
    """
    cm = confusion.double()
    tp = cm.diag()
    union = cm.sum(0) + cm.sum(1) - tp
    return torch.where(union > 0, tp / union.clamp(min=1), torch.full_like(tp, math.nan))


def dice_per_class(confusion: torch.Tensor) -> torch.Tensor:
    """Dice_c = 2TP / (2TP + FP + FN) per class (NaN for a class absent from both)."""
    cm = confusion.double()
    tp = cm.diag()
    total = cm.sum(0) + cm.sum(1)
    return torch.where(total > 0, 2 * tp / total.clamp(min=1), torch.full_like(tp, math.nan))


def _nanmean(v: torch.Tensor) -> float:
    ok = ~torch.isnan(v)
    return float(v[ok].mean()) if bool(ok.any()) else math.nan


def segmentation_metrics(
    logits: torch.Tensor, target: torch.Tensor, num_classes: int
) -> dict[str, float]:
    """IoU, label IoU, Dice and pixel accuracy of one client's test split (MATH §10).

    Every figure is pooled over all test pixels of the client (one confusion matrix), not
    averaged per image. ``iou`` is the mean of IoU_c over the classes, background included
    (the paper's "IoU"; its authors' code computed acc/(2 - acc), which this is not);
    ``label_iou`` and ``dice`` are the foreground's (mean over the classes 1..C-1 when there
    are several). A class absent from both truth and prediction is left out of the means;
    a client whose test split has no foreground and predicts none gets NaN ``label_iou`` and
    ``dice`` (left out of the across-client aggregates).

    Args:
        logits: (n, C, H, W) class scores.
        target: (n, H, W) true classes.
        num_classes: C ≥ 2.

    Returns:
        ``iou``, ``label_iou``, ``dice``, ``acc``.
    """
    pred = logits.argmax(dim=1)
    cm = confusion_matrix(pred, target, num_classes)
    iou = iou_per_class(cm)
    return {
        "iou": _nanmean(iou),
        "label_iou": _nanmean(iou[1:]),
        "dice": _nanmean(dice_per_class(cm)[1:]),
        "acc": float(cm.diag().sum()) / max(int(cm.sum()), 1),
    }


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
