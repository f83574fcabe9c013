"""L2GD against Algorithm 1 of its paper, step by step, and the properties it implies."""

from __future__ import annotations

import pytest
import torch

from fedexp.algorithms.l2gd import L2GD
from fedexp.engine.runner import build_engine
from fedexp.errors import ConfigError
from helpers import assert_eval_stack_is_eval_params
from helpers import assert_resume_exact
from helpers import refused

#: p = 0.5: two local steps a round on average keep the file fast
FAST = ("algorithm=l2gd", "algorithm.p=0.5")


def _rounds(engine, n):
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


def _coins(alg, ctx, rounds):
    """The paper's coin sequence ξ_0, ξ_1, ... that ``rounds`` rounds cover (ends before the
    communication closing the last round)."""
    coins = []
    for t in range(rounds):
        ones, zeros = alg.schedule(ctx, t)
        coins += [1] * ones + [0] * zeros
    return coins


def test_rounds_are_algorithm_1_coin_by_coin(small_cfg):
    """Full gradients: the engine's x_i and x̄ equal L2GD's Algorithm 1 run literally on the
    coin sequence the schedule encodes (runs of 1s: repeated steps towards one x̄)."""
    e = build_engine(small_cfg(*FAST, "algorithm.lam=4.0", "batch_size=0"))
    rounds = 4
    coins = _coins(e.algorithm, e.ctx, rounds)
    assert 0 in coins and coins.count(1) > rounds - 1  # some 1s come in runs of several
    ctx, n, p, lam = e.ctx, len(e.clients), 0.5, 4.0
    eta = ctx.lr * n * (1 - p)
    xs = [e.x0.clone() for _ in range(n)]
    for xi in coins:
        if xi == 0:
            grads = [
                ctx.loss_grad_post(ctx.model_objective(), x, d.x_train, d.y_train, None)[1]
                for x, d in zip(xs, e.clients, strict=True)
            ]
            xs = [x - eta / (n * (1 - p)) * g for x, g in zip(xs, grads, strict=True)]
        else:
            mean = torch.stack(xs).mean(0)
            xs = [x - eta * lam / (n * p) * (x - mean) for x in xs]
    _rounds(e, rounds)
    for state, x in zip(e.client_states, xs, strict=True):
        torch.testing.assert_close(state["x"], x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e.server["xbar"], torch.stack(xs).mean(0), rtol=1e-5, atol=1e-6)


def test_lambda_zero_is_local_training(small_cfg):
    """λ = 0: x_i takes exactly local-only's gradient steps (full batch: the draws do not
    matter), as many as the schedule's local steps."""
    l2gd, _ = _rounds(
        build_engine(small_cfg(*FAST, "algorithm.lam=0.0", "batch_size=0")), rounds := 4
    )
    steps = _coins(l2gd.algorithm, l2gd.ctx, rounds).count(0)
    assert steps > rounds
    local, _ = _rounds(
        build_engine(small_cfg("algorithm=local", "batch_size=0", "local_steps=1")), steps
    )
    for a, b in zip(l2gd.client_states, local.client_states, strict=True):
        assert torch.equal(a["x"], b["theta"])


def test_unit_averaging_rate_sets_every_model_to_the_mean(small_cfg):
    """ηλ/(np) = 1: every client starts its local steps from x̄ exactly, the mean of the last
    uploads (the local steps are η/(n(1−p)) = 0.1)."""
    # p = 0.2, λ = 2.5, n = 5: η = np/λ = 0.4
    cfg = small_cfg("algorithm=l2gd", "algorithm.p=0.2", "algorithm.lam=2.5", "algorithm.eta=0.4")
    e = build_engine(cfg)
    assert e.algorithm.averaging_rate(e.ctx) == pytest.approx(1.0)
    assert e.algorithm.local_lr(e.ctx) == pytest.approx(0.1)
    starts = []
    train = e.ctx.train

    def spy(params, *args, **kwargs):
        starts.extend(params.clone().unbind(0))  # [m, d]: each client's starting point
        return train(params, *args, **kwargs)

    e.ctx.train = spy
    e.run_round()
    for _ in range(2):
        models = torch.stack([s["x"] for s in e.client_states])
        assert not torch.equal(models[0], models[1])  # the local models differ
        xbar = e.server["xbar"].clone()
        torch.testing.assert_close(xbar, models.mean(0))
        starts.clear()
        e.run_round()
        assert len(starts) == 5
        for start in starts:
            assert torch.equal(start, xbar)


