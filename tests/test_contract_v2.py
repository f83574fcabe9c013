"""The algorithm contract v2: optimiser state, objectives, BatchNorm statistics as state,
multi-part messages, and the evaluation protocol."""

from __future__ import annotations

import copy
import csv
from types import MappingProxyType

import pytest
import torch
from torch import nn

from fedexp.algorithms.base import StackedUpdates
from fedexp.algorithms.fedavg import FedAvg
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.engine.solver import passes
from fedexp.engine.solver.optim import SGD
from fedexp.engine.solver.optim import Adam
from fedexp.tracking.base import NullTracker
from helpers import assert_resume_exact
from helpers import solo


def _rounds(engine, n):
    for _ in range(n):
        m = engine.run_round()
    return m


# ------------------------------------------------------------------- optimisers
@pytest.mark.parametrize(
    "ours, theirs",
    [
        (SGD(), dict(cls=torch.optim.SGD)),
        (SGD(momentum=0.9), dict(cls=torch.optim.SGD, momentum=0.9)),
        (
            SGD(momentum=0.8, nesterov=True, weight_decay=0.01),
            dict(cls=torch.optim.SGD, momentum=0.8, nesterov=True, weight_decay=0.01),
        ),
        (Adam(), dict(cls=torch.optim.Adam)),
        (
            Adam(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1),
            dict(cls=torch.optim.Adam, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        ),
    ],
    ids=["sgd", "momentum", "nesterov-wd", "adam", "adam-wd"],
)
def test_optimisers_follow_pytorch_step_by_step(ours, theirs):
    torch.manual_seed(0)
    grads = [torch.randn(7, dtype=torch.float64) for _ in range(6)]
    p0 = torch.randn(7, dtype=torch.float64)
    ref = p0.clone().requires_grad_(True)
    kwargs = {k: v for k, v in theirs.items() if k != "cls"}
    opt = theirs["cls"]([ref], lr=0.05, **kwargs)
    p, state = p0.clone(), ours.init(p0)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        p, state = ours.step(p, g, state, 0.05)
        torch.testing.assert_close(p, ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="PyTorch's scalar kernels round θ − η·g twice; its AVX2/AVX-512 ones fuse it",
)
def test_plain_sgd_steps_a_stack_as_pytorch_does_bit_for_bit():
    """Plain SGD (float32, a scalar step) is torch.optim.SGD's update to the last bit, on a
    stack of rows whose length is no multiple of a vector (the kernels' tails included)."""
    torch.manual_seed(0)
    p0 = torch.randn(3, 1_003)
    grads = [torch.randn(3, 1_003) for _ in range(4)]
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.1)
    ours, p, state = SGD(), p0.clone(), {}
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        p, state = ours.step(p, g, state, 0.1)
    assert torch.equal(p, ref.detach())
    assert not torch.equal(p0 - 0.1 * grads[0], torch.add(p0, grads[0], alpha=-0.1))


def test_optimiser_state_lives_in_the_client_state(small_cfg):
    e = build_engine(small_cfg("optimizer=sgd", "optimizer.momentum=0.9", "rounds=2"))
    _rounds(e, 2)
    assert all("opt.momentum" in s for s in e.client_states)
    fresh = build_engine(
        small_cfg("optimizer=sgd", "optimizer.momentum=0.9", "optimizer.persistent=false")
    )
    _rounds(fresh, 2)
    assert all("opt.momentum" not in s for s in fresh.client_states)
    # round 1 is the same, round 2 starts from a kept vs a zero momentum: different models
    assert not torch.equal(e.server["x"], fresh.server["x"])


def test_adam_state_counts_steps_across_rounds(small_cfg):
    e = build_engine(small_cfg("optimizer=adam", "lr=0.01", "local_steps=4"))
    _rounds(e, 3)
    assert all(float(s["opt.step"]) == 12 for s in e.client_states)


# ---------------------------------------------------------------- BatchNorm
def test_batchnorm_statistics_follow_a_plain_pytorch_loop(small_cfg):
    """One client's local steps: parameters and running statistics equal torch's own BN."""
    e = build_engine(
        small_cfg("model=mlp", "model.hidden=6", "model.norm=batch", "algorithm=local")
    )
    ctx, data = e.ctx, e.clients[0]
    layout = ctx.model.layout
    assert layout.num_buffers == 12 and "body.1.running_var" in layout.names
    module = copy.deepcopy(ctx.model.module).double()
    x0 = ctx.model.initial().double()
    double = _double(data)
    ours = ctx.train(x0[None], solo(double, key=3), steps=4, lr=0.1)
    stream = passes.Stream(3)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    module.train()
    for _ in range(4):
        idx = stream.indices(ctx.batch_size, double.num_train)
        xb, yb = double.x_train[idx], double.y_train[idx]
        opt.zero_grad()
        ctx.task.loss(module(xb), yb).backward()
        opt.step()
    theirs = torch.cat(
        [p.detach().reshape(-1) for p in module.parameters()]
        + [b.reshape(-1) for b in module.buffers() if b.is_floating_point()]
    )
    torch.testing.assert_close(ours.params[0], theirs, rtol=1e-10, atol=1e-10)
    assert not torch.equal(ours.params[0, layout.num_params :], x0[layout.num_params :])


