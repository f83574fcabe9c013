"""TDPFed (Wang et al.): AFM/ACT aggregation, factor-only uplink, the client's two steps."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.algorithms.tdpfed import TDPFed
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.engine.solver import passes
from fedexp.engine.solver.optim import SGD
from fedexp.engine.solver.optim import Adam
from fedexp.models.cp import compose
from fedexp.tracking.base import NullTracker
from helpers import assert_eval_stack_is_eval_params
from helpers import assert_resume_exact
from helpers import refused

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = ("model=mlp", "model.hidden=8")


def _engine(small_cfg, *overrides):
    return build_engine(small_cfg("algorithm=tdpfed", "algorithm.local_rounds=2", *overrides))


def _fake_updates(e, scale=1.0):
    g = torch.Generator().manual_seed(7)
    a = e.server["a"]
    ups = {n: a + scale * torch.randn(a.shape, generator=g, dtype=a.dtype) for n in range(5)}
    w = torch.rand(5, generator=g, dtype=torch.float64)
    weights = {n: float(w[n] / w.sum()) for n in range(5)}
    return ups, weights


@pytest.mark.parametrize("beta", [1.0, 0.6])
def test_afm_is_the_weighted_factor_mean(small_cfg, beta):
    """Eq. 18: A ← (1−β)A + β Σ ω_k A_k; β = 1 is the weighted factor mean."""
    e = _engine(small_cfg, *MLP, f"algorithm.beta={beta}")
    ups, weights = _fake_updates(e)
    mean = sum(weights[n] * ups[n] for n in ups)
    out = e.algorithm.server_update(e.ctx, e.server, ups, weights)
    torch.testing.assert_close(out["a"], (1 - beta) * e.server["a"] + beta * mean)


def test_afm_round_averages_the_clients_uploads(small_cfg):
    """Through the engine: after a full-participation round the server's factors are the
    n_k-weighted mean of what the clients uploaded (β = 1)."""
    e = _engine(small_cfg, *MLP)
    seen = {}
    original = e.algorithm.client_update

    def spy(ctx, model_in, states, cohort):
        result = original(ctx, model_in, states, cohort)
        for n, row in zip(cohort.clients, result.updates, strict=True):
            seen[n] = row.clone()
        return result

    e.algorithm.client_update = spy
    e.run_round()
    sizes = torch.tensor([c.num_train for c in e.clients], dtype=torch.float64)
    expected = sum(float(sizes[n] / sizes.sum()) * seen[n] for n in range(5))
    torch.testing.assert_close(e.server["a"], expected)


def test_act_averages_composed_tensors_and_refits_factors(small_cfg):
    """Eqs. 19-20: the composed average. With every client uploading the same factors the
    average is [[A_k]] itself and the refit keeps it exactly; in general the refit's
    composed tensor is at least as close to the average as the factor mean's (ALS descends)."""
    e = _engine(small_cfg, *MLP, "algorithm.aggregation=act", "algorithm.act_sweeps=5")
    cp = e.algorithm.cp(e.ctx)
    ups, weights = _fake_updates(e, scale=0.3)
    same = {n: ups[0] for n in ups}
    out = e.algorithm.server_update(e.ctx, e.server, same, weights)
    torch.testing.assert_close(cp.compose(out["a"]), cp.compose(ups[0]))
    out = e.algorithm.server_update(e.ctx, e.server, ups, weights)
    afm = sum(weights[n] * ups[n] for n in ups)
    for entry in cp.entries:
        if entry.rank == 0:
            torch.testing.assert_close(
                out["a"][entry.offset : entry.offset + entry.size],
                afm[entry.offset : entry.offset + entry.size],
            )
            continue
        target = sum(weights[n] * compose(cp.factors(ups[n], entry)) for n in ups)
        refit = (compose(cp.factors(out["a"], entry)) - target).norm()
        mean = (compose(cp.factors(afm, entry)) - target).norm()
        assert refit <= mean + 1e-9
    assert not torch.equal(out["a"], afm)


