"""pFedSOP against its paper's equations, hand computations, and the engine's contracts."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.algorithms.pfedsop import PFedSOP
from fedexp.algorithms.pfedsop import angle
from fedexp.algorithms.pfedsop import gompertz
from fedexp.algorithms.pfedsop import sop_direction
from fedexp.engine.runner import build_engine
from helpers import assert_eval_stack_is_eval_params
from helpers import assert_resume_exact
from helpers import cohort_of
from helpers import refused

pytestmark = pytest.mark.usefixtures("one_thread")

#: few local steps keep the file fast; no property here depends on their number
FAST = ("local_steps=2",)


def _rounds(engine, n):
    metrics = {}
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


def _engine(small_cfg, *overrides):
    return build_engine(small_cfg(*FAST, "algorithm=pfedsop", *overrides))


def test_sop_step_is_the_regularised_fisher_solve():
    """Sherman–Morrison: Δp/(ρ + ‖Δp‖²) = (ΔpΔpᵀ + ρI)⁻¹Δp, d = 7, float64."""
    g = torch.Generator().manual_seed(0)
    for rho in (1.0, 0.1, 1e-3):
        for scale in (0.01, 1.0, 30.0):
            dp = scale * torch.randn(7, generator=g, dtype=torch.float64)
            explicit = torch.linalg.solve(torch.outer(dp, dp) + rho * torch.eye(7).double(), dp)
            torch.testing.assert_close(sop_direction(dp, rho), explicit, rtol=0, atol=1e-10)


def test_gompertz_weight_and_angle():
    for lam in (0.5, 1.0, 2.5, 5.0):
        assert float(gompertz(torch.tensor(1.0), lam)) == pytest.approx(1 - math.exp(-1))
        for theta in (0.0, 0.5, math.pi / 2, 2.0, math.pi):
            expected = 1 - math.exp(-math.exp(-lam * (theta - 1)))
            got = float(gompertz(torch.tensor(theta, dtype=torch.float64), lam))
            assert got == pytest.approx(expected, rel=1e-12)
    thetas = torch.linspace(0, math.pi, 50, dtype=torch.float64)
    assert bool((gompertz(thetas, 1.0).diff() < 0).all())  # aligned → β near 1, opposed → 0
    a = torch.tensor([0.1, 0.2, 0.3])
    assert float(angle(a, 3 * a)) == pytest.approx(0.0, abs=1e-3)  # clamped: never NaN
    assert float(angle(a, -a)) == pytest.approx(math.pi, abs=1e-3)
    assert float(angle(a, torch.tensor([0.2, -0.1, 0.0]))) == pytest.approx(math.pi / 2)
    assert float(angle(a, torch.zeros(3))) == pytest.approx(math.pi / 2)  # zero: cosine 0


def _trained(e, clients, starts, t):
    """ctx.train from ``starts`` [m, d] on the clients' streams of round t (what the round
    ran), row by row."""
    return e.ctx.train(starts, cohort_of(e, clients, t)).params


def test_first_time_client_takes_no_step_and_sends_its_local_update(small_cfg):
    """A new client: x_i = x0 untouched, Δ_i = (x0 − x^T)/η₂ of plain local training;
    only the sampled clients are marked seen."""
    e, _ = _rounds(_engine(small_cfg, "participation=0.6"), 1)
    lr, sampled = e.ctx.lr, sorted(e.last_sampled)
    trained = _trained(e, sampled, e.x0.expand(len(sampled), -1), 0)
    trained = dict(zip(sampled, trained, strict=True))
    for n, s in enumerate(e.client_states):
        if n in e.last_sampled:
            assert float(s["seen"]) == 1.0
            assert torch.equal(s["x"], e.x0)
            assert torch.equal(s["delta"], (e.x0 - trained[n]) / lr)
        else:
            assert float(s["seen"]) == 0.0 and torch.equal(s["x"], e.x0)
            assert not s["delta"].any()
    expected = torch.stack([e.client_states[n]["delta"] for n in e.last_sampled]).mean(0)
    torch.testing.assert_close(e.server["delta"], expected)  # Eq. 13: the plain mean

    kept, _ = _rounds(_engine(small_cfg, "algorithm.keep_trained=true"), 1)
    trained = _trained(kept, range(5), kept.x0.expand(5, -1), 0)
    for s, x_t in zip(kept.client_states, trained, strict=True):  # the other reading: x_i ← x^T
        assert torch.equal(s["x"], x_t)


def _hand_step(local, glob, lam, rho, eta, pc=True):
    """Algorithm 1 in float64 with math's functions."""
    local, glob = local.double(), glob.double()
    if pc:
        cos = float(local @ glob) / (float(local.norm()) * float(glob.norm()))
        beta = 1 - math.exp(-math.exp(-lam * (math.acos(cos) - 1)))
        dp = (1 - beta) * local + beta * glob
    else:
        dp = glob
    return eta * dp / (rho + float(dp @ dp))


