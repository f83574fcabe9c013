"""FedDyn (Acar et al., *Federated Learning Based on Dynamic Regularization*, ICLR 2021).

Client n keeps ∇L̃_n (0 at first), the gradient its dynamic regulariser has accumulated. A
sampled client receives x and minimises, from θ = x with the run's optimiser,

    L_n(θ) − ⟨∇L̃_n, θ⟩ + (α/2)‖θ − x‖²

(the task loss with FedProx's proximal term and the linear term −∇L̃_n: ``Objective.linear``),
then sets ∇L̃_n ← ∇L̃_n − α(θ_n − x) and uploads Δ_n = x − θ_n. The server keeps h (0 at
first):

    h ← h − (α/N) Σ_{n∈S} (θ_n − x)       x ← (1/|S|) Σ_{n∈S} θ_n − h/α

Algorithm 1 of the paper. Over the uploads: Σ_S (θ_n − x) = −|S|·mean Δ, so the server reads
only the mean (``ctx.senders`` gives |S| in every slicing and over ranks). ``weighting="samples"``
replaces the plain means by the ω_n-weighted ones and |S|/N by the senders' share of the
samples (``Senders.share``), the same rule for weighted clients. The evaluated model is x (the
paper's server model); the authors' code also reports the plain average of the client models.
"""

from __future__ import annotations

from typing import Annotated

import torch

from fedexp.algorithms.base import Algorithm
from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.base import Updates
from fedexp.algorithms.base import Weights
from fedexp.algorithms.base import weighted_mean
from fedexp.config.ranges import Range
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states


class FedDyn(Algorithm):
    """FedDyn.

    Args:
        alpha: α > 0, the dynamic regulariser's strength (the paper's grid: 0.1, 0.01, 0.001;
            0.01 its CIFAR default).
        weighting: "uniform" (the paper's plain means) or "samples".
    """

    server_reads = "mean"  # the server reads Σ ω_n Δ_n only

    def __init__(
        self, alpha: Annotated[float, Range(gt=0)] = 0.01, weighting: str = "uniform"
    ) -> None:
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting={weighting!r}: expected 'samples' or 'uniform'")
        self.alpha = alpha
        self.weighting = weighting

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """The model x = x0 and h = 0."""
        return {"x": x0.clone(), "h": torch.zeros_like(x0)}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """∇L̃_n = 0."""
        return {"grad": torch.zeros_like(x0)}

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """Minimise L_n − ⟨∇L̃_n, θ⟩ + (α/2)‖θ − x‖² from x; ∇L̃_n ← ∇L̃_n − α(θ_n − x)."""
        assert isinstance(model_in, torch.Tensor)
        x = model_in
        grad = states.stack("grad").to(x)
        opt = ctx.optimizer
        objective = ctx.proximal_objective(x.detach(), self.alpha).with_linear(-grad)
        local = ctx.train(x, cohort, objective=objective, opt_states=opt.load(states))
        delta = x - local.params
        new_states = unstack_states(states, opt, local.opt_state, grad=grad + self.alpha * delta)
        return CohortResult(delta, new_states, {"train_loss": local.loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """H ← h + α·share·mean Δ, then x ← (x − mean Δ) − h/α (share = |S|/N when uniform)."""
        if not updates:
            return server
        mean = weighted_mean(updates, weights)
        h = server["h"] + self.alpha * ctx.senders.share(self.weighting) * mean
        return {**server, "x": server["x"] - mean - h / self.alpha, "h": h}
