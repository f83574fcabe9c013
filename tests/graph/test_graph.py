"""Tests of the pFedNet similarity network: sketches, k-NN graph, incidence operations."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from fedexp.graph import Graph
from fedexp.graph import apply_Q
from fedexp.graph import apply_Qt
from fedexp.graph import canonical_edges
from fedexp.graph import covariance_sketch
from fedexp.graph import incidence_matrix
from fedexp.graph import kernel_sketch
from fedexp.graph import knn_edges
from fedexp.graph import label_sketch
from fedexp.graph import laplacian
from fedexp.graph import make_rff
from fedexp.graph import median_bandwidth
from fedexp.graph import model_sketch
from fedexp.graph import sketch_distances
from fedexp.graph.incidence import DENSE_MAX
from fedexp.graph.incidence import RowOps
from fedexp.graph.incidence import q_rows
from fedexp.graph.incidence import qt_rows


def _random_distances(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pts = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return sketch_distances(pts)


def _brute_knn(d: torch.Tensor, k: int) -> set[tuple[int, int]]:
    n = d.shape[0]
    out: set[tuple[int, int]] = set()
    for i in range(n):
        others = sorted((float(d[i, j]), j) for j in range(n) if j != i)
        for _, j in others[:k]:
            out.add((min(i, j), max(i, j)))
    return out


# ------------------------------------------------------------------------------------ k-NN


@pytest.mark.parametrize("n", [2, 3, 5, 8, 13])
def test_knn_edges_properties(n: int) -> None:
    for seed, k in itertools.product(range(3), range(1, n + 2)):
        d = _random_distances(n, seed)
        e = knn_edges(d, k)
        assert e.dtype == torch.long and e.dim() == 2 and e.shape[1] == 2
        # no self loops, i < j, no duplicates, sorted
        assert bool((e[:, 0] < e[:, 1]).all())
        pairs = [tuple(r) for r in e.tolist()]
        assert len(pairs) == len(set(pairs))
        assert pairs == sorted(pairs)
        # every node has at least min(k, N-1) neighbours
        deg = torch.bincount(e.reshape(-1), minlength=n)
        assert bool((deg >= min(k, n - 1)).all())
        # exactly the undirected union of the k-NN relations
        assert set(pairs) == _brute_knn(d, k)
        if k >= n - 1:
            assert len(pairs) == n * (n - 1) // 2


def test_knn_ties_broken_by_index() -> None:
    d = torch.ones(6, 6)
    e = knn_edges(d, 2)
    # node i chooses the two smallest indices other than itself
    expected = _brute_knn(d, 2)
    assert {tuple(r) for r in e.tolist()} == expected
    assert {tuple(r) for r in e.tolist()} == {(0, 1), (0, 2), (1, 2), (0, 3), (0, 4), (0, 5),
                                              (1, 3), (1, 4), (1, 5)}  # fmt: skip
    # repeated calls give identical results
    assert torch.equal(e, knn_edges(d, 2))


def test_knn_infinite_distances_and_asymmetric() -> None:
    d = torch.full((4, 4), float("inf"))
    e = knn_edges(d, 1)
    # all ties: node 0 picks 1, every other node picks 0
    assert {tuple(r) for r in e.tolist()} == {(0, 1), (0, 2), (0, 3)}
    d = torch.tensor([[0.0, 1.0, 2.0], [5.0, 0.0, 1.0], [1.0, 9.0, 0.0]])
    assert knn_edges(d, 1).tolist() == [[0, 1], [0, 2], [1, 2]]


def test_knn_errors() -> None:
    d = _random_distances(4, 0)
    with pytest.raises(ValueError):
        knn_edges(d, 0)
    with pytest.raises(ValueError):
        knn_edges(d[:, :3], 1)
    d2 = d.clone()
    d2[0, 1] = float("nan")
    with pytest.raises(ValueError):
        knn_edges(d2, 1)
    assert knn_edges(torch.zeros(1, 1), 3).shape == (0, 2)


# ----------------------------------------------------------------------------------- Graph


def test_graph_helpers() -> None:
    path = Graph(num_nodes=4, edges=torch.tensor([[2, 1], [0, 1], [3, 2], [1, 0]]))
    assert path.edges.tolist() == [[0, 1], [1, 2], [2, 3]]
    assert path.num_edges == 3
    assert path.is_connected()
    assert path.degree().tolist() == [1, 2, 2, 1]
    assert path.neighbours(1).tolist() == [0, 2]
    split = Graph(num_nodes=4, edges=torch.tensor([[0, 1], [2, 3]]))
    assert not split.is_connected()
    assert Graph(num_nodes=1, edges=torch.zeros((0, 2), dtype=torch.long)).is_connected()
    assert not Graph(num_nodes=2, edges=torch.zeros((0, 2), dtype=torch.long)).is_connected()
    # weights follow their rows through canonicalisation
    wg = Graph(num_nodes=3, edges=torch.tensor([[2, 1], [1, 0]]), weights=torch.tensor([5.0, 7.0]))
    assert wg.edges.tolist() == [[0, 1], [1, 2]]
    assert wg.weights.tolist() == [7.0, 5.0]
    assert wg.degree(weighted=True).tolist() == [7.0, 12.0, 5.0]
    with pytest.raises(ValueError):
        Graph(num_nodes=3, edges=torch.tensor([[0, 0]]))
    with pytest.raises(ValueError):
        Graph(num_nodes=3, edges=torch.tensor([[0, 3]]))


def test_graph_from_knn_and_laplacian() -> None:
    d = _random_distances(9, 1)
    g = Graph.from_knn(d, 3)
    assert torch.equal(g.edges, knn_edges(d, 3))
    lap = g.laplacian()
    assert torch.allclose(lap, lap.T)
    assert torch.allclose(lap.sum(1), torch.zeros(9, dtype=torch.float64))
    assert torch.equal(torch.diagonal(lap).long(), g.degree())
    ev = torch.linalg.eigvalsh(lap)
    assert float(ev[0]) > -1e-12
    # connected graph <=> exactly one zero eigenvalue
    assert g.is_connected() == (int((ev < 1e-9).sum()) == 1)


def test_canonical_edges() -> None:
    e = canonical_edges(torch.tensor([[3, 1], [1, 3], [0, 2], [2, 0], [0, 1]]))
    assert e.tolist() == [[0, 1], [0, 2], [1, 3]]
    assert canonical_edges(torch.zeros((0, 2), dtype=torch.long)).shape == (0, 2)


# ------------------------------------------------------------------------------- incidence


def _random_graph(n: int, seed: int) -> torch.Tensor:
    return knn_edges(_random_distances(n, seed), 2)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_incidence_ops_match_dense(seed: int, dtype: torch.dtype) -> None:
    n = 5 + seed
    e = _random_graph(n, seed)
    m = e.shape[0]
    g = torch.Generator().manual_seed(100 + seed)
    z = torch.randn(4, n, generator=g, dtype=dtype)
    w = torch.randn(4, m, generator=g, dtype=dtype)
    wts = torch.rand(m, generator=g, dtype=dtype) + 0.5
    q = incidence_matrix(e, n, dtype=dtype)
    # column m of Q: +1 at i, -1 at j
    for col, (i, j) in enumerate(e.tolist()):
        expect = torch.zeros(n, dtype=dtype)
        expect[i], expect[j] = 1.0, -1.0
        assert torch.equal(q[:, col], expect)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 0}
    assert apply_Q(z, e).dtype == dtype
    assert torch.allclose(apply_Q(z, e), z @ q, **tol)
    assert torch.allclose(apply_Qt(w, e, n), w @ q.T, **tol)
    assert torch.allclose(apply_Q(z, e, wts), z @ q @ torch.diag(wts), **tol)
    assert torch.allclose(apply_Qt(w, e, n, wts), w @ torch.diag(wts) @ q.T, **tol)
    assert torch.allclose(incidence_matrix(e, n, wts, dtype=dtype), q @ torch.diag(wts), **tol)
    # adjointness <ZQ, W> = <Z, WQ^T>
    lhs = (apply_Q(z, e).double() * w.double()).sum()
    rhs = (z.double() * apply_Qt(w, e, n).double()).sum()
    assert math.isclose(float(lhs), float(rhs), rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_qqt_is_laplacian(seed: int) -> None:
    n = 7
    e = _random_graph(n, seed)
    q = incidence_matrix(e, n)
    assert torch.allclose(q @ q.T, laplacian(e, n), atol=1e-12)
    wts = torch.rand(e.shape[0], dtype=torch.float64) + 0.1
    assert torch.allclose(q @ torch.diag(wts) @ q.T, laplacian(e, n, wts), atol=1e-12)
    # apply_Qt(apply_Q(Z)) == Z L
    z = torch.randn(3, n, dtype=torch.float64)
    assert torch.allclose(apply_Qt(apply_Q(z, e), e, n), z @ laplacian(e, n), atol=1e-12)
    assert torch.allclose(apply_Qt(apply_Q(z, e), e, n, wts), z @ laplacian(e, n, wts), atol=1e-12)


@pytest.mark.parametrize("dense", [None, torch.float64])
def test_row_ops_are_the_incidence_products(dense) -> None:
    """:class:`RowOps` gives ``Q Y`` and ``Qᵀ X`` by scatters or by a dense ``Q`` alike."""
    n = 9
    e = _random_graph(n, 5)
    m = e.shape[0]
    q = incidence_matrix(e, n)
    ops = RowOps(e, n, dense)
    assert (ops.q_dense is not None) == (dense is not None)
    x = torch.randn(n, 6, dtype=torch.float64)
    y = torch.randn(m, 6, dtype=torch.float64)
    assert torch.allclose(ops.qt(x), q.T @ x, atol=1e-12)
    assert torch.allclose(ops.q(y), q @ y, atol=1e-12)
    out, tmp = torch.empty(m, 6, dtype=torch.float64), torch.empty(m, 6, dtype=torch.float64)
    assert ops.qt(x, out=out, tmp=tmp) is out
    assert torch.allclose(out, q.T @ x, atol=1e-12)
    buf = torch.full((n, 6), 7.0, dtype=torch.float64)  # overwritten, not accumulated
    assert ops.q(y, out=buf) is buf
    assert torch.allclose(buf, q @ y, atol=1e-12)


def test_row_ops_go_dense_on_small_products_only() -> None:
    assert RowOps.fits(5, 9, 31)  # pFedNet's tabular tables: 5 clients, k = 3, 31 weights
    assert RowOps.fits(8, 8, DENSE_MAX // 64)
    assert not RowOps.fits(8, 8, DENSE_MAX // 64 + 1)
    assert not RowOps.fits(1000, 3000, 1)


def test_row_layout_ops_match_dense() -> None:
    n = 9
    e = _random_graph(n, 5)
    m = e.shape[0]
    q = incidence_matrix(e, n)
    x = torch.randn(n, 6, dtype=torch.float64)
    y = torch.randn(m, 6, dtype=torch.float64)
    assert torch.allclose(qt_rows(x, e), q.T @ x, atol=1e-12)
    assert torch.allclose(q_rows(y, e, n), q @ y, atol=1e-12)
    out, tmp = torch.empty(m, 6, dtype=torch.float64), torch.empty(m, 6, dtype=torch.float64)
    assert qt_rows(x, e, out=out, tmp=tmp) is out
    assert torch.allclose(out, q.T @ x, atol=1e-12)
    buf = torch.full((n, 6), 7.0, dtype=torch.float64)  # overwritten, not accumulated
    assert torch.allclose(q_rows(y, e, n, out=buf), q @ y, atol=1e-12)
    assert torch.allclose(qt_rows(x, e), apply_Q(x.T, e).T, atol=1e-12)


def test_incidence_empty_graph() -> None:
    z = torch.randn(3, 4)
    e = torch.zeros((0, 2), dtype=torch.long)
    assert apply_Q(z, e).shape == (3, 0)
    assert torch.equal(apply_Qt(torch.zeros(3, 0), e, 4), torch.zeros(3, 4))
    assert torch.equal(laplacian(e, 4), torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError):
        apply_Qt(torch.zeros(3, 2), e, 4)


# -------------------------------------------------------------------------------- sketches


def test_label_sketch() -> None:
    y = torch.tensor([0, 2, 2, 1, 2, 0])
    s = label_sketch(y, 4)
    assert s.dtype == torch.float32
    assert torch.allclose(s, torch.tensor([2, 1, 3, 0], dtype=torch.float32) / 6)
    assert torch.equal(label_sketch(torch.zeros(0, dtype=torch.long), 3), torch.zeros(3))
    with pytest.raises(ValueError):
        label_sketch(torch.tensor([0, 3]), 3)


def test_covariance_sketch_tabular_and_images() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=g)
    s = covariance_sketch(x)
    assert s.dtype == torch.float32 and s.shape == (16,)
    ref = np.cov(x.double().numpy(), rowvar=False)
    assert np.allclose(s.numpy().reshape(4, 4), ref, atol=1e-6)

    img = torch.randn(10, 3, 5, 6, generator=g)
    ch = covariance_sketch(img)  # auto -> channel
    ref = np.cov(img.double().permute(0, 2, 3, 1).reshape(-1, 3).numpy(), rowvar=False)
    assert ch.shape == (9,)
    assert np.allclose(ch.numpy().reshape(3, 3), ref, atol=1e-6)

    px = covariance_sketch(img, mode="pixel")
    ref = np.cov(img.double().reshape(30, 30).numpy(), rowvar=False)
    assert px.shape == (900,)
    assert np.allclose(px.numpy().reshape(30, 30), ref, atol=1e-6)

    pooled = covariance_sketch(img, mode="pixel", pool_to=(2, 3))
    assert pooled.shape == (36,)
    flat = covariance_sketch(img, mode="flat")
    assert flat.shape == (90 * 90,)
    with pytest.raises(ValueError):
        covariance_sketch(x, mode="channel")


def _rbf_mmd(x: torch.Tensor, y: torch.Tensor, sigma: float) -> float:
    """Biased (V-statistic) MMD with k(a, b) = exp(-|a-b|^2 / (2 sigma^2))."""

    def k(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-(torch.cdist(a, b) ** 2) / (2 * sigma**2))

    mmd2 = k(x, x).mean() + k(y, y).mean() - 2 * k(x, y).mean()
    return math.sqrt(max(float(mmd2), 0.0))


def test_kernel_sketch_estimates_mmd() -> None:
    g = torch.Generator().manual_seed(1)
    dim, n = 3, 200
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    y = torch.randn(n, dim, generator=g, dtype=torch.float64) * 1.2 + 0.8
    x2 = torch.randn(n, dim, generator=g, dtype=torch.float64)
    sigma = 1.5
    feats = make_rff(dim, 20000, sigma, generator=torch.Generator().manual_seed(7))
    assert feats[0].shape == (dim, 20000) and feats[1].shape == (20000,)
    sx, sy, sx2 = (kernel_sketch(v, feats, chunk_size=64) for v in (x, y, x2))
    assert sx.dtype == torch.float32 and sx.shape == (20000,)
    dist = sketch_distances(torch.stack([sx, sy, sx2]))
    exact_xy = _rbf_mmd(x, y, sigma)
    exact_xx2 = _rbf_mmd(x, x2, sigma)
    assert abs(float(dist[0, 1]) - exact_xy) < 0.1 * exact_xy + 0.01
    assert abs(float(dist[0, 2]) - exact_xx2) < 0.03
    assert float(dist[0, 2]) < float(dist[0, 1])
    # the sketch of a single point has norm ~ sqrt(k(x, x)) = 1
    one = kernel_sketch(x[:1], feats)
    assert abs(float(one.double().norm()) - 1.0) < 0.05
    # shared features: same seed, same sketch
    feats2 = make_rff(dim, 20000, sigma, generator=torch.Generator().manual_seed(7))
    assert torch.equal(kernel_sketch(x, feats2), kernel_sketch(x, feats))
    assert median_bandwidth(x) > 0


def test_model_sketch() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    vec = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert torch.equal(model_sketch(model.parameters()), vec)
    assert torch.equal(model_sketch(dict(model.named_parameters())), vec)
    s = model_sketch(vec.double())
    assert s.dtype == torch.float32 and not s.requires_grad


def test_sketch_distances_metrics() -> None:
    g = torch.Generator().manual_seed(3)
    s = torch.randn(5, 7, generator=g)
    e = sketch_distances(s)
    ref = np.linalg.norm(s.double().numpy()[:, None] - s.double().numpy()[None], axis=-1)
    assert np.allclose(e.numpy(), ref, atol=1e-12)
    assert torch.equal(torch.diagonal(e), torch.zeros(5, dtype=torch.float64))
    assert torch.equal(e, e.T)
    l1 = sketch_distances(s, "l1")
    ref1 = np.abs(s.double().numpy()[:, None] - s.double().numpy()[None]).sum(-1)
    assert np.allclose(l1.numpy(), ref1, atol=1e-12)
    # Frobenius distance between covariance sketches = Frobenius norm of the difference
    covs = torch.stack([covariance_sketch(torch.randn(20, 3, generator=g)) for _ in range(3)])
    fro = sketch_distances(covs, "frobenius")
    diff = (covs[0].double() - covs[1].double()).reshape(3, 3)
    assert math.isclose(float(fro[0, 1]), float(torch.linalg.matrix_norm(diff)), rel_tol=1e-9)
    assert torch.equal(sketch_distances(list(s)), e)
    with pytest.raises(ValueError):
        sketch_distances(s, "cosine")  # type: ignore[arg-type]
