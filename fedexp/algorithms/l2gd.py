"""L2GD (Hanzely & Richtárik, 2020): "Federated Learning of a Mixture of Global and Local Models".

arXiv:2002.05516, Algorithm 1 (Loopless Local Gradient Descent). It minimises

    F(x) = (1/n) Σ_i f_i(x_i) + (λ/2n) Σ_i ‖x_i − x̄‖²,      x̄ = (1/n) Σ_i x_i,

over the clients' personal models x_1..x_n. Each iteration one coin ξ ~ Bernoulli(p), shared
by every party, decides the step:

    ξ = 0 (local step):     x_i ← x_i − η/(n(1−p)) ∇f_i(x_i)          on every client
    ξ = 1 (communication):  x_i ← x_i − ηλ/(np) (x_i − x̄)             on every client

An averaging step leaves x̄ unchanged, so a run of m consecutive 1s needs one communication
and equals one step towards x̄ by 1 − (1 − ηλ/(np))^m (the paper's remark: only a 1 after a 0
communicates). With c = ηλ/(np) = 1 a communication sets every x_i to x̄.

A fedexp round is the stretch between two communications. The coin sequence is cut into
maximal runs, [k_0 zeros] [m_0 ones] [k_1 zeros] [m_1 ones] ..., and round t is: receive x̄
(the server's mean, which every averaging step of the run m_{t−1} uses), take the m_{t−1}
averaging steps at once (none in round 0, where every x_i = x̄ = x_0 anyway), then the k_t
local steps, and upload. So k_0 ~ Geometric on {0, 1, ...} with success probability p, k_t ~
Geometric on {1, 2, ...} for t ≥ 1 (a run of zeros between two maximal runs of ones is not
empty), and m ~ Geometric on {1, 2, ...} with success probability 1 − p. Round t's draws
(m_{t−1}, k_t) come from the stream ``streams.generator(seed, COINS, t)`` that every party can
derive, so every client, every sub-cohort and a resumed run take the same steps; full
participation makes this Algorithm 1 exactly (tested step by step), up to the cap below.

Choices the paper leaves open (written here, on purpose):

* ``max_local_steps`` caps k_t (a truncated geometric: the paper has no cap; at the default
  p = 0.2 and cap 50 the truncated mass is 0.8⁵⁰ ≈ 1.4e-5).
* The upload is the difference Δ_i = x̄_in − x_i against the x̄ received (an "update" part,
  as FedAvg's, so compressors code it); the server sets x̄ ← x̄ − mean_i Δ_i, the plain mean of
  the uploaded x_i (uniform weights: the paper's x̄ is unweighted).
* Partial participation (not Algorithm 1, whose steps involve every client): a client not
  sampled in round t takes none of its steps, and x̄ is the mean over the round's uploads.
* The local steps use the run's optimiser (plain SGD by default, the paper's; momentum or
  Adam state persists in the client's state) and its minibatches (the paper: full gradients).
* Clients are evaluated with x_i as it stands after the round's local steps (the iterate just
  before the next communication). BatchNorm statistics are part of x and averaged with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated

import torch

from fedexp import streams
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
from fedexp.config.ranges import Positive
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states
from fedexp.errors import ConfigError

#: Purpose of the shared coin stream (beside ``fedexp.streams``'s purposes).
COINS = 0x126D


class L2GD(Algorithm):
    """L2GD. Persists per client: ``x`` (its model x_i) and ``opt.*``; the server: ``xbar``.

    Metrics: ``local_steps`` (k_t) and ``averaging_steps`` (m_{t−1}) of the round, the same on
    every client; ``train_loss`` on rounds with local steps.

    Args:
        lam: λ ≥ 0, the strength of the pull towards the mean (0: local training).
        p: probability 0 < p < 1 of a communication step (the mean round has 1/p local steps).
        eta: the step size η (None: η = lr · n(1 − p), so that a local step is the run's lr).
        max_local_steps: cap on the local steps of a round (truncates the geometric law).
    """

    server_reads = "mean"  # the server step reads Σ ω_n u_n only (central DP noises it)

    weighting = "uniform"
    stacks = False  # the round's coin flips come from the run's seed (schedule)

    def __init__(
        self,
        lam: Annotated[float, Range(ge=0, note="0: local training")] = 1.0,
        p: Annotated[float, Range(gt=0, lt=1)] = 0.2,
        eta: Positive | None = None,
        max_local_steps: PositiveInt = 50,
    ) -> None:
        self.lam, self.p, self.eta, self.max_local_steps = lam, p, eta, max_local_steps

    # ------------------------------------------------------------------ step sizes
    def step_size(self, ctx: Context) -> float:
        """The step size η (given, or lr · n(1 − p))."""
        return self.eta if self.eta is not None else ctx.lr * ctx.num_clients * (1 - self.p)

    def local_lr(self, ctx: Context) -> float:
        """The local step η / (n(1 − p))."""
        if self.eta is None:
            return ctx.lr
        return self.eta / (ctx.num_clients * (1 - self.p))

    def averaging_rate(self, ctx: Context) -> float:
        """The averaging rate c = ηλ / (np): a communication step moves x_i by c (x̄ − x_i)."""
        return self.step_size(ctx) * self.lam / (ctx.num_clients * self.p)

    def schedule(self, ctx: Context, round_: int) -> tuple[int, int]:
        """Round ``round_``'s (m_{t−1}, k_t): averaging steps closing t − 1, local steps of t."""
        u = 1.0 - torch.rand(
            2, generator=streams.generator(ctx.seed, COINS, round_), dtype=torch.float64
        )
        zeros = int(math.floor(math.log(float(u[0])) / math.log(1.0 - self.p)))
        if round_ == 0:
            return 0, min(zeros, self.max_local_steps)
        ones = 1 + int(math.floor(math.log(float(u[1])) / math.log(self.p)))
        return ones, min(1 + zeros, self.max_local_steps)

    # ---------------------------------------------------------------------- hooks
    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """The mean x̄ = x_0 (every client starts there); refuses a step past the mean (c > 1)."""
        c = self.averaging_rate(ctx)
        if c > 1.0:
            raise ConfigError(
                f"L2GD averaging step ηλ/(np) = {c:.4g} > 1 overshoots the mean "
                f"(η={self.step_size(ctx):.4g}, λ={self.lam}, n={ctx.num_clients}, p={self.p}): "
                "lower algorithm.lam / algorithm.eta (or lr), or raise algorithm.p"
            )
        return {"xbar": x0.clone()}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """The client's x_i starts at the common initial model."""
        return {"x": x0.clone()}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """The current mean x̄, the same for every client."""
        return broadcast(clients, server["xbar"])

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """Take m_{t−1} averaging steps towards the received x̄, k_t local steps; send x̄ − x_i.

        One schedule for the whole cohort: it is the round's.
        """
        assert isinstance(model_in, torch.Tensor)
        ones, zeros = self.schedule(ctx, ctx.round)
        x = states.stack("x")
        if ones > 0:  # lerp is exact at both ends: weight 0 keeps x, weight 1 gives x̄
            x = torch.lerp(x, model_in, 1.0 - (1.0 - self.averaging_rate(ctx)) ** ones)
        opt = ctx.optimizer
        local = ctx.train(
            x, cohort, opt_states=opt.load(states), steps=zeros, lr=self.local_lr(ctx)
        )
        new_states = unstack_states(states, opt, local.opt_state, x=local.params)
        full = torch.ones(len(cohort), device=x.device)
        metrics = {"local_steps": full * zeros, "averaging_steps": full * ones}
        if zeros > 0:
            metrics["train_loss"] = local.loss
        return CohortResult(model_in - local.params, new_states, metrics)

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """The new mean x̄ ← x̄ − mean_i Δ_i: the plain mean of the uploaded x_i."""
        if not updates:
            return server
        return {**server, "xbar": server["xbar"] - weighted_mean(updates, weights)}

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Every client's own x_i, at once."""
        return states.stack("x")

    def global_vector(
        self, ctx: Context, server: State, average: Callable[[str], torch.Tensor]
    ) -> torch.Tensor | None:
        """x̄: the server's mean model, the one every averaging step pulls the x_i towards."""
        return server["xbar"]
