"""Stress grid of the pFedNet Z-step's stopping rule (issue 23, item 7).

Each case solves the Z-step of pFedNet (Zhao, Liu, Liu & He, *Medical Federated Model with
Mixture of Personalized and Sharing Components*, Algorithm 4) by ADMM with the solver's default
settings and compares its objective with cvxpy/Clarabel's on the same problem: the relative gap
must stay within 1e-6 from η = 1e-3 to 100, λ = 0.01 to 30 and gradient magnitudes |G| = 0.01 to
100, on k-NN and complete graphs, for p in {1, 2, ∞}. The residual test alone (the rule before
the duality-gap certificate) stopped early at the extreme scales: 52 of the 162 grid cases were
off by more than 1e-6, and in the reported case (η = 100, λ = 30, |G| = 0.01, complete graph,
p = 1) it stopped after 7 iterations 6.2e-3 above the optimum with the solver's defaults and
after 8 iterations 6.9e-4 above it with pFedNet's settings.
"""

from __future__ import annotations

import functools
import itertools
import math
import zlib

import cvxpy as cp
import numpy as np
import pytest
import torch

from fedexp.graph import Graph
from fedexp.graph import incidence_matrix
from fedexp.graph import knn_edges
from fedexp.graph import sketch_distances
from fedexp.graph.admm import ZStepSolver
from fedexp.graph.admm import zstep_objective
from fedexp.graph.prox import parse_p

N, D2 = 8, 4
ETAS = [1e-3, 1.0, 100.0]
LAMS = [0.01, 1.0, 30.0]
GRADS = [0.01, 1.0, 100.0]
GRAPHS = ["knn", "complete"]
P_VALUES = [1, 2, "inf"]
CP_NORM = {"1": 1, "2": 2, "inf": "inf"}
REL_TOL = 1e-6

# The reported failure and pFedNet's ADMM settings (conf/algorithm/pfednet.yaml).
REPORTED = {"eta": 100.0, "lam": 30.0, "grad": 0.01, "graph": "complete", "p": 1}
PFEDNET_ADMM = {"max_iter": 500, "eps_abs": 1e-7, "eps_rel": 1e-5}


@functools.cache
def _edges(graph: str) -> torch.Tensor:
    """A connected 2-NN graph on random points, or the complete graph, on N nodes."""
    if graph == "complete":
        pairs = [(i, j) for i in range(N) for j in range(i + 1, N)]
        return torch.tensor(pairs, dtype=torch.long)
    gen = torch.Generator().manual_seed(7)
    while True:
        e = knn_edges(sketch_distances(torch.randn(N, 2, generator=gen, dtype=torch.float64)), 2)
        if Graph(num_nodes=N, edges=e).is_connected():
            return e


def _instance(*key: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Z_t, G)`` in float64 with ``G`` of magnitude ``key[2]``, seeded by the case."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    zt = torch.randn(D2, N, generator=gen, dtype=torch.float64)
    grad = float(key[2]) * torch.randn(D2, N, generator=gen, dtype=torch.float64)
    return zt, grad


@functools.cache
def _cvxpy_problem(graph: str, p: str) -> tuple[cp.Problem, cp.Variable, dict[str, cp.Parameter]]:
    """The Z-step as a parametrised cvxpy problem, canonicalised once per graph and norm.

    ``‖Z − Z_t‖²/(2η) = ‖aZ − aZ_t‖²`` with ``a = 1/√(2η)`` keeps it DPP.
    """
    q = incidence_matrix(_edges(graph), N).numpy()
    z = cp.Variable((D2, N))
    par = {
        "g_over_n": cp.Parameter((D2, N)),
        "a": cp.Parameter(nonneg=True),
        "a_zt": cp.Parameter((D2, N)),
        "lam": cp.Parameter(nonneg=True),
    }
    obj = (
        cp.sum(cp.multiply(par["g_over_n"], z))
        + par["lam"] * cp.sum(cp.norm(z @ q, CP_NORM[p], axis=0))
        + cp.sum_squares(par["a"] * z - par["a_zt"])
    )
    return cp.Problem(cp.Minimize(obj)), z, par