def _double(data):
    out = copy.copy(data)
    out.x_train, out.x_test = data.x_train.double(), data.x_test.double()
    return out


def test_batchnorm_statistics_are_per_client_and_used_in_evaluation(small_cfg):
    e = build_engine(
        small_cfg("model=mlp", "model.hidden=6", "model.norm=batch", "algorithm=local")
    )
    _rounds(e, 2)
    n = e.ctx.model.layout.num_params
    stats = torch.stack([s["theta"][n:] for s in e.client_states])
    assert stats.std(dim=0).max() > 0  # every client has its own statistics
    params = e.client_states[0]["theta"]
    other = torch.cat([params[:n], e.client_states[1]["theta"][n:]])
    out_a = e.ctx.evaluate(params, e.clients[0])
    out_b = e.ctx.evaluate(other, e.clients[0])
    assert out_a["loss"] != out_b["loss"]  # evaluation reads the vector's statistics
    assert e.ctx.evaluate(params, e.clients[0]) == out_a  # and does not change them


def test_batchnorm_densenet_builds_and_trains(small_cfg):
    from fedexp.models.flat import FlatModel
    from fedexp.models.imaging import densenet

    net = densenet([1, 8, 8], 2, growth_rate=2, block_config=(1, 1), norm="batch")
    model = FlatModel(net, torch.device("cpu"))
    assert model.has_buffers and model.layout.num_buffers > 0
    x = torch.randn(4, 1, 8, 8)
    flat = model.initial()
    logits, buffers = model.forward_train(flat, x)
    assert logits.shape == (4, 2) and not torch.equal(buffers, flat[model.layout.num_params :])
    assert torch.equal(flat, model.initial())  # the input vector is not modified


# ---------------------------------------------------------------- resume
@pytest.mark.parametrize(
    "overrides",
    [
        ("optimizer=adam", "lr=0.01", "algorithm=ditto"),
        ("model=mlp", "model.hidden=6", "model.norm=batch", "optimizer.momentum=0.9"),
        ("model=mlp", "model.hidden=6", "model.norm=batch", "algorithm=fedbn"),
        ("model=mlp", "model.hidden=6", "algorithm=ifca", "compressor=stc"),
    ],
    ids=["ditto-adam-state", "fedavg-batchnorm", "fedbn-buffers", "ifca-parts-stc"],
)
def test_resume_is_exact_with_optimiser_state_and_buffers(small_cfg, tmp_path, overrides):
    cfg = small_cfg("rounds=5", "checkpoint_every=2", "participation=0.6", *overrides)
    assert_resume_exact(cfg, tmp_path)


# ----------------------------------------------------------- message parts
class _TwoParts(FedAvg):
    """FedAvg whose messages have named parts: a model and a tag down, an update and an id up."""

    uplink_parts = MappingProxyType({"id": "exact"})
    downlink_parts = MappingProxyType({"tag": "exact"})

    def downlinks(self, ctx, server, clients):
        ids = torch.tensor(clients, dtype=torch.float32)
        tag = torch.stack([ids, torch.full_like(ids, 0.5)], dim=1)  # per client: [n, 0.5]
        return StackedUpdates(clients, {"model": server["x"].expand(len(clients), -1), "tag": tag})

    def client_update(self, ctx, model_in, states, cohort):
        assert torch.all(model_in["tag"][:, 1] == 0.5)  # an exact part arrives exact
        result = super().client_update(ctx, model_in["model"], states, cohort)
        ident = 1000.25 + model_in["tag"][:, :1]
        result.updates = {"update": result.updates, "id": ident}
        return result

    def server_update(self, ctx, server, updates, weights):
        for n, msg in updates.items():
            assert float(msg["id"][0]) == 1000.25 + n  # exact, whatever the codec
        plain = {n: msg["update"] for n, msg in updates.items()}
        return super().server_update(ctx, server, plain, weights)


