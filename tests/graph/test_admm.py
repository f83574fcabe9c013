"""Tests of the pFedNet Z-step: column proxes and the anchored ADMM (docs/pfednet_math.md §3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedexp.graph import Graph
from fedexp.graph import incidence_matrix
from fedexp.graph import knn_edges
from fedexp.graph import laplacian
from fedexp.graph import sketch_distances
from fedexp.graph.admm import ZStepSolver
from fedexp.graph.admm import zstep_objective
from fedexp.graph.prox import parse_p
from fedexp.graph.prox import project_l1_ball_columns
from fedexp.graph.prox import prox_columns
from fedexp.graph.prox import prox_l1_columns
from fedexp.graph.prox import prox_l2_columns
from fedexp.graph.prox import prox_linf_columns


class _Cvxpy:
    """cvxpy, imported at first use: the reference solutions need it, the CUDA test does not
    (it runs where only the engine's packages are, scripts/gpu/check.sh)."""

    def __getattr__(self, name: str):
        import cvxpy

        return getattr(cvxpy, name)


cp = _Cvxpy()

P_VALUES = [1, 2, "inf"]
CP_NORM = {"1": 1, "2": 2, "inf": "inf"}


def _random_columns(d: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random V with columns of very different sizes, and per-column thresholds."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(d, m, generator=g, dtype=torch.float64)
    v = v * torch.logspace(-1.5, 1.0, m, dtype=torch.float64)  # some columns inside the ball
    tau = torch.rand(m, generator=g, dtype=torch.float64) * 2.0 + 0.05
    tau[0] = 0.0
    v[:, 1] = 0.0
    return v, tau


def _cvxpy_prox(v: np.ndarray, tau: float, p: str) -> np.ndarray:
    x = cp.Variable(v.shape[0])
    obj = tau * cp.norm(x, CP_NORM[p]) + 0.5 * cp.sum_squares(x - v)
    cp.Problem(cp.Minimize(obj)).solve(solver=cp.CLARABEL)
    return np.asarray(x.value)


# ------------------------------------------------------------------------------- proxes


@pytest.mark.parametrize("seed", range(3))
def test_prox_l1_optimality(seed: int) -> None:
    v, tau = _random_columns(6, 12, seed)
    x = prox_l1_columns(v, tau)
    g = v - x  # must be tau * (subgradient of ||.||_1 at x)
    t = tau.expand_as(v)
    nz = x != 0
    assert torch.allclose(g[nz], t[nz] * torch.sign(x[nz]), atol=1e-12)
    assert bool((g[~nz].abs() <= t[~nz] + 1e-12).all())


@pytest.mark.parametrize("seed", range(3))
def test_prox_l2_optimality(seed: int) -> None:
    v, tau = _random_columns(6, 12, seed)
    x = prox_l2_columns(v, tau)
    for m in range(v.shape[1]):
        xm, gm, tm = x[:, m], v[:, m] - x[:, m], float(tau[m])
        if float(xm.norm()) > 0:
            assert torch.allclose(gm, tm * xm / xm.norm(), atol=1e-12)
        else:
            assert float(v[:, m].norm()) <= tm + 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_prox_linf_optimality(seed: int) -> None:
    v, tau = _random_columns(6, 12, seed)
    x = prox_linf_columns(v, tau)
    for m in range(v.shape[1]):
        xm, gm, tm = x[:, m], v[:, m] - x[:, m], float(tau[m])
        if float(xm.abs().max()) > 0:
            # the dual norm of l_inf is l_1: ||g||_1 = tau and <g, x> = tau ||x||_inf
            assert math.isclose(float(gm.abs().sum()), tm, rel_tol=1e-10, abs_tol=1e-12)
            assert math.isclose(
                float(gm @ xm), tm * float(xm.abs().max()), rel_tol=1e-10, abs_tol=1e-12
            )
        else:
            assert float(v[:, m].abs().sum()) <= tm + 1e-12


@pytest.mark.parametrize("p", P_VALUES)
def test_prox_matches_cvxpy(p: int | str) -> None:
    v, tau = _random_columns(5, 8, 11)
    x = prox_columns(v, tau, p)
    for m in range(v.shape[1]):
        ref = _cvxpy_prox(v[:, m].numpy(), float(tau[m]), parse_p(p))
        assert np.allclose(x[:, m].numpy(), ref, atol=1e-6), (p, m)
    # scalar tau broadcasts over columns
    assert torch.allclose(prox_columns(v, 0.7, p), prox_columns(v, torch.full((8,), 0.7), p))
    # tau = 0 is the identity
    assert torch.allclose(prox_columns(v, 0.0, p), v)


def test_l1_ball_projection() -> None:
    v, tau = _random_columns(7, 10, 5)
    x = project_l1_ball_columns(v, tau)
    assert bool((x.abs().sum(0) <= tau + 1e-12).all())
    for m in range(v.shape[1]):
        y = cp.Variable(7)
        prob = cp.Problem(
            cp.Minimize(cp.sum_squares(y - v[:, m].numpy())), [cp.norm(y, 1) <= float(tau[m])]
        )
        prob.solve(solver=cp.CLARABEL)
        assert np.allclose(x[:, m].numpy(), y.value, atol=1e-6)
    # float32 and ties
    w = torch.tensor([[1.0, 1.0, 1.0, -1.0]], dtype=torch.float32).T
    out = project_l1_ball_columns(w, 2.0)
    assert out.dtype == torch.float32
    assert torch.allclose(out[:, 0], torch.tensor([0.5, 0.5, 0.5, -0.5]))
    with pytest.raises(ValueError):
        project_l1_ball_columns(w, -1.0)


def test_parse_p() -> None:
    assert parse_p(1) == "1" and parse_p(2.0) == "2" and parse_p(float("inf")) == "inf"
    assert parse_p("inf") == "inf" and parse_p("L2") == "2"
    for bad in (3, 0, "fro", True):
        with pytest.raises(ValueError):
            parse_p(bad)


# ------------------------------------------------------------------------------- Z-step


def _connected_knn(n: int, seed: int, k: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    while True:
        pts = torch.randn(n, 2, generator=g, dtype=torch.float64)
        e = knn_edges(sketch_distances(pts), k)
        if Graph(num_nodes=n, edges=e).is_connected():
            return e


def _instance(
    seed: int, n: int, d2: int, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e = _connected_knn(n, seed)
    g = torch.Generator().manual_seed(1000 + seed)
    zt = torch.randn(d2, n, generator=g, dtype=torch.float64).to(dtype)
    grad = (3.0 * torch.randn(d2, n, generator=g, dtype=torch.float64)).to(dtype)
    return e, zt, grad


def _cvxpy_zstep(
    zt: torch.Tensor,
    grad: torch.Tensor,
    e: torch.Tensor,
    lam: float,
    eta: float,
    p: str,
    weights: torch.Tensor | None = None,
) -> tuple[np.ndarray, float]:
    d2, n = zt.shape
    q = incidence_matrix(e, n).numpy()
    w = np.ones(e.shape[0]) if weights is None else weights.double().numpy()
    z = cp.Variable((d2, n))
    obj = (
        cp.sum(cp.multiply(grad.double().numpy(), z)) / n
        + lam * (w @ cp.norm(z @ q, CP_NORM[p], axis=0))
        + cp.sum_squares(z - zt.double().numpy()) / (2 * eta)
    )
    prob = cp.Problem(cp.Minimize(obj))
    prob.solve(solver=cp.CLARABEL, tol_gap_abs=1e-10, tol_gap_rel=1e-10, tol_feas=1e-10)
    return np.asarray(z.value), float(prob.value)


CASES = [(0, 6, 3), (1, 7, 4), (2, 8, 5), (3, 8, 3)]


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize(("seed", "n", "d2"), CASES)
def test_zstep_matches_cvxpy(p: int | str, seed: int, n: int, d2: int) -> None:
    e, zt, grad = _instance(seed, n, d2)
    lam, eta = 0.3 + 0.2 * seed, 0.5
    solver = ZStepSolver(e, n)
    z, _, info = solver.solve(zt, grad, lam, eta, p=p, max_iter=50000, eps_abs=1e-11, eps_rel=1e-11)
    assert info["converged"], info
    z_ref, f_ref = _cvxpy_zstep(zt, grad, e, lam, eta, parse_p(p))
    # the objective function agrees with cvxpy's at cvxpy's point
    f_at_ref = zstep_objective(torch.from_numpy(z_ref), zt, grad, e, lam, eta, p)
    assert math.isclose(f_at_ref, f_ref, rel_tol=1e-9, abs_tol=1e-9)
    f = zstep_objective(z, zt, grad, e, lam, eta, p)
    assert abs(f - f_ref) <= 1e-6 * max(1.0, abs(f_ref)), (f, f_ref)
    # strong convexity (modulus 1/eta): the minimisers agree as well
    assert np.allclose(z.numpy(), z_ref, atol=1e-4)


@pytest.mark.parametrize("p", P_VALUES)
def test_zstep_weighted_matches_cvxpy(p: int | str) -> None:
    e, zt, grad = _instance(5, 7, 4)
    wts = torch.linspace(0.2, 2.0, e.shape[0], dtype=torch.float64)
    lam, eta = 0.6, 0.8
    solver = ZStepSolver.from_graph(Graph(7, e, wts), use_weights=True)
    z, _, info = solver.solve(zt, grad, lam, eta, p=p, max_iter=50000, eps_abs=1e-11, eps_rel=1e-11)
    assert info["converged"]
    _, f_ref = _cvxpy_zstep(zt, grad, e, lam, eta, parse_p(p), wts)
    f = zstep_objective(z, zt, grad, e, lam, eta, p, weights=wts)
    assert abs(f - f_ref) <= 1e-6 * max(1.0, abs(f_ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", P_VALUES)
def test_lambda_zero_is_exact_gradient_step(dtype: torch.dtype, p: int | str) -> None:
    n = 7
    e, zt, grad = _instance(0, n, 4, dtype)
    eta = 0.37
    z, state, info = ZStepSolver(e, n).solve(zt, grad, 0.0, eta, p=p)
    assert z.dtype == dtype
    assert torch.equal(z, zt - (eta / n) * grad)
    assert info["iterations"] == 0
    assert state.W.shape == (4, e.shape[0])


def test_no_edges_is_exact_gradient_step() -> None:
    n = 5
    zt = torch.randn(3, n)
    grad = torch.randn(3, n)
    solver = ZStepSolver(torch.zeros((0, 2), dtype=torch.long), n)
    z, state, info = solver.solve(zt, grad, 2.0, 0.1, p=2)
    assert torch.equal(z, zt - (0.1 / n) * grad)
    assert state.W.shape == (3, 0) and info["iterations"] == 0


@pytest.mark.parametrize("p", P_VALUES)
def test_large_lambda_gives_consensus(p: int | str) -> None:
    n, d2, eta = 8, 4, 0.5
    e, zt, grad = _instance(2, n, d2)
    free = zt - (eta / n) * grad
    z, _, info = ZStepSolver(e, n).solve(
        zt, grad, 1e4, eta, p=p, max_iter=20000, eps_abs=1e-12, eps_rel=1e-12
    )
    assert info["converged"]
    mean = free.mean(dim=1, keepdim=True).expand_as(free)
    assert torch.allclose(z, mean, atol=1e-7), (z - mean).abs().max()


@pytest.mark.parametrize("p", P_VALUES)
def test_warm_start_reduces_iterations(p: int | str) -> None:
    n, d2, eta, lam = 8, 5, 0.5, 0.4
    e, zt, grad = _instance(3, n, d2)
    solver = ZStepSolver(e, n)
    kw = {"p": p, "max_iter": 20000, "eps_abs": 1e-9, "eps_rel": 1e-9}
    z0, state, cold = solver.solve(zt, grad, lam, eta, **kw)
    # the same problem again: starts at the fixed point
    z1, _, again = solver.solve(zt, grad, lam, eta, warm=state, **kw)
    assert again["iterations"] < cold["iterations"]
    assert again["iterations"] <= 2
    assert torch.allclose(z0, z1, atol=1e-7)
    # a nearby problem (next round): fewer iterations than from cold
    grad2 = grad + 0.01 * torch.randn(d2, n, generator=torch.Generator().manual_seed(9))
    _, _, cold2 = solver.solve(zt, grad2, lam, eta, **kw)
    _, _, warm2 = solver.solve(zt, grad2, lam, eta, warm=state, **kw)
    assert warm2["iterations"] < cold2["iterations"]
    # a state of the wrong shape is ignored
    _, _, other = solver.solve(zt[:2], grad[:2], lam, eta, warm=state, **kw)
    assert other["converged"]


@pytest.mark.parametrize("p", P_VALUES)
def test_dense_incidence_products_take_the_scatters_steps(p: int | str, monkeypatch) -> None:
    """A small Z-step multiplies by a dense ``Q``; it stops at the same iteration, same point.

    Rounds of warm-started solves (pFedNet's server), with the dense products and with the
    gathers and scatters (``RowOps.fits`` false): the sums differ by rounding only.
    """
    from fedexp.graph.incidence import RowOps

    n, d2, eta, lam = 7, 6, 0.5, 0.3
    e, zt, grad = _instance(5, n, d2)
    kw = {"p": p, "max_iter": 2000, "eps_abs": 1e-7, "eps_rel": 1e-5}
    gen = torch.Generator().manual_seed(11)
    grads = [
        grad + 0.1 * t * torch.randn(d2, n, generator=gen, dtype=torch.float64) for t in range(6)
    ]

    def rounds() -> tuple[list[torch.Tensor], list[int], ZStepSolver]:
        solver, state, z, out, its = ZStepSolver(e, n), None, zt, [], []
        for g in grads:
            z, state, info = solver.solve(z, g, lam, eta, warm=state, **kw)
            out.append(z)
            its.append(info["iterations"])
        return out, its, solver

    dense, dense_its, solver = rounds()
    assert all(ops.q_dense is not None for ops in solver._ops_on.values())
    monkeypatch.setattr(RowOps, "fits", staticmethod(lambda *a: False))
    scatter, scatter_its, solver = rounds()
    assert all(ops.q_dense is None for ops in solver._ops_on.values())
    assert dense_its == scatter_its
    for a, b in zip(dense, scatter, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("p", P_VALUES)
def test_sparse_path_matches_eigh(p: int | str) -> None:
    n, d2 = 40, 3
    e, zt, grad = _instance(4, n, d2)
    kw = {"p": p, "max_iter": 3000, "eps_abs": 1e-10, "eps_rel": 1e-10}
    dense = ZStepSolver(e, n, method="eigh")
    sparse = ZStepSolver(e, n, method="auto", sparse_threshold=10)
    assert sparse.method == "sparse" and dense.method == "eigh"
    za, _, ia = dense.solve(zt, grad, 0.5, 0.3, **kw)
    zb, _, ib = sparse.solve(zt, grad, 0.5, 0.3, **kw)
    assert torch.allclose(za, zb, atol=1e-9)
    assert ia["iterations"] == ib["iterations"]


def test_apply_a_is_the_inverse() -> None:
    n = 9
    e = _connected_knn(n, 6)
    lap = laplacian(e, n)
    x = torch.randn(4, n, dtype=torch.float64)
    for method in ("eigh", "sparse"):
        solver = ZStepSolver(e, n, method=method)
        for c in (0.1, 2.5):
            ref = x @ torch.linalg.inv(torch.eye(n, dtype=torch.float64) + c * lap)
            assert torch.allclose(solver.apply_A(x, c), ref, atol=1e-12)


def test_dtype_shape_and_residual_info() -> None:
    n, d2 = 6, 3
    e, zt, grad = _instance(1, n, d2, torch.float32)
    solver = ZStepSolver(e, n)
    z, state, info = solver.solve(zt, grad, 0.2, 0.5, p=2)
    assert z.dtype == torch.float32 and z.shape == (d2, n)
    assert state.W.dtype == torch.float64 and state.Omega.shape == (d2, e.shape[0])
    assert set(info) >= {"iterations", "primal_residual", "dual_residual", "converged", "rho"}
    assert info["converged"] and info["iterations"] >= 1
    # max_iter caps the iterations
    _, _, capped = solver.solve(zt, grad, 0.2, 0.5, p=2, max_iter=3, eps_abs=0, eps_rel=0)
    assert capped["iterations"] == 3 and not capped["converged"]
    with pytest.raises(ValueError):
        solver.solve(zt, grad, -1.0, 0.5)
    with pytest.raises(ValueError):
        solver.solve(zt[:, :4], grad[:, :4], 0.1, 0.5)


@pytest.mark.parametrize("p", P_VALUES)
def test_adaptive_rho_same_solution(p: int | str) -> None:
    n, d2 = 7, 4
    e, zt, grad = _instance(2, n, d2)
    solver = ZStepSolver(e, n)
    kw = {"p": p, "max_iter": 20000, "eps_abs": 1e-11, "eps_rel": 1e-11}
    za, _, _ = solver.solve(zt, grad, 0.5, 0.5, rho=0.05, **kw)
    zb, _, info = solver.solve(zt, grad, 0.5, 0.5, rho=0.05, adaptive_rho=True, **kw)
    assert info["converged"]
    assert torch.allclose(za, zb, atol=1e-7)


def test_anchor_on_z_t_matters() -> None:
    """The fixed point satisfies the Z-step optimality condition anchored on Z_t."""
    n, d2, lam, eta = 6, 3, 0.4, 0.5
    e, zt, grad = _instance(0, n, d2)
    z, state, _ = ZStepSolver(e, n).solve(
        zt, grad, lam, eta, p=2, max_iter=20000, eps_abs=1e-12, eps_rel=1e-12
    )
    q = incidence_matrix(e, n)
    # stationarity: G/N + (Z - Z_t)/eta + Omega Q^T = 0, Omega columns in lam * (l2 unit ball)
    station = grad / n + (z - zt) / eta + state.Omega @ q.T
    assert float(station.abs().max()) < 1e-8
    assert bool((state.Omega.norm(dim=0) <= lam + 1e-8).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    n, d2 = 8, 5
    e, zt, grad = _instance(1, n, d2, torch.float32)
    kw = {"p": 2, "max_iter": 5000, "eps_abs": 1e-10, "eps_rel": 1e-10}
    z_cpu, _, _ = ZStepSolver(e, n).solve(zt, grad, 0.3, 0.5, **kw)
    z_gpu, state, _ = ZStepSolver(e, n).solve(zt.cuda(), grad.cuda(), 0.3, 0.5, **kw)
    assert z_gpu.device.type == "cuda" and z_gpu.dtype == torch.float32
    assert state.W.device.type == "cuda"
    assert torch.allclose(z_gpu.cpu(), z_cpu, atol=1e-5)