def _cvxpy_objective(
    zt: torch.Tensor, grad: torch.Tensor, graph: str, lam: float, eta: float, p: str
) -> float:
    """Clarabel's minimiser, evaluated with :func:`zstep_objective` (float64)."""
    prob, z, par = _cvxpy_problem(graph, p)
    a = 1.0 / math.sqrt(2.0 * eta)
    par["g_over_n"].value = grad.numpy() / N
    par["a"].value = a
    par["a_zt"].value = a * zt.numpy()
    par["lam"].value = lam
    for tol in (1e-10, 1e-9, 1e-8):
        # Clarabel now and then stops on numerical trouble at 1e-10 (SolverError), in some
        # runs of the whole suite and not alone (a CI run, 2026-11-29: η = λ = 1, |G| = 100,
        # complete graph, p = 2); 1e-8 still puts its point far within REL_TOL of the optimum
        try:
            prob.solve(solver=cp.CLARABEL, tol_gap_abs=tol, tol_gap_rel=tol, tol_feas=tol)
            break
        except cp.SolverError:
            if tol == 1e-8:
                raise
    # At these tolerances Clarabel sometimes reports "optimal_inaccurate" where its point is
    # still within ~1e-12 of the optimum. The problem is unconstrained, so the reference can
    # only lie above the optimum, and the two-sided comparison flags a poor one.
    assert prob.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE), prob.status
    z_ref = torch.from_numpy(np.asarray(z.value))
    return zstep_objective(z_ref, zt, grad, _edges(graph), lam, eta, p)


def _solve_and_compare(
    eta: float, lam: float, grad_mag: float, graph: str, p: int | str, **kw: object
) -> tuple[dict, float]:
    """Solve one case by ADMM; return its info and the relative gap to cvxpy's objective."""
    zt, grad = _instance(eta, lam, grad_mag, graph, str(p))
    edges = _edges(graph)
    z, _, info = ZStepSolver(edges, N).solve(zt, grad, lam, eta, p=p, **kw)
    f = zstep_objective(z, zt, grad, edges, lam, eta, p)
    f_ref = _cvxpy_objective(zt, grad, graph, lam, eta, parse_p(p))
    # the duality-gap certificate is an upper bound of the true error (up to cvxpy's accuracy)
    if info["converged"] and not math.isnan(info["gap"]):
        assert f - f_ref <= (info["gap"] + 1e-9) * abs(f), (f, f_ref, info)
    return info, (f - f_ref) / abs(f_ref)


GRID = list(itertools.product(ETAS, LAMS, GRADS))


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("graph", GRAPHS)
@pytest.mark.parametrize(("eta", "lam", "grad_mag"), GRID)
def test_stress_grid_matches_cvxpy(
    eta: float, lam: float, grad_mag: float, graph: str, p: int | str
) -> None:
    info, rel = _solve_and_compare(eta, lam, grad_mag, graph, p)
    assert info["converged"], info
    assert abs(rel) <= REL_TOL, (rel, info)


CORNERS = list(itertools.product([1e-3, 100.0], [0.01, 30.0], [0.01, 100.0]))


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize(("eta", "lam", "grad_mag"), CORNERS)
def test_stress_corners_adaptive_rho(eta: float, lam: float, grad_mag: float, p: int | str) -> None:
    """Residual balancing on the relative residuals keeps the guarantee (and the pace)."""
    info, rel = _solve_and_compare(eta, lam, grad_mag, "knn", p, adaptive_rho=True)
    assert info["converged"], info
    assert abs(rel) <= REL_TOL, (rel, info)


@pytest.mark.parametrize(
    "settings",
    [{}, PFEDNET_ADMM, {**PFEDNET_ADMM, "adaptive_rho": True}],
    ids=["defaults", "pfednet", "pfednet-adaptive"],
)
def test_reported_case(settings: dict) -> None:
    """η = 100, λ = 30, |G| = 0.01, complete graph, p = 1: within 1e-6 of cvxpy."""
    case = (REPORTED["eta"], REPORTED["lam"], REPORTED["grad"], REPORTED["graph"], REPORTED["p"])
    info, rel = _solve_and_compare(*case, **settings)
    assert info["converged"] and info["gap"] <= 1e-7, info
    assert abs(rel) <= REL_TOL, (rel, info)
    # the residual test alone stops earlier, orders of magnitude above the optimum
    old, rel_old = _solve_and_compare(*case, **settings, gap_tol=None)
    assert old["iterations"] < info["iterations"]
    assert rel_old > 100 * REL_TOL, rel_old
