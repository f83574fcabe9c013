"""SuPerFed, model mixing (Hahn, Jeong, Lee, KDD 2022; the authors' ``superfed-mm``).

"Connecting Low-Loss Subspace for Personalized Federated Learning", arXiv:2109.07628; the
authors' code: github.com/vaseline555/SuPerFed.

Client n keeps a local model w_l beside the federated model w_g it receives. For the first L
rounds (warm-up) it trains w_g alone; afterwards each minibatch draws λ ~ U(0, 1) and the joint
vector [w_g ; w_l] takes a step on

    ℓ((1 − λ) w_g + λ w_l; ξ) + μ ‖w_g − w_g^t‖² + ν cos²(w_g, w_l),

w_g^t the model received this round, cos(a, b) = ⟨a, b⟩ / (‖a‖ ‖b‖). The client sends
Δ = w_g^t − w_g^E; the server is FedAvg's. The personalised model is the mixture at the
evaluation λ. With λ ≡ 0 and μ = ν = 0 the global model is FedAvg's exactly (tested).

Choices where the paper, the authors' code and this engine differ:

* Proximal term: μ‖w_g − w_g^t‖² as the paper writes it; the authors' code adds
  μ Σ_layers ‖w_g − w_g^t‖₂ (not squared). As in their code it also applies in the warm-up
  rounds (FedProx with strength 2μ); μ = 0 makes the warm-up plain FedAvg.
* Mixed coordinates: every trainable parameter; the running statistics (BatchNorm) are
  w_g's, trained and averaged as FedAvg's (one set, as in their code). Their code gives
  local copies to the weights only: Linear/Conv biases stay global. μ and the cos² term are
  over all trainable parameters.
* Local model initialisation: their code initialises w_l per client with its own seed
  (``local_init: reinit``: every layer's ``reset_parameters`` under a (seed, client) stream);
  ``x0`` starts it at the common initial model instead (then cos² = 1 at the first mixed step).
* Evaluation λ: their code evaluates λ ∈ {0, 0.1, …, 1} and reports, per client, the best
  test accuracy over that grid. The engine's evaluation cannot see test labels (and should
  not), so ``eval_lambda: null`` picks, at the end of each of the client's mixing rounds, the
  grid λ with the lowest *training* loss; a number fixes λ for every client. Before a
  client's first mixing round it is evaluated with w_g (λ = 0).
* Optimiser: the run's; their code uses SGD, momentum 0.9, weight decay 1e-4, a fresh
  state every round (``optimizer.momentum=0.9 optimizer.weight_decay=1e-4
  optimizer.persistent=false``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial
from typing import Annotated

import torch

from fedexp import streams
from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import Fraction
from fedexp.config.ranges import NonNegativeInt
from fedexp.config.ranges import Range
from fedexp.data.client import ClientData
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.losses import train_losses
from fedexp.engine.solver.objective import Aux
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.optim import State as OptState
from fedexp.engine.solver.steps import unstack_states
from fedexp.models.flat import FlatModel
from fedexp.transfer import to_device

#: the evaluation grid of the authors' code
LAMBDA_GRID = tuple(i / 10 for i in range(11))


class SuPerFed(FedAvg):
    """SuPerFed (model mixing).

    Persists per client: ``local`` (w_l), ``lam_eval`` (its evaluation λ, 1-element), and the
    optimiser states ``opt.*`` (w_g's) and ``opt_l.*`` (w_l's). Metrics: ``train_loss`` (with
    the penalties), ``lam_eval`` (the clients' evaluation λ, mixing rounds only).

    Args:
        mu: μ ≥ 0, proximal strength towards the received global model.
        nu: ν ≥ 0, strength of the cos² (orthogonality) penalty between w_g and w_l.
        warmup_rounds: L, rounds before mixing starts (the authors: ⌊L·R⌋, L a fraction).
        eval_lambda: the evaluation λ ∈ [0, 1]; None: per client, the grid λ with the lowest
            training loss (see the module docstring).
        fixed_lambda: train with this λ instead of λ ~ U(0, 1) (tests, ablations).
        local_init: "reinit" (a per-client seeded re-initialisation, the authors') or "x0".
        server_lr: as FedAvg.
        weighting: as FedAvg.
    """

    def __init__(
        self,
        mu: Annotated[float, Range(ge=0, note="0: no proximal term")] = 0.01,
        nu: Annotated[float, Range(ge=0, note="0: no cos² term")] = 1.0,
        warmup_rounds: NonNegativeInt = 30,
        eval_lambda: Fraction | None = None,
        fixed_lambda: Fraction | None = None,
        local_init: str = "reinit",
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        if local_init not in ("reinit", "x0"):
            raise ValueError(f"local_init={local_init!r}: expected 'reinit' or 'x0'")
        self.init_per_client = local_init == "reinit"  # a (seed, client) stream each
        super().__init__(server_lr, weighting)
        self.mu, self.nu, self.warmup_rounds = mu, nu, warmup_rounds
        self.eval_lambda, self.fixed_lambda, self.local_init = eval_lambda, fixed_lambda, local_init

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """w_l: a per-client seeded re-initialisation (or x0); evaluation λ = 0."""
        local = x0.clone() if self.local_init == "x0" else reinit(ctx, client).to(x0)
        return {"local": local, "lam_eval": torch.zeros(1, dtype=x0.dtype, device=x0.device)}

    # ------------------------------------------------------------------ objective
    @staticmethod
    def mixture(
        ctx: Context, g: torch.Tensor, local: torch.Tensor, lam: float | torch.Tensor
    ) -> torch.Tensor:
        """(1 − λ) w_g + λ w_l on the parameters; running statistics from w_g (rows too)."""
        n = ctx.model.layout.num_params
        mixed = (1 - lam) * g[..., :n] + lam * local[..., :n]
        return torch.cat([mixed, g[..., n:]], dim=-1)

    def mix_loss(
        self,
        ctx: Context,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: Aux,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ℓ(mixture) + μ‖w_g − w_g^t‖² + ν cos²(w_g, w_l) over [w_g ; w_l]."""
        d = params.shape[-1] // 2
        n = ctx.model.layout.num_params
        g, local = params[:d], params[d:]
        lam = u[0] if self.fixed_lambda is None else self.fixed_lambda
        loss, post = ctx.model_loss(self.mixture(ctx, g, local, lam), x, y, aux, u)
        if self.mu:
            diff = g[:n] - aux["anchor"][:n]
            loss = loss + self.mu * (diff * diff).sum()
        if self.nu:
            loss = loss + self.nu * cos2(g[:n], local[:n])
        if post is not None:
            post = torch.cat([g.detach()[:n], post[n:], local.detach()])
        return loss, post

    def objective(self, ctx: Context, anchor: torch.Tensor) -> Objective:
        """The warm-up's objective of w_g: ℓ + μ‖w_g − w_g^t‖² (FedProx with strength 2μ)."""
        return ctx.proximal_objective(anchor, 2 * self.mu)

    def mixing_objective(self, ctx: Context, anchor: torch.Tensor) -> Objective:
        """The mixing objective over [w_g ; w_l] (``anchor``: the received w_g^t)."""
        frozen = None
        if ctx.model.has_buffers:
            frozen = torch.cat([ctx.model.buffer_mask, ctx.model.buffer_mask])
        return Objective(
            partial(self.mix_loss, ctx),
            aux={"anchor": anchor.detach()},
            frozen=frozen,
            noise=1 if self.fixed_lambda is None else 0,
        )

    # ---------------------------------------------------------------------- hooks
    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: list[State], cohort: Cohort
    ) -> CohortResult:
        """Warm-up: w_g alone (+ proximal term); then the mixture steps on [w_g ; w_l].

        E steps either way; in the mixing rounds each minibatch's λ ~ U(0, 1) comes from the
        client's own stream, and its evaluation λ is chosen after the steps. Send
        Δ = w_g^t − w_g^E.
        """
        assert isinstance(model_in, torch.Tensor)
        if ctx.round < self.warmup_rounds:  # FedAvg's steps on self.objective
            return super().client_update(ctx, model_in, states, cohort)
        opt = ctx.optimizer
        d = model_in.shape[-1]
        w_l = torch.stack([s["local"] for s in states])
        out = ctx.train(
            torch.cat([model_in.detach(), w_l], dim=1),
            cohort,
            objective=self.mixing_objective(ctx, model_in),
            opt_states=[
                merge_states(
                    opt.load(s) or opt.init(model_in[0]),
                    opt.load(s, "opt_l") or opt.init(s["local"]),
                )
                for s in states
            ],
        )
        g, w_l = out.params[:, :d], out.params[:, d:]
        lams = [self.eval_lambda] * len(cohort)
        if self.eval_lambda is None:
            lams = select_lambdas(ctx, g, w_l, cohort.data)
        halves = [split_state(out.opt_state, d, h) for h in (0, 1)]
        lam = to_device(lams, w_l.device, w_l.dtype)[:, None]
        new_states = unstack_states(states, opt, halves[0], local=w_l, lam_eval=lam)
        new_states = unstack_states(new_states, opt, halves[1], "opt_l")
        metrics = {"train_loss": out.loss, "lam_eval": lam[:, 0]}
        return CohortResult(model_in - g, new_states, metrics)

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """(1 − λ_n) w_g + λ_n w_l,n at each client's evaluation λ, w_g the global model."""
        g = server["x"].expand(len(clients), -1)
        lam = states.stack("lam_eval").to(g)
        return self.mixture(ctx, g, states.stack("local"), lam)


def cos2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """cos²(a, b) = ⟨a, b⟩² / (‖a‖² ‖b‖²) (0 if either vector is zero)."""
    return (a * b).sum() ** 2 / ((a * a).sum() * (b * b).sum()).clamp_min(1e-30)


def merge_states(g: OptState, local: OptState) -> OptState:
    """One optimiser state over [w_g ; w_l]: vectors concatenated, scalars (Adam's step) w_g's."""
    return {k: torch.cat([g[k], local[k]]) if g[k].dim() else g[k] for k in g}


def split_state(state: OptState, d: int, part: int) -> OptState:
    """The w_g (part 0) or w_l (part 1) half of the cohort's joint optimiser state.

    Of every client's state at once: [m, 2d] vectors halved, [m] scalars (Adam's step) kept.
    """
    return {k: (v[..., d * part : d * (part + 1)] if v.dim() >= 2 else v) for k, v in state.items()}


def reinit(ctx: Context, client: int) -> torch.Tensor:
    """The model re-initialised (every layer's ``reset_parameters``) from a (seed, client) stream.

    Each layer gets PyTorch's default initialisation (a model's own custom initialisation, e.g.
    MONAI DenseNet's Kaiming-normal convolutions, is not replayed). Runs on a CPU copy under a
    forked global generator: the run's other streams are untouched.
    """
    module = copy.deepcopy(ctx.model.module).to("cpu")
    with streams.seeded_global(streams.derive_seed(ctx.seed, streams.INIT, 1, client)):
        for m in module.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    return FlatModel(module, torch.device("cpu")).initial()


def select_lambdas(
    ctx: Context, g: torch.Tensor, local: torch.Tensor, data: Sequence[ClientData]
) -> list[float]:
    """Each client's grid λ whose mixture has the lowest loss on its training split.

    ``g``, ``local``: the clients' [m, d] rows. Each grid λ's mixtures are scored for all
    clients at once (:func:`fedexp.engine.solver.losses.train_losses`, the module in eval mode); the
    first λ of the lowest loss wins.
    """

    def mixtures(j: int, rows: slice) -> torch.Tensor:
        return SuPerFed.mixture(ctx, g[rows], local[rows], LAMBDA_GRID[j])

    losses = train_losses(ctx, mixtures, len(LAMBDA_GRID), data).cpu().nan_to_num(nan=float("inf"))
    best = torch.tensor(LAMBDA_GRID, dtype=torch.float64)[losses.argmin(dim=1)]  # first lowest
    return best.tolist()
