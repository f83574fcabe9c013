"""FedPer, FedBN and FedRep against the properties their papers imply (docs/algorithms.md)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fedexp.algorithms.fedrep import FedRep
from fedexp.engine.runner import build_engine
from helpers import assert_eval_stack_is_eval_params
from helpers import cohort_of
from helpers import refused

MLP = ("model=mlp", "model.hidden=8")
BN = (*MLP, "model.norm=batch")


pytestmark = pytest.mark.usefixtures("one_thread")


def _rounds(engine, n):
    engine.setup()
    metrics = {}
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


def _masked(engine, idx):
    """``engine`` whose local training moves only the coordinates ``idx``."""
    ctx = engine.ctx
    original = ctx.train
    mask = torch.zeros(ctx.model.layout.numel, device=ctx.device)
    mask[idx] = 1.0

    def train(*args, **kwargs):
        assert kwargs.get("mask") is None
        return original(*args, **{**kwargs, "mask": mask})

    ctx.train = train
    return engine


# ---------------------------------------------------------------------------- FedPer
def test_fedper_without_personal_layers_is_fedavg(small_cfg):
    """An empty head (`algorithm.head=[]`): FedAvg exactly (with momentum state kept); patterns
    that match nothing are refused (tests/test_model_fit.py)."""
    over = (*MLP, "optimizer.momentum=0.9", "participation=0.6")
    per, _ = _rounds(build_engine(small_cfg("algorithm=fedper", "algorithm.head=[]", *over)), 3)
    avg, _ = _rounds(build_engine(small_cfg("algorithm=fedavg", *over)), 3)
    assert torch.equal(per.server["x"], avg.server["x"])
    assert per.algorithm.personal_idx(per.ctx).numel() == 0
    for a, b in zip(per.client_states, avg.client_states, strict=True):
        assert a["head"].numel() == 0
        assert torch.equal(
            a.get("opt.momentum", torch.zeros(0)), b.get("opt.momentum", torch.zeros(0))
        )


def test_fedper_everything_personal_is_local_training(small_cfg):
    """The default data and model (logistic regression, whose ``personal`` is all of it):
    local-only training exactly, and nothing is sent."""
    per, metrics = _rounds(build_engine(small_cfg("algorithm=fedper")), 3)
    local, _ = _rounds(build_engine(small_cfg("algorithm=local")), 3)
    assert metrics["bytes/up"] == metrics["bytes/down"] == 0
    assert math.isfinite(per.evaluate()[0]["acc/mean"])
    for a, b in zip(per.client_states, local.client_states, strict=True):
        assert torch.equal(a["head"], b["theta"])


def test_fedper_head_never_crosses_the_network(small_cfg):
    engine, metrics = _rounds(
        build_engine(small_cfg("algorithm=fedper", "participation=0.6", *MLP)), 3
    )
    ctx, alg = engine.ctx, engine.algorithm
    head, body = alg.personal_idx(ctx), alg.body_idx(ctx)
    assert torch.equal(head, ctx.model.layout.indices(["head.*"]))
    assert head.numel() > 0 and body.numel() + head.numel() == ctx.model.layout.numel
    sent = 4 * body.numel() * len(engine.last_sampled)
    assert metrics["bytes/down"] == sent and metrics["bytes/up"] == sent
    # the server's head coordinates are never touched; the clients' heads are their own
    assert torch.equal(engine.server["x"][head], engine.x0[head])
    heads = torch.stack([s["head"] for s in engine.client_states])
    assert not torch.equal(heads[0], heads[1])
    # evaluation: the current body with each client's own head
    params = alg.eval_params(ctx, engine.server, engine.client_states[1], 1)
    assert torch.equal(params[body], engine.server["x"][body])
    assert torch.equal(params[head], engine.client_states[1]["head"])


def test_fedper_explicit_head_patterns(small_cfg):
    """``algorithm.head`` overrides the model's patterns: here the first body layer too."""
    engine, metrics = _rounds(
        build_engine(small_cfg("algorithm=fedper", "algorithm.head=[head.*,body.0.bias]", *MLP)),
        1,
    )
    layout = engine.ctx.model.layout
    expected = layout.numel - layout.indices(["head.*", "body.0.bias"]).numel()
    assert metrics["bytes/up"] == 4 * expected * 5


