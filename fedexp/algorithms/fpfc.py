"""FPFC (Yu, Liu, Wang, Sun 2022): fusion-penalised federated clustering by pairwise ADMM.

Paper: "Clustered Federated Learning based on Nonconvex Pairwise Fusion", arXiv:2211.04218;
code github.com/xueyu-ubc/FPFC. Objective ``Σ_i f_i(θ_i) + Σ_{i<j} P_{λ,a}(‖θ_i − θ_j‖)`` (SCAD or
MCP, :mod:`fedexp.graph.fusion`), solved by ADMM on the split ``ζ_ij = θ_i − θ_j`` with
duals ``v_ij`` over the complete graph's edges (i, j), i < j. Everything is batched over edges
with :mod:`fedexp.graph.incidence`: ``qt_rows`` gathers θ_i − θ_j per edge, ``q_rows`` scatters
row m to node i (+) and node j (−); no dense Q, no loop over pairs. A round:

1. downlink to each sampled client i its centre
   ``c_i = (1/(N−1)) Σ_{j≠i} (θ_j + ζ_ij − v_ij/ρ)`` (ζ_ji = −ζ_ij, v_ji = −v_ij), computed for
   every client at the end of the previous round in one scatter over the edges;
2. client i takes E local steps from its θ_i on
   ``f_i(θ) + (ρ/2) Σ_{j≠i} ‖θ − θ_j − ζ_ij + v_ij/ρ‖² = f_i(θ) + (ρ(N−1)/2)‖θ − c_i‖² + const``
   and uploads θ_i (a "model" part);
3. the server writes the received θ_i into Θ, then on every edge with a sampled endpoint
   ``ζ_ij ← prox_{P/ρ}(θ_i − θ_j + v_ij/ρ)``, then ``v_ij ← v_ij + ρ(θ_i − θ_j − ζ_ij)``
   (the authors' order and partial-participation rule: only pairs touching a sampled client).

Clients whose pairs are fused (``‖ζ_ij‖ ≤ ξ``; ξ = 0: ζ_ij = 0) form a cluster; the number of
connected components is logged as ``fpfc/clusters``. Each client is evaluated with its θ_i.

Differences from the authors' code, on purpose:

* The local proximal weight is the ADMM's ``ρ(N−1)`` around the mean over j ≠ i; the released
  code pulls with weight ρ towards the mean over all N terms (the j = i term being θ_i's
  previous value), a rescaled variant that is not the augmented Lagrangian's θ-step.
* An edge with both endpoints sampled is updated once (the code visits it from both sides,
  the second visit overwriting the first with the dual already moved).
* The authors' final post-processing (after the last round, clients whose ‖ζ_ij‖ is below a
  threshold, 3 by default, get their sample-weighted mean model) is not applied: evaluation
  uses θ_i every round; ``fpfc/clusters`` counts fused pairs at ‖ζ_ij‖ ≤ ξ instead.

The prox, its ξ-smoothing (the code's ``xi``) and its branches are the code's (group SCAD
thresholding on ‖δ‖); MCP is added with the same construction.

With λ = 0 the prox is the identity, so v ≡ 0, ζ_ij = θ_i − θ_j and c_i = θ_i: each client runs
proximal-point steps on its own f_i, decoupled from the others (local training as ρ → 0);
tested. Persists: the client's θ_i (and optimiser state); the server's Θ ``[N, d]``, ζ and v
``[M, d]`` (M = N(N−1)/2) and the centres ``[N, d]``. Memory is O(N² d) on the server, as in the
paper.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
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
from fedexp.algorithms.base import gather_rows
from fedexp.algorithms.base import scatter_rows
from fedexp.config.ranges import Positive
from fedexp.config.ranges import Range
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states
from fedexp.graph.fusion import check_penalty
from fedexp.graph.fusion import prox_rows
from fedexp.graph.incidence import q_rows
from fedexp.graph.incidence import qt_rows
from fedexp.transfer import to_device


def complete_edges(num_nodes: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The complete graph's edges ``(i, j)``, i < j, in row-major order, as ``(M, 2)`` int64."""
    return torch.triu_indices(num_nodes, num_nodes, offset=1, device=device).T.contiguous()


