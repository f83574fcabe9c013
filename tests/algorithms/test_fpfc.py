"""FPFC and its SCAD/MCP group prox against the properties its paper implies."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedexp.algorithms.fpfc import FPFC
from fedexp.algorithms.fpfc import complete_edges
from fedexp.algorithms.fpfc import count_clusters
from fedexp.engine.runner import build_engine
from fedexp.graph.fusion import check_penalty
from fedexp.graph.fusion import penalty_derivative
from fedexp.graph.fusion import penalty_value
from fedexp.graph.fusion import prox_norm
from fedexp.graph.fusion import prox_rows
from helpers import assert_eval_stack_is_eval_params
from helpers import assert_resume_exact

MLP = ("model=mlp", "model.hidden=8")
LAM, RHO = 0.5, 1.5
CASES = [("scad", 3.7, 0.0), ("scad", 3.7, 0.05), ("mcp", 2.0, 0.0), ("mcp", 2.0, 0.05)]


def _rounds(engine, n):
    for _ in range(n):
        metrics = engine.run_round()
    return metrics


def _branch_norms(penalty, a, xi):
    """Norms t = ‖δ‖ inside every branch of the prox (and on its boundaries)."""
    c = LAM if penalty == "scad" else LAM - xi / a
    cuts = [0.0, xi + c / RHO]
    cuts += [LAM + LAM / RHO, a * LAM] if penalty == "scad" else [a * LAM]
    cuts.append(a * LAM + 2.0)
    inner = [
        lo + f * (hi - lo)
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)
        for f in (0.1, 0.5, 0.9)
    ]
    return torch.tensor(inner + cuts[1:-1], dtype=torch.float64), cuts


@pytest.mark.parametrize(("penalty", "a", "xi"), CASES)
def test_prox_meets_its_optimality_condition_in_every_branch(penalty, a, xi):
    """P'(‖z‖) z/‖z‖ + ρ(z − δ) = 0 where z ≠ 0; ρ‖δ‖ ≤ λ = ∂P(0) where z = 0."""
    t, _ = _branch_norms(penalty, a, xi)
    g = torch.Generator().manual_seed(0)
    u = torch.randn(len(t), 7, generator=g, dtype=torch.float64)
    delta = u / u.norm(dim=1, keepdim=True) * t[:, None]
    z = prox_rows(delta, penalty, LAM, a, RHO, xi)
    zn = z.norm(dim=1)
    nonzero = zn > 0
    grad = penalty_derivative(zn, penalty, LAM, a, xi)[:, None] * z / zn.clamp(min=1e-300)[:, None]
    resid = grad + RHO * (z - delta)
    torch.testing.assert_close(resid[nonzero], torch.zeros_like(resid[nonzero]), atol=1e-12, rtol=0)
    assert bool((RHO * delta[~nonzero].norm(dim=1) <= LAM + 1e-12).all())
    assert bool((~nonzero).any()) == (xi == 0)  # exact fusion only without smoothing
    # each output is a nonnegative multiple of its input (the minimiser is on the ray)
    torch.testing.assert_close(z, delta * (zn / t)[:, None])


@pytest.mark.parametrize(("penalty", "a", "xi"), CASES)
def test_prox_is_the_global_minimiser_along_the_ray_and_off_it(penalty, a, xi):
    """A fine 1-D scan of (ρ/2)(s − t)² + P(s) finds s(t); random points off the ray lose."""
    t, _ = _branch_norms(penalty, a, xi)
    grid = torch.linspace(0, float(t.max()) + 1, 400_001, dtype=torch.float64)
    pen = penalty_value(grid, penalty, LAM, a, xi)
    for ti in t:
        obj = 0.5 * RHO * (grid - ti) ** 2 + pen
        s_scan = grid[int(torch.argmin(obj))]
        s = prox_norm(ti[None], penalty, LAM, a, RHO, xi)[0]
        assert abs(float(s - s_scan)) <= 2e-5, (float(ti), float(s), float(s_scan))
    g = torch.Generator().manual_seed(1)
    delta = torch.randn(20, 4, generator=g, dtype=torch.float64) * LAM
    z = prox_rows(delta, penalty, LAM, a, RHO, xi)

    def f(x):
        return 0.5 * RHO * ((x - delta) ** 2).sum(1) + penalty_value(
            x.norm(dim=1), penalty, LAM, a, xi
        )

    for _ in range(50):
        other = z + 0.05 * torch.randn(z.shape, generator=g, dtype=torch.float64)
        assert bool((f(z) <= f(other) + 1e-12).all())


