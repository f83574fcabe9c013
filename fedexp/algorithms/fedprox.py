"""FedProx (Li et al., 2020): FedAvg whose local objective adds (μ/2)‖θ − x‖².

Each local step follows ∇f_n(θ) + μ(θ − x), x the model received this round; the server is
FedAvg's. With μ = 0 it is FedAvg exactly (tested).
"""

from __future__ import annotations

import torch

from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import NonNegative
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Objective


class FedProx(FedAvg):
    """FedProx.

    Args:
        mu: proximal strength μ ≥ 0.
        server_lr: server step on the averaged model difference (as FedAvg).
        weighting: "samples" or "uniform" (as FedAvg).
    """

    def __init__(
        self, mu: NonNegative = 0.01, server_lr: ServerLr = 1.0, weighting: str = "samples"
    ) -> None:
        super().__init__(server_lr, weighting)
        self.mu = mu

    def objective(self, ctx: Context, anchor: torch.Tensor) -> Objective:
        """Task loss + (μ/2)‖θ − x‖² (the task loss alone when μ = 0)."""
        return ctx.proximal_objective(anchor, self.mu)
