"""FedDyn against the properties its paper implies (Acar et al. 2021)."""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.runner import build_engine
from helpers import FIXED_POINT
from helpers import stationarity

pytestmark = pytest.mark.usefixtures("one_thread")


def _rounds(engine, n):
    for _ in range(n):
        engine.run_round()
    return engine.server["x"]


def test_the_fixed_point_is_the_global_optimum(small_cfg):
    """At FedDyn's fixed point the clients' dynamic regularisers cancel their drift: the server
    model is a stationary point of (1/N) Σ_n f_n, where FedAvg's is not (the paper's Prop. 1;
    the FedAvg side is tests/algorithms/test_scaffold.py's)."""
    engine = build_engine(small_cfg("algorithm=feddyn", "algorithm.alpha=0.5", *FIXED_POINT))
    _rounds(engine, 60)
    assert stationarity(engine) < 1e-3
    # at that point a round leaves x where it is
    x = engine.server["x"].clone()
    engine.run_round()
    torch.testing.assert_close(engine.server["x"], x, rtol=0, atol=1e-4)


def test_a_large_alpha_keeps_the_local_models_at_x(small_cfg):
    """α → ∞: the proximal term holds θ_n at x, so the uploads Δ_n = x − θ_n vanish (20 steps
    of η = 0.01: ‖x − θ_n‖ ≈ 20η‖g‖ at α = 0.01, the equilibrium ‖g‖/α at α = 90, ηα < 1)."""
    drift = {}
    for alpha in (0.01, 90.0):
        engine = build_engine(
            small_cfg("algorithm=feddyn", f"algorithm.alpha={alpha}", "lr=0.01", "local_steps=20")
        )
        engine.setup()
        engine.run_round()
        drift[alpha] = max(float(s["grad"].norm()) / alpha for s in engine.client_states)
    assert drift[90.0] < 0.1 * drift[0.01]


def test_one_round_follows_algorithm_1(small_cfg):
    """By hand from the clients' models: ∇L̃_n = α(x − θ_n) after one round (it starts at 0),
    h = −(α/N) Σ_S (θ_n − x), and x = mean_S θ_n − h/α."""
    alpha = 0.1
    engine = build_engine(
        small_cfg("algorithm=feddyn", f"algorithm.alpha={alpha}", "participation=0.6")
    )
    engine.setup()
    x0 = engine.server["x"].clone()
    engine.run_round()
    sampled, n = engine.last_sampled, len(engine.clients)
    theta = torch.stack([x0 - engine.client_states[i]["grad"] / alpha for i in sampled])
    h = -(alpha / n) * (theta - x0).sum(0)
    torch.testing.assert_close(engine.server["h"], h)
    torch.testing.assert_close(engine.server["x"], theta.mean(0) - h / alpha)
    for i in set(range(n)) - set(sampled):
        assert not engine.client_states[i]["grad"].any()


def test_with_alpha_small_the_first_round_is_fedprox_like(small_cfg):
    """Round 0 has ∇L̃_n = 0 and h starts at 0: the clients' models are FedProx's (μ = α), so
    mean_S θ_n is FedProx's new model, and x sits −h/α from it."""
    dyn = build_engine(small_cfg("algorithm=feddyn", "algorithm.alpha=0.1"))
    prox = build_engine(
        small_cfg("algorithm=fedprox", "algorithm.mu=0.1", "algorithm.weighting=uniform")
    )
    dyn.run_round()
    prox.run_round()
    torch.testing.assert_close(
        dyn.server["x"] + dyn.server["h"] / 0.1, prox.server["x"], rtol=1e-6, atol=1e-7
    )
