"""FedALA against the properties its paper implies, and against a hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedexp import streams
from fedexp.algorithms.fedala import ALA_STREAM
from fedexp.algorithms.fedala import FedALA
from fedexp.algorithms.fedala import first_draws
from fedexp.engine.runner import build_engine
from helpers import assert_eval_stack_is_eval_params
from helpers import assert_resume_exact
from helpers import cohort_of
from helpers import refused

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = ("model=mlp", "model.hidden=8")


def _rounds(engine, n):
    history = [engine.run_round() for _ in range(n)]
    return history


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.eta=0.0",),
        ("algorithm.eta=0.0", "participation=0.6", "optimizer.momentum=0.9", *MLP),
        ("algorithm.eta=0.0", *MLP, "model.norm=batch"),
        ("algorithm.layers=0", "algorithm.eta=5.0", *MLP),
    ],
    ids=["w1-logreg", "w1-mlp-momentum-partial", "w1-batchnorm", "p0-mlp"],
)
def test_unit_weights_or_no_layers_is_fedavg_bit_for_bit(small_cfg, overrides):
    """W ≡ 1 (η_W = 0) or p = 0: Θ̂ = Θ, so training starts from the global model as FedAvg."""
    common = [o for o in overrides if not o.startswith("algorithm.")]
    ala = build_engine(small_cfg("algorithm=fedala", *overrides))
    avg = build_engine(small_cfg("algorithm=fedavg", *common))
    for _ in range(3):
        ala.run_round()
        avg.run_round()
        assert torch.equal(ala.server["x"], avg.server["x"])
    for a, b in zip(ala.client_states, avg.client_states, strict=True):
        assert bool((a["W"] == 1).all())
        for key in b:  # the same optimiser state as FedAvg's clients
            assert torch.equal(a[key], b[key])


def test_weight_step_matches_a_hand_computation(small_cfg):
    """One minibatch: W ← clip(W − η (∇_θ L(Θ̂))_top ⊙ (Θ − Θ_i)_top, 0, 1)."""
    engine = build_engine(small_cfg("algorithm=fedala", "algorithm.eta=3.0", *MLP))
    alg, ctx, x0 = engine.algorithm, engine.ctx, engine.x0
    lo, hi = alg.top_range(ctx)
    head = ctx.model.layout.indices(["head.*"])
    assert torch.equal(torch.arange(lo, hi), head)  # p = 2: the last layer's weight and bias
    gen = torch.Generator().manual_seed(0)
    glob = x0 + 0.5 * torch.randn(x0.shape, generator=gen)
    local = x0 - 0.5 * torch.randn(x0.shape, generator=gen)
    w = torch.rand(hi - lo, generator=gen)
    data = engine.clients[0]
    x, y = data.x_train[:16], data.y_train[:16]

    mixed = alg.mix(ctx, glob, local, w)
    assert torch.equal(mixed[:lo], glob[:lo])  # lower layers: the global model
    torch.testing.assert_close(mixed[lo:hi], local[lo:hi] + (glob - local)[lo:hi] * w)

    objective = alg.ala_objective(ctx, glob[None], local[None])  # a cohort of one
    new_w, loss = alg.ala_step(ctx, objective, w[None], x[None], y[None])
    new_w, loss = new_w[0], loss[0]
    ref_loss, grad, _ = ctx.loss_grad_post(ctx.model_objective(), mixed, x, y, None)
    expected = torch.clamp(w - 3.0 * grad[lo:hi] * (glob - local)[lo:hi], 0.0, 1.0)
    torch.testing.assert_close(new_w, expected)
    torch.testing.assert_close(loss, ref_loss)
    assert bool(((new_w == 0) | (new_w == 1)).any())  # the clip is exercised
    assert bool(((new_w > 0) & (new_w < 1)).any())


def test_weights_stay_in_unit_interval_and_start_phase_converges(small_cfg):
    """Round 0 skips ALA (Θ = Θ_i = x0); round 1 learns W to convergence; then one epoch."""
    engine = build_engine(small_cfg("algorithm=fedala", "algorithm.eta=20.0", *MLP))
    history = _rounds(engine, 3)
    epochs = [m["train/ala_epochs"] for m in history]
    assert epochs[0] == 0.0
    assert 11.0 <= epochs[1] <= 100.0  # more than num_pre_loss = 10 epochs, capped at 100
    assert epochs[2] == 1.0
    moved = False
    for n, state in enumerate(engine.client_states):
        w = state["W"]
        assert bool(((w >= 0) & (w <= 1)).all())
        moved |= bool((w < 1).any())
        assert float(state["started"][0]) == 1.0
        mixed = engine.algorithm.eval_params(engine.ctx, engine.server, state, n)
        lo, hi = engine.algorithm.top_range(engine.ctx)
        assert torch.equal(mixed[:lo], engine.server["x"][:lo])
        torch.testing.assert_close(
            mixed[lo:hi], torch.lerp(state["theta"][lo:hi], engine.server["x"][lo:hi], w)
        )
    assert moved


def test_first_participation_after_round_zero_starts_the_phase(small_cfg):
    """A client first sampled after round 0 (Θ_i = x0 ≠ Θ) runs its start phase then."""
    engine = build_engine(small_cfg("algorithm=fedala", "participation=0.4"))
    for _ in range(4):
        engine.run_round()
        for n in engine.last_sampled:
            started = float(engine.client_states[n]["started"][0])
            assert started == (0.0 if engine.round == 1 else 1.0)


def test_resume_is_exact(small_cfg, tmp_path):
    cfg = small_cfg("algorithm=fedala", "rounds=4", "checkpoint_every=2", "participation=0.6")
    assert_resume_exact(cfg, tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [(), MLP, (*MLP, "model.norm=batch", "algorithm.stats=local", "algorithm.evaluate=local")],
    ids=["default", "mlp", "batchnorm-local"],
)
def test_runs(small_cfg, overrides):
    engine = build_engine(small_cfg("algorithm=fedala", *overrides))
    _rounds(engine, 2)
    agg, per_client = engine.evaluate()
    assert math.isfinite(agg["acc/mean"]) and len(per_client) == 5
    assert_eval_stack_is_eval_params(engine, [3, 0, 4, 1])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="stats"):
        FedALA(stats="mine")
    assert refused(FedALA, rand_percent=0).startswith("algorithm.rand_percent=0: expected")


def test_start_phase_runs_to_the_papers_threshold(small_cfg, monkeypatch):
    """The default threshold is the paper's 0.01: with the last 10 epoch losses' std at 0.05,
    the start phase goes on (``ALA.py``'s 0.1 would stop there) until the std is below 0.01."""
    engine = build_engine(small_cfg("algorithm=fedala", *MLP))
    alg, ctx, x0 = engine.algorithm, engine.ctx, engine.x0
    assert alg.threshold == 0.01
    lo, hi = alg.top_range(ctx)
    # epoch losses: 15 epochs alternating ±0.05 (std 0.05), then ±0.004 (std 0.004)
    noisy = [1 + 0.05 * (-1) ** e for e in range(15)]
    losses = iter(noisy + [1 + 0.004 * (-1) ** e for e in range(40)])
    batches = math.ceil(int(0.8 * engine.clients[0].num_train) / ctx.batch_size)
    calls = {"n": 0}

    def step(ctx, objective, w, xb, yb):
        calls["n"] += 1
        loss = next(losses) if calls["n"] % batches == 0 else 0.0  # the epoch's last counts
        return w, torch.tensor([loss])

    monkeypatch.setattr(alg, "ala_step", step)
    w = torch.ones(1, hi - lo)
    cohort = cohort_of(engine, [0])

    def epochs():
        return alg.learn_weights(ctx, x0[None], x0[None] + 1, w, cohort, [0], [True], [True])[1]

    assert epochs() == [25]  # 15 noisy epochs, then 10 whose std is below 0.01
    alg.threshold = 0.1  # ALA.py's default stops as soon as 10 losses are in (std 0.05)
    losses = iter([1 + 0.05 * (-1) ** e for e in range(15)])
    calls["n"] = 0
    assert epochs() == [11]


@pytest.mark.parametrize("norm", [(), ("model.norm=batch",)], ids=["mlp", "batchnorm"])
def test_a_cohort_learns_each_clients_weights_as_alone(small_cfg, norm):
    """ALA over a cohort of unequal clients (their slices of different lengths, short last
    minibatches) gives each client the weights and epochs it gets alone."""
    overrides = ("algorithm=fedala", "algorithm.eta=5.0", *MLP, *norm, "batch_size=10")
    engine = build_engine(small_cfg(*overrides))
    alg, ctx, x0 = engine.algorithm, engine.ctx, engine.x0
    lo, hi = alg.top_range(ctx)
    sizes = [c.num_train for c in engine.clients]
    assert len(set(sizes)) > 1 and any(int(0.8 * n) % 10 for n in sizes)
    gen = torch.Generator().manual_seed(1)
    m = len(engine.clients)
    glob = (x0 + 0.3 * torch.randn(x0.shape, generator=gen)).expand(m, -1)
    local = x0 + 0.3 * torch.randn((m, *x0.shape), generator=gen)
    w = torch.rand(m, hi - lo, generator=gen)
    ids, phase = list(range(m)), [n % 2 == 0 for n in range(m)]
    cohort = cohort_of(engine, ids)
    together, epochs = alg.learn_weights(ctx, glob, local, w, cohort, ids, [True] * m, phase)
    for n in ids:
        one = cohort_of(engine, [n])
        alone_w, alone_epochs = alg.learn_weights(
            ctx, glob[n : n + 1], local[n : n + 1], w[n : n + 1], one, [n], [True], [phase[n]]
        )
        torch.testing.assert_close(together[n], alone_w[0])
        assert epochs[n] == alone_epochs[0]
    assert epochs[1] == 1 and max(epochs) > 1


def test_slice_starts_are_the_streams_first_draws():
    """:func:`first_draws` gives what a torch generator seeded from the stream draws first."""
    seeds = [streams.derive_seed(7, ALA_STREAM, t, n) for t in range(3) for n in range(200)]
    seeds += [0, 1, 2**32 - 1, 2**32, 2**63 - 1]
    gen = torch.Generator().manual_seed(3)
    highs = torch.randint(1, 100_000, (len(seeds),), generator=gen).tolist()
    want = [
        int(torch.randint(h, (1,), generator=torch.Generator().manual_seed(s)))
        for s, h in zip(seeds, highs, strict=True)
    ]
    assert first_draws(seeds, np.array(highs)).tolist() == want
