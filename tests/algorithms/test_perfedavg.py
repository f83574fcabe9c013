"""Per-FedAvg (FO and HF) against FedAvg and hand computations of its steps."""

from __future__ import annotations

import pytest
import torch

from fedexp import streams
from fedexp.algorithms.perfedavg import PerFedAvg
from fedexp.engine.runner import build_engine
from fedexp.engine.solver import passes
from helpers import deterministic
from helpers import refused

pytestmark = pytest.mark.usefixtures("one_thread")


def _grad(ctx, params, x, y):
    return ctx.loss_grad_post(ctx.model_objective(), params, x, y, None)[1]


def _hvp(ctx, params, x, y, v):
    """The exact Hessian-vector product ∇²f(params; x, y)·v, by double backward."""
    p = params.detach().requires_grad_(True)
    loss, _ = ctx.model_loss(p, x, y, {}, torch.zeros(0))
    (g,) = torch.autograd.grad(loss, p, create_graph=True)
    (hv,) = torch.autograd.grad(g @ v, p)
    return hv


def _weights(e):
    sizes = torch.tensor([float(c.num_train) for c in e.clients])
    return sizes / sizes.sum()


@pytest.mark.parametrize(
    ("variant", "extra"),
    [("perfedavg", ()), ("perfedavg_hf", ()), ("perfedavg", ("optimizer.momentum=0.9",))],
    ids=["fo", "hf", "fo-momentum"],
)
def test_alpha_zero_is_fedavg_exactly(small_cfg, variant, extra):
    """α = 0: w̃ = w and no Hessian term, so each step is FedAvg's step of size β on D' (D, D''
    are not drawn): server, metrics and evaluation bit for bit, on minibatches, 3 rounds."""
    common = ("local_steps=3", "batch_size=8", "participation=0.6", *extra)
    a = build_engine(small_cfg(f"algorithm={variant}", "algorithm.alpha=0", *common))
    b = build_engine(small_cfg("algorithm=fedavg", *common))
    for _ in range(3):
        m_a, m_b = a.run_round(), b.run_round()
        assert deterministic(m_a) == deterministic(m_b)
    assert torch.equal(a.server["x"], b.server["x"])
    assert a.evaluate() == b.evaluate()


def test_fo_minibatch_steps_match_a_hand_computation(small_cfg):
    """FO, τ = 2 steps on minibatches of 4 replayed from each client's stream: D then D' a
    step, w̃ = w − α∇f(w; D), w ← w − β∇f(w̃; D'); the server averages (ω ∝ n)."""
    alpha, beta = 0.3, 0.2
    e = build_engine(
        small_cfg(
            "algorithm=perfedavg",
            f"algorithm.alpha={alpha}",
            f"lr={beta}",
            "batch_size=4",
            "local_steps=2",
        )
    )
    x = e.server["x"].clone()
    expected = torch.zeros_like(x)
    for n, (data, weight) in enumerate(zip(e.clients, _weights(e), strict=True)):
        gen = passes.client_stream(e.seed, 0, n)
        w = x.clone()
        for _ in range(2):
            xd, yd = data.batch(4, gen)
            xd2, yd2 = data.batch(4, gen)
            w_tilde = w - alpha * _grad(e.ctx, w, xd, yd)
            w = w - beta * _grad(e.ctx, w_tilde, xd2, yd2)
        expected += weight * w
    e.run_round()
    torch.testing.assert_close(e.server["x"], expected)


def test_hf_step_matches_the_exact_hessian_vector_product(small_cfg):
    """HF, one full-batch step on the logistic regression: the finite-difference step equals
    w − β(g − α∇²f(w)·g), g = ∇f(w − α∇f(w)), with the exact (autograd) Hessian-vector
    product, to 1e-5; the Hessian term itself is ~1,000 times that (so FO is far from it)."""
    alpha, beta = 0.5, 0.5
    common = (f"algorithm.alpha={alpha}", f"lr={beta}", "batch_size=0", "local_steps=1")
    hf = build_engine(small_cfg("algorithm=perfedavg_hf", *common))
    fo = build_engine(small_cfg("algorithm=perfedavg", *common))
    x = hf.server["x"].clone()
    exact, first_order = torch.zeros_like(x), torch.zeros_like(x)
    for data, weight in zip(hf.clients, _weights(hf), strict=True):
        xs, ys = data.x_train, data.y_train
        g = _grad(hf.ctx, x - alpha * _grad(hf.ctx, x, xs, ys), xs, ys)
        exact += weight * (x - beta * (g - alpha * _hvp(hf.ctx, x, xs, ys, g)))
        first_order += weight * (x - beta * g)
    hf.run_round()
    fo.run_round()
    torch.testing.assert_close(hf.server["x"], exact, rtol=0, atol=1e-5)
    torch.testing.assert_close(fo.server["x"], first_order)
    assert float((exact - first_order).abs().max()) > 1e-2


def test_evaluation_is_one_alpha_step_from_the_global_model(small_cfg):
    """A client is evaluated with x − α∇f(x; B), B the first minibatch of its evaluation
    stream (streams.EVAL) at the evaluated round: by hand for client 2."""
    alpha = 0.4
    e = build_engine(small_cfg("algorithm=perfedavg", f"algorithm.alpha={alpha}", "batch_size=8"))
    e.run_round()
    x, n, data = e.server["x"], 2, e.clients[2]
    key = int(streams.stream_keys(e.seed, streams.EVAL, e.round, [n])[0])
    xb, yb = data.batch(8, passes.Stream(key))
    expected = x - alpha * _grad(e.ctx, x, xb, yb)
    torch.testing.assert_close(e.eval_vectors([n])[0], expected)
    assert float((expected - x).abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("variant", "overrides"),
    [
        ("perfedavg", ("model=mlp", "model.hidden=8")),
        ("perfedavg_hf", ("model=mlp", "model.hidden=8", "model.norm=batch")),
    ],
    ids=["fo-mlp", "hf-mlp-batchnorm"],
)
def test_runs_and_learns(small_cfg, variant, overrides):
    e = build_engine(small_cfg(f"algorithm={variant}", "local_steps=2", *overrides))
    first = e.run_round()["train/train_loss"]
    for _ in range(3):
        last = e.run_round()["train/train_loss"]
    out, per_client = e.evaluate()
    assert 0.0 <= out["acc/mean"] <= 1.0 and len(per_client) == len(e.clients)
    assert last < first


def test_bad_arguments_are_refused():
    assert refused(PerFedAvg, alpha=-0.1).startswith("algorithm.alpha=-0.1: expected")
    assert refused(PerFedAvg, delta=0.0).startswith("algorithm.delta=0.0: expected")
    with pytest.raises(ValueError, match="variant"):
        PerFedAvg(variant="so")
