"""Edge-incidence operations of the similarity network, without a dense incidence matrix.

pFedNet (Liu et al., "pFedNet: personalised federated learning on a similarity network",
§III-B; ``docs/pfednet_math.md`` §1-§2) couples the personalised components through the matrix
``Q ∈ R^{N×M}``: column ``m`` belongs to edge ``(i, j)`` and holds ``+1`` in row ``i`` and
``-1`` in row ``j``. With ``Z = [z⁽¹⁾ … z⁽ᴺ⁾] ∈ R^{d2×N}``:

* ``(Z Q)[:, m] = z⁽ⁱ⁾ − z⁽ʲ⁾``  -- a gather-subtract, :func:`apply_Q`;
* ``(W Qᵀ)[:, n] = Σ_{m=(n,·)} W[:, m] − Σ_{m=(·,n)} W[:, m]``  -- a scatter-add,
  :func:`apply_Qt`;
* ``Q Qᵀ = L``, the (unweighted) graph Laplacian.

Both operations cost ``O(d2 · M)``; ``Q`` itself is materialised only where it is cheaper:
:class:`RowOps` multiplies by a dense ``Q`` on small graphs (``N · M · d2`` at most
:data:`DENSE_MAX`), where a gather or scatter costs more to launch than the product costs to
run, and :func:`incidence_matrix` builds one for tests.

Weights convention. The optional ``weights`` argument scales the columns of ``Q``:
``apply_Q(Z, edges, w) = Z Q diag(w)`` and ``apply_Qt(W, edges, N, w) = W diag(w) Qᵀ``, so that
``apply_Qt(apply_Q(Z, edges), edges, N, w) = Z Q diag(w) Qᵀ = Z L_w`` with ``L_w`` the weighted
Laplacian of :func:`fedexp.graph.knn.laplacian`. The pFedNet ADMM
(:mod:`fedexp.graph.admm`) does **not** use weighted incidence operations: it keeps
the unweighted split ``W = Z Q`` and puts edge weights into the penalty
``λ Σ_m w_m ‖W[:, m]‖_p`` (per-column prox thresholds ``λ w_m / ρ``).
"""

from __future__ import annotations

import torch

from fedexp.transfer import to_device

__all__ = [
    "DENSE_MAX",
    "RowOps",
    "apply_Q",
    "apply_Qt",
    "as_edge_tensor",
    "incidence_matrix",
    "q_rows",
    "qt_rows",
]

#: The largest ``N · M · d2`` whose row-layout products :class:`RowOps` takes with a dense ``Q``.
#: On this project's 2-core machine (float64, one thread) a gather-subtract and a scatter-add
#: cost about 24 µs together at any small size; the two dense products 3 µs at N = 5, M = 6,
#: d2 = 31 and 24 µs at N = 50, M = 73, d2 = 31 (``N · M · d2`` = 113k), and lose beyond.
DENSE_MAX = 65_536


