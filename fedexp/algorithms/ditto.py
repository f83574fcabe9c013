"""Ditto (Li, Hu, Beirami, Smith, ICML 2021): FedAvg plus a personal model pulled to it.

Client n keeps a personal model v_n. Each round it (1) runs FedAvg's E local steps on the
received global model w and sends the model difference, and (2) takes ``personal_steps``
steps on its personal objective f_n(v) + (λ/2)‖v − w‖² (Ditto, Algorithm 1), the pull anchored
on the w it received. The server is FedAvg's. Clients are evaluated with v_n.

λ = 0 makes v_n plain local training; the global model never depends on the v_n, so it follows
FedAvg exactly (both tested).
"""

from __future__ import annotations

from typing import Annotated

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states


class Ditto(FedAvg):
    """Ditto.

    Args:
        lam: λ ≥ 0, strength of the pull of the personal model towards the global one.
        personal_steps: local steps on the personal objective per round (None: the run's
            local steps / epochs).
        server_lr: as FedAvg.
        weighting: as FedAvg.
    """

    def __init__(
        self,
        lam: Annotated[float, Range(ge=0, note="0: v_n trains alone")] = 0.1,
        personal_steps: PositiveInt | None = None,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        super().__init__(server_lr, weighting)
        self.lam, self.personal_steps = lam, personal_steps

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """The personal model starts at the common initial model."""
        return {"v": x0.clone()}

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """Global part as FedAvg, then the personal steps pulled towards the received w.

        E local steps from w, sending Δ = w − θ^E; then ``personal_steps`` steps from v_n on
        f_n(v) + (λ/2)‖v − w‖².
        """
        assert isinstance(model_in, torch.Tensor)
        result = super().client_update(ctx, model_in, states, cohort)
        opt = ctx.optimizer
        personal = ctx.train(
            states.stack("v"),
            cohort,
            objective=ctx.proximal_objective(model_in.detach(), self.lam),
            opt_states=opt.load(states, "opt_v"),
            steps=self.personal_steps,
        )
        new_states = unstack_states(
            result.states, opt, personal.opt_state, "opt_v", v=personal.params
        )
        metrics = {**result.metrics, "personal_loss": personal.loss}
        return CohortResult(result.updates, new_states, metrics)

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Every client's personal model v_n, at once."""
        return states.stack("v")
