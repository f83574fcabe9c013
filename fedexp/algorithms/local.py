"""Local-only training: every client trains alone and nothing crosses the network.

The lower bound of every personalised-FL table (pFedNet §VI, "Local"): each client keeps its
own model, starting from the common initial model, and is evaluated with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedexp.algorithms.base import Algorithm
from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.base import Updates
from fedexp.algorithms.base import Weights
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states


class LocalOnly(Algorithm):
    """Local-only training (no communication)."""

    server_reads = "mean"  # the server step reads Σ ω_n u_n only (central DP noises it)

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """The server holds nothing."""
        return {}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """Each client starts from the common initial model."""
        return {"theta": x0.clone()}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> dict[int, None]:
        """Nothing is sent."""
        return dict.fromkeys(clients)

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """E local steps on each client's own model (optimiser state kept); no upload."""
        opt = ctx.optimizer
        theta = states.stack("theta")
        local = ctx.train(theta, cohort, opt_states=opt.load(states))
        new_states = unstack_states(states, opt, local.opt_state, theta=local.params)
        return CohortResult(None, new_states, {"train_loss": local.loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """Nothing to aggregate."""
        return server

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Every client's own model, at once."""
        return states.stack("theta")

    def global_vector(
        self, ctx: Context, server: State, average: Callable[[str], torch.Tensor]
    ) -> torch.Tensor | None:
        """No model is shared: the clients' one-shot average, Σ_n (n_n / n) θ_n.

        What the clients would have if they pooled their local models once (model averaging
        without rounds), the global model local-only's personal ones are judged against.
        """
        return average("theta")

    def newcomer(
        self, ctx: Context, server: State, global_model: torch.Tensor | None, x0: torch.Tensor
    ) -> torch.Tensor | None:
        """A new client trains alone too: from the common initial model."""
        return x0