def as_edge_tensor(edges: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Validate an edge list and return it as a contiguous ``(M, 2)`` int64 tensor.

    Args:
        edges: ``(M, 2)`` integer tensor (or anything ``torch.as_tensor`` accepts) of node pairs.
        device: device to put the result on (default: the input's device).

    Returns:
        The edge list, int64, shape ``(M, 2)`` (an empty list gives shape ``(0, 2)``).

    Raises:
        ValueError: if the shape is not ``(M, 2)``.
    """
    e = torch.as_tensor(edges, device=device)
    if e.numel() == 0:
        return torch.zeros((0, 2), dtype=torch.long, device=e.device)
    if e.dim() != 2 or e.shape[1] != 2:
        raise ValueError(f"edges must have shape (M, 2), got {tuple(e.shape)}")
    if e.dtype.is_floating_point or e.dtype == torch.bool:
        raise ValueError(f"edges must be an integer tensor, got {e.dtype}")
    return e.to(dtype=torch.long).contiguous()


def _check_weights(weights: torch.Tensor | None, m: int, like: torch.Tensor) -> torch.Tensor | None:
    if weights is None:
        return None
    w = to_device(weights, like.device, like.dtype)
    if w.shape != (m,):
        raise ValueError(f"weights must have shape ({m},), got {tuple(w.shape)}")
    return w


def apply_Q(  # noqa: N802 - the paper's name for the matrix
    Z: torch.Tensor,  # noqa: N803
    edges: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compute ``Z Q`` (optionally ``Z Q diag(w)``) by a gather-subtract over the edges.

    Args:
        Z: ``(d2, N)`` matrix whose columns are the nodes' personalised components.
        edges: ``(M, 2)`` edge list; edge ``m = (i, j)`` gives column ``Z[:, i] − Z[:, j]``.
        weights: optional ``(M,)`` column scaling (see the module docstring for the convention).

    Returns:
        ``(d2, M)`` tensor with the dtype and device of ``Z``.
    """
    if Z.dim() != 2:
        raise ValueError(f"Z must be 2-D (d2, N), got shape {tuple(Z.shape)}")
    e = as_edge_tensor(edges, device=Z.device)
    out = Z.index_select(1, e[:, 0]) - Z.index_select(1, e[:, 1])
    w = _check_weights(weights, e.shape[0], Z)
    if w is not None:
        out = out * w
    return out


def apply_Qt(  # noqa: N802 - the paper's name for the matrix
    W: torch.Tensor,  # noqa: N803
    edges: torch.Tensor,
    num_nodes: int,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compute ``W Qᵀ`` (optionally ``W diag(w) Qᵀ``) by a scatter-add over the edges.

    Column ``m`` of ``W`` (edge ``(i, j)``) is added to column ``i`` and subtracted from
    column ``j`` of the result.

    Args:
        W: ``(d2, M)`` matrix with one column per edge.
        edges: ``(M, 2)`` edge list.
        num_nodes: ``N``, the number of nodes (columns of the result).
        weights: optional ``(M,)`` column scaling of ``W`` (see the module docstring).

    Returns:
        ``(d2, N)`` tensor with the dtype and device of ``W``.
    """
    if W.dim() != 2:
        raise ValueError(f"W must be 2-D (d2, M), got shape {tuple(W.shape)}")
    e = as_edge_tensor(edges, device=W.device)
    if W.shape[1] != e.shape[0]:
        raise ValueError(f"W has {W.shape[1]} columns but there are {e.shape[0]} edges")
    w = _check_weights(weights, e.shape[0], W)
    cols = W if w is None else W * w
    out = torch.zeros((W.shape[0], num_nodes), dtype=W.dtype, device=W.device)
    if e.shape[0] == 0:
        return out
    out.index_add_(1, e[:, 0], cols)
    out.index_add_(1, e[:, 1], cols, alpha=-1)
    return out


def qt_rows(
    X: torch.Tensor,  # noqa: N803
    edges: torch.Tensor,
    out: torch.Tensor | None = None,
    tmp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-layout ``Qᵀ X = (Xᵀ Q)ᵀ``: row ``m`` is ``X[i] − X[j]`` for edge ``m = (i, j)``.

    The same operation as :func:`apply_Q` on ``Xᵀ``, with nodes along rows so that every
    gather moves a contiguous row (the layout the ADMM of
    :mod:`fedexp.graph.admm` iterates in).

    Args:
        X: ``(N, d)`` matrix, one row per node.
        edges: ``(M, 2)`` int64 edge list on ``X``'s device.
        out: optional ``(M, d)`` output buffer.
        tmp: optional ``(M, d)`` scratch buffer (avoids an allocation).

    Returns:
        ``(M, d)`` tensor (``out`` if given).
    """
    if out is None:
        out = X.index_select(0, edges[:, 0])
    else:
        torch.index_select(X, 0, edges[:, 0], out=out)
    if tmp is not None:
        out.sub_(torch.index_select(X, 0, edges[:, 1], out=tmp))
    else:
        out.sub_(X.index_select(0, edges[:, 1]))
    return out


def q_rows(
    Y: torch.Tensor,  # noqa: N803
    edges: torch.Tensor,
    num_nodes: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-layout ``Q Y = (Yᵀ Qᵀ)ᵀ``: row ``m`` of ``Y`` goes to row ``i`` (+) and row ``j`` (−).

    The same operation as :func:`apply_Qt` on ``Yᵀ``, scattering contiguous rows.

    Args:
        Y: ``(M, d)`` matrix, one row per edge.
        edges: ``(M, 2)`` int64 edge list on ``Y``'s device.
        num_nodes: ``N``.
        out: optional ``(N, d)`` output buffer (overwritten).

    Returns:
        ``(N, d)`` tensor (``out`` if given).
    """
    if out is None:
        out = torch.zeros((num_nodes, Y.shape[1]), dtype=Y.dtype, device=Y.device)
    else:
        out.zero_()
    if edges.shape[0] == 0:
        return out
    out.index_add_(0, edges[:, 0], Y)
    out.index_add_(0, edges[:, 1], Y, alpha=-1)
    return out


def incidence_matrix(
    edges: torch.Tensor,
    num_nodes: int,
    weights: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Dense incidence matrix ``Q`` (``N × M``), or ``Q diag(w)``: a reference for small graphs.

    Args:
        edges: ``(M, 2)`` edge list.
        num_nodes: ``N``.
        weights: optional ``(M,)`` column scaling.
        dtype: dtype of the result.

    Returns:
        ``(N, M)`` tensor with ``+1`` (or ``w_m``) at ``(i, m)`` and ``-1`` (``-w_m``) at
        ``(j, m)`` for edge ``m = (i, j)``.
    """
    e = as_edge_tensor(edges)
    m = e.shape[0]
    q = torch.zeros((num_nodes, m), dtype=dtype, device=e.device)
    cols = torch.arange(m, device=e.device)
    q[e[:, 0], cols] = 1.0
    q[e[:, 1], cols] = -1.0
    w = _check_weights(weights, m, q)
    if w is not None:
        q = q * w
    return q


class RowOps:
    """``Q Y`` and ``Qᵀ X`` in the row layout of one graph, for one dtype and device.

    :func:`q_rows` and :func:`qt_rows`, or, on a small graph (``dense``), products with a dense
    ``Q`` built once: one kernel each instead of two to four. The sums differ from the
    scatter's by rounding only (the entries are ±1 and 0).

    Args:
        edges: ``(M, 2)`` int64 edge list on the operands' device.
        num_nodes: ``N``.
        dense: multiply by a dense ``Q`` of this dtype (None: gathers and scatters).
    """

    def __init__(
        self, edges: torch.Tensor, num_nodes: int, dense: torch.dtype | None = None
    ) -> None:
        self.edges, self.num_nodes = edges, int(num_nodes)
        self.q_dense: torch.Tensor | None = None
        self.qt_dense: torch.Tensor | None = None
        if dense is not None:
            q = incidence_matrix(edges, self.num_nodes, dtype=dense).to(edges.device)
            self.q_dense, self.qt_dense = q, q.T.contiguous()

    @staticmethod
    def fits(num_nodes: int, num_edges: int, width: int) -> bool:
        """Whether products with a dense ``Q`` are the cheaper way (:data:`DENSE_MAX`)."""
        return num_nodes * num_edges * width <= DENSE_MAX

    def q(self, Y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # noqa: N803
        """``Q Y``: row ``m`` of ``Y`` added to row ``i``, taken from row ``j`` (:func:`q_rows`)."""
        if self.q_dense is None:
            return q_rows(Y, self.edges, self.num_nodes, out=out)
        return torch.mm(self.q_dense, Y, out=out) if out is not None else self.q_dense @ Y

    def qt(
        self,
        X: torch.Tensor,  # noqa: N803
        out: torch.Tensor | None = None,
        tmp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``Qᵀ X``: row ``m`` is ``X[i] − X[j]`` (:func:`qt_rows`; ``tmp``: its scratch)."""
        if self.qt_dense is None:
            return qt_rows(X, self.edges, out=out, tmp=tmp)
        return torch.mm(self.qt_dense, X, out=out) if out is not None else self.qt_dense @ X
