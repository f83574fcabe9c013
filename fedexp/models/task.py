"""What a model is trained for: its loss and its per-client evaluation.

The task follows the data set's ``task`` attribute (:data:`TASKS`, :func:`task_for`):
``classification`` (tabular data, LUNA16), ``segmentation`` (BraTS, one region) or
``regions`` (BraTS, the whole tumour, tumour core and enhancing tumour in one run).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from fedexp.data.dataset import ArrayDataset
from fedexp.errors import ConfigError
from fedexp.errors import DataError
from fedexp.metrics import CLASSIFICATION_METRICS
from fedexp.metrics import classification_metrics
from fedexp.metrics import classification_table
from fedexp.metrics import nanmean
from fedexp.metrics import segmentation_metrics

#: The target of a padding row (a short minibatch's place-holder in a cohort's ``[m, B]``
#: batch, :func:`fedexp.engine.solver.steps.draw_batch`), in every target entry of the row:
#: torch's ``ignore_index`` default. A task's :meth:`Task.loss` gives such rows no weight.
PADDING = -100


def valid_rows(y: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows of a batch's targets ``y`` [B, ...] that are not :data:`PADDING`."""
    return y.reshape(y.shape[0], -1)[:, 0] != PADDING


def binary_cross_entropy(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of logits ``z`` and targets ``t`` in [0, 1], per entry.

    ``-t log σ(z) - (1 - t) log(1 - σ(z)) = softplus(-z) + (1 - t) z``: five operations
    forward and seven backward, each batched by :func:`torch.func.vmap` as it is, so that an
    algorithm's vmapped objective and the stacked loss (:meth:`ClassificationTask.loss_stacked`)
    give the same bits. ``F.binary_cross_entropy_with_logits`` is one operation, but vmap
    decomposes it into fifteen forward and twenty backward, which the stacked loss had to
    repeat to give vmap's bits and which dominated a logistic regression's step over a
    cohort's ``[m, B]`` logits. The gradient is ``σ(z) - t`` to float precision; the loss's
    rounding is of the order of an ulp of ``z`` (a loss near 0, where ``σ(z)`` is on the
    target's side, is off by up to about ``|z|·2⁻²⁴`` absolute).
    """
    return F.softplus(-z).add((1 - t.to(z.dtype)).mul(z))


class Task(Protocol):
    """Loss and evaluation of one kind of prediction."""

    num_classes: int

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean training loss of a batch over its rows whose target is not :data:`PADDING`."""
        ...

    def evaluate(self, logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Metrics of one client's test split (the first is the headline figure)."""
        ...


class ClassificationTask:
    """Cross-entropy classification; a one-logit model is binary logistic regression."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (binary cross-entropy with logits for one output).

        The mean over the rows whose label is not :data:`PADDING` (cross-entropy's
        ``ignore_index``).
        """
        if logits.shape[-1] == 1:
            valid = y != PADDING
            per_sample = binary_cross_entropy(logits.squeeze(-1), torch.where(valid, y, 0))
            return torch.where(valid, per_sample, 0.0).sum() / valid.sum()  # none: NaN, as a mean
        return F.cross_entropy(logits, y, ignore_index=PADDING)

    def evaluate(self, logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Accuracy, balanced accuracy and AUC on one client's test split."""
        return classification_metrics(logits, y, self.num_classes)

    def loss_stacked(
        self, logits: torch.Tensor, y: torch.Tensor, full: bool = False
    ) -> torch.Tensor:
        """:meth:`loss` of m clients' minibatches at once: ``[m]`` from ``[m, B, C]`` logits.

        The operations ``vmap(self.loss)`` runs (a mean over each client's rows whose label
        is not :data:`PADDING`), without :func:`torch.func.vmap`'s wrapping. ``full``: no
        label is :data:`PADDING`, and the masks are left out: the same sums divided by the
        same counts, so the same bits, in about ten fewer operations forward and backward.
        """
        if full:
            if logits.shape[-1] == 1:
                # ×1 exactly, for the backward pass: the masked path's ``where`` hands the
                # softplus a gradient of its own, where the sum alone would hand it a
                # broadcast one, which torch's kernel takes element by element (other bits)
                per_sample = binary_cross_entropy(logits.squeeze(-1), y).mul(1.0)
            else:
                logp = torch.log_softmax(logits, dim=-1)
                per_sample = -logp.gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
            return per_sample.sum(-1) / y.shape[-1]
        valid = y != PADDING
        if logits.shape[-1] == 1:
            per_sample = binary_cross_entropy(logits.squeeze(-1), torch.where(valid, y, 0))
        else:  # cross-entropy: -log softmax at the label
            logp = torch.log_softmax(logits, dim=-1)
            picked = logp.gather(-1, torch.where(valid, y, 0).long().unsqueeze(-1)).squeeze(-1)
            per_sample = -picked
        return torch.where(valid, per_sample, 0.0).sum(-1) / valid.sum(-1)

    def loss_batch(
        self,
        logits: torch.Tensor,
        y: torch.Tensor,
        lengths: torch.Tensor,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """:meth:`loss` of every client of a padded batch: [m] (NaN for a client without rows).

        Client i's rows are the first ``lengths[i]`` of ``logits[i]`` (m, n, C) and ``y[i]``
        (m, n); the mean of their per-sample losses is summed in ``dtype`` (default the
        logits').
        """
        m, n, c = logits.shape
        valid = torch.arange(n, device=logits.device) < lengths.to(logits.device)[:, None]
        y = y.to(logits.device)
        if c == 1:
            per_sample = binary_cross_entropy(logits[..., 0], y)
        else:
            labels = torch.where(valid, y.long(), 0)  # padding's label: anything valid
            per_sample = F.cross_entropy(
                logits.reshape(m * n, c), labels.reshape(-1), reduction="none"
            ).view(m, n)
        dtype = dtype or logits.dtype
        total = torch.where(valid, per_sample, 0.0)
        return total.sum(1, dtype=dtype) / valid.sum(1).to(dtype)

    def evaluate_batch(
        self, logits: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor
    ) -> list[dict[str, float]]:
        """:meth:`evaluate` plus ``loss`` for every client of a padded batch.

        Client i's test samples are the first ``lengths[i]`` rows of ``logits[i]`` and
        ``y[i]``; the rest is padding and is ignored. ``loss`` is the mean over those rows of
        this task's per-sample loss, i.e. :meth:`loss` of the unpadded client. All is computed
        on the logits' device and comes to the host in one transfer.

        Args:
            logits: (m, n, C) logits.
            y: (m, n) labels.
            lengths: (m,) int64 valid rows per client.

        Returns:
            One dict per client: the keys of :meth:`evaluate`, then ``loss`` (NaN for a client
            without samples).
        """
        with torch.no_grad():
            table = classification_table(logits, y, lengths, self.num_classes)
            loss = self.loss_batch(logits, y, lengths, table.dtype)
            columns = torch.cat([table, loss[:, None]], dim=1).cpu().T.tolist()
        keys = (*CLASSIFICATION_METRICS, "loss")
        # from columns: no list per client alongside the dicts (100,000 clients: -18 MB)
        return [dict(zip(keys, row, strict=True)) for row in zip(*columns, strict=True)]


class SegmentationTask:
    """Per-pixel segmentation (pFedNet §VI, BraTS2017 with U-Net).

    The loss is MONAI's Dice + cross-entropy (:class:`monai.losses.DiceCELoss`, softmax over
    the C output channels, one-hot targets, background included); evaluation is IoU, label IoU,
    Dice and pixel accuracy pooled over the client's test pixels
    (:func:`fedexp.metrics.segmentation_metrics`; ``docs/imaging.md``).
    """

    def __init__(self, num_classes: int) -> None:
        # imported here: MONAI takes seconds to import and tabular runs never need it
        from monai.losses import DiceLoss

        self.num_classes = num_classes
        # one-hot targets made here by a comparison (MONAI's ``one_hot`` scatters in place,
        # which vmap refuses: the cohort's gradients would go client by client)
        self._dice = DiceLoss(softmax=True, reduction="none")

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Dice + cross-entropy of (n, C, H, W) logits against (n, H, W) class masks.

        What MONAI's :class:`~monai.losses.DiceCELoss` computes (the mean Dice loss over the
        images and channels plus the mean cross-entropy over the pixels), over the images
        whose mask is not :data:`PADDING`: MONAI's :class:`~monai.losses.DiceLoss` per image,
        averaged over those; the cross-entropy with the padding as its ``ignore_index``
        (every image has as many pixels).
        """
        n = y.shape[0]
        valid = (y.reshape(n, -1)[:, 0] != PADDING).to(logits.dtype)
        target = y.long().unsqueeze(1)
        classes = torch.arange(logits.shape[1], device=y.device).view(1, -1, *[1] * (y.dim() - 1))
        onehot = (target.clamp(min=0) == classes).to(logits.dtype)
        dice = self._dice(logits, onehot).reshape(n, -1).mean(1)
        dice = (dice * valid).sum() / valid.sum()
        return dice + F.cross_entropy(logits, target[:, 0], ignore_index=PADDING)

    def evaluate(self, logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """``iou``, ``label_iou``, ``dice``, ``acc`` pooled over the test pixels."""
        return segmentation_metrics(logits, y, self.num_classes)


#: The BraTS evaluation regions a :class:`RegionsTask` names, in its channels' order: whole
#: tumour, tumour core, enhancing tumour (``dice_wt``, ``dice_tc``, ``dice_et``).
REGION_NAMES = ("wt", "tc", "et")


class RegionsTask:
    """Overlapping binary regions, one sigmoid channel each (BraTS's WT, TC, ET in one run).

    The BraTS challenges score three nested regions at once (Menze et al., "The Multimodal
    Brain Tumor Image Segmentation Benchmark (BRATS)", IEEE TMI 2015); a region is not a class
    (a tumour-core pixel is also whole tumour), so each has its own sigmoid channel, as in
    MONAI's BraTS recipe (``ConvertToMultiChannelBasedOnBratsClasses``, ``DiceLoss(sigmoid=
    True)``). The loss is, per channel, MONAI's :class:`~monai.losses.DiceCELoss` with
    ``sigmoid=True`` on that one channel (soft Dice + binary cross-entropy), averaged over the
    channels; evaluation is MONAI's :class:`~monai.metrics.DiceMetric` per region.

    Args:
        num_classes: the number of regions R (channels of the masks and of the model's output).
    """

    #: Regions overlap: no class-prior reweighting (FedRoD) applies.
    exclusive = False

    def __init__(self, num_classes: int) -> None:
        from monai.losses import DiceLoss

        self.num_classes = num_classes
        self.names = (
            REGION_NAMES
            if num_classes == len(REGION_NAMES)
            else tuple(str(c) for c in range(num_classes))
        )
        self._dice = DiceLoss(sigmoid=True, reduction="none")

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Soft Dice + binary cross-entropy of (n, R, H, W) logits against (n, R, H, W) masks.

        The mean over the regions of MONAI's ``DiceCELoss(sigmoid=True)`` on each region's
        channel: the Dice loss per image and region averaged over the images whose mask is not
        :data:`PADDING`, plus the mean binary cross-entropy over their pixels.
        """
        n = y.shape[0]
        valid = (y.reshape(n, -1)[:, 0] != PADDING).to(logits.dtype)
        target = y.clamp(min=0).to(logits.dtype)
        dice = self._dice(logits, target).reshape(n, -1).mean(1)
        dice = (dice * valid).sum() / valid.sum()
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        bce = (bce.reshape(n, -1).mean(1) * valid).sum() / valid.sum()
        return dice + bce

    def evaluate(self, logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """``dice`` (the mean over the regions), ``dice_<region>`` each, and ``acc``.

        Each region's Dice is MONAI's :class:`~monai.metrics.DiceMetric` of the thresholded
        prediction (logit > 0) per test image, averaged over the images whose truth holds that
        region (``ignore_empty``: Dice is undefined on an empty truth, as MONAI's default);
        a client whose test split never holds the region gets NaN for it, left out of the
        across-client aggregates and of the mean. ``acc`` is the pixel accuracy over every
        region's channel.
        """
        from monai.metrics import DiceMetric

        pred = (logits > 0).to(logits.dtype)
        per_image = DiceMetric(include_background=True, reduction="none", ignore_empty=True)(
            pred, y.to(logits.dtype)
        )
        seen = ~torch.isnan(per_image)
        counts = seen.sum(0)
        total = torch.where(seen, per_image, 0.0).sum(0, dtype=torch.float64)
        region = torch.where(counts > 0, total / counts.clamp(min=1), math.nan)
        out = {"dice": nanmean(region)}
        out.update(
            {f"dice_{name}": float(v) for name, v in zip(self.names, region.tolist(), strict=True)}
        )
        out["acc"] = float((pred == y).double().mean())
        return out


#: ``ArrayDataset.task`` -> the task built for it (called with the number of classes).
TASKS: dict[str, Callable[[int], Task]] = {
    "classification": ClassificationTask,
    "segmentation": SegmentationTask,
    "regions": RegionsTask,
}


def task_for(data: ArrayDataset) -> Task:
    """The task of a data set, from its ``task`` attribute.

    Raises:
        DataError: the data set names a task without a class in :data:`TASKS`.
    """
    try:
        cls = TASKS[data.task]
    except KeyError:
        raise DataError(
            f"dataset {data.name!r} has task={data.task!r}; known tasks: {', '.join(TASKS)}"
        ) from None
    return cls(data.num_classes)


def _expected_output(data: ArrayDataset) -> list[tuple[int, ...]]:
    """The per-sample output shapes the data set's task accepts (one logit for two classes)."""
    if data.task == "regions":  # one channel per region, the masks' shape
        return [tuple(data.y.shape[1:])]
    classes = {data.num_classes, 1} if data.num_classes == 2 else {data.num_classes}
    if data.task == "segmentation":
        spatial = tuple(data.y.shape[1:])
        return [(c, *spatial) for c in sorted(classes - {1})]
    return [(c,) for c in sorted(classes)]


def check_model_fits(module: torch.nn.Module, data: ArrayDataset, model: str, dataset: str) -> None:
    """Refuse a model whose output does not fit the data set's task, before round 0.

    The model is run once, in evaluation mode and without gradients, on one all-zero sample
    of the data's input shape; its output per sample must be what the task's loss takes:
    C logits for classification (one for two classes), C × H × W for segmentation of H × W
    masks. ``model=unet`` on a classification set, or ``model=resnet9`` on BraTS, would
    otherwise fail in the middle of the first round with a shape traceback.

    Args:
        module: the built model.
        data: the data set as loaded.
        model: the model's name for the message (``model=unet``).
        dataset: the data set's name for the message.

    Raises:
        ConfigError: one line naming the model, the data set, both shapes and the task.
    """
    sample = tuple(data.x.shape[1:])
    weight = next(module.parameters())
    x = torch.zeros((1, *sample), dtype=weight.dtype, device=weight.device)
    expected = _expected_output(data)
    said = " or ".join(str(list(s)) for s in expected)
    where = f"model={model} on dataset={dataset} ({data.task}, samples {list(sample)})"
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(x)
    except (RuntimeError, ValueError, IndexError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"{where}: the model cannot take these samples ({first}); expected a model whose "
            f"output per sample is {said}"
        ) from None
    finally:
        module.train(training)
    got = tuple(out.shape[1:]) if isinstance(out, torch.Tensor) else None
    if got not in expected:
        raise ConfigError(
            f"{where}: the model's output per sample is {list(got or ())}, the task needs "
            f"{said}; choose a {data.task} model"
        )
