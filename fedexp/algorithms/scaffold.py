"""SCAFFOLD, Algorithm 1 with option II for the client's control variate.

Karimireddy et al., *SCAFFOLD: Stochastic Controlled Averaging for Federated Learning*, ICML
2020.

The server holds the model x and a control variate c, client n its own c_n (0 at first). A
round: the server sends (x, c); each sampled client takes K local steps from y = x of
y ← y − η_l (g_n(y) − c_n + c) (the correction c − c_n as the objective's linear term, so the
run's optimiser, batching and slicing apply unchanged); then c_n⁺ = c_n − c + (x − y)/(K η_l)
(option II) and it uploads Δy_n = x − y and Δc_n = c_n⁺ − c_n (two parts, both counted in the
ledger). The server: x ← x − η_g Σ ω_n Δy_n and c ← c + (|S|/N) Σ ω_n Δc_n.

Departures and decisions:

* Uploads are x − y (fedexp's sign for model changes: FedAvg's Δ), so the server step is
  FedAvg's with η_g = ``server_lr``.
* ω_n: the paper's plain mean over S (``weighting="uniform"``, the default here). With
  ``weighting="samples"``, c stays the population's weighted mean Σ_n p_n c_n (p_n = n_n/n):
  c ← c + (Σ_{S} n_n / n) Σ ω_n Δc_n, the same rule with the senders' share of the weight in
  place of |S|/N (``Senders.share``).
* The server reads the uploads only through their weighted means, so memory-sliced rounds and
  several processes work (the senders' count comes with ``ctx.senders``).
* Option II assumes plain SGD steps of size η_l; with momentum or Adam the control variate is
  still (x − y)/(K η_l), the average pseudo-gradient of the round.
"""

from __future__ import annotations

from types import MappingProxyType

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
from fedexp.algorithms.base import update_parts
from fedexp.algorithms.fedavg import ServerLr
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.server_optim import server_optimizer_of
from fedexp.engine.solver.steps import unstack_states
from fedexp.transfer import to_device


class Scaffold(Algorithm):
    """SCAFFOLD, option II.

    Args:
        server_lr: η_g, the global step on the averaged model difference (1: the paper's
            experiments).
        weighting: "uniform" (the paper's mean over S) or "samples".
    """

    server_reads = "mean"  # Σ ω_n Δy_n and Σ ω_n Δc_n only
    server_optimized = True  # x moves by the run's server optimiser (FedAdam, ... on Σ ω_n Δy_n)
    downlink_parts = MappingProxyType({"x": "model", "c": "model"})
    uplink_parts = MappingProxyType({"dy": "update", "dc": "update"})
    # Δy is a model change (η_l × a pseudo-gradient), Δc a gradient: CER's γ on each as such
    update_scale = MappingProxyType({"dy": "step", "dc": "gradient", "c": "gradient"})

    def __init__(self, server_lr: ServerLr = 1.0, weighting: str = "uniform") -> None:
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting={weighting!r}: expected 'samples' or 'uniform'")
        self.server_lr = server_lr
        self.weighting = weighting

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """The model x = x0 and the control variate c = 0."""
        return {"x": x0.clone(), "c": torch.zeros_like(x0)}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """c_n = 0."""
        return {"c": torch.zeros_like(x0)}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """(x, c), the same for every client."""
        return broadcast(clients, {"x": server["x"], "c": server["c"]})

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """K corrected steps from x; c_n⁺ = c_n − c + (x − y)/(K η_l); send (x − y, c_n⁺ − c_n)."""
        assert isinstance(model_in, dict)
        x, c = model_in["x"], model_in["c"]
        c_n = states.stack("c").to(x)
        opt = ctx.optimizer
        objective = ctx.model_objective().with_linear(c - c_n)
        local = ctx.train(x, cohort, objective=objective, opt_states=opt.load(states))
        dy = x - local.params
        steps = ctx.cohort_steps(cohort)
        c_new = c_n - c + dy / (steps * ctx.lr)
        new_states = unstack_states(states, opt, local.opt_state, c=c_new)
        return CohortResult({"dy": dy, "dc": c_new - c_n}, new_states, {"train_loss": local.loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """X ← x − η_g Σ ω_n Δy_n and c ← c + share · Σ ω_n Δc_n (share = |S|/N when uniform).

        The x step is the run's ``server_optimizer``'s (FedAvg's by default).
        """
        if not updates:
            return server
        clients = sorted(updates)
        parts = update_parts(updates, clients)
        x = server["x"]
        w = to_device([weights[n] for n in clients], x.device, x.dtype)
        dy = w @ parts["dy"].reshape(len(clients), -1)
        dc = w @ parts["dc"].reshape(len(clients), -1)
        share = ctx.senders.share(self.weighting)
        server = {**server, "c": server["c"] + share * dc}
        return server_optimizer_of(ctx).step(ctx, server, "x", dy, self.server_lr)
