"""TDPFed (Wang et al., "Tensor Decomposition based Personalized Federated Learning").

Every weight tensor of the model has CP factors of the rank its compression rate gives
(TDPFed eqs. 21-22, Table I; ``fedexp.models.cp``); the factors (and the biases, carried as
they are) form the *tensorized local model* A. Client k keeps a full personalised model θ_k.
Each round (Algorithm 1) it receives the global factors A, then for t' = 1..τ draws ONE
minibatch B and takes

* s Nesterov steps (step η_p) on θ for f_k(θ; B) + (λ/2)‖θ − [[A]]‖² (eq. 13), then
* s′ Adam steps (step η) on A for (λ/2)‖θ − [[A]]‖² (eqs. 15-17),

and uploads A only (the ledger's uplink is the factor vector: 4 bytes an entry dense). The
server aggregates by

* AFM (eq. 18): A ← (1−β)A + β Σ_k ω_k A_k, or
* ACT (eqs. 19-20): ω̃ = (1−β)[[A]] + β Σ_k ω_k [[A_k]] per weight tensor, then new factors by
  ``act_sweeps`` ALS sweeps on ω̃ started from the AFM factors (the paper does not say how
  factors are recovered from ω̃; biases are averaged as in AFM).

Clients are evaluated with θ_k. Who trains: Algorithm 1 (lines 2-5) has every client k run
ClientUpdate each round and the server aggregate a random set S_t of them (``all_train=true``,
the default): every θ_k and its optimiser states move every round, the downlink reaches every
client, only the sampled clients upload. ``all_train=false`` runs the sampled clients only.

Choices where the paper is silent or inconsistent:

* A_0: ``init_sweeps`` ALS sweeps fitting the common initial model x0 from a random start
  seeded by the run's seed; θ_k starts at x0.
* θ_k persists between rounds (Algorithm 1); §V-A's text says the server
  broadcasts the aggregated tensor as the personalised model: ``reset_personal=true`` starts
  θ_k from [[A]] every round (computed by the client: the downlink is still factors only).
* ω_k ∝ n_k (``weighting="samples"``, eq. 20's |D_k|); eq. 18 weights by the minibatch size
  |B_k|, equal for every client: ``weighting="uniform"``.
* The Nesterov momentum is not given: ``momentum`` 0.9 by default. Both optimisers' states
  persist in the client's state (``opt_theta.*``, ``opt_a.*``).
* BatchNorm statistics (not in the paper's models) are carried dense in A, taken from θ.

Persists: θ_k (client ``theta``), the optimiser states; the server's factors ``a``.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Annotated

import torch

from fedexp.algorithms.base import Algorithm
from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import StackedUpdates
from fedexp.algorithms.base import State
from fedexp.algorithms.base import Updates
from fedexp.algorithms.base import Weights
from fedexp.algorithms.base import broadcast
from fedexp.algorithms.base import weighted_mean
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import OpenFraction
from fedexp.config.ranges import Positive
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.contract import update_parts
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Aux
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.optim import SGD
from fedexp.engine.solver.optim import Adam
from fedexp.engine.solver.optim import Optimizer
from fedexp.engine.solver.optim import stack_states
from fedexp.engine.solver.steps import draw_batch
from fedexp.engine.solver.steps import unstack_states
from fedexp.models.cp import CPLayout
from fedexp.models.cp import als
from fedexp.models.cp import compose
from fedexp.models.flat import Layout
from fedexp.transfer import to_device


@functools.lru_cache(maxsize=8)
def cp_layout(layout: Layout, rate: float) -> CPLayout:
    """The factor layout of a model layout at a compression rate (cached: one per run)."""
    return CPLayout(layout, rate)


class TDPFed(Algorithm):
    """TDPFed.

    Args:
        rate: the compression rate of every weight (TDPFed's ×1.5 or ×2).
        aggregation: "afm" (factor mean, eq. 18) or "act" (composed-tensor mean, eq. 19-20).
        lam: λ > 0, pull of θ_k to [[A]].
        beta: β, server mixing (1: the weighted mean).
        personal_steps: s, Nesterov steps on θ per local round.
        factor_steps: s′, Adam steps on the factors per local round.
        personal_lr: η_p, the step of the θ steps (the run's ``lr`` is η of the factor steps).
        momentum: the Nesterov momentum of the θ steps.
        local_rounds: τ, local rounds (one minibatch each) per round (None: the run's local
            steps / epochs).
        init_sweeps: ALS sweeps fitting A_0 to the initial model.
        act_sweeps: ALS sweeps re-deriving factors from the ACT average.
        reset_personal: start θ_k from [[A]] each round (§V-A's text) instead of keeping it.
        weighting: "samples" (eq. 20) or "uniform" (eq. 18 with equal minibatches).
        all_train: every client trains each round, the sampled ones upload (Algorithm 1,
            lines 2-5); False: the sampled clients only.
    """

    def __init__(
        self,
        rate: Positive = 2.0,
        aggregation: str = "afm",
        lam: Positive = 12.0,
        beta: ServerLr = 1.0,
        personal_steps: Annotated[int, Range(ge=0, note="0: θ_k is not trained")] = 5,
        factor_steps: Annotated[int, Range(ge=0, note="0: A is not trained")] = 17,
        personal_lr: Positive = 0.08,
        momentum: OpenFraction = 0.9,
        local_rounds: PositiveInt | None = None,
        init_sweeps: Annotated[int, Range(ge=0, note="0: A_0 is the random start")] = 10,
        act_sweeps: Annotated[int, Range(ge=0, note="0: the AFM factors")] = 3,
        reset_personal: bool = False,
        weighting: str = "samples",
        all_train: bool = True,
    ) -> None:
        if aggregation not in ("afm", "act"):
            raise ValueError(f"aggregation={aggregation!r}: expected 'afm' or 'act'")
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting={weighting!r}: expected 'samples' or 'uniform'")
        self.rate, self.aggregation, self.lam, self.beta = rate, aggregation, lam, beta
        self.personal_steps, self.factor_steps = personal_steps, factor_steps
        self.personal_lr, self.local_rounds = personal_lr, local_rounds
        self.init_sweeps, self.act_sweeps = init_sweeps, act_sweeps
        self.reset_personal, self.weighting = reset_personal, weighting
        self.all_train = all_train
        self.theta_opt = SGD(momentum=momentum, nesterov=momentum > 0)
        self.factor_opt = Adam()

    def cp(self, ctx: Context) -> CPLayout:
        """The factor layout of the run's model at this compression rate."""
        return cp_layout(ctx.model.layout, self.rate)

    # ------------------------------------------------------------------ server
    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """A_0: ALS factors of the initial model from a random start seeded by the run."""
        gen = torch.Generator().manual_seed(ctx.seed)
        return {"a": self.cp(ctx).decompose(x0, sweeps=self.init_sweeps, generator=gen)}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """θ_k starts at the common initial model."""
        return {"theta": x0.clone()}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """The global factors A (and the biases), the same for every client."""
        return broadcast(clients, server["a"])

    # ------------------------------------------------------------------ client
    def factor_loss(
        self,
        cp: CPLayout,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: Aux,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(λ/2)‖θ − [[A]]‖² (eq. 12 at fixed θ; its gradient is eq. 15); ``aux``: θ, λ."""
        diff = aux["theta"] - cp.compose(params)
        return 0.5 * aux["lam"] * (diff * diff).sum(), params.detach()

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """τ local rounds of s θ-steps then s′ factor steps on one minibatch; upload A.

        Each local round draws every client's minibatch at once; the θ-steps and the factor
        steps are then one run each of the whole cohort on it.
        """
        assert isinstance(model_in, torch.Tensor)
        rounds = ctx.cohort_steps(cohort) if self.local_rounds is None else self.local_rounds
        cp = self.cp(ctx)
        compose_rows = torch.func.vmap(cp.compose)
        a = model_in.detach().clone()
        theta = compose_rows(a) if self.reset_personal else states.stack("theta")
        opt_theta = _stacked_opt(self.theta_opt, theta, states, "opt_theta")
        opt_a = _stacked_opt(self.factor_opt, a, states, "opt_a")
        buffers = ctx.model.buffer_mask if ctx.model.has_buffers else None
        frozen_a = None if buffers is None else cp.model_mask(buffers)
        dense_src = None if buffers is None else cp.dense_source(a.device)
        lam = torch.full((), float(self.lam), device=a.device, dtype=a.dtype)
        total = torch.zeros(len(cohort), device=a.device)
        for _ in range(rounds):
            batch = draw_batch(ctx, cohort)
            if self.personal_steps > 0:
                personal = ctx.train(
                    theta,
                    cohort,
                    objective=ctx.proximal_objective(compose_rows(a), self.lam),
                    optimizer=self.theta_opt,
                    opt_states=opt_theta,
                    steps=self.personal_steps,
                    lr=self.personal_lr,
                    batch=batch,
                )
                theta, opt_theta = personal.params, personal.opt_state
                total = total + personal.loss
            if frozen_a is not None:  # running statistics travel in A, taken from θ
                a = torch.where(frozen_a, theta[:, dense_src], a)
            if self.factor_steps > 0:
                aux = {"theta": theta.detach(), "lam": lam}
                fit = ctx.train(
                    a,
                    cohort,
                    objective=Objective(partial(self.factor_loss, cp), aux=aux, frozen=frozen_a),
                    optimizer=self.factor_opt,
                    opt_states=opt_a,
                    steps=self.factor_steps,
                    batch=batch,
                )
                a, opt_a = fit.params, fit.opt_state
        new_states = unstack_states(states, self.theta_opt, opt_theta, "opt_theta", theta=theta)
        new_states = unstack_states(new_states, self.factor_opt, opt_a, "opt_a")
        return CohortResult(a, new_states, {"train_loss": total / max(rounds, 1)})

    # ------------------------------------------------------------------ server
    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """AFM (eq. 18) or ACT (eqs. 19-20 and ALS sweeps back to factors)."""
        a = server["a"]
        mean = weighted_mean(updates, weights)  # type: ignore[arg-type]
        afm = (1.0 - self.beta) * a + self.beta * mean
        if self.aggregation == "afm":
            return {**server, "a": afm}
        cp = self.cp(ctx)
        new = afm.clone()
        clients = sorted(updates)
        stack = update_parts(updates, clients)[""]  # [m, numel] the uploaded factors
        w = to_device([weights[n] for n in clients], a.device, a.dtype)
        for e in cp.entries:
            if e.rank == 0:
                continue
            composed = compose(cp.factors(stack, e))  # [m, I_1, …, I_N]
            avg = torch.tensordot(w, composed, dims=1)
            target = (1.0 - self.beta) * compose(cp.factors(a, e)) + self.beta * avg
            fitted = als(target, cp.factors(afm, e), self.act_sweeps)
            new[e.offset : e.offset + e.size] = torch.cat([f.reshape(-1) for f in fitted])
        return {**server, "a": new}

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Every client's θ_k, at once."""
        return states.stack("theta")


def _stacked_opt(
    opt: Optimizer, params: torch.Tensor, states: CohortStates, prefix: str
) -> dict[str, torch.Tensor]:
    """The cohort's stacked optimiser state saved under ``prefix`` (fresh if none was)."""
    loaded = opt.load(states, prefix)
    return loaded if loaded is not None else stack_states(opt, params, [None] * len(states))
