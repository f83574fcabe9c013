"""FedBN (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021): BatchNorm layers stay local.

"FedBN: Federated Learning on Non-IID Features via Local Batch Normalization", Algorithm 1:
FedAvg, except that every BatchNorm layer's affine parameters (γ, β) and running statistics
(mean, variance) are neither sent nor averaged: each client keeps its own, the usual answer
to feature shift between sites (scanners, protocols). Here it is :class:`FedPer` whose personal
part is every ``torch.nn.modules.batchnorm._BatchNorm`` submodule's coordinates of the flat
vector (parameters and float buffers; the integer ``num_batches_tracked`` is not in the vector
and is only read when a layer's momentum is None). A model without BatchNorm gives FedAvg
exactly (tested).

Differences from the authors' code (github.com/med-air/FedBN): it weights clients uniformly
(its sites have equal training sets); here ``weighting`` defaults to the sample weights of
FedAvg, which coincide with uniform ones for equal sites. It recreates plain SGD every round;
here the run's optimiser is used, its state kept per client as in every algorithm.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from fedexp.algorithms.fedavg import ServerLr
from fedexp.algorithms.fedper import FedPer
from fedexp.engine.solver.context import Context


class FedBN(FedPer):
    """FedBN. Persists: each client's BatchNorm parameters and statistics (``head``), ``opt.*``.

    Args:
        server_lr: server step on the averaged difference of the non-BatchNorm coordinates.
        weighting: "samples" (ω_n ∝ n_train) or "uniform" (the authors' code).
    """

    def __init__(self, server_lr: ServerLr = 1.0, weighting: str = "samples") -> None:
        super().__init__(None, server_lr, weighting)

    def personal_idx(self, ctx: Context) -> torch.Tensor:
        """Flat coordinates of every BatchNorm layer: γ, β, running mean and variance."""
        return ctx.model.indices_once(
            ("norms", str(ctx.device)), lambda: ctx.model.module_indices((_BatchNorm,), ctx.device)
        )