@pytest.mark.parametrize(("penalty", "a", "xi"), CASES)
def test_penalty_value_and_derivative_agree(penalty, a, xi):
    """The pieces of P are continuous, P(0) = 0, and P' is its derivative (central differences)."""
    s = torch.linspace(1e-3, a * LAM + 1, 2001, dtype=torch.float64)
    h = 1e-6
    fd = (penalty_value(s + h, penalty, LAM, a, xi) - penalty_value(s - h, penalty, LAM, a, xi)) / (
        2 * h
    )
    torch.testing.assert_close(fd, penalty_derivative(s, penalty, LAM, a, xi), atol=1e-5, rtol=0)
    assert float(penalty_value(torch.zeros(1, dtype=torch.float64), penalty, LAM, a, xi)) == 0.0
    jumps = penalty_value(s[1:], penalty, LAM, a, xi) - penalty_value(s[:-1], penalty, LAM, a, xi)
    assert float(jumps.abs().max()) < 2 * LAM * float(s[1] - s[0])


def test_soft_threshold_branch_matches_cvxpy():
    """Where SCAD is λ‖z‖ (convex), the prox is the group lasso's: solved by cvxpy."""
    cp = pytest.importorskip("cvxpy")
    import numpy as np

    g = torch.Generator().manual_seed(2)
    for radius in (0.3, 0.9, 1.2):  # ρ‖δ‖ below and above λ, inside λ + λ/ρ
        delta = torch.randn(5, generator=g, dtype=torch.float64)
        delta = delta / delta.norm() * radius * (LAM + LAM / RHO) / 1.2
        z = cp.Variable(5)
        obj = 0.5 * RHO * cp.sum_squares(z - delta.numpy()) + LAM * cp.norm(z, 2)
        cp.Problem(cp.Minimize(obj)).solve()
        ours = prox_rows(delta[None], "scad", LAM, 3.7, RHO, 0.0)[0].numpy()
        np.testing.assert_allclose(ours, z.value, atol=1e-5)


def test_parameters_outside_the_theory_are_refused():
    with pytest.raises(ValueError, match="SCAD needs"):
        check_penalty("scad", 0.5, 3.7, 0.3)  # ρ(a − 1) = 0.81 ≤ 1
    with pytest.raises(ValueError, match="MCP needs"):
        check_penalty("mcp", 0.5, 0.5, 1.0)
    with pytest.raises(ValueError, match="penalty="):
        FPFC(penalty="lasso")
    with pytest.raises(ValueError, match="smoothing"):
        FPFC(lam=0.1, xi=0.2)
    FPFC(lam=0.0, rho=1e-9)  # λ = 0: the prox is the identity, any ρ > 0 will do
    t = torch.tensor([0.0, 1.0, 5.0])
    assert torch.equal(prox_norm(t, "scad", 0.0, 3.7, 1.0), t)


def _reference_round(alg, server, updates):
    """The ADMM step written pair by pair (ζ_ji = −ζ_ij, v_ji = −v_ij), for a hand check."""
    theta = server["theta"].clone()
    for i, th in updates.items():
        theta[i] = th
    n = theta.shape[0]
    zeta = torch.zeros(n, n, theta.shape[1], dtype=theta.dtype)
    dual = torch.zeros_like(zeta)
    for m, (i, j) in enumerate(complete_edges(n).tolist()):
        zeta[i, j], zeta[j, i] = server["zeta"][m], -server["zeta"][m]
        dual[i, j], dual[j, i] = server["dual"][m], -server["dual"][m]
    for i in range(n):
        for j in range(i + 1, n):
            if i not in updates and j not in updates:
                continue
            d = theta[i] - theta[j] + dual[i, j] / alg.rho
            zeta[i, j] = prox_rows(d[None], alg.penalty, alg.lam, alg.a, alg.rho, alg.xi)[0]
            dual[i, j] = dual[i, j] + alg.rho * (theta[i] - theta[j] - zeta[i, j])
            zeta[j, i], dual[j, i] = -zeta[i, j], -dual[i, j]
    centre = torch.stack(
        [
            sum(theta[j] + zeta[i, j] - dual[i, j] / alg.rho for j in range(n) if j != i) / (n - 1)
            for i in range(n)
        ]
    )
    return theta, zeta, dual, centre


