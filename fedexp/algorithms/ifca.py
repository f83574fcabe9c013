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
  ``"uniform"`` the former. The server-optimiser form (``server_lr``) is FedAvg's here, and
  the run's ``server_optimizer`` steps each cluster on its own mean (FedAdam etc.: moments
  ``[k, d]`` in the server state, a cluster nobody chose keeps its moments); Option I (one
  gradient per round, scaled by 1/m over all clients) is not provided.
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
  with the cluster model's running statistics), every client's training split gathered from
  the training pool at once (:func:`fedexp.engine.solver.losses.train_losses`); it draws
  nothing from the client's stream, so the minibatches are FedAvg's. Ties go to the lowest
  index; a non-finite loss never wins. The choice ĵ stays on the device (an argmin, then
  gathers and masks).
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
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.contract import update_parts
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.losses import train_losses
from fedexp.engine.solver.server_optim import server_optimizer_of
from fedexp.engine.solver.steps import unstack_states
from fedexp.transfer import to_device

#: stream purpose of the cluster initialisation (beside ``fedexp.streams``'s)
CLUSTER_INIT = 31


def restarted(opt_state: State | None, stayed: torch.Tensor) -> State | None:
    """The stacked optimiser state, kept in the rows ``stayed`` (bool [m]), fresh (zeros) else."""
    if opt_state is None:
        return None
    return {
        name: torch.where(stayed.to(v.device).view(-1, *[1] * (v.dim() - 1)), v, 0.0)
        for name, v in opt_state.items()
    }


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
    server_optimized = True  # each cluster is moved by its mean upload (ctx.server_optimizer)

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
            gen = streams.generator(ctx.seed, CLUSTER_INIT, j)
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

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """All k cluster models (one "model" part), the same for every client."""
        return broadcast(clients, {"clusters": server["clusters"]})

    # ----------------------------------------------------------------- client
    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """ĵ = argmin_j F_n(θ_j); E local steps from θ_ĵ; send Δ = θ_ĵ − θ^E and ĵ.

        F_n(θ_j): the mean task loss on the client's training split (eval mode), each cluster
        model scored on every client's split at once (``train_losses``). The choice stays on the
        device: a gather of the chosen rows, a mask of the clients that moved.
        """
        assert isinstance(model_in, dict)
        clusters = model_in["clusters"]  # [m, k, d]
        j, losses = self.estimate(ctx, clusters, cohort)
        rows = torch.arange(len(cohort), device=j.device)
        theta = clusters[rows, j]
        opt = ctx.optimizer
        stayed = states.stack("cluster")[:, 0].to(j.device) == j
        local = ctx.train(theta, cohort, opt_states=restarted(opt.load(states), stayed))
        chosen = j[:, None].to(theta.device)
        new_states = unstack_states(states, opt, local.opt_state, cluster=chosen)
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
        k = clusters.shape[1]
        losses = train_losses(ctx, lambda j, rows: clusters[rows, j], k, cohort.data).float()
        losses = torch.where(torch.isfinite(losses), losses, torch.full_like(losses, torch.inf))
        return torch.argmin(losses, dim=1), losses  # the first of equal losses

    # ----------------------------------------------------------------- server
    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """θ_j ← θ_j − η_s Σ_{ĵ_n = j} ω_n Δ_n / Σ_{ĵ_n = j} ω_n; unchosen clusters stay.

        Over the stacked uploads: a [k, m] membership mask of the clients' ĵ, one host read
        (whether an ĵ is out of range) and a product per cluster (k of them, for any cohort).

        Raises:
            ValueError: a client sent ĵ outside 0..k−1.
        """
        clusters = server["clusters"]
        if not updates:
            return {**server, "counts": torch.zeros(self.k, device=clusters.device)}
        clients = sorted(updates)
        parts = update_parts(updates, clients)
        deltas = parts["update"].reshape(len(clients), -1).to(clusters)
        j = parts["cluster"].reshape(len(clients), -1)[:, 0].round().long().to(clusters.device)
        bad = (j < 0) | (j >= self.k)
        if bool(bad.any()):
            i = int(bad.long().argmax())
            raise ValueError(
                f"client {clients[i]} sent cluster {int(j[i])}: expected 0 ≤ ĵ < k={self.k}"
            )
        member = j[None, :] == torch.arange(self.k, device=j.device)[:, None]  # [k, m]
        counts = member.sum(dim=1)
        # ω_n renormalised within each cluster, in float64 (a cluster of every client: the
        # weights already sum to one, kept as they are: k = 1 is FedAvg's sums bit for bit)
        w = to_device([weights[n] for n in clients], j.device, torch.float64)
        w = member * w
        total = w.sum(dim=1, keepdim=True)
        w = w / torch.where((counts[:, None] < len(clients)) & (total > 0), total, 1.0)
        w = w.to(deltas.dtype)
        mean = torch.stack([w[c] @ deltas for c in range(self.k)])  # as FedAvg's weighted_mean
        moved = server_optimizer_of(ctx).step(
            ctx, server, "clusters", mean.reshape(clusters.shape), self.server_lr, rows=counts > 0
        )  # an adaptive optimiser keeps moments per cluster ([k, d]); unchosen rows keep theirs
        return {**moved, "counts": counts.to(torch.float32)}

    def server_metrics(self, ctx: Context, server: State) -> dict[str, float]:
        """How many of the round's clients chose each cluster."""
        return {f"ifca/clients_{j}": float(c) for j, c in enumerate(server["counts"].tolist())}

    def eval_models(
        self, ctx: Context, server: State, states: list[State], cohort: Cohort
    ) -> torch.Tensor:
        """θ_ĵ with ĵ estimated on the client's training split from the current clusters."""
        j, _ = self.estimate(ctx, server["clusters"], cohort)
        return server["clusters"][j.to(server["clusters"].device)]

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """``evaluate="last"``: θ_ĵ of each client's last participation (θ_0 before its first)."""
        clusters = server["clusters"]
        j = states.stack("cluster")[:, 0].clamp_min(0)
        return clusters.index_select(0, j.to(clusters.device))
