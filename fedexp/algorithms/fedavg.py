"""FedAvg (McMahan et al., 2017), in the server-optimiser form of Reddi et al. (2021).

Client n runs E local steps (the run's ``optimizer``, plain SGD by default; a momentum or
Adam state persists in the client's state) from the global model x and returns the difference
Δ_n = x − θ_n^E; the server applies x ← x − η_s Σ_n ω_n Δ_n. With η_s = 1 this is plain
FedAvg (the weighted average of the client models); with one client, full batches and E = 1
it is gradient descent with step η_l. The server's step is the run's ``server_optimizer``
(:mod:`fedexp.engine.solver.server_optim`): FedAvg's by default, FedAdagrad, FedAdam or FedYogi.
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
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.server_optim import server_optimizer_of
from fedexp.engine.solver.steps import unstack_states

#: η_s, the server step on the averaged model difference (every FedAvg-style server's).
ServerLr = Annotated[float, Range(gt=0, note="1: plain averaging")]


class FedAvg(Algorithm):
    """FedAvg.

    Args:
        server_lr: server step η_s on the averaged model difference.
        weighting: "samples" (ω_n ∝ n_train) or "uniform".
    """

    server_reads = "mean"  # the server step reads Σ ω_n u_n only (central DP noises it)
    #: the server moves a global model by the mean upload through ``ctx.server_optimizer``
    #: (``server_optimizer=adam`` etc. are refused for methods without this)
    server_optimized = True

    def __init__(self, server_lr: ServerLr = 1.0, weighting: str = "samples") -> None:
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting={weighting!r}: expected 'samples' or 'uniform'")
        self.server_lr = server_lr
        self.weighting = weighting

    def objective(self, ctx: Context, anchor: torch.Tensor) -> Objective:
        """The local objective around the received model (FedAvg: the task loss)."""
        return ctx.model_objective()

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """E local steps of the run's optimiser (its state kept); send Δ = x − θ^E."""
        assert isinstance(model_in, torch.Tensor)
        opt = ctx.optimizer
        local = ctx.train(
            model_in,
            cohort,
            objective=self.objective(ctx, model_in.detach()),
            opt_states=opt.load(states),
        )
        new_states = unstack_states(states, opt, local.opt_state)
        return CohortResult(model_in - local.params, new_states, {"train_loss": local.loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """X ← x − η_s Σ ω_n Δ_n (the run's ``server_optimizer``: FedAdam, ... on that mean)."""
        if not updates:
            return server
        mean = weighted_mean(updates, weights)
        return server_optimizer_of(ctx).step(ctx, server, "x", mean, self.server_lr)
