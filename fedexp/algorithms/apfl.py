"""APFL (Deng, Kamani, Mahdavi, 2020): "Adaptive Personalized Federated Learning".

arXiv:2003.13461; the authors' code: github.com/MLOPTPSU/FedTorch.

Client n keeps a personal model v_n and a mixing weight α_n ∈ [0, 1]; its personalised model is
v̄_n = α_n v_n + (1 − α_n) w_n. Each local step (Algorithm 1, with the α gradient step of the
adaptive variant) draws one minibatch ξ and updates, all from the previous iterates:

    w ← w − η ∇f_n(w; ξ)
    v ← v − η α ∇f_n(v̄; ξ)                                (∇_v f_n(v̄) = α ∇f_n(v̄))
    α ← clip(α − η_α ⟨v − w, ∇f_n(v̄; ξ)⟩, 0, 1)         (∇_α f_n(v̄))

Here that is one joint vector [w ; v ; α] with the objective f_n(w) + f_n(α v + (1 − α) w̃),
w̃ = w held constant (detached): its gradient is exactly the three rows above, so one
optimiser step on it is the paper's simultaneous update (η_α through ``lr_scale``, the clip
through ``project``). The client starts w at the received global model and sends
Δ = w_in − w^E; the server is FedAvg's (sample-weighted). w never depends on v or α, so the
global model is FedAvg's for every α; with α fixed at 1, v is local-only training (both tested).
Clients are evaluated with v̄ = α v + (1 − α) w, w the current global model (at a
synchronisation every client's w is the global one).

Differences from the paper and the authors' code (MLOPTPSU/FedTorch), on purpose:

* FedTorch mixes the two models' *outputs* (α·v(x) + (1 − α)·w(x)), steps w before v (v̄
  then uses the new w), updates α only at the first local step of a round, with an extra
  0.02·α term in its gradient, and defaults to a fixed α = 0.5. We follow the paper: the
  parameters are mixed, all three blocks step together at every local step, no α penalty.
  (For logistic regression output and parameter mixing coincide.)
* BatchNorm statistics: w's follow w's forward passes (as FedAvg); v's follow the mixture's
  forward passes (the evaluated v̄ takes its statistics from v), since a mixture of running
  statistics is not the statistics of the mixed model.
* The run's optimiser acts on the joint vector (momentum / Adam element-wise, weight decay
  also on α); the paper uses plain SGD.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import Fraction
from fedexp.config.ranges import Range
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Aux
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.steps import unstack_states


class APFL(FedAvg):
    """APFL. Persists per client: ``v`` (personal model), ``alpha`` (1-element) and ``opt.*``.

    ``opt.*`` is the run's optimiser state over the joint vector [w ; v ; α] (length 2d + 1).
    Metrics: ``train_loss`` is the joint objective f(w) + f(v̄); ``alpha`` the clients' α.

    Args:
        alpha: initial mixing weight α_n ∈ [0, 1] (the authors' default 0.5).
        adapt_alpha: update α by gradient descent (the paper's adaptive APFL); False keeps
            it fixed (the paper's APFL with a given α).
        alpha_lr: η_α (None: the run's lr, the paper's single step size η_t).
        server_lr: as FedAvg.
        weighting: as FedAvg.
    """

    def __init__(
        self,
        alpha: Fraction = 0.5,
        adapt_alpha: bool = True,
        alpha_lr: Annotated[float, Range(ge=0, note="0 keeps α fixed")] | None = None,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        super().__init__(server_lr, weighting)
        self.alpha, self.adapt_alpha, self.alpha_lr = alpha, adapt_alpha, alpha_lr

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """The personal model v starts at the common initial model, α at ``alpha``."""
        return {
            "v": x0.clone(),
            "alpha": torch.full((1,), self.alpha, dtype=x0.dtype, device=x0.device),
        }

    # ------------------------------------------------------------------ objective
    def mixture(
        self, ctx: Context, w: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor
    ) -> torch.Tensor:
        """v̄ = α v + (1 − α) w on the parameters; running statistics from v.

        Of one client's vectors or of rows of them (``[m, d]``, ``[m, d]``, ``[m, 1]``).
        """
        mixed = alpha * v + (1 - alpha) * w
        if not ctx.model.has_buffers:
            return mixed
        n = ctx.model.layout.num_params
        return torch.cat([mixed[..., :n], v[..., n:]], dim=-1)

    def joint_loss(
        self,
        ctx: Context,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: Aux,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """f(w) + f(α v + (1 − α) w̃) over [w ; v ; α], w̃ = w detached."""
        d = (params.shape[-1] - 1) // 2
        w, v, alpha = params[:d], params[d : 2 * d], params[2 * d :]
        loss_w, post_w = ctx.model_loss(w, x, y, aux, u)
        loss_v, post_v = ctx.model_loss(self.mixture(ctx, w.detach(), v, alpha), x, y, aux, u)
        post = None
        if post_w is not None and post_v is not None:
            n = ctx.model.layout.num_params
            post = torch.cat([post_w, v.detach()[:n], post_v[n:], alpha.detach()])
        return loss_w + loss_v, post

    def clip_alpha(self, params: torch.Tensor, aux: Aux) -> torch.Tensor:
        """Project α (the last coordinate) onto [0, 1]."""
        return torch.cat([params[:-1], params[-1:].clamp(0.0, 1.0)])

    def objective(self, ctx: Context, anchor: torch.Tensor) -> Objective:
        """The joint objective over [w ; v ; α] (d = ``anchor``'s length)."""
        d = anchor.shape[-1]
        frozen = None
        if ctx.model.has_buffers:
            mask = ctx.model.buffer_mask
            frozen = torch.cat([mask, mask, torch.zeros(1, dtype=torch.bool, device=mask.device)])
        lr_scale = None
        if not self.adapt_alpha or self.alpha_lr is not None:
            scale = 0.0 if not self.adapt_alpha else self.alpha_lr / ctx.lr
            lr_scale = torch.ones(2 * d + 1, dtype=anchor.dtype, device=anchor.device)
            lr_scale[-1] = scale
        return Objective(
            partial(self.joint_loss, ctx), frozen=frozen, lr_scale=lr_scale, project=self.clip_alpha
        )

    # ---------------------------------------------------------------------- hooks
    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """E joint steps on [w ; v ; α] from w = the received model; send Δ = w_in − w^E."""
        assert isinstance(model_in, torch.Tensor)
        d = model_in.shape[-1]
        v = states.stack("v")
        alpha = states.stack("alpha").to(model_in)
        opt = ctx.optimizer
        local = ctx.train(
            torch.cat([model_in.detach(), v, alpha], dim=1),
            cohort,
            objective=self.objective(ctx, model_in.detach()),
            opt_states=opt.load(states),
        )
        w, v, alpha = local.params[:, :d], local.params[:, d : 2 * d], local.params[:, 2 * d :]
        new_states = unstack_states(states, opt, local.opt_state, v=v, alpha=alpha)
        metrics = {"train_loss": local.loss, "alpha": alpha[:, 0]}
        return CohortResult(model_in - w, new_states, metrics)

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """v̄_n = α_n v_n + (1 − α_n) w of every client, w the current global model."""
        w = server["x"].expand(len(clients), -1)
        return self.mixture(ctx, w, states.stack("v"), states.stack("alpha").to(w))
