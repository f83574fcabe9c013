"""pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020): personalised FL with Moreau envelopes.

Client i minimises the Moreau envelope F_i(w) = min_θ f_i(θ) + (λ/2)‖θ − w‖² (pFedMe, eq. 2-3).
Algorithm 1: from w_{i,0} = w (the received global model), for r = 0..R−1 it draws ONE
minibatch, approximately solves the inner problem θ̃ = argmin_θ f_i(θ; batch) + (λ/2)‖θ − w_{i,r}‖²
with K gradient steps (step ``personal_lr``) on that same minibatch, then takes the envelope step
w_{i,r+1} = w_{i,r} − ηλ(w_{i,r} − θ̃) (η the run's ``lr``). It uploads Δ_i = w − w_{i,R}; the
server sets w ← (1 − β)w + β Σ ω_i w_{i,R} = w − β Σ ω_i Δ_i (FedAvg's server with η_s = β).
Clients are evaluated with their last θ̃ (the personalised model).

Who trains: Algorithm 1 (lines 4-9) has the server send w to all clients, every client run its
R local rounds, and the server aggregate a sampled subset S of the clients' w_{i,R}
(``all_train=true``, the default, as the authors' code): every client's θ̃ moves every round,
the downlink reaches every client and only the sampled ones upload. ``all_train=false`` runs
the sampled clients only (cheaper on a large population; the unsampled keep their θ̃).

Choices, from the authors' code (github.com/CharlieDinh/pFedMe, ``userpFedMe.py``,
``pFedMeOptimizer``), where Algorithm 1 is silent or differs:

* θ starts at the received w and each local round's K steps start from the previous θ̃ (warm
  start; the code steps the model's parameters and never resets them to w_{i,r}).
* ω_i ∝ n_i over the sampled clients (``weighting="samples"``, the code's
  ``persionalized_aggregate_parameters``); Algorithm 1 writes the plain mean 1/S
  (``weighting="uniform"``).
* Not followed: the code's inner step adds an undocumented weight decay μθ (μ = 0.001), and its
  θ̃ aliases the model's parameters, which are overwritten by w_{i,R} after training, so its
  "personalised" accuracy is measured on w_{i,R}. Here the inner steps are the paper's plain
  gradient steps on f_i + (λ/2)‖θ − w_{i,r}‖², and θ̃ is evaluated (the paper's intent).
* BatchNorm statistics (not in the paper): they receive no gradient, so w_{i,r+1} takes θ̃'s
  statistics (those of the latest forward passes) instead of the envelope step.

The inner solver is plain SGD (the paper's); the run's ``optimizer`` is not used.

Persists: θ̃_i (client state ``theta``; the common initial model before the first participation).
"""

from __future__ import annotations

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import Positive
from fedexp.config.ranges import PositiveInt
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.optim import SGD
from fedexp.engine.solver.steps import check_rows
from fedexp.engine.solver.steps import draw_batch
from fedexp.engine.solver.steps import unstack_states


class PFedMe(FedAvg):
    """pFedMe.

    Args:
        lam: λ > 0, the Moreau envelope's regularisation strength.
        personal_steps: K, gradient steps on the inner problem per local round.
        personal_lr: step size of the K inner steps.
        beta: β, the server's mixing (1: the weighted mean of the clients' w_{i,R}).
        local_rounds: R, local rounds (one minibatch each) per round (None: the run's local
            steps / epochs).
        weighting: "samples" (the authors' code) or "uniform" (Algorithm 1).
        all_train: every client trains each round, the sampled ones upload (Algorithm 1,
            lines 4-9); False: the sampled clients only.
    """

    def __init__(
        self,
        lam: Positive = 12.0,
        personal_steps: PositiveInt = 5,
        personal_lr: Positive = 0.08,
        beta: ServerLr = 1.0,
        local_rounds: PositiveInt | None = None,
        weighting: str = "samples",
        all_train: bool = True,
    ) -> None:
        super().__init__(server_lr=beta, weighting=weighting)
        self.lam, self.personal_steps, self.personal_lr = lam, personal_steps, personal_lr
        self.beta, self.local_rounds, self.all_train = beta, local_rounds, all_train
        self.inner = SGD(persistent=False)

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """θ̃ starts at the common initial model (evaluated until the first participation)."""
        return {"theta": x0.clone()}

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: list[State], cohort: Cohort
    ) -> CohortResult:
        """R local rounds: one minibatch, K inner steps giving θ̃, one envelope step on w.

        Each local round draws every client's minibatch at once and runs the K inner steps as
        one stacked run on them; running statistics of w are θ̃'s.
        """
        assert isinstance(model_in, torch.Tensor)
        rounds = ctx.cohort_steps(cohort) if self.local_rounds is None else self.local_rounds
        frozen = ctx.model.buffer_mask if ctx.model.has_buffers else None
        w = model_in.detach().clone()
        theta, total = w, torch.zeros(len(cohort), device=w.device)
        for _ in range(rounds):
            inner = ctx.train(
                theta,
                cohort,
                objective=ctx.proximal_objective(w, self.lam),
                optimizer=self.inner,
                steps=self.personal_steps,
                lr=self.personal_lr,
                batch=draw_batch(ctx, cohort),
            )
            theta, total = inner.params, total + inner.loss
            new_w = w - ctx.lr * self.lam * (w - theta)
            w = new_w if frozen is None else torch.where(frozen, theta, new_w)
        check_rows(ctx, cohort, w, total, ctx.lr)
        new_states = unstack_states(states, self.inner, {}, theta=theta)
        return CohortResult(model_in - w, new_states, {"train_loss": total / max(rounds, 1)})

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Every client's personalised model θ̃_i, at once."""
        return states.stack("theta")