def test_uplink_is_the_factors_only(small_cfg):
    """Each client uploads 4 bytes per factor-vector entry: Σ factor sizes + the biases,
    far fewer than the model's (dense float32, no compressor)."""
    e = _engine(small_cfg, "model=mlp", "model.hidden=40", "algorithm.rate=2.0")
    cp = e.algorithm.cp(e.ctx)
    e.setup()
    m = e.run_round()
    biases = cp.numel - cp.num_factor_entries
    assert cp.ranks == {"body.0.weight": round(40 * 30 / (2 * 70)), "head.weight": 1}
    assert m["bytes/up"] == 5 * 4 * (cp.num_factor_entries + biases)
    assert m["bytes/down"] == 5 * 4 * cp.numel
    assert cp.numel < e.ctx.model.layout.numel / 1.7


def test_one_round_matches_algorithm_1(small_cfg):
    """Replays Algorithm 1 for every client with the paper's two optimisers: τ = 2 local
    rounds of one minibatch; s = 2 Nesterov steps on θ then s′ = 3 Adam steps on A."""
    lam, eta_p, eta = 3.0, 0.05, 0.01
    e = _engine(
        small_cfg,
        *MLP,
        "batch_size=8",
        f"lr={eta}",
        f"algorithm.lam={lam}",
        f"algorithm.personal_lr={eta_p}",
        "algorithm.personal_steps=2",
        "algorithm.factor_steps=3",
        "algorithm.momentum=0.5",
    )
    cp = e.algorithm.cp(e.ctx)
    a0 = e.server["a"].clone()
    uploads, thetas = [], []
    for n, data in enumerate(e.clients):
        gen = passes.client_stream(e.seed, 0, n)
        theta = e.client_states[n]["theta"].clone()
        a = a0.clone()
        sgd, adam = SGD(momentum=0.5, nesterov=True), Adam()
        s_theta, s_a = sgd.init(theta), adam.init(a)
        for _ in range(2):
            xb, yb = data.batch(8, gen)
            anchor = cp.compose(a)
            for _ in range(2):
                p = theta.detach().requires_grad_(True)
                loss = e.ctx.task.loss(e.ctx.model(p, xb), yb)
                loss = loss + 0.5 * lam * ((p - anchor) ** 2).sum()
                (grad,) = torch.autograd.grad(loss, p)
                theta, s_theta = sgd.step(theta, grad, s_theta, eta_p)
            for _ in range(3):
                q = a.detach().requires_grad_(True)
                loss = 0.5 * lam * ((theta - cp.compose(q)) ** 2).sum()
                (grad,) = torch.autograd.grad(loss, q)
                a, s_a = adam.step(a, grad, s_a, eta)
        uploads.append(a)
        thetas.append(theta)
    e.run_round()
    sizes = torch.tensor([c.num_train for c in e.clients], dtype=torch.float64)
    expected = sum(float(sizes[n] / sizes.sum()) * uploads[n] for n in range(5))
    torch.testing.assert_close(e.server["a"], expected)
    for state, theta in zip(e.client_states, thetas, strict=True):
        torch.testing.assert_close(state["theta"], theta)
        assert int(state["opt_a.step"]) == 6
    state = e.client_states[0]  # evaluated with θ_k (close to the replay's, checked above)
    assert torch.equal(e.algorithm.eval_params(e.ctx, e.server, state, 0), state["theta"])


def test_initial_factors_fit_the_initial_model(small_cfg):
    """A_0 is an ALS fit of x0: with a rank that can represent the weights exactly
    (rate ≤ 1/2 of the full rank's), [[A_0]] reproduces x0."""
    e = _engine(small_cfg, "model=logreg", "algorithm.rate=0.1")
    x0 = e.client_states[0]["theta"]
    cp = e.algorithm.cp(e.ctx)
    assert cp.ranks["linear.weight"] >= 1
    torch.testing.assert_close(cp.compose(e.server["a"]), x0, rtol=1e-4, atol=1e-5)


