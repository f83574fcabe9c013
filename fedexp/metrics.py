"""Metrics per client and across clients.

Classification: accuracy (the paper's), balanced accuracy and AUC (which matter under label
imbalance). Segmentation: IoU (mean over classes, background included, the paper's "IoU"),
label IoU (the foreground's), Dice and pixel accuracy, all pooled over the client's test pixels.
Across clients: the test-sample-weighted mean (the paper's), the unweighted mean, the worst
client, the standard deviation and the tail: the 10th, 50th and 90th percentiles of the
clients' values (pfl-research's per-user quantiles).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

#: Metrics whose worst client is the one with the largest value.
LOWER_IS_BETTER = frozenset({"loss"})


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Class probabilities (n, C) from logits; one logit means a binary sigmoid model."""
    if logits.shape[-1] == 1:
        p1 = torch.sigmoid(logits[:, 0])
        return torch.stack([1 - p1, p1], dim=1)
    return torch.softmax(logits, dim=-1)


#: Columns of :func:`classification_table`, the keys of :func:`classification_metrics`.
CLASSIFICATION_METRICS = ("acc", "bal_acc", "auc")


def _score_dtype(device: torch.device) -> torch.dtype:
    """Ranking precision: float64 (no false ties), float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def _rank_auc(scores: torch.Tensor, positive: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One-vs-rest AUC per (client, class) by the Mann-Whitney rank formula.

    ``AUC = (R_+ - n_+(n_+ + 1)/2) / (n_+ n_-)`` with ``R_+`` the sum of the positives'
    1-based ranks among the client's valid samples, ties getting their average rank
    ``(left + right + 1) / 2`` (``left``/``right``: how many valid scores are < / <= it); this
    is ``roc_auc_score``'s trapezoidal area, a tie counting one half.

    Args:
        scores: (m, K, n) scores of class k for client i's samples (float).
        positive: (m, K, n) bool, sample of class k.
        valid: (m, n) bool, the client's real (not padding) samples.

    Returns:
        (m, K) AUCs; NaN where class k has no positive or no negative sample, or where one of
        the client's valid scores is not finite.
    """
    v = valid[:, None, :]
    # padding sorts last (+inf is above every finite score) and is never counted
    s = torch.where(v, scores, math.inf).contiguous()
    ordered = torch.sort(s, dim=-1).values
    left = torch.searchsorted(ordered, s, side="left")
    right = torch.searchsorted(ordered, s, side="right")
    rank = (left + right + 1).to(scores.dtype) / 2
    pos = positive & v
    n_pos = pos.sum(-1).to(scores.dtype)
    n_neg = v.sum(-1).to(scores.dtype) - n_pos
    r_pos = torch.where(pos, rank, 0.0).sum(-1)
    auc = (r_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
    finite = (torch.isfinite(scores) | ~v).all(-1)
    return torch.where(finite, auc, math.nan)


def classification_table(
    logits: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor, num_classes: int
) -> torch.Tensor:
    """Accuracy, balanced accuracy and AUC of many clients' test splits at once.

    Client i's samples are the first ``lengths[i]`` rows of ``logits[i]`` and ``y[i]``; the
    rest is padding, whatever it holds, and is ignored. Everything is computed in torch on the
    logits' device, vectorised over clients (no loop, no host transfer):

    - ``acc``: the fraction of samples whose argmax class (of the probabilities, i.e. of the
      logits; a one-logit model predicts class 1 when its logit is > 0) is the label.
    - ``bal_acc``: scikit-learn's ``balanced_accuracy_score``: the mean recall over the
      classes present in the client's labels (a class that is only predicted is left out).
    - ``auc``: NaN when fewer than two classes are present; for ``num_classes == 2``,
      ``roc_auc_score(y, prob[:, 1])``; otherwise the probabilities renormalised over the
      present classes and the macro mean of their one-vs-rest AUCs (with exactly two present
      classes, the binary AUC of the larger label, as ``roc_auc_score`` does). The ranking
      scores are monotone transforms of those probabilities taken from the logits in float64
      (the logit, the logit difference, or ``z_k - logsumexp`` over the present classes), so
      saturated probabilities never make false ties. Non-finite logits give NaN AUC.

    A client with no sample gets NaN for every metric.

    Args:
        logits: (m, n, C) logits; C = 1 is a binary sigmoid model (``num_classes == 2``),
            otherwise C = ``num_classes``.
        y: (m, n) integer labels in [0, num_classes) (padding: anything).
        lengths: (m,) int64 number of valid samples of each client (<= n).
        num_classes: the data set's number of classes.

    Returns:
        (m, 3) float tensor on the logits' device, columns :data:`CLASSIFICATION_METRICS`.

    Raises:
        ValueError: the shapes disagree, or C is neither ``num_classes`` nor 1 for two classes.
    """
    if logits.dim() != 3 or y.shape != logits.shape[:2] or lengths.shape != logits.shape[:1]:
        raise ValueError(
            f"classification metrics need logits (m, n, C), y (m, n), lengths (m,); got "
            f"{tuple(logits.shape)}, {tuple(y.shape)}, {tuple(lengths.shape)}"
        )
    m, n, c = logits.shape
    if not (c == num_classes or (c == 1 and num_classes == 2)):
        raise ValueError(
            f"classification metrics got {c} logits per sample for num_classes={num_classes}; "
            f"expected {num_classes}" + (" or 1" if num_classes == 2 else "")
        )
    dev = logits.device
    dt = _score_dtype(dev)
    with torch.no_grad():
        z = logits.detach().to(dt)
        valid = torch.arange(n, device=dev) < lengths.to(dev)[:, None]
        labels = torch.where(valid, y.to(dev).long(), 0)  # padding's label: anything valid
        weight = valid.to(dt)
        counts = torch.zeros(m, num_classes, dtype=dt, device=dev).scatter_add_(1, labels, weight)
        present = counts > 0
        n_present = present.sum(1)
        pred = (z[..., 0] > 0).long() if c == 1 else z.argmax(-1)
        correct = (pred == labels).to(dt) * weight
        acc = correct.sum(1) / weight.sum(1)  # 0/0 = NaN for an empty client
        hits = torch.zeros_like(counts).scatter_add_(1, labels, correct)
        recall = torch.where(present, hits / counts.clamp(min=1), 0.0)
        bal_acc = recall.sum(1) / n_present.to(dt)

        if num_classes == 2:
            score = z[..., 0] if c == 1 else z[..., 1] - z[..., 0]  # monotone in prob[:, 1]
            auc = _rank_auc(score[:, None, :], (labels == 1)[:, None, :], valid)[:, 0]
        else:
            # log of the probabilities renormalised over the present classes
            masked = torch.where(present[:, None, :], z, -math.inf)
            log_sub = z - torch.logsumexp(masked, dim=-1, keepdim=True)
            classes = torch.arange(num_classes, device=dev)
            positive = labels[:, None, :] == classes[None, :, None]
            per_class = _rank_auc(log_sub.transpose(1, 2), positive, valid)  # (m, K)
            # two present classes: roc_auc_score's binary AUC of the larger label
            last = (present * (classes + 1)).amax(1) - 1
            only_last = classes[None, :] == last[:, None]
            use = torch.where((n_present == 2)[:, None], only_last, present)
            picked = torch.where(use, per_class, 0.0)
            auc = picked.sum(1) / use.sum(1).clamp(min=1).to(dt)
        auc = torch.where(n_present >= 2, auc, math.nan)
        return torch.stack([acc, bal_acc, auc], dim=1)


def _rows(table: torch.Tensor, keys: Sequence[str]) -> list[dict[str, float]]:
    """One dict per row of a (m, len(keys)) tensor, after one transfer to the host."""
    return [dict(zip(keys, row, strict=True)) for row in table.cpu().tolist()]


def classification_metrics_batched(
    logits: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor, num_classes: int
) -> list[dict[str, float]]:
    """``acc``, ``bal_acc`` and ``auc`` of each client of a padded batch.

    The figures of :func:`classification_table` (its docstring gives their definitions), as
    one dict per client after a single transfer of the (m, 3) result.

    Args:
        logits: (m, n, C) logits, client i's valid rows first.
        y: (m, n) labels.
        lengths: (m,) int64 valid rows per client.
        num_classes: the data set's number of classes.

    Returns:
        One ``{"acc", "bal_acc", "auc"}`` per client, in order.
    """
    return _rows(classification_table(logits, y, lengths, num_classes), CLASSIFICATION_METRICS)


def classification_metrics(
    logits: torch.Tensor, y: torch.Tensor, num_classes: int
) -> dict[str, float]:
    """Accuracy, balanced accuracy and (one-vs-rest) AUC of one client's test split.

    The batched computation (:func:`classification_metrics_batched`) for one client, so the
    single and the batched paths are the same code. AUC is NaN when the client's test split
    holds a single class.

    Args:
        logits: (n, C) logits.
        y: (n,) labels.
        num_classes: the data set's number of classes.
    """
    lengths = torch.full((1,), y.shape[0], dtype=torch.int64, device=logits.device)
    return classification_metrics_batched(logits[None], y[None], lengths, num_classes)[0]


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
    """IoU_c = TP / (TP + FP + FN) per class from a confusion matrix.

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


def nanmean(v: torch.Tensor) -> float:
    """The mean of the entries that are not NaN (NaN when every entry is)."""
    ok = ~torch.isnan(v)
    return float(v[ok].mean()) if bool(ok.any()) else math.nan


def segmentation_metrics(
    logits: torch.Tensor, target: torch.Tensor, num_classes: int
) -> dict[str, float]:
    """IoU, label IoU, Dice and pixel accuracy of one client's test split.

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
        "iou": nanmean(iou),
        "label_iou": nanmean(iou[1:]),
        "dice": nanmean(dice_per_class(cm)[1:]),
        "acc": float(cm.diag().sum()) / max(int(cm.sum()), 1),
    }


