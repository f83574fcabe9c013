"""pFedMe against hand computations of its Algorithm 1 and the properties its paper implies."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.algorithms.pfedme import PFedMe
from fedexp.contract import CohortStates
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.engine.solver import passes
from fedexp.tracking.base import NullTracker
from helpers import assert_resume_exact
from helpers import cohort_of
from helpers import solo

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(small_cfg, *overrides):
    return build_engine(small_cfg("algorithm=pfedme", *overrides))


def _grad(ctx, params, x, y):
    return ctx.loss_grad_post(ctx.model_objective(), params, x, y, None)[1]


def test_one_round_full_batch_matches_a_hand_computation(small_cfg):
    """Full batch, R = 1, K = 2, β = 0.5: θ₁ = w − α∇f(w) (the pull is zero at w),
    θ̃ = θ₁ − α(∇f(θ₁) + λ(θ₁ − w)), w₁ = w − ηλ(w − θ̃), x ← (1 − β)w + β Σ ω_i w₁_i."""
    lam, alpha, eta, beta = 3.0, 0.05, 0.1, 0.5
    e = _engine(
        small_cfg,
        "batch_size=0",
        f"lr={eta}",
        f"algorithm.lam={lam}",
        f"algorithm.personal_lr={alpha}",
        f"algorithm.beta={beta}",
        "algorithm.local_rounds=1",
        "algorithm.personal_steps=2",
    )
    w = e.server["x"].clone()
    sizes = [c.num_train for c in e.clients]
    mean = torch.zeros_like(w)
    thetas = []
    for data, size in zip(e.clients, sizes, strict=True):
        x, y = data.x_train, data.y_train
        t1 = w - alpha * _grad(e.ctx, w, x, y)
        t2 = t1 - alpha * (_grad(e.ctx, t1, x, y) + lam * (t1 - w))
        mean += size / sum(sizes) * (w - eta * lam * (w - t2))
        thetas.append(t2)
    e.run_round()
    torch.testing.assert_close(e.server["x"], (1 - beta) * w + beta * mean)
    for state, theta in zip(e.client_states, thetas, strict=True):
        torch.testing.assert_close(state["theta"], theta)


def test_minibatch_rounds_match_a_reference_algorithm_1(small_cfg):
    """R = 3 local rounds of K = 3 steps on minibatches of 4, replayed from the client's stream:
    one minibatch a local round (all K steps on it), θ warm-started from the previous θ̃ (the
    authors' code), uniform mean over the clients with weighting=uniform."""
    lam, alpha, eta, big_r, k = 4.0, 0.05, 0.05, 3, 3
    e = _engine(
        small_cfg,
        "batch_size=4",
        f"lr={eta}",
        f"algorithm.lam={lam}",
        f"algorithm.personal_lr={alpha}",
        f"algorithm.local_rounds={big_r}",
        f"algorithm.personal_steps={k}",
        "algorithm.weighting=uniform",
    )
    x = e.server["x"].clone()
    models, thetas = [], []
    for n, data in enumerate(e.clients):
        gen = passes.client_stream(e.seed, 0, n)
        w, theta = x.clone(), x.clone()
        for _ in range(big_r):
            xb, yb = data.batch(4, gen)
            for _ in range(k):
                theta = theta - alpha * (_grad(e.ctx, theta, xb, yb) + lam * (theta - w))
            w = w - eta * lam * (w - theta)
        models.append(w)
        thetas.append(theta)
    e.run_round()
    torch.testing.assert_close(e.server["x"], torch.stack(models).mean(0))
    for state, theta in zip(e.client_states, thetas, strict=True):
        torch.testing.assert_close(state["theta"], theta)


@pytest.mark.parametrize("lam", [4.0, 64.0])
def test_inner_step_of_one_over_lambda_is_a_fedavg_step(small_cfg, lam):
    """K = 1, personal lr 1/λ from θ = w: θ̃ = w − ∇f(w)/λ, so w − ηλ(w − θ̃) = w − η∇f(w):
    one pFedMe local round is FedAvg's local step on the same minibatch, for every λ."""
    common = ("batch_size=8", "lr=0.1", "participation=0.6")
    p = _engine(
        small_cfg,
        *common,
        f"algorithm.lam={lam}",
        f"algorithm.personal_lr={1 / lam}",
        "algorithm.personal_steps=1",
        "algorithm.local_rounds=1",
    )
    a = build_engine(small_cfg("algorithm=fedavg", *common, "local_steps=1"))
    for _ in range(3):
        p.run_round()
        a.run_round()
    torch.testing.assert_close(p.server["x"], a.server["x"])


def test_large_lambda_gives_theta_equal_w_and_fedavg_steps(small_cfg):
    """β = 1, λ → ∞ (inner problem solved: K = 30 steps with personal lr 0.5/λ): θ̃ → w_{i,r}
    and each envelope step → an SGD step on the local round's minibatch, so the server follows
    FedAvg with R local steps (same draws); both gaps shrink like 1/λ."""
    common = ("batch_size=8", "lr=0.1")
    avg = build_engine(small_cfg("algorithm=fedavg", *common, "local_steps=3"))
    x = avg.server["x"].clone()
    avg.run_round()
    gap, pull = {}, {}
    for lam in (10.0, 1000.0):
        e = _engine(
            small_cfg,
            *common,
            f"algorithm.lam={lam}",
            f"algorithm.personal_lr={0.5 / lam}",
            "algorithm.personal_steps=30",
            "algorithm.local_rounds=3",
            "algorithm.beta=1.0",
        )
        e.run_round()
        gap[lam] = float((e.server["x"] - avg.server["x"]).norm())
        # one local round from x: θ̃ is the prox point of x, ‖θ̃ − x‖ = ‖∇f(θ̃)‖/λ
        one = PFedMe(lam=lam, personal_steps=30, personal_lr=0.5 / lam, local_rounds=1)
        out = one.client_update(e.ctx, x[None], CohortStates(1), solo(e.clients[0]))
        pull[lam] = float((out.states[0]["theta"] - x).norm())
    assert gap[1000.0] < gap[10.0] / 20
    assert gap[1000.0] < 0.01 * float((avg.server["x"] - x).norm())
    assert pull[1000.0] < pull[10.0] / 50


def test_local_rounds_draw_exactly_one_minibatch_each(small_cfg):
    """The K inner steps reuse the local round's minibatch: R rounds, R index draws."""
    for overrides, rounds in ((("algorithm.local_rounds=3",), 3), (("local_steps=2",), 2)):
        e = _engine(small_cfg, "batch_size=4", "algorithm.personal_steps=5", *overrides)
        cohort = cohort_of(e, [1, 3])
        e.algorithm.client_update(
            e.ctx, e.server["x"].expand(2, -1), e.client_states.rows([1, 3]), cohort
        )
        assert cohort.draws.tolist() == [rounds, rounds]


def test_unsampled_clients_keep_the_initial_model_when_only_the_sampled_train(small_cfg):
    e = _engine(small_cfg, "participation=0.6", "algorithm.all_train=false")
    x0 = e.server["x"].clone()
    e.run_round()
    sampled = set(e.last_sampled)
    assert 0 < len(sampled) < len(e.clients)
    for n, state in enumerate(e.client_states):
        assert torch.equal(state["theta"], x0) != (n in sampled)
        assert torch.equal(e.algorithm.eval_params(e.ctx, e.server, state, n), state["theta"])


def test_batchnorm_statistics_of_w_follow_theta(small_cfg):
    """w_{i,R} carries θ̃'s running statistics: with β = 1 and every client sampled the
    server's statistics are the weighted mean of the clients' θ̃ statistics."""
    e = _engine(small_cfg, "model=mlp", "model.hidden=8", "model.norm=batch")
    assert e.ctx.model.has_buffers
    e.run_round()
    mask = e.ctx.model.buffer_mask
    sizes = torch.tensor([float(c.num_train) for c in e.clients])
    thetas = torch.stack([s["theta"] for s in e.client_states])
    expected = ((sizes / sizes.sum())[:, None] * thetas).sum(0)
    torch.testing.assert_close(e.server["x"][mask], expected[mask])
    metrics, _ = e.evaluate()
    assert math.isfinite(metrics["acc/mean"])


@pytest.mark.parametrize("overrides", [(), ("model=mlp", "model.hidden=8")], ids=["default", "mlp"])
def test_runs(small_cfg, overrides):
    result = run(small_cfg("algorithm=pfedme", "rounds=2", *overrides), tracker=NullTracker())
    assert math.isfinite(result.metrics["acc/mean"])
    assert len(result.per_client) == 5


def test_resume_is_exact(small_cfg, tmp_path):
    cfg = small_cfg(
        "algorithm=pfedme", "rounds=5", "checkpoint_every=2", "participation=0.6", "local_steps=2"
    )
    assert_resume_exact(cfg, tmp_path)