def test_schedule_is_shared_reproducible_and_follows_the_coin_law(small_cfg):
    ctx = build_engine(small_cfg(*FAST)).ctx
    alg = L2GD(p=0.3, max_local_steps=1000)
    sched = [alg.schedule(ctx, t) for t in range(2000)]
    assert sched == [alg.schedule(ctx, t) for t in range(2000)]  # a function of (seed, t)
    assert sched[0][0] == 0 and all(m >= 1 and k >= 1 for m, k in sched[1:])
    ctx.seed = 1
    assert sched[:50] != [alg.schedule(ctx, t) for t in range(50)]
    ctx.seed = 0
    coins = _coins(alg, ctx, 2000)
    assert coins.count(1) / len(coins) == pytest.approx(0.3, abs=0.02)  # P(ξ = 1) = p
    # k_t ≥ 1 is 1 + Geometric(p): mean 1/p; m ≥ 1 is 1 + Geometric(1 − p): mean 1/(1 − p)
    assert sum(k for _, k in sched[1:]) / 1999 == pytest.approx(1 / 0.3, rel=0.05)
    assert sum(m for m, _ in sched[1:]) / 1999 == pytest.approx(1 / 0.7, rel=0.05)
    assert max(L2GD(p=0.3, max_local_steps=2).schedule(ctx, t)[1] for t in range(200)) == 2


def test_every_client_takes_the_rounds_shared_steps(small_cfg):
    e = build_engine(small_cfg(*FAST, "participation=0.6"))
    seen = {}
    update = e.algorithm.client_update

    def spy(ctx, model_in, states, cohort):
        out = update(ctx, model_in, states, cohort)
        pairs = zip(out.metrics["averaging_steps"], out.metrics["local_steps"], strict=True)
        seen.setdefault(ctx.round, set()).update((float(m), float(k)) for m, k in pairs)
        return out

    e.algorithm.client_update = spy
    _rounds(e, 4)
    for t, steps in seen.items():
        assert steps == {tuple(float(s) for s in e.algorithm.schedule(e.ctx, t))}


@pytest.mark.parametrize(
    "overrides",
    [(), ("model=mlp", "model.hidden=8"), ("model=mlp", "model.hidden=8", "model.norm=batch")],
    ids=["logreg", "mlp", "mlp-batchnorm"],
)
def test_runs_and_evaluates_the_personal_models(small_cfg, overrides):
    e, metrics = _rounds(build_engine(small_cfg(*FAST, *overrides)), 2)
    out, per_client = e.evaluate()
    assert 0.0 <= out["acc/mean"] <= 1.0 and len(per_client) == 5
    assert metrics["train/local_steps"] >= 1
    params = e.algorithm.eval_params(e.ctx, e.server, e.client_states[2], 2)
    assert torch.equal(params, e.client_states[2]["x"])
    assert not torch.equal(params, e.server["xbar"])


def test_resume_is_exact(small_cfg, tmp_path):
    cfg = small_cfg(
        "algorithm=l2gd",
        "algorithm.p=0.5",
        "rounds=5",
        "checkpoint_every=2",
        "optimizer.momentum=0.9",
    )
    assert_resume_exact(cfg, tmp_path)


def test_bad_arguments_are_refused(small_cfg):
    for bad in ({"p": 0.0}, {"p": 1.0}, {"lam": -1.0}, {"eta": 0.0}, {"max_local_steps": 0}):
        (key,) = bad
        assert refused(L2GD, **bad).startswith(f"algorithm.{key}=")
    with pytest.raises(ConfigError, match="overshoots the mean"):
        build_engine(small_cfg("algorithm=l2gd", "algorithm.lam=100"))


def test_eval_stack_is_eval_params_client_by_client(small_cfg):
    engine, _ = _rounds(build_engine(small_cfg(*FAST, "participation=0.6")), 2)
    assert_eval_stack_is_eval_params(engine, personal=False)
