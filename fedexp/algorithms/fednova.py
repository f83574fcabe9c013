"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020): normalised averaging.

"Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization".
Clients may take different numbers of local steps τ_n (``local_epochs`` on clients of
different sizes: the engine trains one sub-cohort per step count). FedAvg's average of the
model changes then weighs client n by about p_n τ_n and converges to the optimum of that
surrogate objective, not of Σ p_n F_n. FedNova normalises each change by its solver's gain a_n
before averaging: client n runs τ_n local steps from x and uploads d_n = (x − θ_n)/a_n with
a_n; the server takes x ← x − η_s τ_eff Σ ω_n d_n, τ_eff = Σ ω_n a_n (ω_n the run's
``weighting``: the paper's p_n = n_n/n with "samples"). a_n is the sum of the coefficients
with which the local gradients enter x − θ_n (the ℓ1 norm of the paper's vector a_n): τ_n for
plain SGD, Σ_{k=1..τ} (1 − ρ^k)/(1 − ρ) with momentum ρ, (1 − (1 − η μ)^τ)/(η μ) with a
proximal term μ (FedProx's local objective), computed by :func:`gain` for any combination.
With equal τ_n it is FedAvg (FedProx with ``mu``) up to rounding (tested).

Departures and decisions:

* The server step is FedAvg's applied to the mean pseudo-update τ_eff Σ ω_n d_n, so the run's
  ``server_optimizer`` (FedAdam, ...) and ``server_lr`` act on it as on FedAvg's mean (the
  authors' ``gmf``, a server momentum, is ``server_optimizer`` territory).
* The server reads only Σ ω_n d_n and Σ ω_n a_n (``server_reads = "mean"``): memory-sliced
  rounds and several processes work. a_n crosses as an "exact" part (4 bytes, never
  compressed; with DP it is neither clipped nor noised, and it reveals τ_n).
* The momentum buffer starts at zero every round (the authors' code zeroes it after each
  averaging; a_n assumes it): nothing persists in the client's state, whatever
  ``optimizer.persistent`` says. Nesterov momentum gets its own exact a_n (the authors' code
  uses heavy-ball's). Weight decay is part of the local objective (a_n ignores it, as theirs).
* With ``mu`` the proximal gradient μ(θ − x) goes through the momentum buffer like the task's
  (the solver's proximal objective); a_n follows that. The authors' code adds it after the
  momentum and sets τ_eff = Σ p_n τ_n when μ > 0; here τ_eff = Σ ω_n a_n always
  (ALGORITHMS.md's rule; with equal τ_n that is FedProx).
* Adam (``optimizer=adam``) has no such gain: refused with one line before round 0.
* Running statistics (BatchNorm buffers) are not gradient steps: their change is sent as is
  and averaged as FedAvg averages them (x ← x − η_s Σ ω_n Δ_n on those coordinates).
* With CER (``update_scale = "step"``), γ acts on d_n / η_l, one averaged local gradient, not
  FedAvg's sum of τ_n: with equal τ_n, FedNova with γ is FedAvg with τ γ.

Persists: the global model x and the last round's τ_eff (``fednova/tau_eff`` in the metrics).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.base import Updates
from fedexp.algorithms.base import Weights
from fedexp.algorithms.base import update_parts
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import NonNegative
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.optim import SGD
from fedexp.errors import ConfigError
from fedexp.transfer import to_device


def gain(steps: int, momentum: float = 0.0, nesterov: bool = False, lr_mu: float = 0.0) -> float:
    """The gain a = ‖a‖₁: x − θ^τ = η a g when every local task gradient is the same g.

    τ local steps of SGD (heavy-ball or Nesterov momentum ρ, buffer from zero) on the task
    loss plus (μ/2)‖θ − x‖², from θ = x, with step η (``lr_mu`` = η μ); the recursion of the
    solver's step on the scalar s = (x − θ)/η with a unit task gradient. Closed forms: τ
    (plain), Σ_{k=1..τ} (1 − ρ^k)/(1 − ρ) (momentum), (1 − (1 − ημ)^τ)/(ημ) (proximal).
    """
    s = buf = 0.0
    for _ in range(steps):
        g = 1.0 - lr_mu * s  # the task's unit gradient plus μ(θ − x) = −μ η s
        buf = momentum * buf + g
        s += g + momentum * buf if nesterov else buf
    return s


class FedNova(FedAvg):
    """FedNova.

    Args:
        mu: proximal strength μ ≥ 0 of the local objective (0: plain local SGD; > 0: FedProx's
            local solver, with the paper's a_n for it).
        server_lr: server step η_s on the mean pseudo-update τ_eff Σ ω_n d_n (1: the paper).
        weighting: "samples" (ω_n ∝ n_train, the paper's p_n) or "uniform".
    """

    uplink_parts = MappingProxyType({"d": "update", "a": "exact"})
    #: the model moves by the mean pseudo-update through FedAvg's step (ctx.server_optimizer)
    server_optimized = True

    def __init__(
        self, mu: NonNegative = 0.0, server_lr: ServerLr = 1.0, weighting: str = "samples"
    ) -> None:
        super().__init__(server_lr, weighting)
        self.mu = mu

    def objective(self, ctx: Context, anchor: torch.Tensor) -> Objective:
        """Task loss + (μ/2)‖θ − x‖² (the task loss alone when μ = 0)."""
        return ctx.proximal_objective(anchor, self.mu)

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """X = x0 and τ_eff = 0; refuses a local optimiser without a known gain (Adam).

        Raises:
            ConfigError: ``optimizer`` is not SGD.
        """
        _sgd(ctx)
        tau = torch.zeros(1, dtype=x0.dtype, device=x0.device)
        return {**super().init_server(ctx, x0), "tau_eff": tau}

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """τ_n steps from x (momentum from zero); send d = (x − θ^τ)/a and a.

        One sub-cohort has one step count τ (``ctx.cohort_steps``), hence one a.
        """
        assert isinstance(model_in, torch.Tensor)
        opt = _sgd(ctx)
        a = gain(ctx.cohort_steps(cohort), opt.momentum, opt.nesterov, ctx.lr * self.mu)
        if not (a > 0 and math.isfinite(a)):
            raise ConfigError(
                f"algorithm=fednova: the local solver's gain a = {a:g} is not positive "
                f"(lr·mu = {ctx.lr * self.mu:g} ≥ 2 diverges): lower lr or algorithm.mu"
            )
        local = ctx.train(model_in, cohort, objective=self.objective(ctx, model_in.detach()))
        delta = model_in - local.params
        p = ctx.model.layout.num_params
        d = delta / a if p == delta.shape[1] else torch.cat([delta[:, :p] / a, delta[:, p:]], 1)
        upload = {"d": d, "a": torch.full((len(cohort), 1), a, dtype=d.dtype, device=d.device)}
        return CohortResult(upload, states, {"train_loss": local.loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """X ← x − η_s τ_eff Σ ω_n d_n, τ_eff = Σ ω_n a_n: FedAvg's step on that mean.

        Running statistics move by Σ ω_n d_n as sent (FedAvg's average). An upload that is a
        bare tensor is taken as a mean pseudo-update already (central DP's release of an empty
        Poisson cohort, whose noise comes shaped as the downlink).
        """
        if not updates:
            return server
        clients = sorted(updates)
        first = updates[clients[0]]
        if isinstance(first, torch.Tensor):
            step = super().server_update(ctx, server, updates, weights)
            return {**step, "tau_eff": torch.zeros_like(server["tau_eff"])}
        parts = update_parts(updates, clients)
        d, a = parts["d"], parts["a"].reshape(len(clients), -1)[:, 0].to(parts["d"])
        w = to_device([weights[n] for n in clients], d.device, d.dtype)
        tau_eff = w @ a
        mean = w @ d.reshape(len(clients), -1)
        p = ctx.model.layout.num_params
        mean = torch.cat([tau_eff * mean[:p], mean[p:]])
        step = super().server_update(ctx, server, {clients[0]: mean}, {clients[0]: 1.0})
        return {**step, "tau_eff": tau_eff.reshape(1).to(server["tau_eff"])}

    def server_metrics(self, ctx: Context, server: State) -> dict[str, float]:
        """τ_eff of the last round with uploads (0 before the first)."""
        return {"fednova/tau_eff": float(server["tau_eff"][0])}


def _sgd(ctx: Context) -> SGD:
    """The run's local optimiser, SGD (FedNova's a_n is SGD's gain)."""
    opt = ctx.optimizer
    if not isinstance(opt, SGD):
        raise ConfigError(
            f"algorithm=fednova normalises by SGD's gain a_n (plain, momentum, Nesterov); "
            f"optimizer={type(opt).__name__.lower()} has none: use optimizer=sgd"
        )
    return opt