@pytest.mark.parametrize("pc", [True, False], ids=["with-pc", "without-pc"])
def test_returning_client_takes_the_fisher_step(small_cfg, pc):
    """Round 2: x_i = x0 − η₁ (ΔpΔpᵀ + ρI)⁻¹Δp with the paper's Gompertz Δp (with the PC) or
    Δp = Δ_{t−1} (without); then Δ_i is measured from that point."""
    overrides = ("algorithm.lam=2.5", "algorithm.rho=0.1", "algorithm.personal_lr=0.3")
    e = _engine(small_cfg, *overrides, f"algorithm.personal_correction={str(pc).lower()}")
    _rounds(e, 1)
    before = [dict(s) for s in e.client_states]
    glob = e.server["delta"].clone()
    _rounds(e, 1)
    starts = torch.stack([s["x"] for s in e.client_states])
    trained = _trained(e, range(5), starts, 1)
    steps = []
    for n, s in enumerate(e.client_states):
        step = _hand_step(before[n]["delta"], glob, 2.5, 0.1, 0.3, pc)
        torch.testing.assert_close(s["x"].double(), e.x0.double() - step, rtol=1e-5, atol=1e-7)
        assert torch.equal(s["delta"], (s["x"] - trained[n]) / e.ctx.lr)
        steps.append(step)
    # the two variants really differ: the PC mixes in Δ_i, without it every client steps alike
    if pc:
        assert not torch.allclose(steps[0], steps[1])
    else:
        assert all(torch.equal(steps[0], s) for s in steps)


def test_without_pc_changes_the_personal_models(small_cfg):
    with_pc, _ = _rounds(_engine(small_cfg), 3)
    without, _ = _rounds(_engine(small_cfg, "algorithm.personal_correction=false"), 3)
    gap = max(
        float((a["x"] - b["x"]).abs().max())
        for a, b in zip(with_pc.client_states, without.client_states, strict=True)
    )
    assert gap > 1e-4


def test_resume_is_exact(small_cfg, tmp_path):
    """Server Δ, client x_i, Δ_i, seen (and the downlink's error-feedback residuals)."""
    cfg = small_cfg(
        *FAST,
        "algorithm=pfedsop",
        "participation=0.6",
        "compressor=topk",
        "rounds=4",
        "checkpoint_every=2",
    )
    assert_resume_exact(cfg, tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [(), ("model=mlp", "model.hidden=8"), ("model=mlp", "model.hidden=8", "model.norm=batch")],
    ids=["logreg", "mlp", "mlp-batchnorm"],
)
def test_runs_and_evaluates_the_personal_models(small_cfg, overrides):
    e, metrics = _rounds(_engine(small_cfg, *overrides), 2)
    out, per_client = e.evaluate()
    assert 0.0 <= out["acc/mean"] <= 1.0 and len(per_client) == 5
    assert math.isfinite(metrics["train/train_loss"])
    s = e.client_states[0]
    assert torch.equal(e.algorithm.eval_params(e.ctx, e.server, s, 0), s["x"])
    assert not torch.equal(s["x"], e.x0)  # the Fisher step of round 2 moved it
    n = e.ctx.model.layout.num_params
    if e.ctx.model.has_buffers:  # statistics: no gradient, x_i takes those of x^T
        assert not s["delta"][n:].any() and not e.server["delta"][n:].any()
        assert not torch.equal(s["x"][n:], e.x0[n:])


@pytest.mark.parametrize("compressor", ["topk", "stc"])
def test_downlink_is_coded_as_an_update(small_cfg, compressor):
    """The client receives code(Δ_{t−1} + residual), not a replica plus a coded change, and the
    ledger's downlink bytes are those of coding Δ_{t−1}."""
    e = _engine(small_cfg, f"compressor={compressor}")
    received = {}
    original = e.algorithm.client_update

    def spy(ctx, model_in, states, cohort):
        received.update({n: m.clone() for n, m in zip(cohort.clients, model_in, strict=True)})
        return original(ctx, model_in, states, cohort)

    e.algorithm.client_update = spy
    codec = e.downlink.codec
    for t in range(3):
        glob = e.server["delta"].clone()
        residual = {n: r.clone() for (n, _), r in e.transport.residual["down"].items()}
        received.clear()
        metrics = e.run_round()
        size = 0
        for n, got in sorted(received.items()):
            acc = glob if n not in residual else glob + residual[n]
            sent = codec.compress(acc)
            assert torch.equal(got, sent), (t, n)
            size += len(codec.encode(sent))
        assert metrics["bytes/down"] == size
        if t > 0:  # a nonzero Δ: the ledger counts a compressed message
            assert size < 4 * glob.numel() * len(received)
    assert any(r.any() for r in e.transport.residual["down"].values())  # error feedback on Δ


def test_bad_arguments_are_refused():
    for bad in ({"rho": 0.0}, {"lam": -1.0}, {"personal_lr": -0.1}):
        (key,) = bad
        assert refused(PFedSOP, **bad).startswith(f"algorithm.{key}=")
    with pytest.raises(ValueError, match="expected"):
        PFedSOP(weighting="x")


def test_eval_stack_is_eval_params_client_by_client(small_cfg):
    engine, _ = _rounds(_engine(small_cfg, "participation=0.6"), 2)
    assert_eval_stack_is_eval_params(engine, personal=False)
