"""k-nearest-neighbour similarity network of pFedNet.

pFedNet (Liu et al., §III-A) links each client to its ``k`` nearest clients in
sketch distance (``k = 3`` in the paper's experiments) and takes the undirected union of those
relations as the edge set ``E``, each pair once. Edges are stored as a sorted ``(M, 2)`` int64
tensor with ``i < j`` in every row; that order fixes the column order of the incidence matrix
``Q`` (:mod:`fedexp.graph.incidence`). Details: ``docs/pfednet_math.md`` §1.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import torch

from fedexp.graph.incidence import as_edge_tensor
from fedexp.transfer import to_device

__all__ = ["Graph", "canonical_edges", "knn_edges", "laplacian"]


def canonical_edges(edges: torch.Tensor, num_nodes: int | None = None) -> torch.Tensor:
    """Put an undirected edge list in canonical form: ``i < j``, no duplicates, sorted.

    Args:
        edges: ``(M, 2)`` integer pairs in any orientation, possibly repeated.
        num_nodes: if given, every endpoint must lie in ``[0, num_nodes)``.

    Returns:
        ``(M', 2)`` int64 tensor on the CPU, rows sorted lexicographically.

    Raises:
        ValueError: on self loops or out-of-range endpoints.
    """
    e = as_edge_tensor(edges).cpu()
    if e.shape[0] == 0:
        return e
    if bool((e[:, 0] == e[:, 1]).any()):
        raise ValueError("self loops are not allowed")
    if bool((e < 0).any()) or (num_nodes is not None and bool((e >= num_nodes).any())):
        raise ValueError(f"edge endpoints must lie in [0, {num_nodes})")
    lo = torch.minimum(e[:, 0], e[:, 1])
    hi = torch.maximum(e[:, 0], e[:, 1])
    # torch.unique(dim=0) returns the unique rows sorted lexicographically.
    return torch.unique(torch.stack([lo, hi], dim=1), dim=0).contiguous()


def knn_edges(D: torch.Tensor, k: int) -> torch.Tensor:  # noqa: N803
    """Edge set of the symmetrised k-NN graph of a distance matrix.

    Row ``i`` of ``D`` ranks the other nodes; node ``i`` is linked to the ``k`` nodes with the
    smallest ``D[i, j]``, ``j ≠ i``, ties broken by the smaller index ``j``. The graph is the
    undirected union of those relations (an edge is kept if either endpoint chose the other).

    Args:
        D: ``(N, N)`` distance matrix (need not be symmetric; the diagonal is ignored).
        k: neighbours per node, ``k ≥ 1``; ``k ≥ N − 1`` gives the complete graph.

    Returns:
        ``(M, 2)`` int64 tensor on the CPU, ``i < j`` in each row, rows sorted, no duplicates.

    Raises:
        ValueError: if ``k < 1``, ``D`` is not square, or ``D`` has NaN off the diagonal.
    """
    if int(k) != k or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k}")
    k = int(k)
    if D.dim() != 2 or D.shape[0] != D.shape[1]:
        raise ValueError(f"D must be a square matrix, got shape {tuple(D.shape)}")
    n = D.shape[0]
    if n < 2:
        return torch.zeros((0, 2), dtype=torch.long)
    d = D.detach().to(device="cpu", dtype=torch.float64).clone()
    off = ~torch.eye(n, dtype=torch.bool)
    if bool(torch.isnan(d[off]).any()):
        raise ValueError("D has NaN entries off the diagonal")
    d.fill_diagonal_(float("inf"))
    kk = min(k, n - 1)
    # A stable sort keeps equal distances in index order: deterministic tie-breaking by index.
    # Self (+inf) sorts last; with +inf distances off the diagonal the self index may precede
    # them, so drop self explicitly rather than relying on the position.
    order = torch.sort(d, dim=1, stable=True).indices
    rows = torch.arange(n).unsqueeze(1).expand(n, n)
    not_self = order != rows
    order = order[not_self].view(n, n - 1)[:, :kk]
    src = torch.arange(n).repeat_interleave(kk)
    return canonical_edges(torch.stack([src, order.reshape(-1)], dim=1), n)


def laplacian(
    edges: torch.Tensor,
    num_nodes: int,
    weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dense graph Laplacian ``L = Q diag(w) Qᵀ`` (``= Q Qᵀ`` without weights).

    ``L[i, i] = Σ_{edges at i} w``, ``L[i, j] = −Σ_{edges (i,j)} w``. Duplicate edges add up.

    Args:
        edges: ``(M, 2)`` edge list.
        num_nodes: ``N``.
        weights: optional ``(M,)`` nonnegative edge weights (default: ones).
        dtype: dtype of the result.

    Returns:
        ``(N, N)`` symmetric positive semidefinite tensor on the edges' device.
    """
    e = as_edge_tensor(edges)
    m = e.shape[0]
    w = (
        torch.ones(m, dtype=dtype, device=e.device)
        if weights is None
        else to_device(weights, e.device, dtype)
    )
    if w.shape != (m,):
        raise ValueError(f"weights must have shape ({m},), got {tuple(w.shape)}")
    lap = torch.zeros((num_nodes, num_nodes), dtype=dtype, device=e.device)
    if m == 0:
        return lap
    i, j = e[:, 0], e[:, 1]
    lap.index_put_((i, j), -w, accumulate=True)
    lap.index_put_((j, i), -w, accumulate=True)
    lap.index_put_((i, i), w, accumulate=True)
    lap.index_put_((j, j), w, accumulate=True)
    return lap


@dataclass
class Graph:
    """An undirected similarity network: ``N`` nodes, canonical edges, edge weights.

    Attributes:
        num_nodes: ``N``.
        edges: ``(M, 2)`` int64 CPU tensor, ``i < j`` per row, sorted, no duplicates
            (canonicalised on construction).
        weights: ``(M,)`` float64 nonnegative edge weights ``w_ij`` (default ones, as in the
            paper). If ``edges`` needed reordering, pass weights aligned with the *given* rows:
            they are permuted along; duplicated pairs are rejected when weights are given.
    """

    num_nodes: int
    edges: torch.Tensor
    weights: torch.Tensor | None = field(default=None)

    def __post_init__(self) -> None:
        if self.num_nodes < 0:
            raise ValueError("num_nodes must be >= 0")
        raw = as_edge_tensor(self.edges).cpu()
        canon = canonical_edges(raw, self.num_nodes)
        if self.weights is None:
            w = torch.ones(canon.shape[0], dtype=torch.float64)
        else:
            w_raw = torch.as_tensor(self.weights, dtype=torch.float64).cpu()
            if w_raw.shape != (raw.shape[0],):
                raise ValueError(f"weights must have shape ({raw.shape[0]},)")
            if canon.shape[0] != raw.shape[0]:
                raise ValueError("duplicate edges are not allowed together with weights")
            if bool((w_raw < 0).any()):
                raise ValueError("edge weights must be nonnegative")
            # Map each given row to its position in the canonical order.
            lo = torch.minimum(raw[:, 0], raw[:, 1])
            hi = torch.maximum(raw[:, 0], raw[:, 1])
            key_raw = lo * max(self.num_nodes, 1) + hi
            key_can = canon[:, 0] * max(self.num_nodes, 1) + canon[:, 1]
            pos = torch.searchsorted(key_can, key_raw)
            w = torch.empty_like(w_raw)
            w[pos] = w_raw
        self.edges = canon
        self.weights = w

    @classmethod
    def from_knn(cls, D: torch.Tensor, k: int) -> Graph:  # noqa: N803
        """Build the k-NN similarity network of a distance matrix (see :func:`knn_edges`)."""
        return cls(num_nodes=int(D.shape[0]), edges=knn_edges(D, k))

    @property
    def num_edges(self) -> int:
        """``M``, the number of undirected edges."""
        return int(self.edges.shape[0])

    def degree(self, weighted: bool = False) -> torch.Tensor:
        """Node degrees: neighbour counts (int64), or weight sums (float64) if ``weighted``."""
        if weighted:
            deg = torch.zeros(self.num_nodes, dtype=torch.float64)
            deg.index_add_(0, self.edges[:, 0], self.weights)
            deg.index_add_(0, self.edges[:, 1], self.weights)
            return deg
        return torch.bincount(self.edges.reshape(-1), minlength=self.num_nodes)

    def neighbours(self, node: int) -> torch.Tensor:
        """Sorted indices of the nodes adjacent to ``node``."""
        e = self.edges
        nb = torch.cat([e[e[:, 0] == node, 1], e[e[:, 1] == node, 0]])
        return torch.sort(nb).values

    def laplacian(self, weighted: bool = False, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Dense Laplacian ``Q Qᵀ`` (or ``Q diag(w) Qᵀ`` if ``weighted``)."""
        return laplacian(
            self.edges, self.num_nodes, self.weights if weighted else None, dtype=dtype
        )

    def is_connected(self) -> bool:
        """True if the graph has one connected component (an empty or 1-node graph is)."""
        n = self.num_nodes
        if n <= 1:
            return True
        parent = list(range(n))

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        components = n
        for i, j in self.edges.tolist():
            ri, rj = find(i), find(j)
            if ri != rj:
                parent[ri] = rj
                components -= 1
        return components == 1
