"""FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, 2019): a shared body, personal heads.

"Federated Learning with Personalization Layers" (arXiv:1912.00818), Algorithm 1: the model is
a base (body) W_B, shared, and personalisation layers (head) W_P,n, one per client, that never
leave it. Each round client n receives the body, runs E local steps on (body, its own head)
jointly, keeps the head and returns the body; the server takes the sample-weighted average of
the bodies, W_B ← Σ_n (n_n / n_S) W_B,n. Client n is evaluated with the current body and its
own head.

Here, as FedAvg, the client sends Δ_n = body_in − body_n^E and the server steps
body ← body − η_s Σ_n ω_n Δ_n (η_s = 1 is the paper's average). Only the body's coordinates
cross the network, both ways. With no personal coordinates this is FedAvg exactly; with every
coordinate personal (the logistic regression of ``model=logreg``, whose ``personal`` is all of
it) it is local-only training (both tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

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
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.server_optim import server_optimizer_of
from fedexp.engine.solver.steps import unstack_states


def head_idx(ctx: Context, head: Sequence[str] | None) -> torch.Tensor:
    """Flat coordinates of the entries ``head`` matches (None: ``model.personal``), made once.

    Raises:
        ConfigError: patterns that match no entry of the model.
    """
    if head is None:
        return ctx.personal_idx
    patterns = list(head)
    return ctx.model.indices_once(
        ("head", tuple(patterns), str(ctx.device)),
        lambda: ctx.model.layout.matched(patterns, "algorithm.head", ctx.device),
    )


class FedPer(FedAvg):
    """FedPer. Persists: each client's head ``head`` and its optimiser state ``opt.*``.

    The server holds the full vector ``x``; only its body coordinates are used (its head
    coordinates stay at the initial model's).

    Args:
        head: glob patterns over the model's entry names that make the personal head (None:
            the model config's ``personal`` patterns, ``ctx.personal_idx``).
        server_lr: server step η_s on the averaged body difference (1: the paper's average).
        weighting: "samples" (ω_n ∝ n_train, the paper) or "uniform".
    """

    server_optimized = True  # the body is moved by the mean upload (ctx.server_optimizer)

    def __init__(
        self,
        head: Sequence[str] | None = None,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        if isinstance(head, str):
            raise ValueError(f"head={head!r}: expected a list of glob patterns")
        super().__init__(server_lr, weighting)
        self.head = None if head is None else [str(p) for p in head]

    # ------------------------------------------------------------------ the split
    def personal_idx(self, ctx: Context) -> torch.Tensor:
        """Flat coordinates of the personal part (FedPer: the head), made once a run."""
        return head_idx(ctx, self.head)

    def body_idx(self, ctx: Context) -> torch.Tensor:
        """Flat coordinates of the shared part: every coordinate not personal (made once)."""

        def complement() -> torch.Tensor:
            shared = torch.ones(ctx.model.layout.numel, dtype=torch.bool, device=ctx.device)
            shared[self.personal_idx(ctx)] = False
            return torch.nonzero(shared).flatten()

        head = None if self.head is None else tuple(self.head)
        return ctx.model.indices_once(
            ("body", type(self).__qualname__, head, str(ctx.device)), complement
        )

    def assemble(self, ctx: Context, body: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """The full model vector of a body and a head (rows of them: [m, ...] each)."""
        shape = (*body.shape[:-1], ctx.model.layout.numel)
        full = torch.empty(shape, dtype=body.dtype, device=body.device)
        full[..., self.body_idx(ctx)] = body
        full[..., self.personal_idx(ctx)] = head
        return full

    def train_mask(self, ctx: Context) -> torch.Tensor | None:
        """0/1 over the coordinates: what the local steps move (FedPer: everything, None)."""
        return None

    # ---------------------------------------------------------------------- hooks
    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """Every head starts at the initial model's."""
        return {"head": x0[self.personal_idx(ctx)].clone()}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """The body only, the same for every client (the head's bytes never cross)."""
        return broadcast(clients, server["x"][self.body_idx(ctx)])

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """E local steps on (received body, own head); keep the head, send Δ of the body."""
        assert isinstance(model_in, torch.Tensor)
        opt = ctx.optimizer
        local = ctx.train(
            self.assemble(ctx, model_in, states.stack("head")),
            cohort,
            objective=ctx.model_objective(),
            opt_states=opt.load(states),
            mask=self.train_mask(ctx),
        )
        head = local.params[:, self.personal_idx(ctx)]
        new_states = unstack_states(states, opt, local.opt_state, head=head)
        update = model_in - local.params[:, self.body_idx(ctx)]
        return CohortResult(update, new_states, {"train_loss": local.loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """Body ← body − η_s Σ ω_n Δ_n (the head coordinates of ``x`` are left alone).

        The step is the run's ``server_optimizer`` on the body's coordinates.
        """
        if not updates:
            return server
        mean = weighted_mean(updates, weights)
        return server_optimizer_of(ctx).step(
            ctx, server, "x", mean, self.server_lr, idx=self.body_idx(ctx)
        )

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """The current body with every client's own head, [m, d] at once.

        ``x`` holds the body in its body coordinates: its rows with the heads put in.
        """
        full = server["x"].expand(len(clients), -1).clone()
        full[:, self.personal_idx(ctx)] = states.stack("head").to(full)
        return full

    def global_vector(
        self, ctx: Context, server: State, average: Callable[[str], torch.Tensor]
    ) -> torch.Tensor | None:
        """None: the heads are never aggregated, so there is no global model to score."""
        return None

    def newcomer(
        self, ctx: Context, server: State, global_model: torch.Tensor | None, x0: torch.Tensor
    ) -> torch.Tensor | None:
        """The current body with a new head, the initial model's (what ``init_client`` gives).

        ``x`` holds exactly that: the body in its body coordinates, the initial head in the
        others; the new client's local steps then train both.
        """
        return server["x"]