# ----------------------------------------------------------------------------- FedBN
@pytest.mark.parametrize("model", [(), MLP], ids=["default-data", "mlp"])
def test_fedbn_without_batchnorm_is_fedavg(small_cfg, model):
    bn, _ = _rounds(build_engine(small_cfg("algorithm=fedbn", *model)), 3)
    avg, _ = _rounds(build_engine(small_cfg("algorithm=fedavg", *model)), 3)
    assert bn.algorithm.personal_idx(bn.ctx).numel() == 0
    assert torch.equal(bn.server["x"], avg.server["x"])


def test_fedbn_keeps_batchnorm_local(small_cfg):
    """Round 0 by hand: non-BN coordinates averaged, BN ones (γ, β, statistics) kept apart."""
    engine, metrics = _rounds(build_engine(small_cfg("algorithm=fedbn", *BN)), 1)
    ctx, x0 = engine.ctx, engine.x0
    layout = ctx.model.layout
    bn = engine.algorithm.personal_idx(ctx)
    assert torch.equal(bn, layout.indices(["body.1.*"]))  # weight, bias, running mean/var
    assert "body.1.running_mean" in layout.names and layout.num_buffers == 16
    body = engine.algorithm.body_idx(ctx)
    assert metrics["bytes/down"] == metrics["bytes/up"] == 4 * body.numel() * 5

    sizes = torch.tensor([float(c.num_train) for c in engine.clients], dtype=torch.float64)
    omega = sizes / sizes.sum()
    thetas = [  # each client alone on its stream of round 0
        ctx.train(x0[None], cohort_of(engine, [n], 0)).params[0] for n in range(len(engine.clients))
    ]
    for n, theta in enumerate(thetas):  # each client's BN part is its own local result
        assert torch.equal(engine.client_states[n]["head"], theta[bn])
    mean = sum(w * t[body].double() for w, t in zip(omega, thetas, strict=True))
    torch.testing.assert_close(engine.server["x"][body].double(), mean, rtol=1e-5, atol=1e-6)
    assert torch.equal(engine.server["x"][bn], x0[bn])  # the server never sees BN coordinates
    stats = layout.num_params + torch.arange(layout.num_buffers)
    heads = torch.stack([s["head"] for s in engine.client_states])
    own_stats = heads[:, -layout.num_buffers :]  # BN's float buffers are last in the vector
    assert torch.equal(bn[-layout.num_buffers :], stats)
    assert not torch.equal(own_stats[0], own_stats[1])
    assert not torch.equal(own_stats[0], x0[stats])
    for n, state in enumerate(engine.client_states):  # evaluated with its own BN part
        params = engine.algorithm.eval_params(ctx, engine.server, state, n)
        assert torch.equal(params[bn], state["head"])
        assert torch.equal(params[body], engine.server["x"][body])
    aggregates, _ = engine.evaluate()
    assert math.isfinite(aggregates["acc/mean"])


# ---------------------------------------------------------------------------- FedRep
def test_fedrep_without_head_phase_is_fedavg_with_a_frozen_head(small_cfg):
    """τ_h = 0: the body follows FedAvg whose head coordinates are frozen at x0."""
    over = (*MLP, "optimizer.momentum=0.9", "participation=0.6")
    rep, _ = _rounds(
        build_engine(small_cfg("algorithm=fedrep", "algorithm.head_steps=0", *over)), 3
    )
    avg = build_engine(small_cfg("algorithm=fedavg", *over))
    avg, _ = _rounds(_masked(avg, rep.algorithm.body_idx(rep.ctx)), 3)
    assert torch.equal(rep.server["x"], avg.server["x"])
    head = rep.algorithm.personal_idx(rep.ctx)
    for s in rep.client_states:
        assert torch.equal(s["head"], rep.x0[head])
        assert not any(k.startswith("opt_head.") for k in s)


