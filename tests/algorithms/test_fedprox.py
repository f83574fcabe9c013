"""FedProx against the properties its paper implies."""

from __future__ import annotations

import torch

from fedexp.engine.runner import build_engine


def _rounds(engine, n):
    for _ in range(n):
        engine.run_round()
    return engine.server["x"]


def test_mu_zero_equals_fedavg(small_cfg):
    prox = _rounds(build_engine(small_cfg("algorithm=fedprox", "algorithm.mu=0.0")), 3)
    avg = _rounds(build_engine(small_cfg("algorithm=fedavg")), 3)
    assert torch.equal(prox, avg)


def test_proximal_term_keeps_local_models_closer_to_the_global_one(small_cfg):
    drift = {}
    for mu in (0.0, 10.0):
        engine = build_engine(
            small_cfg("algorithm=fedprox", f"algorithm.mu={mu}", "local_steps=20", "lr=0.05")
        )
        x = engine.server["x"].clone()
        engine.run_round()
        drift[mu] = float((engine.server["x"] - x).norm())
    assert drift[10.0] < 0.8 * drift[0.0]


def test_one_local_step_matches_the_closed_form(small_cfg):
    """E = 1, full batch: θ = x − η(∇f(x) + μ(x − x)) = x − η∇f(x): μ has no effect."""
    a = _rounds(
        build_engine(
            small_cfg("algorithm=fedprox", "algorithm.mu=5.0", "local_steps=1", "batch_size=0")
        ),
        2,
    )
    b = _rounds(build_engine(small_cfg("algorithm=fedavg", "local_steps=1", "batch_size=0")), 2)
    torch.testing.assert_close(a, b)