def count_clusters(fused: np.ndarray, num_nodes: int) -> int:
    """Connected components of the graph whose edges are the ``fused`` pairs.

    Args:
        fused: bool ``(M,)`` on the host, one flag a pair of :func:`complete_edges`' order.
        num_nodes: the clients.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    i, j = np.triu_indices(num_nodes, 1)  # complete_edges' order (row-major, i < j)
    i, j = i[fused], j[fused]
    adj = coo_matrix((np.ones(len(i)), (i, j)), shape=(num_nodes, num_nodes))
    return int(connected_components(adj, directed=False)[0])


class FPFC(Algorithm):
    """FPFC: ADMM on pairwise differences with a SCAD/MCP fusion penalty.

    Args:
        lam: λ ≥ 0, the fusion penalty's level (authors' default 0.6; 0: decoupled clients).
        a: concavity (SCAD 3.7, Fan & Li; SCAD needs a > 2 and ρ(a − 1) > 1, MCP aρ > 1).
        rho: ADMM penalty ρ > 0 (authors: 1).
        penalty: "scad" or "mcp".
        xi: smoothing ξ ∈ [0, λ) of the penalty near 0 (authors' code: 1e-4; 0: plain).
    """

    uplink_parts = {"": "model"}  # θ_i is a model: a lossy uplink codes its change

    def __init__(
        self,
        lam: Annotated[float, Range(ge=0, note="0 decouples the clients")] = 0.6,
        a: Annotated[float, Range(gt=0, note="SCAD needs > 2")] = 3.7,
        rho: Positive = 1.0,
        penalty: str = "scad",
        xi: Annotated[float, Range(ge=0, note="< λ when λ > 0")] = 1e-4,
    ) -> None:
        check_penalty(penalty, lam, a, rho, xi)
        self.lam, self.a, self.rho, self.penalty, self.xi = lam, a, rho, penalty, xi

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """Θ rows at x0; ζ = v = 0 (= x0 − x0); centres x0."""
        n = ctx.num_clients
        m = n * (n - 1) // 2
        theta = x0.expand(n, -1).clone()
        zeros = torch.zeros((m, x0.numel()), dtype=x0.dtype, device=x0.device)
        return {"theta": theta, "zeta": zeros, "dual": zeros.clone(), "centre": theta.clone()}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """θ_i starts at the common initial model."""
        return {"theta": x0.clone()}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """The clients' proximal centres c_i, [m, d]: one gather of the server's rows."""
        return StackedUpdates(clients, gather_rows(server["centre"], clients))

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """E local steps from θ_i on f_i + (ρ(N−1)/2)‖θ − c_i‖²; upload θ_i."""
        assert isinstance(model_in, torch.Tensor)
        opt = ctx.optimizer
        mu = self.rho * max(ctx.num_clients - 1, 1)
        local = ctx.train(
            states.stack("theta"),
            cohort,
            objective=ctx.proximal_objective(model_in.detach(), mu),
            opt_states=opt.load(states),
        )
        new_states = unstack_states(states, opt, local.opt_state, theta=local.params)
        return CohortResult(local.params, new_states, {"train_loss": local.loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """Write Θ; ζ- then v-step on the edges touching a sampled client; new centres."""
        if not updates:
            return server
        theta = scatter_rows(server["theta"], updates)
        n = theta.shape[0]
        sampled = to_device(sorted(updates), theta.device)
        edges = complete_edges(n, theta.device)
        touched = torch.zeros(n, dtype=torch.bool, device=theta.device).index_fill(0, sampled, True)
        active = (touched[edges[:, 0]] | touched[edges[:, 1]])[:, None]
        diff = qt_rows(theta, edges)  # θ_i − θ_j per edge
        rho = self.rho
        zeta_new = prox_rows(
            diff + server["dual"] / rho, self.penalty, self.lam, self.a, rho, self.xi
        )
        zeta = torch.where(active, zeta_new, server["zeta"])
        dual = torch.where(active, server["dual"] + rho * (diff - zeta), server["dual"])
        new = {"theta": theta, "zeta": zeta, "dual": dual}
        return {**server, **new, **self._centres(theta, zeta, dual)}

    def _centres(self, theta: torch.Tensor, zeta: torch.Tensor, dual: torch.Tensor) -> State:
        """c_i = (Σ_{j≠i} θ_j + Σ_m ±(ζ_m − v_m/ρ)) / (N − 1), one scatter over the edges."""
        n = theta.shape[0]
        if n == 1:
            return {"centre": theta.clone()}
        edges = complete_edges(n, theta.device)
        pairs = q_rows(zeta - dual / self.rho, edges, n)
        return {"centre": (theta.sum(dim=0) - theta + pairs) / (n - 1)}

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Every client's own θ_i, at once."""
        return states.stack("theta")

    def server_metrics(self, ctx: Context, server: State) -> dict[str, float]:
        """Clusters (components of the fused pairs ‖ζ_ij‖ ≤ ξ) and the primal residual."""
        n = server["theta"].shape[0]
        edges = complete_edges(n, server["theta"].device)
        norms = torch.linalg.vector_norm(server["zeta"], dim=1)
        residual = qt_rows(server["theta"], edges) - server["zeta"]
        # the fused flags and the residual's norm to the host in one read; the rest there
        both = torch.cat([(norms <= self.xi).double(), torch.linalg.vector_norm(residual)[None]])
        host = both.cpu().numpy()
        fused = host[:-1] > 0
        return {
            "fpfc/clusters": float(count_clusters(fused, n)),
            "fpfc/fused_pairs": float(fused.sum()),
            "fpfc/primal_residual": float(host[-1]),
        }