def test_server_step_and_centres_match_a_pair_by_pair_computation():
    """Signs per edge orientation, the prox, the dual step and the partial-participation rule."""
    n, d = 5, 3
    alg = FPFC(lam=0.4, a=3.7, rho=1.5, xi=0.0)
    g = torch.Generator().manual_seed(3)
    m = n * (n - 1) // 2
    server = {
        "theta": 0.2 * torch.randn(n, d, generator=g, dtype=torch.float64),
        "zeta": 0.3 * torch.randn(m, d, generator=g, dtype=torch.float64),
        "dual": 0.05 * torch.randn(m, d, generator=g, dtype=torch.float64),
        "centre": torch.zeros(n, d, dtype=torch.float64),
    }
    server["theta"][4] += 5.0  # far from everyone: the identity branch of the prox
    updates = {1: torch.randn(d, generator=g, dtype=torch.float64), 3: server["theta"][2].clone()}
    out = alg.server_update(None, server, updates, {1: 0.5, 3: 0.5})
    theta, zeta, dual, centre = _reference_round(alg, server, updates)
    edges = complete_edges(n).tolist()
    torch.testing.assert_close(out["theta"], theta)
    torch.testing.assert_close(out["zeta"], torch.stack([zeta[i, j] for i, j in edges]))
    torch.testing.assert_close(out["dual"], torch.stack([dual[i, j] for i, j in edges]))
    torch.testing.assert_close(out["centre"], centre)
    untouched = [k for k, (i, j) in enumerate(edges) if {i, j}.isdisjoint(updates)]
    assert untouched and torch.equal(out["zeta"][untouched], server["zeta"][untouched])
    norms = out["zeta"].norm(dim=1)
    assert bool((norms == 0).any()) and bool((norms > 4).any())  # fused and far pairs


def test_clusters_are_the_components_of_the_fused_pairs():
    """The flags in complete_edges' order (the server's ζ rows) name the pairs counted."""
    edges = complete_edges(5)
    fused = np.array([tuple(e) in {(0, 1), (2, 3), (1, 4)} for e in edges.tolist()])
    assert count_clusters(fused, 5) == 2  # {0, 1, 4}, {2, 3}
    assert count_clusters(np.zeros(10, dtype=bool), 5) == 5
    assert count_clusters(np.ones(10, dtype=bool), 5) == 1


def test_lambda_zero_decouples_the_clients(small_cfg):
    """λ = 0: v ≡ 0, ζ_ij = θ_i − θ_j, so each centre is the client's own θ_i (partial
    participation too), and as ρ → 0 the clients follow local training."""
    engine = build_engine(small_cfg("algorithm=fpfc", "algorithm.lam=0", "participation=0.6"))
    for _ in range(3):
        metrics = engine.run_round()
        assert torch.equal(engine.server["dual"], torch.zeros_like(engine.server["dual"]))
        for n, state in enumerate(engine.client_states):
            torch.testing.assert_close(engine.server["centre"][n], state["theta"])
    assert metrics["fpfc/clusters"] == 5.0

    fpfc = build_engine(small_cfg("algorithm=fpfc", "algorithm.lam=0", "algorithm.rho=1e-9"))
    local = build_engine(small_cfg("algorithm=local"))
    _rounds(fpfc, 3)
    _rounds(local, 3)
    for a, b in zip(fpfc.client_states, local.client_states, strict=True):
        torch.testing.assert_close(a["theta"], b["theta"], rtol=1e-5, atol=1e-6)


def test_large_lambda_fuses_everyone_into_one_cluster(small_cfg):
    fpfc = build_engine(small_cfg("algorithm=fpfc", "algorithm.lam=100", "algorithm.xi=0"))
    local = build_engine(small_cfg("algorithm=local"))
    metrics = _rounds(fpfc, 5)
    _rounds(local, 5)
    assert torch.equal(fpfc.server["zeta"], torch.zeros_like(fpfc.server["zeta"]))
    assert metrics["fpfc/clusters"] == 1.0 and metrics["fpfc/fused_pairs"] == 10.0

    def spread(engine):
        th = torch.stack([s["theta"] for s in engine.client_states])
        return float(torch.cdist(th, th).max())

    assert spread(fpfc) < 0.4 * spread(local)


def test_runs_with_an_mlp_and_sends_one_model_each_way(small_cfg):
    engine = build_engine(small_cfg("algorithm=fpfc", *MLP))
    d, n = engine.x0.numel(), len(engine.clients)
    metrics = _rounds(engine, 2)
    assert metrics["bytes/up"] == metrics["bytes/down"] == 4 * d * n
    agg, _ = engine.evaluate()
    assert math.isfinite(agg["acc/mean"])
    for n_, state in enumerate(engine.client_states):  # the server holds what each client sent
        assert torch.equal(engine.server["theta"][n_], state["theta"])


def test_resume_is_exact(small_cfg, tmp_path):
    assert_resume_exact(small_cfg("algorithm=fpfc", "rounds=5", "checkpoint_every=2"), tmp_path)


def test_eval_stack_is_eval_params_client_by_client(small_cfg):
    engine = build_engine(small_cfg("algorithm=fpfc", "participation=0.6", *MLP))
    _rounds(engine, 2)
    assert_eval_stack_is_eval_params(engine, personal=False)