def test_fedrep_head_phase_leaves_the_body_alone(small_cfg):
    """τ_φ = 0: the body stays x0 exactly; each head is local training of the head alone."""
    rep = build_engine(
        small_cfg("algorithm=fedrep", "algorithm.body_steps=0", "algorithm.head_ratio=1", *MLP)
    )
    rep, _ = _rounds(rep, 3)
    assert torch.equal(rep.server["x"], rep.x0)
    head = rep.algorithm.personal_idx(rep.ctx)
    local, _ = _rounds(_masked(build_engine(small_cfg("algorithm=local", *MLP)), head), 3)
    for a, b in zip(rep.client_states, local.client_states, strict=True):
        assert torch.equal(a["head"], b["theta"][head])
        assert not torch.equal(a["head"], rep.x0[head])


def test_fedrep_head_phase_with_batchnorm_moves_only_statistics_of_the_body(small_cfg):
    rep = build_engine(
        small_cfg("algorithm=fedrep", "algorithm.head_steps=4", "algorithm.body_steps=0", *BN)
    )
    rep, _ = _rounds(rep, 1)
    params = rep.ctx.model.layout.num_params
    body = rep.algorithm.body_idx(rep.ctx)
    trainable = body[body < params]
    assert torch.equal(rep.server["x"][trainable], rep.x0[trainable])
    assert not torch.equal(rep.server["x"][params:], rep.x0[params:])  # statistics follow


def test_fedrep_phase_lengths():
    """τ_φ = the run's local steps E, τ_h = ceil(head_ratio · E), unless given in steps."""
    ctx, data = SimpleNamespace(steps_for=lambda d: 3), None
    assert FedRep().phase_steps(ctx, data) == (30, 3)
    assert FedRep(head_ratio=0.5).phase_steps(ctx, data) == (2, 3)
    assert FedRep(head_ratio=1.1, body_steps=1).phase_steps(
        SimpleNamespace(steps_for=lambda d: 10), data
    ) == (11, 1)
    assert FedRep(head_steps=4, body_steps=0).phase_steps(ctx, data) == (4, 0)
    assert refused(FedRep, head_steps=-1).startswith("algorithm.head_steps=-1: expected ≥ 0")


def test_fedrep_defaults_are_the_papers_and_run_on_the_default_data(small_cfg):
    """The paper's 10 head epochs per body epoch: ``local_epochs=1`` and the default ratio."""
    engine = build_engine(small_cfg("algorithm=fedrep", "local_epochs=1"))
    alg = engine.algorithm
    assert (alg.head_ratio, alg.head_steps, alg.body_steps) == (10, None, None)
    data = engine.clients[0]
    per_epoch = math.ceil(data.num_train / engine.ctx.batch_size)
    assert alg.phase_steps(engine.ctx, data) == (10 * per_epoch, per_epoch)
    engine, metrics = _rounds(engine, 1)
    assert {"train/head_loss", "train/body_loss", "train/train_loss"} <= set(metrics)
    assert math.isfinite(metrics["train/train_loss"])
    assert math.isfinite(engine.evaluate()[0]["acc/mean"])


@pytest.mark.parametrize(
    ("algorithm", "model"), [("fedper", MLP), ("fedrep", MLP), ("fedbn", BN), ("fedper", ())]
)
def test_eval_stack_is_eval_params_client_by_client(small_cfg, algorithm, model):
    engine = build_engine(small_cfg(f"algorithm={algorithm}", "participation=0.6", *model))
    _rounds(engine, 2)
    assert_eval_stack_is_eval_params(engine, personal=False)
