"""Ditto against the properties its paper implies."""

from __future__ import annotations

import torch

from fedexp.engine.runner import build_engine


def _rounds(engine, n):
    for _ in range(n):
        engine.run_round()
    return engine


def test_global_model_is_fedavg(small_cfg):
    ditto = _rounds(build_engine(small_cfg("algorithm=ditto", "algorithm.lam=1.0")), 3)
    avg = _rounds(build_engine(small_cfg("algorithm=fedavg")), 3)
    assert torch.equal(ditto.server["x"], avg.server["x"])


def test_lambda_zero_personal_models_are_local_training(small_cfg):
    """Full batch (draws do not matter): v_n follows local-only gradient descent exactly."""
    ditto = _rounds(
        build_engine(small_cfg("algorithm=ditto", "algorithm.lam=0.0", "batch_size=0")), 3
    )
    local = _rounds(build_engine(small_cfg("algorithm=local", "batch_size=0")), 3)
    for a, b in zip(ditto.client_states, local.client_states, strict=True):
        assert torch.equal(a["v"], b["theta"])


def test_larger_lambda_keeps_personal_models_nearer_the_global_one(small_cfg):
    gap = {}
    for lam in (0.0, 5.0):
        e = _rounds(
            build_engine(small_cfg("algorithm=ditto", f"algorithm.lam={lam}", "lr=0.05")), 5
        )
        gap[lam] = sum(float((s["v"] - e.server["x"]).norm()) for s in e.client_states)
    assert gap[5.0] < 0.5 * gap[0.0]
