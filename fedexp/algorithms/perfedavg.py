"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020), first-order and Hessian-free.

"Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning
Approach". Client i minimises the MAML objective F_i(w) = f_i(w − α∇f_i(w)): a model that
one gradient step of size α on the client's own data turns into its personalised model. Each
of τ local steps (the run's local steps) draws independent minibatches D, D', D'' and takes

    w̃ = w − α ∇f_i(w; D)
    w ← w − β ∇f_i(w̃; D') (I − α ∇²f_i(w; D''))

with β the run's ``lr`` and optimiser (plain SGD: the paper's step). ``variant="fo"``
(Per-FedAvg (FO)) drops the Hessian term; ``variant="hf"`` (Per-FedAvg (HF)) estimates its
product with g = ∇f_i(w̃; D') by central differences,
∇²f_i(w; D'') g ≈ [∇f_i(w + δg; D'') − ∇f_i(w − δg; D'')] / 2δ. The client sends
Δ = w_in − w^τ; the server is FedAvg's (the average of the clients' w). A client is evaluated
with the global model after one step of size α on one minibatch of its training data (the
run's batch size; the whole set with ``batch_size=0``), drawn from its evaluation stream:
the paper's "one step of stochastic gradient descent", and PFLlib's ``train_one_step``.

Choices where the paper is silent, and departures:

* β is the run's ``lr`` (and ``optimizer``: momentum or Adam act on the meta-gradient, its
  state kept as FedAvg's); α defaults to it too (``alpha=null``: PFLlib's α = β); the inner
  step and the evaluation step are plain gradient steps of size α.
* τ is the run's step count (``local_steps``, or ``local_epochs`` converted at the run's batch
  size); each step draws two minibatches (FO) or three (HF), so an "epoch" of steps reads the
  data two or three times (PFLlib reads one loader batch of 2B a step, split in D and D').
* With α = 0 the inner step and the Hessian term vanish: D and D'' are not drawn, so every
  step is FedAvg's step on D', draws included (FedAvg exactly; tested), and evaluation is the
  global model's.
* BatchNorm statistics (not in the paper): w̃ takes those of the forward pass on D, and w
  those of the pass at w̃ on D' (as PFLlib, which restores the parameters of w after the inner
  step but not its buffers); the HF probes at w ± δg move no statistics.
