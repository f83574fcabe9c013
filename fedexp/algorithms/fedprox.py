"""FedProx (Li et al., 2020): FedAvg whose local objective adds (μ/2)‖θ − x‖².

Each local step follows ∇f_n(θ) + μ(θ − x), x the model received this round; the server is
FedAvg's. With μ = 0 it is FedAvg exactly (tested).
"""

from __future__ import annotations

import torch

from fedexp.algorithms.base import ClientResult, State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.data.federated import ClientData
from fedexp.engine.context import Context


class FedProx(FedAvg):
    """FedProx.

    Args:
        mu: proximal strength μ ≥ 0.
        server_lr: server step on the averaged model difference (as FedAvg).
        weighting: "samples" or "uniform" (as FedAvg).
    """

    def __init__(
        self, mu: float = 0.01, server_lr: float = 1.0, weighting: str = "samples"
    ) -> None:
        if mu < 0:
            raise ValueError(f"mu={mu}: expected μ ≥ 0")
        super().__init__(server_lr, weighting)
        self.mu = mu

    def client_update(
        self,
        ctx: Context,
        model_in: torch.Tensor | None,
        state: State,
        data: ClientData,
        generator: torch.Generator,
    ) -> ClientResult:
        """E local steps on f_n(θ) + (μ/2)‖θ − x‖²; send Δ = x − θ^E."""
        assert model_in is not None
        anchor = model_in.detach()
        extra = None if self.mu == 0 else (lambda p: self.mu * (p - anchor))
        theta, loss = ctx.sgd(model_in, data, generator, extra=extra)
        return ClientResult(model_in - theta, state, {"train_loss": loss})
