"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021): shared representation, local heads.

"Exploiting Shared Representations for Personalized Federated Learning", Algorithm 1: client
n receives the body (representation) φ, then

1. τ_h steps on its own head h_n (kept from its last round) with the body frozen at φ;
2. τ_φ steps on the body with the new head frozen, giving φ_n;

and the server averages the bodies. As :class:`FedPer` (whose split, messages and server step
it reuses), the client sends Δ_n = φ − φ_n and the server steps φ ← φ − η_s Σ_n ω_n Δ_n; only
the body crosses the network. τ_h = 0 makes the body follow FedAvg run with the head frozen at
the initial model (tested).

Paper and authors' code (github.com/lgcollins/FedRep): 10 local epochs of the head and 1 of the
body (``--local_ep 11 --local_rep_ep 1``; their FedAvg runs 1 local epoch), bodies averaged
with sample weights. Here the head phase is ``head_ratio`` (10) times the body's. Differences:
the authors use one SGD (momentum 0.5, weight decay 1e-4) created afresh every round; here the
run's optimiser is used with one persistent state per phase (``opt_head.*``, ``opt_body.*``).
BatchNorm running statistics (if any) follow every training forward pass, the head phase's
included, as in PyTorch, where a frozen layer in training mode still updates them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.fedavg import ServerLr
from fedexp.algorithms.fedper import FedPer
from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import Range
from fedexp.data.client import ClientData
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states


class FedRep(FedPer):
    """FedRep. Persists: each client's ``head`` and optimiser states ``opt_head.*``, ``opt_body.*``.

    The body phase defaults to the run's local work E (``local_steps``, or ``local_epochs``
    passes: what FedAvg does in a round) and the head phase to ``head_ratio`` times it, so the
    paper's 10 head epochs and 1 body epoch are ``local_epochs=1`` with the default ratio.

    Args:
        head_steps: τ_h, head steps with the body frozen (None: ceil(head_ratio · E); 0: no
            head phase).
        body_steps: τ_φ, body steps with the head frozen (None: E).
        head_ratio: τ_h / E when ``head_steps`` is None (the paper: 10).
        head: glob patterns of the head, as :class:`FedPer` (None: the model's ``personal``).
        server_lr: server step on the averaged body difference.
        weighting: "samples" (ω_n ∝ n_train, the authors' code) or "uniform" (Algorithm 1).
    """

    def __init__(
        self,
        head_steps: Annotated[int, Range(ge=0, note="0: no head phase")] | None = None,
        body_steps: Annotated[int, Range(ge=0, note="0: no body phase")] | None = None,
        head_ratio: NonNegative = 10.0,
        head: Sequence[str] | None = None,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        super().__init__(head, server_lr, weighting)
        self.head_steps, self.body_steps, self.head_ratio = head_steps, body_steps, head_ratio

    def phase_steps(self, ctx: Context, data: ClientData) -> tuple[int, int]:
        """(τ_h, τ_φ) of this client this round (a function of ``ctx.steps_for(data)``)."""
        local = ctx.steps_for(data)
        body = local if self.body_steps is None else self.body_steps
        if self.head_steps is not None:
            return self.head_steps, body
        return math.ceil(round(self.head_ratio * local, 9)), body

    def phase_mask(self, ctx: Context, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """0/1 mask of the coordinates a phase moves: ``idx`` and the running statistics."""
        mask = torch.zeros_like(like)
        mask[idx] = 1.0
        if ctx.model.has_buffers:
            mask[ctx.model.buffer_mask] = 1.0
        return mask

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """τ_h head steps (body frozen), τ_φ body steps (head frozen); send Δ of the body.

        The phase lengths depend on the step count only, which a cohort's clients share.
        """
        assert isinstance(model_in, torch.Tensor)
        opt, body, head = ctx.optimizer, self.body_idx(ctx), self.personal_idx(ctx)
        theta = self.assemble(ctx, model_in, states.stack("head"))
        new_states, metrics = states, {}
        head_steps, body_steps = self.phase_steps(ctx, cohort.data[0])
        for name, idx, steps in (("head", head, head_steps), ("body", body, body_steps)):
            if steps == 0:
                continue
            local = ctx.train(
                theta,
                cohort,
                objective=ctx.model_objective(),
                opt_states=opt.load(states, f"opt_{name}"),
                steps=steps,
                mask=self.phase_mask(ctx, idx, theta[0]),
            )
            theta = local.params
            new_states = unstack_states(new_states, opt, local.opt_state, f"opt_{name}")
            metrics[f"{name}_loss"] = local.loss
            metrics["train_loss"] = local.loss
        new_states = unstack_states(new_states, opt, {}, head=theta[:, head])
        return CohortResult(model_in - theta[:, body], new_states, metrics)