* The train loss logged is f_i(w̃; D'), the stochastic MAML objective, a step's mean.

Persists: the run's optimiser state (``opt.*``) only.
"""

from __future__ import annotations

import logging

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import Positive
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.optim import SGD
from fedexp.engine.solver.optim import State as OptState
from fedexp.engine.solver.optim import stack_states
from fedexp.engine.solver.steps import Ahead
from fedexp.engine.solver.steps import check_rows
from fedexp.engine.solver.steps import draw_step
from fedexp.engine.solver.steps import rowwise
from fedexp.engine.solver.steps import stacked_gradients
from fedexp.engine.solver.steps import unstack_states

log = logging.getLogger("fedexp")

_VARIANTS = ("fo", "hf")


class PerFedAvg(FedAvg):
    """Per-FedAvg. Persists per client: ``opt.*`` (the run's optimiser state of the β step).

    Args:
        variant: "fo" (first-order: the Hessian term dropped) or "hf" (Hessian-free: its
            product by central differences).
        alpha: α ≥ 0, the MAML inner step (the personalisation step of the evaluation too);
            None: the run's ``lr`` (PFLlib's α = β). β, the meta step, is the run's ``lr``.
        delta: δ > 0 of the HF finite differences.
        server_lr: as FedAvg (1: the paper's average of the clients' w).
        weighting: as FedAvg.
    """

    def __init__(
        self,
        variant: str = "fo",
        alpha: NonNegative | None = None,
        delta: Positive = 0.001,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        if variant not in _VARIANTS:
            raise ValueError(f"variant={variant!r}: expected 'fo' or 'hf'")
        super().__init__(server_lr, weighting)
        self.variant, self.alpha, self.delta = variant, alpha, delta
        self.eval_with_data = alpha != 0
        self.inner = SGD(persistent=False)  # the α steps: plain gradient steps

    def _alpha(self, ctx: Context) -> float:
        return ctx.lr if self.alpha is None else self.alpha

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """τ meta-steps of every client at once; send Δ = w_in − w^τ (vmap refusal: rowwise)."""
        assert isinstance(model_in, torch.Tensor)
        opt, obj = ctx.optimizer, ctx.model_objective()
        w0 = model_in.detach()
        state = opt.load(states)
        if state is None:
            state = stack_states(opt, w0, [None] * len(cohort))
        draws = cohort.draws.clone()
        try:
            w, state, loss = self._steps(ctx, obj, w0, state, cohort)
        except RuntimeError as exc:  # an op vmap refuses: the same draws again, row by row
            if rowwise(ctx, obj):
                raise
            ctx.vmap_ok = False
            log.warning("Per-FedAvg: cannot vmap this model/loss (%s); row by row", exc)
            cohort.draws = draws
            w, state, loss = self._steps(ctx, obj, w0, state, cohort)
        check_rows(ctx, cohort, w, loss, ctx.lr)
        new_states = unstack_states(states, opt, state)
        return CohortResult(model_in - w, new_states, {"train_loss": loss})

    def _steps(
        self,
        ctx: Context,
        obj: Objective,
        w: torch.Tensor,
        state: OptState,
        cohort: Cohort,
    ) -> tuple[torch.Tensor, OptState, torch.Tensor]:
        """The τ steps of the module's docstring over the cohort's ``[m, d]`` stack."""
        ctx.model.module.train()
        alpha, delta, hf = self._alpha(ctx), self.delta, self.variant == "hf"
        steps = ctx.cohort_steps(cohort)
        per_step = 1 if alpha == 0 else (3 if hf else 2)
        grad = stacked_gradients(ctx, obj)
        u = torch.zeros(len(cohort), 0, device=w.device)
        frozen = obj.frozen
        if ctx.batch_size <= 0:  # every draw is the whole training sets: gathered once
            whole = draw_step(ctx, cohort)

            def draw() -> tuple[torch.Tensor, torch.Tensor, bool]:
                return whole

        else:
            ahead = Ahead(ctx, cohort, per_step * steps)

            def draw() -> tuple[torch.Tensor, torch.Tensor, bool]:
                return draw_step(ctx, cohort, ahead)

        total = torch.zeros(len(cohort), device=w.device)
        for _ in range(steps):
            w_tilde = w
            if alpha != 0:
                x, y, full = draw()
                g, (_, post) = grad(w, x, y, {}, u, full)
                w_tilde = w - alpha * g
                if frozen is not None and post is not None:
                    w_tilde = torch.where(frozen, post, w_tilde)
            x, y, full = draw()
            meta, (values, post) = grad(w_tilde, x, y, {}, u, full)
            if hf and alpha != 0:
                x, y, full = draw()
                plus, _ = grad(w + delta * meta, x, y, {}, u, full)
                minus, _ = grad(w - delta * meta, x, y, {}, u, full)
                meta = meta - (alpha / (2 * delta)) * (plus - minus)
            new, state = ctx.optimizer.step(w, meta, state, ctx.lr)
            if frozen is not None and post is not None:
                new = torch.where(frozen, post, new)
            w = new
            total = total + values
        return w.detach(), state, total / max(steps, 1)

    def eval_models(
        self, ctx: Context, server: State, states: list[State], cohort: Cohort
    ) -> torch.Tensor:
        """The global model after one step of size α on a minibatch of each client's data."""
        x = server["x"].repeat(len(cohort), 1)
        return ctx.train(x, cohort, steps=1, lr=self._alpha(ctx), optimizer=self.inner).params