#: The per-client quantiles :func:`aggregate` reports: ``<m>/p10``, ``/p50``, ``/p90``.
QUANTILES = {"p10": 0.1, "p50": 0.5, "p90": 0.9}
#: Prefix of the per-client gains of personalisation (``gain/acc = acc − global/acc``);
#: :func:`aggregate` adds their ``/hurt``, the share of clients with a negative gain.
#: A gain within this of 0 is no harm: the same model scored by a vmapped and a plain pass
#: (or on 1 or 2 processes) differs in a loss by float rounding (~1e-8), whose sign is noise.
HURT_TOL = 1e-6
GAIN = "gain/"


def lower_is_better(key: str) -> bool:
    """Whether a metric's worst client is its largest value (``loss``, ``global/loss``...).

    A gain (``gain/...``) is oriented so that larger is better, whatever its metric.
    """
    return not key.startswith(GAIN) and key.rsplit("/", 1)[-1] in LOWER_IS_BETTER


def aggregate(
    per_client: Sequence[Mapping[str, float]],
    weights: Sequence[float],
    keys: Sequence[str] | None = None,
) -> dict[str, float]:
    """Across clients: ``<m>/weighted``, ``/mean``, ``/worst``, ``/std``, ``/p10``...

    ``/weighted`` is weighted by test samples; the tail ``/p10``, ``/p50``, ``/p90`` are
    :data:`QUANTILES`.
    The quantiles are numpy's (``np.quantile``, linear interpolation between the order
    statistics), of the clients' values whatever the metric's direction: a loss's ``p90`` is
    its bad tail, an accuracy's ``p10``. A gain of personalisation (``gain/<m>``, see
    :data:`GAIN`) also gets ``/hurt``: the share of clients whose gain is negative.

    NaN client values (e.g. AUC of a one-class test split) are left out of that metric, as
    is a client that lacks the key (a held-out client has no personal metrics).
    ``keys``: the metrics to aggregate (default: every key of the first client's).
    """
    out: dict[str, float] = {}
    w_all = np.asarray(weights, dtype=np.float64)
    levels = list(QUANTILES.values())
    for key in per_client[0] if keys is None else keys:
        v = np.asarray([m.get(key, math.nan) for m in per_client], dtype=np.float64)
        ok = np.isfinite(v)
        if not ok.any():
            continue
        v, w = v[ok], w_all[ok]
        out[f"{key}/weighted"] = float((v * w).sum() / w.sum())
        out[f"{key}/mean"] = float(v.mean())
        out[f"{key}/worst"] = float(v.max() if lower_is_better(key) else v.min())
        out[f"{key}/std"] = float(v.std())
        for name, q in zip(QUANTILES, np.quantile(v, levels), strict=True):
            out[f"{key}/{name}"] = float(q)
        if key.startswith(GAIN):
            out[f"{key}/hurt"] = float((v < -HURT_TOL).mean())
    return out
