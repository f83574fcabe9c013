"""The local solver (fedexp.engine.solver.steps, issue 22): how a cohort's steps execute is its
business. Row by row and vmapped give the same models; a loss vmap refuses is rerun row by row
with the same draws; BatchNorm statistics follow every step; clients whose step counts differ
run in sub-cohorts, each client its own count."""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.runner import build_engine
from helpers import solo

pytestmark = pytest.mark.usefixtures("one_thread")


def _rounds(engine, rounds=2):
    engine.setup()
    return [engine.run_round() for _ in range(rounds)]


def _assert_same_states(a, b, **tol):
    for key in a.server:
        torch.testing.assert_close(b.server[key], a.server[key], **tol)
    for sa, sb in zip(a.client_states, b.client_states, strict=True):
        assert sorted(sa) == sorted(sb)
        for key in sa:
            torch.testing.assert_close(sb[key], sa[key], **tol)


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm=fedavg", "optimizer=adam"),
        ("algorithm=ditto", "algorithm.lam=0.5", "model=mlp", "model.hidden=8"),
        ("algorithm=superfed", "algorithm.warmup_rounds=0"),  # noise from the streams
    ],
    ids=["fedavg-adam", "ditto-mlp", "superfed-noise"],
)
def test_row_by_row_equals_vmapped(small_cfg, overrides):
    vmapped = build_engine(small_cfg(*overrides))
    rows = build_engine(small_cfg(*overrides))
    rows.ctx.vmap_ok = False  # what a model vmap refuses runs
    _rounds(vmapped)
    _rounds(rows)
    assert vmapped.ctx.vmap_ok and not rows.ctx.vmap_ok
    _assert_same_states(vmapped, rows, rtol=1e-5, atol=1e-6)


def test_a_loss_vmap_refuses_is_rerun_row_by_row_with_the_same_draws(small_cfg):
    """An in-place op vmap refuses (MONAI's one_hot does this): the cohort's steps are rerun
    row by row from the same draws; the run then stays row by row."""

    def patch(engine):
        original = engine.ctx.task.loss

        def loss(logits, y):
            onehot = torch.zeros(y.shape[0], 2)
            onehot.scatter_(1, y[:, None].long(), 1.0)  # not vmappable: y batched, onehot not
            return original(logits, y) + 0.0 * onehot.sum()

        engine.ctx.task.loss = loss
        return engine

    refused = patch(build_engine(small_cfg("optimizer=sgd", "optimizer.momentum=0.9")))
    rows = patch(build_engine(small_cfg("optimizer=sgd", "optimizer.momentum=0.9")))
    rows.ctx.vmap_ok = False
    plain = build_engine(small_cfg("optimizer=sgd", "optimizer.momentum=0.9"))
    for engine in (refused, rows, plain):
        _rounds(engine)
    assert refused.ctx.vmap_ok is False
    _assert_same_states(rows, refused, rtol=0, atol=0)  # the same draws, the same path
    _assert_same_states(plain, refused, rtol=1e-5, atol=1e-6)


def test_batchnorm_statistics_follow_each_step(small_cfg):
    """Running statistics are coordinates of the flat vector: the solver writes the forward
    pass's values after every step (row by row), and they differ between clients."""
    engine = build_engine(small_cfg("algorithm=local", "model=mlp", "model.hidden=8",
                                    "model.norm=batch"))  # fmt: skip
    x0 = engine.x0.clone()
    _rounds(engine, 1)
    buffers = engine.ctx.model.buffer_mask
    thetas = torch.stack([s["theta"] for s in engine.client_states])
    assert buffers.any()
    assert not torch.equal(thetas[:, buffers], x0[buffers].expand(len(thetas), -1))
    assert not torch.equal(thetas[0, buffers], thetas[1, buffers])


def test_clients_with_different_step_counts_run_in_sub_cohorts(small_cfg):
    """``local_epochs`` on unequal splits: each client takes its own ``steps_for`` steps, its
    sub-cohort of clients with the same count as one computation."""
    engine = build_engine(small_cfg("local_epochs=1", "algorithm=local"))
    seen = []
    hook = engine.algorithm.client_update

    def spy(ctx, model_in, states, cohort):
        seen.append((list(cohort.clients), ctx.cohort_steps(cohort)))
        result = hook(ctx, model_in, states, cohort)
        assert cohort.draws.tolist() == [ctx.cohort_steps(cohort)] * len(cohort)
        return result

    engine.algorithm.client_update = spy
    _rounds(engine, 1)
    steps = {n: engine.ctx.steps_for(c) for n, c in enumerate(engine.clients)}
    assert len(set(steps.values())) > 1 and len(seen) == len(set(steps.values()))
    assert sorted(n for clients, _ in seen for n in clients) == list(range(5))
    for clients, count in seen:
        assert all(steps[n] == count for n in clients)


def test_a_cohort_of_one_takes_the_steps_a_plain_loop_takes(small_cfg):
    """The solver's SGD on one client equals plain torch: minibatches drawn from the client's
    stream, loss.backward, p -= lr·grad."""
    from fedexp.engine import rng

    engine = build_engine(small_cfg("model=mlp", "model.hidden=8"))
    ctx, data = engine.ctx, engine.clients[2]
    cohort = solo(data, key=12345)
    out = ctx.train(engine.x0[None], cohort, steps=4, lr=0.1)
    assert cohort.draws.tolist() == [4]
    p = engine.x0.clone()
    stream = rng.Stream(12345)
    for _ in range(4):
        idx = stream.indices(ctx.batch_size, data.num_train)
        q = p.detach().requires_grad_(True)
        loss = ctx.task.loss(ctx.model(q, data.x_train[idx]), data.y_train[idx])
        loss.backward()
        p = p - 0.1 * q.grad
    torch.testing.assert_close(out.params[0], p, rtol=1e-5, atol=1e-6)
