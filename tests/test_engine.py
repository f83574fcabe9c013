"""The round loop: FedAvg = gradient descent, honest bytes, streams, end-to-end runs."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp import streams
from fedexp.contract import CohortStates
from fedexp.engine.files import checkpoint
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import DivergenceError
from fedexp.tracking.base import NullTracker
from helpers import cohort_of


def test_fedavg_one_client_full_batch_equals_gradient_descent(small_cfg):
    cfg = small_cfg(
        "num_clients=1", "batch_size=0", "local_steps=3", "lr=0.5", "partition=iid", "rounds=4"
    )
    engine = build_engine(cfg)
    data = engine.clients[0]
    # centralised GD on the same training data, written independently of the engine
    w = engine.x0.clone()
    model = engine.ctx.model
    for _ in range(4 * 3):
        p = w.clone().requires_grad_(True)
        logits = model(p, data.x_train)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits[:, 0], data.y_train.float()
        )
        (g,) = torch.autograd.grad(loss, p)
        w = w - 0.5 * g
    for _ in range(4):
        engine.run_round()
    torch.testing.assert_close(engine.server["x"], w, rtol=1e-5, atol=1e-6)
    assert not torch.equal(w, engine.x0)


def test_dense_bytes_are_four_per_parameter(small_cfg):
    engine = build_engine(small_cfg("num_clients=4", "participation=0.5"))
    d = engine.x0.numel()
    m = engine.run_round()
    assert m["clients/sampled"] == 2
    assert m["bytes/up"] == 2 * 4 * d and m["bytes/down"] == 2 * 4 * d
    m = engine.run_round()
    assert m["bytes/up_cum"] == 4 * 4 * d and m["bytes/down_cum"] == 4 * 4 * d
    assert m["compression/up"] == 1.0


def test_local_only_sends_nothing_and_personalises(small_cfg):
    engine = build_engine(small_cfg("algorithm=local"))
    m = engine.run_round()
    assert m["bytes/up"] == 0 and m["bytes/down"] == 0
    thetas = [s["theta"] for s in engine.client_states]
    assert not torch.equal(thetas[0], thetas[1])


def test_client_streams_do_not_depend_on_order_or_sampling(small_cfg):
    a = build_engine(small_cfg("algorithm=local", "participation=1.0"))
    b = build_engine(small_cfg("algorithm=local", "participation=1.0"))
    a.run_round()
    # b runs the clients in reverse order, each a cohort of one, through the same hook
    for n in reversed(range(len(b.clients))):
        res = b.algorithm.client_update(
            b.ctx, None, CohortStates.of_rows([b.client_states[n]]), cohort_of(b, [n], 0)
        )
        b.client_states[n] = res.states[0]
    for sa, sb in zip(a.client_states, b.client_states, strict=True):  # (batched rounding)
        torch.testing.assert_close(sa["theta"], sb["theta"], rtol=1e-6, atol=1e-7)


def test_sampling_is_deterministic_and_fractional():
    s = streams.sample_clients(0, 5, 100, 0.1)
    assert s == streams.sample_clients(0, 5, 100, 0.1) and len(s) == 10
    assert s != streams.sample_clients(0, 6, 100, 0.1)
    assert streams.sample_clients(0, 0, 3, 0.01) and len(streams.sample_clients(0, 0, 3, 0.01)) == 1


@pytest.mark.parametrize("algorithm", ["fedavg", "local"])
def test_tiny_end_to_end_run(small_cfg, algorithm):
    tracker = NullTracker()
    res = run(small_cfg(f"algorithm={algorithm}", "rounds=5", "lr=1.0"), tracker=tracker)
    assert tracker.status == "FINISHED"
    assert sorted(tracker.steps) == [0, 1, 2, 3, 4, 5]
    assert len(res.per_client) == 5
    acc = tracker.metrics["acc/weighted"]
    assert acc[5] > 0.85 and acc[0] < 0.7, acc  # breast cancer is easy for logistic regression
    assert (res.output_dir / "clients.csv").exists() and (res.output_dir / "curves.png").exists()
    assert {"config.yaml", "clients.csv", "rounds.csv", "curves.png"} <= set(tracker.artifacts)


def test_divergence_stops_the_run_and_keeps_checkpoints(small_cfg, tmp_path):
    cfg = small_cfg("rounds=6", "checkpoint_every=1")
    tracker = NullTracker()

    def blow_up(engine, metrics):
        if engine.round == 2:
            engine.ctx.lr = 1e38

    with pytest.raises(DivergenceError, match="(?i)client .*(nan|inf)"):
        run(cfg, tracker=tracker, callbacks=[blow_up])
    assert tracker.status == "FAILED" and "DivergenceError" in tracker.tags["error"]
    assert sorted(tracker.steps) == [0, 1, 2]  # what was logged survives
    _, meta = checkpoint.load(tmp_path / "out" / "checkpoints")
    assert meta["round"] == 2
    tree, _ = checkpoint.load(tmp_path / "out" / "checkpoints")
    assert torch.isfinite(tree["server"]["x"]).all()
    assert math.isfinite(tracker.metrics["acc/weighted"][2])


def test_lossy_downlink_with_error_feedback_tracks_the_server_model(small_cfg):
    """STC both ways: the clients' models follow the server's (no double-counted residual)."""
    engine = build_engine(small_cfg("compressor=stc", "model=mlp", "model.hidden=16", "lr=0.1"))
    for _ in range(40):
        m = engine.run_round()
    x = engine.server["x"]
    for n in range(5):
        gap = (engine.transport.replica["down"][n, ""] - x).norm() / x.norm()
        assert gap < 0.5, (n, float(gap))
    agg, _ = engine.evaluate()
    assert agg["acc/weighted"] > 0.85
    assert m["compression/down"] > 5 and m["compression/up"] > 5


def test_lossy_downlink_without_error_feedback_drops_the_error(small_cfg):
    engine = build_engine(small_cfg("compressor=stc_twomean", "model=mlp", "model.hidden=16"))
    engine.run_round()
    sent = engine.server["x"].clone()  # what the server sends in the next round
    engine.run_round()
    # the reference of the next change is the server's own last message, not what the client
    # decoded: the compression error is not sent again
    assert torch.equal(engine.transport.reference["down"][0, ""], sent)
    assert not torch.equal(engine.transport.replica["down"][0, ""], sent)
