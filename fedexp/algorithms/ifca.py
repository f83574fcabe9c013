"""IFCA (Ghosh, Chung, Yin, Ramchandran, NeurIPS 2020): k cluster models, clients pick one.

"An Efficient Framework for Clustered Federated Learning", Algorithm 1 with Option II (model
averaging). The server keeps k cluster models θ_1..θ_k and sends all of them (the downlink
costs k models). Client n estimates its cluster ĵ = argmin_j F_n(θ_j), the loss of each
cluster model on its whole training split, runs E local steps from θ_ĵ and uploads
Δ_n = θ_ĵ − θ_n^E with ĵ. The server moves each cluster with the clients that chose it:
θ_j ← θ_j − η_s Σ_{n: ĵ_n = j} ω_n Δ_n / Σ_{n: ĵ_n = j} ω_n (η_s = 1: the weighted mean of
their models); a cluster nobody chose stays. Client n is evaluated with θ_{ĵ_n}.

Differences from the paper and the authors' code (github.com/jichan3751/ifca), and choices:

* Weights: Algorithm 1 averages the models of a cluster uniformly; the authors' FEMNIST
  code weights them by training samples. ``weighting="samples"`` (default) is the latter,
  ``"uniform"`` the former. The server-optimiser form (``server_lr``) is FedAvg's here;
  Option I (one gradient per round, scaled by 1/m over all clients) is not provided.
* Upload of the identity: the paper sends the one-hot s_n (k entries); here the index ĵ, one
  float32 ("exact" part: 4 bytes, never compressed), the same information.
* Initialisation: the authors build each cluster model from its own seed (``seed + j``). Here
  θ_0 = x0 exactly (so k = 1 is FedAvg bit for bit) and θ_j, j ≥ 1, permutes the entries of
  every parameter tensor of x0 with a stream derived from (seed, j): for the i.i.d.
  initialisers of the project's models (PyTorch defaults, Kaiming, constants) that is a draw
  from the same distribution as x0, without rebuilding the network. Constant tensors (zero
  biases, unit norm scales) and the running statistics stay as in x0. ``init_scale`` s
  interpolates: θ_j = x0 + s (perm_j(x0) − x0). The paper's random restarts (pick the best of
  several runs) and the FEMNIST warm start (a pretrained FedAvg model, 20 rounds of random
  forced assignments) are left to the experiment.
* The loss estimate runs the model in evaluation mode without gradients (no dropout; BatchNorm
  with the cluster model's running statistics), in chunks
  (:func:`fedexp.engine.solver.losses.train_losses`); it draws nothing from the client's stream, so
  the minibatches are FedAvg's. Ties go to the lowest index; a non-finite loss never wins.
* Optimiser state (momentum, Adam moments): kept between rounds while the client stays in the
  same cluster, restarted fresh when ĵ changes (the old state belongs to another model).
* Evaluation (``evaluate="estimate"``, the default): Algorithm 1 estimates a client's cluster
  from the current k models, ĵ = argmin_j F_n(θ_j); so at every evaluation each evaluated
  client scores the current cluster models on its training split (as in training) and is
  tested with the best one (nothing is kept; the authors' MNIST code re-estimates the same way
  at every evaluation). ``evaluate="last"``: the cluster it chose at its last participation
  (θ_0 before its first; the authors' FEMNIST code reuses the training-time identity), which
  at low participation can be stale.
* The paper's weight-sharing variant (layers shared by all clusters) is not implemented.

Persists: the server's ``clusters`` [k, d] and ``counts`` [k] (clients per cluster in the
last round, logged as ``ifca/clients_<j>``); each client's ``cluster`` ([1], −1 before its
first participation) and its optimiser state.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Annotated

import torch

from fedexp.algorithms.base import (
    Algorithm,
    Cohort,
    CohortResult,
    Message,
    Stacked,
    StackedUpdates,
    State,
    weighted_mean,
)
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import PositiveInt, Range
from fedexp.engine import rng
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.losses import train_losses
from fedexp.engine.solver.steps import unstack_states

#: stream purpose of the cluster initialisation (beside ``fedexp.engine.rng``'s)
CLUSTER_INIT = 31


class IFCA(Algorithm):
    """Iterative Federated Clustering Algorithm.

    Args:
        k: number of cluster models (the authors' runs use the true number of clusters: 2 or
            4 on synthetic data, 4 on rotated MNIST, 2 on rotated CIFAR-10, 2 or 3 on FEMNIST).
        server_lr: server step η_s on each cluster's averaged model difference (1: the
            average of the cluster's models, Algorithm 1's Option II).
        weighting: "samples" (ω_n ∝ n_train within a cluster, the authors' code) or "uniform"
            (Algorithm 1's plain mean).
        init_scale: s ≥ 0; clusters j ≥ 1 start at x0 + s (perm_j(x0) − x0) (1: an
            independent draw of the initialiser; 0: every cluster at x0, so round 0 is FedAvg's
            and the other clusters start to move only when a client prefers x0 to θ_0).
        evaluate: "estimate" (the current cluster of lowest training loss, Algorithm 1's
            estimate) or "last" (the cluster of the client's last participation).
    """

    uplink_parts = MappingProxyType({"cluster": "exact"})

    def __init__(
        self,
        k: PositiveInt = 2,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
        init_scale: Annotated[float, Range(ge=0, note="0: every cluster at x0")] = 1.0,
        evaluate: str = "estimate",
    ) -> None:
        if weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting={weighting!r}: expected 'samples' or 'uniform'")
        if evaluate not in ("estimate", "last"):
            raise ValueError(f"evaluate={evaluate!r}: expected 'estimate' or 'last'")
        self.evaluate = evaluate
        self.eval_with_data = evaluate == "estimate"
        self.k, self.server_lr = k, server_lr
        self.weighting, self.init_scale = weighting, init_scale

    # ------------------------------------------------------------------ state
    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """θ_0 = x0; θ_j = x0 + s (perm_j(x0) − x0), parameters permuted per tensor."""
        layout = ctx.model.layout
        clusters = [x0.clone()]
        for j in range(1, self.k):
            gen = rng.generator(ctx.seed, CLUSTER_INIT, j)
            drawn = x0.clone()
            for shape, off in zip(layout.shapes, layout.offsets, strict=True):
                if off >= layout.num_params:
                    break  # running statistics are not drawn
                size = int(torch.Size(shape).numel())
                perm = torch.randperm(size, generator=gen).to(x0.device)
                drawn[off : off + size] = x0[off : off + size][perm]
            clusters.append(torch.lerp(x0, drawn, self.init_scale))
        return {"clusters": torch.stack(clusters), "counts": torch.zeros(self.k, device=x0.device)}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """No cluster chosen yet (−1)."""
        return {"cluster": torch.full((1,), -1, dtype=torch.long, device=x0.device)}

    def downlink(self, ctx: Context, server: State, client: int) -> Message:
        """All k cluster models (one "model" part)."""
        return {"clusters": server["clusters"]}

    # ----------------------------------------------------------------- client
    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: list[State], cohort: Cohort
    ) -> CohortResult:
        """ĵ = argmin_j F_n(θ_j); E local steps from θ_ĵ; send Δ = θ_ĵ − θ^E and ĵ.

        F_n(θ_j): the mean task loss on the client's training split (eval mode), each cluster
        model scored on every client's split at once (:func:`train_losses`).
        """
        assert isinstance(model_in, dict)
        clusters = model_in["clusters"]  # [m, k, d]
        j, losses = self.estimate(ctx, clusters, cohort)
        rows = torch.arange(len(cohort), device=j.device)
        theta = clusters[rows, j]
        opt = ctx.optimizer
        before = torch.stack([s["cluster"][0] for s in states]).tolist()
        local = ctx.train(
            theta,
            cohort,
            opt_states=[  # kept in the same cluster, fresh when ĵ changed
                opt.load(s) if b == c else None
                for s, b, c in zip(states, before, j.tolist(), strict=True)
            ],
        )
        chosen = j[:, None].to(theta.device)
        kept = [{k: v for k, v in s.items() if not k.startswith("opt.")} for s in states]
        new_states = unstack_states(kept, opt, local.opt_state, cluster=chosen)
        upload = {"update": theta - local.params, "cluster": chosen}
        metrics = {"train_loss": local.loss, "cluster_loss": losses[rows, j]}
        return CohortResult(upload, new_states, metrics)

    def estimate(
        self, ctx: Context, clusters: torch.Tensor, cohort: Cohort
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ĵ = argmin_j F_n(θ_j) for each client of ``cohort``: ([m] indices, [m, k] losses).

        ``clusters`` [m, k, d] (each client's received models) or [k, d] (the server's).
        """
        if clusters.dim() == 2:
            clusters = clusters.expand(len(cohort), -1, -1)
        losses = train_losses(
            ctx, lambda j, rows: clusters[rows, j], clusters.shape[1], cohort.data
        ).float()
        losses = torch.where(torch.isfinite(losses), losses, torch.full_like(losses, torch.inf))
        return torch.argmin(losses, dim=1), losses  # the first of equal losses

    # ----------------------------------------------------------------- server
    def server_update(
        self,
        ctx: Context,
        server: State,
        updates: dict[int, Message],
        weights: dict[int, float],
    ) -> State:
        """θ_j ← θ_j − η_s Σ_{ĵ_n = j} ω_n Δ_n / Σ_{ĵ_n = j} ω_n; unchosen clusters stay."""
        clusters = server["clusters"]
        counts = torch.zeros(self.k, device=clusters.device)
        chosen: dict[int, int] = {}
        for n, msg in updates.items():
            assert isinstance(msg, dict)
            j = int(round(float(msg["cluster"].reshape(-1)[0])))
            if not 0 <= j < self.k:
                raise ValueError(f"client {n} sent cluster {j}: expected 0 ≤ ĵ < k={self.k}")
            chosen[n] = j
        new = clusters.clone()
        for j in range(self.k):
            members = [n for n in sorted(updates) if chosen[n] == j]
            if not members:
                continue
            w = {n: weights[n] for n in members}
            if len(members) < len(updates):  # all of them: the weights already sum to one
                total = sum(w.values())
                w = {n: v / total for n, v in w.items()}
            rows = torch.stack([updates[n]["update"] for n in members])  # type: ignore[index]
            stack = StackedUpdates(members, rows)  # read as FedAvg's (k = 1: the same sums)
            new[j] = clusters[j] - self.server_lr * weighted_mean(stack, w)
            counts[j] = len(members)
        return {**server, "clusters": new, "counts": counts}

    def server_metrics(self, ctx: Context, server: State) -> dict[str, float]:
        """How many of the round's clients chose each cluster."""
        return {f"ifca/clients_{j}": float(c) for j, c in enumerate(server["counts"].tolist())}

    def eval_models(
        self, ctx: Context, server: State, states: list[State], cohort: Cohort
    ) -> torch.Tensor:
        """θ_ĵ with ĵ estimated on the client's training split from the current clusters."""
        j, _ = self.estimate(ctx, server["clusters"], cohort)
        return server["clusters"][j.to(server["clusters"].device)]

    def eval_params(
        self, ctx: Context, server: State, client_state: State, client: int
    ) -> torch.Tensor:
        """``evaluate="last"``: θ_ĵ of the client's last participation (θ_0 before its first)."""
        j = max(int(client_state["cluster"][0]), 0)
        return server["clusters"][j]
