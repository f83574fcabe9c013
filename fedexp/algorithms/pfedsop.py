"""pFedSOP (Sen & Mohan, 2025): a Gompertz-personalised regularised-Fisher step per client.

"pFedSOP: Accelerating Training Of Personalized Federated Learning Using Second-Order
Optimization", arXiv:2506.07159 (the authors released no code).

The server keeps only the global gradient update Δ_{t−1} (zero before the first round) and
sends it, an *update*, not a model. Client i keeps its personal model x_i, its last local
gradient update Δ_i and whether it has taken part before. In round t (Algorithms 1–3):

1. A returning client personalises the global update (Alg. 1, Eq. 14–15):
   θ = arccos(cos(Δ_i, Δ_{t−1})), β = 1 − exp(−exp(−λ(θ − 1))) (Gompertz),
   Δp = (1 − β) Δ_i + β Δ_{t−1}; then takes one regularised-Fisher (Newton) step
   x_i ← x_i − η₁ (Δp Δpᵀ + ρI)⁻¹ Δp = x_i − η₁ Δp / (ρ + ‖Δp‖²) (Sherman–Morrison, Eq. 18–19).
   A new client takes no step: its x_i is the common initial model x (Alg. 3, line 6).
2. From x_i⁰ = x_i (after the step) it runs T local SGD steps (the run's local steps / epochs,
   step η₂ = the run's lr) and sends Δ_i = (x_i⁰ − x_i^T)/η₂ (Alg. 2, Eq. 11), the sum of its
   T gradients.
3. The server sets Δ_t = (1/K′) Σ_j Δ_j over the K′ received updates (Eq. 13).

Clients are evaluated with x_i (never-sampled clients: the initial model).

Choices where the paper is silent or open to two readings (summarised in docs/algorithms.md):

* x_i keeps the point after the Newton step, not x_i^T: Algorithm 2 only *computes* Δ_i "at the
  point x_it" and Algorithm 3 outputs x_it (Alg. 1, line 6) as the personal model, so the local
  SGD iterates are discarded. ``keep_trained=True`` is the other reading (x_i ← x_i^T).
* If Δ_i or Δ_{t−1} is zero the cosine is taken as 0 (θ = π/2), as
  ``torch.nn.functional.cosine_similarity`` does; it is clamped to [−1, 1] before arccos.
* "Without PC" (Table III): the paper does not spell the ablation out. The personalisation
  component is the Gompertz mix of Eq. 14–15; without it Δp = Δ_{t−1} (β ≡ 1): every client
  steps along the global update. (The paper's Fig. 5, where the PC lowers the training loss
  faster, fits this reading, not the local-only Δp = Δ_i.)
* η₁ is not given in the paper (one learning rate η per run, Table IV): ``personal_lr=None``
  uses the run's lr.
* Running statistics (BatchNorm buffers) are not gradients: Δ_i is zero there (so are Δ_{t−1}
  and the Newton step), and x_i takes them from x_i^T, the forward passes of the local steps.
* The local steps use the run's optimiser, its state persisting as in FedAvg; with plain SGD
  (the paper's) Δ_i is exactly the sum of the T minibatch gradients.
"""

from __future__ import annotations

from functools import partial
from types import MappingProxyType
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
from fedexp.config.ranges import Positive
from fedexp.config.ranges import Range
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states


def gompertz(theta: torch.Tensor, lam: float) -> torch.Tensor:
    """β = 1 − exp(−exp(−λ(θ − 1))) (Eq. 14): near 1 for θ ≪ 1, 1 − 1/e at θ = 1, → 0."""
    return 1 - torch.exp(-torch.exp(-lam * (theta - 1)))


def angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Arccos of the cosine of ``a`` and ``b`` (clamped to [−1, 1]; 0 if either is zero)."""
    norms = a.norm() * b.norm()
    cos = torch.where(norms > 0, (a @ b) / torch.where(norms > 0, norms, 1), 0)
    return torch.arccos(cos.clamp(-1.0, 1.0))


def sop_direction(dp: torch.Tensor, rho: float) -> torch.Tensor:
    """(Δp Δpᵀ + ρI)⁻¹ Δp = Δp / (ρ + ‖Δp‖²) (Sherman–Morrison, Eq. 18), in O(d)."""
    return dp / (rho + dp @ dp)


class PFedSOP(Algorithm):
    """pFedSOP.

    Persists: server ``delta`` (Δ_{t−1}); per client ``x`` (personal model), ``delta`` (Δ_i),
    ``seen`` (1-element float, 1 once it has taken part) and ``opt.*`` (the run's optimiser).

    Metrics: ``train_loss`` (mean loss of the local steps).

    Args:
        rho: ρ > 0, the Fisher regularisation (paper: 1).
        lam: λ > 0, the steepness of the Gompertz function (paper: 1).
        personal_lr: η₁ of the Newton step (None: the run's lr).
        personal_correction: the Gompertz mix of Δ_i and Δ_{t−1}; False is the "without PC"
            ablation (Table III): Δp = Δ_{t−1}.
        keep_trained: False (the paper): x_i stays at the Newton step's point; True: x_i ← x_i^T.
        weighting: "uniform" (Eq. 13: the plain mean) or "samples".
    """

    server_reads = "mean"  # the server step reads Σ ω_n u_n only (central DP noises it)

    downlink_parts = MappingProxyType({"": "update"})
    update_scale = "gradient"  # Δ_i = (x⁰ − x^T) / η₂ and Δ_{t−1} are pseudo-gradients

    def __init__(
        self,
        rho: Positive = 1.0,
        lam: Positive = 1.0,
        personal_lr: Annotated[float, Range(ge=0, note="0: no Newton step")] | None = None,
        personal_correction: bool = True,
        keep_trained: bool = False,
        weighting: str = "uniform",
    ) -> None:
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting={weighting!r}: expected 'samples' or 'uniform'")
        self.rho, self.lam, self.personal_lr = rho, lam, personal_lr
        self.personal_correction, self.keep_trained = personal_correction, keep_trained
        self.weighting = weighting

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """Δ_0 = 0: no global update before the first round."""
        return {"delta": torch.zeros_like(x0)}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """x_i = the common initial model; no Δ_i yet."""
        return {"x": x0.clone(), "delta": torch.zeros_like(x0), "seen": x0.new_zeros(1)}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """The global gradient update Δ_{t−1} (coded as an update), the same for every client."""
        return broadcast(clients, server["delta"])

    def personalized_update(self, local: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
        """Δp = (1 − β) Δ_i + β Δ_{t−1} (Eq. 15); Δ_{t−1} alone without the PC."""
        if not self.personal_correction:
            return glob
        beta = gompertz(angle(local, glob), self.lam)
        return (1 - beta) * local + beta * glob

    def newton_start(
        self,
        eta1: float,
        x: torch.Tensor,
        delta: torch.Tensor,
        glob: torch.Tensor,
        seen: torch.Tensor,
    ) -> torch.Tensor:
        """One client's start: x_i − η₁ (Δp Δpᵀ + ρI)⁻¹ Δp if it has taken part before, else x_i."""
        stepped = x - eta1 * sop_direction(self.personalized_update(delta, glob), self.rho)
        return torch.where(seen > 0, stepped, x)

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """Newton step (returning clients), T local steps from it, send Δ_i = (x⁰ − x^T)/η₂.

        The local steps start at x_i − η₁ (Δp Δpᵀ + ρI)⁻¹ Δp for a returning client, at x_i for
        a new one. Running statistics: Δ_i is zero there and x_i takes them from x^T.
        """
        assert isinstance(model_in, torch.Tensor)
        x, delta, seen = (states.stack(k) for k in ("x", "delta", "seen"))
        eta1 = ctx.lr if self.personal_lr is None else self.personal_lr
        x_start = torch.func.vmap(partial(self.newton_start, eta1))(x, delta, model_in.to(x), seen)
        opt = ctx.optimizer
        local = ctx.train(x_start, cohort, opt_states=opt.load(states))
        delta = (x_start - local.params) / ctx.lr
        x_new = local.params if self.keep_trained else x_start
        if ctx.model.has_buffers:  # running statistics: no gradient, taken from x^T
            stats = ctx.model.buffer_mask
            delta = delta.masked_fill(stats, 0.0)
            x_new = torch.where(stats, local.params, x_new)
        seen = torch.ones_like(x_new[:, :1])
        new_states = unstack_states(states, opt, local.opt_state, x=x_new, delta=delta, seen=seen)
        return CohortResult(delta, new_states, {"train_loss": local.loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """Δ_t = the mean of the received Δ_j (Eq. 13); unchanged if none arrived."""
        if not updates:
            return server
        return {**server, "delta": weighted_mean(updates, weights)}

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Every client's own x_i, at once."""
        return states.stack("x")