@pytest.mark.parametrize("compressor", ["none", "stc"])
def test_named_parts_are_coded_by_kind_and_counted_per_part(small_cfg, compressor):
    e = build_engine(small_cfg(f"compressor={compressor}"))
    e.algorithm = e.transport.algorithm = _TwoParts()
    d = e.x0.numel()
    m = _rounds(e, 2)
    assert m["bytes/down/tag"] == 5 * 8 and m["bytes/up/id"] == 5 * 4
    assert m["bytes/down"] == m["bytes/down/model"] + m["bytes/down/tag"]
    assert m["bytes/up"] == m["bytes/up/update"] + m["bytes/up/id"]
    if compressor == "none":
        assert m["bytes/down/model"] == 5 * 4 * d and m["bytes/up/update"] == 5 * 4 * d
    else:
        assert m["bytes/up/update"] < 5 * 4 * d
    assert m["bytes/up/id_cum"] == 2 * 5 * 4


def test_plain_fedavg_equals_itself_through_named_parts(small_cfg):
    a = build_engine(small_cfg())
    b = build_engine(small_cfg())
    b.algorithm = b.transport.algorithm = _TwoParts()
    _rounds(a, 3)
    _rounds(b, 3)
    # the server's mean: one product of a stack, a sum over a dict of named parts' rows
    torch.testing.assert_close(a.server["x"], b.server["x"], rtol=1e-6, atol=1e-7)


# -------------------------------------------------------- evaluation protocol
def test_best_over_rounds_per_client_and_the_history_artifact(small_cfg, tmp_path):
    cfg = small_cfg("rounds=4", "lr=0.5")
    res = run(cfg, tracker=NullTracker())
    tracker = res.tracker
    means = tracker.metrics["acc/mean"]
    best = tracker.metrics["acc/best_mean"]
    assert all(best[t] >= means[t] - 1e-12 for t in means)
    assert best[4] >= max(means.values()) - 1e-12  # mean of maxima ≥ max of means
    assert set(tracker.metrics["time/round_s"]) == {1, 2, 3, 4}
    times = tracker.metrics["time/round_s"]
    for t, mean in tracker.metrics["time/round_mean_s"].items():  # mean of rounds 1..t
        assert mean == pytest.approx(sum(times[r] for r in range(1, t + 1)) / t)
    with open(res.output_dir / "clients_rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 5 * 5  # rounds 0..4, five clients
    by_client = {}
    for row in rows:
        by_client.setdefault(row["client"], []).append(float(row["acc"]))
    with open(res.output_dir / "clients.csv") as fh:
        final = list(csv.DictReader(fh))
    for row in final:
        assert float(row["best_acc"]) == max(by_client[row["client"]])


def test_evaluating_only_the_participants(small_cfg):
    cfg = small_cfg("rounds=3", "participation=0.4", "eval_participants=true")
    res = run(cfg, tracker=NullTracker())
    import pandas as pd

    rows = pd.read_csv(res.output_dir / "clients_rounds.csv")
    counts = rows.groupby("round").size().to_dict()
    assert counts == {0: 5, 1: 2, 2: 2, 3: 5}  # round 0 and the last: everyone


def test_headline_is_the_unweighted_mean_over_clients(small_cfg):
    e = build_engine(small_cfg())
    agg, per_client = e.evaluate()
    assert agg["acc/mean"] == pytest.approx(sum(c["acc"] for c in per_client) / 5)


def test_custom_prediction_hook_is_used_in_evaluation(small_cfg):
    class Flipped(FedAvg):
        def predict(self, ctx, params, x):
            return -ctx.model(params, x)

    e = build_engine(small_cfg())
    plain, _ = e.evaluate()
    e.algorithm = Flipped()
    flipped, _ = e.evaluate()
    assert flipped["acc/mean"] == pytest.approx(1 - plain["acc/mean"])


def test_a_module_with_buffers_round_trips_through_the_flat_vector():
    from fedexp.models.flat import FlatModel

    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    net[1].running_mean.fill_(0.25)
    model = FlatModel(net, torch.device("cpu"))
    flat = model.initial()
    assert flat.numel() == model.layout.numel == 3 * 4 + 4 + 4 + 4 + 4 + 4
    assert torch.equal(model.layout.unflatten(flat)["1.running_mean"], torch.full((4,), 0.25))


def test_steps_on_one_fixed_minibatch(small_cfg):
    """A fixed batch: K steps reuse it, nothing is drawn (pFedMe's solver)."""
    e = build_engine(small_cfg())
    ctx, data = e.ctx, e.clients[0]
    idx = torch.randint(data.num_train, (8,), generator=torch.Generator().manual_seed(0))
    xb, yb = data.x_train[idx], data.y_train[idx]
    cohort = solo(data)
    out = ctx.train(e.x0[None], cohort, steps=3, lr=0.1, batch=(xb[None], yb[None]))
    assert cohort.draws.tolist() == [0]  # nothing drawn
    p = e.x0.clone()
    for _ in range(3):
        _, grad, _ = ctx.loss_grad_post(ctx.model_objective(), p, xb, yb, None)
        p = p - 0.1 * grad
    torch.testing.assert_close(out.params[0], p)
