"""BatchNorm in training mode as a pure function: batch statistics of the valid rows alone.

PyTorch's BatchNorm (Ioffe & Szegedy, "Batch Normalization", ICML 2015) normalises a training
batch by its mean and biased variance over the batch and spatial axes, and updates its running
statistics in place: r ← (1 − f)·r + f·s, with the unbiased variance and f the momentum (or
1 / (batches tracked + 1) when the momentum is None). Two things the cohort's solver needs are
not in that kernel:

* under :func:`torch.func.vmap` (one row per client) the in-place update of a buffer copy is
  lost: the gradients are right, the running statistics come back unchanged;
* a short minibatch in a cohort is padded (:data:`fedexp.models.task.PADDING`), and the
  padding rows must not enter the batch statistics.

:func:`functional_norms` swaps the training forward of every tracked BatchNorm of a module for
one that takes the statistics over the valid rows and records them, and :func:`updated`
computes the new running statistics from them. With every row valid the output equals
PyTorch's up to rounding (``tests/test_norms.py``). FedBN (Li et al., "FedBN: Federated
Learning on Non-IID Features via Local Batch Normalization", ICLR 2021) keeps these
statistics per client.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def tracked_norms(module: nn.Module) -> dict[str, _BatchNorm]:
    """The BatchNorm submodules that keep running statistics, by name."""
    return {
        name: m
        for name, m in module.named_modules()
        if isinstance(m, _BatchNorm) and m.track_running_stats and name
    }


def _norm_forward(
    m: _BatchNorm,
    original,  # noqa: ANN001 - the module's bound forward
    name: str,
    rows: torch.Tensor | None,
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]],
):  # noqa: ANN202
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not m.training:
            return original(x)
        dims = [0, *range(2, x.dim())]
        shape = (1, -1, *[1] * (x.dim() - 2))
        per_row = math.prod(x.shape[2:])
        if rows is None:
            weight = torch.ones((), dtype=x.dtype, device=x.device)
            count = torch.full((), float(x.shape[0] * per_row), dtype=x.dtype, device=x.device)
        else:
            weight = rows.to(x.dtype).view(-1, *[1] * (x.dim() - 1))
            count = rows.to(x.dtype).sum() * per_row
        mean = (x * weight).sum(dims) / count
        centred = x - mean.view(shape)
        var = (centred.square() * weight).sum(dims) / count
        out = centred * torch.rsqrt(var + m.eps).view(shape)
        if m.affine:
            out = out * m.weight.view(shape) + m.bias.view(shape)
        stats[name] = (mean, var * count / (count - 1).clamp(min=1))
        return out

    return forward


@contextmanager
def functional_norms(
    norms: dict[str, _BatchNorm], rows: torch.Tensor | None
) -> Iterator[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The norms' training forwards on the valid ``rows`` (a [B] bool mask; None: all).

    Yields the dict that each norm's forward fills with its (batch mean, unbiased variance);
    the modules' own forwards come back on exit.
    """
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    saved = {}
    for name, m in norms.items():
        saved[name] = m.__dict__.get("forward")
        m.forward = _norm_forward(m, m.forward, name, rows, stats)
    try:
        yield stats
    finally:
        for name, m in norms.items():
            if saved[name] is None:
                del m.forward
            else:
                m.forward = saved[name]


def momentum(m: _BatchNorm) -> float:
    """The factor f of the running update, as PyTorch's.

    The momentum, or the cumulative average's 1 / (batches tracked + 1) when it is None.
    """
    if m.momentum is not None:
        return float(m.momentum)
    tracked = m.num_batches_tracked
    return 1.0 / (float(tracked) + 1.0) if tracked is not None else 0.0


def updated(old: torch.Tensor, stat: torch.Tensor, factor: float) -> torch.Tensor:
    """(1 − f)·r + f·s: a running statistic after one batch."""
    return old * (1.0 - factor) + stat * factor