def test_reset_personal_starts_theta_at_the_composed_factors(small_cfg):
    """reset_personal: θ_k restarts from [[A]]; with s = 0 it stays there exactly."""
    e = _engine(small_cfg, *MLP, "algorithm.reset_personal=true", "algorithm.personal_steps=0")
    cp = e.algorithm.cp(e.ctx)
    a0 = e.server["a"].clone()
    e.run_round()
    for state in e.client_states:
        torch.testing.assert_close(state["theta"], cp.compose(a0))


def test_no_local_steps_keeps_the_factors(small_cfg):
    e = _engine(small_cfg, *MLP, "algorithm.personal_steps=0", "algorithm.factor_steps=0")
    a0 = e.server["a"].clone()
    e.run_round()
    torch.testing.assert_close(e.server["a"], a0)


@pytest.mark.parametrize(
    "overrides",
    [(), MLP, (*MLP, "model.norm=batch"), (*MLP, "algorithm.aggregation=act")],
    ids=["default", "mlp", "mlp-bn", "act"],
)
def test_runs(small_cfg, overrides):
    result = run(
        small_cfg("algorithm=tdpfed", "rounds=2", "algorithm.local_rounds=2", *overrides),
        tracker=NullTracker(),
    )
    assert math.isfinite(result.metrics["acc/mean"])
    assert len(result.per_client) == 5


@pytest.mark.parametrize("all_train", ["true", "false"])
def test_evaluates_every_clients_theta_at_once(small_cfg, all_train):
    """θ_k of clients that trained (all of them, or the sampled ones) and of one that has
    not (its initial θ = x0)."""
    e = _engine(small_cfg, *MLP, "participation=0.6", f"algorithm.all_train={all_train}")
    e.run_round()
    e.run_round()
    assert_eval_stack_is_eval_params(e, [3, 0, 4, 1])


def test_resume_is_exact_with_both_optimiser_states(small_cfg, tmp_path):
    cfg = small_cfg(
        "algorithm=tdpfed",
        "algorithm.local_rounds=2",
        *MLP,
        "rounds=5",
        "checkpoint_every=2",
        "participation=0.6",
    )
    assert_resume_exact(cfg, tmp_path)


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="aggregation"):
        TDPFed(aggregation="mean")
    assert refused(TDPFed, lam=0.0) == "algorithm.lam=0.0: expected > 0"


@pytest.mark.parametrize("keep", [0.667, 0.5])
def test_fedavg_sar_sends_a_random_share_both_ways(small_cfg, keep):
    """FedAvg (s.a.r.), TDPFed §VII-D: the random-k codec with q = keep up and down, and the
    bytes of both directions below the dense float32 count."""
    e = build_engine(small_cfg("compressor=sar", f"compressor.keep={keep}", "model=mlp"))
    for channel in (e.uplink, e.downlink):
        assert channel.codec.q == pytest.approx(keep)
    e.setup()
    m = e.run_round()
    for d in ("up", "down"):
        assert 0 < m[f"bytes/{d}"] < m[f"bytes/{d}_dense"]


def test_running_statistics_move_into_the_factor_vector(small_cfg):
    """``dense_source`` gathers a model vector's dense entries into the factor vector's
    places: what a zero-sweep decomposition started at the factors copies there."""
    e = _engine(small_cfg, *MLP, "model.norm=batch")
    cp = e.algorithm.cp(e.ctx)
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(e.x0.shape, generator=gen)
    dense = cp.dense_mask()
    assert cp.model_mask(e.ctx.model.buffer_mask).any()
    copied = cp.decompose(theta, start=e.server["a"], sweeps=0)
    assert torch.equal(theta[cp.dense_source()][dense], copied[dense])
