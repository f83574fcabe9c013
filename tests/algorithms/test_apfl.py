"""APFL against the properties its paper implies, and one step computed by hand."""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.runner import build_engine
from helpers import assert_eval_stack_is_eval_params
from helpers import solo

#: few local steps keep the file fast; no property here depends on their number
FAST = ("local_steps=2",)


def _rounds(engine, n):
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


def test_global_model_is_fedavg(small_cfg):
    """W never depends on v or α: the global model is FedAvg's bit for bit, fixed or adaptive α."""
    avg, _ = _rounds(build_engine(small_cfg(*FAST, "algorithm=fedavg")), 3)
    fixed0, _ = _rounds(
        build_engine(
            small_cfg(*FAST, "algorithm=apfl", "algorithm.alpha=0", "algorithm.adapt_alpha=false")
        ),
        3,
    )
    adaptive, _ = _rounds(
        build_engine(small_cfg(*FAST, "algorithm=apfl", "algorithm.alpha=0.5")), 3
    )
    assert torch.equal(fixed0.server["x"], avg.server["x"])
    assert torch.equal(adaptive.server["x"], avg.server["x"])
    assert any(float(s["alpha"]) != 0.5 for s in adaptive.client_states)  # α did adapt
    for s in fixed0.client_states:  # α = 0: ∇_v = α ∇f(v̄) = 0 and α stays put
        assert torch.equal(s["v"], fixed0.x0) and float(s["alpha"]) == 0.0
    # α = 0: evaluated with v̄ = w, the global model
    params = fixed0.algorithm.eval_params(fixed0.ctx, fixed0.server, fixed0.client_states[0], 0)
    assert torch.equal(params, fixed0.server["x"])


def test_alpha_fixed_at_one_personal_model_is_local_training(small_cfg):
    """v̄ = v and ∇_v = ∇f(v); one minibatch per step for both: the same draws as local-only."""
    apfl, _ = _rounds(
        build_engine(
            small_cfg(*FAST, "algorithm=apfl", "algorithm.alpha=1", "algorithm.adapt_alpha=false")
        ),
        3,
    )
    local, _ = _rounds(build_engine(small_cfg(*FAST, "algorithm=local")), 3)
    for a, b in zip(apfl.client_states, local.client_states, strict=True):
        assert torch.equal(a["v"], b["theta"])
        assert float(a["alpha"]) == 1.0


def _grad(data, theta):
    """Hand-derived gradient of the mean binary cross-entropy of logistic regression."""
    x, y = data.x_train.flatten(1), data.y_train.to(theta.dtype)
    r = torch.sigmoid(x @ theta[:-1] + theta[-1]) - y
    return torch.cat([x.T @ r, r.sum()[None]]) / len(y)


def test_one_step_matches_the_hand_computation(small_cfg):
    """Full batch, SGD: w, v and α move as Algorithm 1 says, simultaneously; α's sign too."""
    e = build_engine(small_cfg(*FAST, "algorithm=apfl", "batch_size=0"))
    ctx, data, alg = e.ctx, e.clients[0], e.algorithm
    w = e.x0
    g_w = _grad(data, w)
    for direction in (-1.0, 1.0):  # v better than w (along −∇f(w)), then worse
        v = w + direction * 0.01 * g_w / g_w.norm()
        alpha, eta = 0.5, ctx.lr
        v_bar = alpha * v + (1 - alpha) * w
        g_bar = _grad(data, v_bar)
        inner = float((v - w) @ g_bar)  # ∇_α f(v̄) = ⟨v − w, ∇f(v̄)⟩
        alg.alpha_lr = 0.1 / abs(inner)  # η_α: a step of 0.1, inside [0, 1]
        out = ctx.train(
            torch.cat([w, v, torch.tensor([alpha])])[None],
            solo(data),
            objective=alg.objective(ctx, w),
            steps=1,
        ).params[0]
        d = w.numel()
        torch.testing.assert_close(out[:d], w - eta * g_w)
        torch.testing.assert_close(out[d : 2 * d], v - eta * alpha * g_bar)
        expected = alpha - alg.alpha_lr * inner
        torch.testing.assert_close(float(out[-1]), expected, rtol=1e-4, atol=1e-5)
        # a personal model better than w pulls α up (towards v), a worse one pushes it down
        assert float(out[-1]) == pytest.approx(alpha - 0.1 * direction, abs=1e-4)


def test_alpha_is_clipped_to_the_unit_interval(small_cfg):
    e, _ = _rounds(build_engine(small_cfg(*FAST, "algorithm=apfl", "algorithm.alpha_lr=1e6")), 1)
    alphas = torch.cat([s["alpha"] for s in e.client_states])
    assert bool(((alphas >= 0) & (alphas <= 1)).all())
    assert bool(((alphas == 0) | (alphas == 1)).all())  # a huge step lands on a bound


@pytest.mark.parametrize(
    "overrides",
    [(), ("model=mlp", "model.hidden=8"), ("model=mlp", "model.hidden=8", "model.norm=batch")],
    ids=["logreg", "mlp", "mlp-batchnorm"],
)
def test_runs_and_evaluates_the_mixture(small_cfg, overrides):
    e, metrics = _rounds(build_engine(small_cfg(*FAST, "algorithm=apfl", *overrides)), 2)
    out, per_client = e.evaluate()
    assert 0.0 <= out["acc/mean"] <= 1.0 and len(per_client) == 5
    assert 0.0 <= metrics["train/alpha"] <= 1.0
    assert_eval_stack_is_eval_params(e, [3, 0, 4, 1])
    s = e.client_states[0]
    expected = float(s["alpha"]) * s["v"] + (1 - float(s["alpha"])) * e.server["x"]
    params = e.algorithm.eval_params(e.ctx, e.server, s, 0)
    n = e.ctx.model.layout.num_params
    torch.testing.assert_close(params[:n], expected[:n])
    if e.ctx.model.has_buffers:  # v's statistics followed the mixture's forward passes
        assert torch.equal(params[n:], s["v"][n:])
        assert not torch.equal(s["v"][n:], e.x0[n:])
        assert not torch.equal(s["v"][n:], e.server["x"][n:])
