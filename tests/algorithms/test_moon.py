"""MOON against FedAvg, a hand computation of its contrastive loss, and its paper's intent."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedexp.algorithms.moon import MOON
from fedexp.algorithms.moon import contrastive_loss
from fedexp.engine.runner import build_engine
from fedexp.errors import ConfigError
from fedexp.models.task import PADDING
from helpers import cohort_of
from helpers import deterministic
from helpers import refused

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = ("model=mlp", "model.hidden=8")
FAST = ("local_steps=3",)


def _rounds(engine, n):
    metrics = {}
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


def test_mu_zero_is_fedavg(small_cfg):
    """Server, training metrics and evaluation bit for bit (momentum kept, partial rounds)."""
    over = (*MLP, *FAST, "participation=0.6", "optimizer.momentum=0.9")
    moon, m_moon = _rounds(build_engine(small_cfg("algorithm=moon", "algorithm.mu=0", *over)), 3)
    avg, m_avg = _rounds(build_engine(small_cfg("algorithm=fedavg", *over)), 3)
    assert torch.equal(moon.server["x"], avg.server["x"])
    assert deterministic(m_moon) == deterministic(m_avg)
    assert moon.evaluate() == avg.evaluate()
    for a, b in zip(moon.client_states, avg.client_states, strict=True):
        assert torch.equal(
            a.get("opt.momentum", torch.zeros(0)), b.get("opt.momentum", torch.zeros(0))
        )


def _numpy_mlp_bn(v, layout, x, train):
    """The body of ``model=mlp model.norm=batch`` (Linear, BatchNorm1d, ReLU) in NumPy."""
    p = {n: t.detach().double().numpy() for n, t in layout.unflatten(v).items()}
    h = x @ p["body.0.weight"].T + p["body.0.bias"]
    if train:
        mean, var = h.mean(0), h.var(0)  # the batch's biased variance
    else:
        mean, var = p["body.1.running_mean"], p["body.1.running_var"]
    h = (h - mean) / np.sqrt(var + 1e-5) * p["body.1.weight"] + p["body.1.bias"]
    return np.maximum(h, 0.0), p


def test_contrastive_loss_by_hand(small_cfg):
    """CE + μ·ℓ_con of one batch against NumPy: the local model's representation in training
    mode (batch statistics), the global and previous ones in evaluation mode (running
    statistics, the authors' code); a padded row counts in neither term; vmapped over two
    clients it is each client's loss."""
    e = build_engine(small_cfg(*MLP, "model.norm=batch", "algorithm=moon", "algorithm.tau=0.7"))
    ctx, layout = e.ctx, e.ctx.model.layout
    g = torch.Generator().manual_seed(0)
    d = layout.numel
    theta, glob, prev = (e.x0 + 0.3 * torch.randn(3, d, generator=g)).unbind(0)
    stats = torch.zeros(d, dtype=torch.bool)
    stats[layout.num_params :] = True  # running statistics: positive variances
    glob, prev = (torch.where(stats, v.abs() + 0.5, v) for v in (glob, prev))
    data = e.clients[0]
    x, y = data.x_train[:6].clone(), data.y_train[:6].clone()
    y[5] = PADDING
    mu, tau = 2.0, 0.7
    aux = {"glob": glob, "prev": prev, "mu": torch.tensor(mu), "tau": torch.tensor(tau)}
    ctx.model.module.train()
    loss, post = contrastive_loss(ctx, "head", theta, x, y, aux, torch.zeros(0))

    xs, ys = x[:5].flatten(1).double().numpy(), y[:5].numpy()
    z, p = _numpy_mlp_bn(theta, layout, xs, train=True)
    z_glob, _ = _numpy_mlp_bn(glob, layout, xs, train=False)
    z_prev, _ = _numpy_mlp_bn(prev, layout, xs, train=False)

    def cos(a, b):
        return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    pos, neg = cos(z, z_glob) / tau, cos(z, z_prev) / tau
    con = -np.log(np.exp(pos) / (np.exp(pos) + np.exp(neg)))
    logits = z @ p["head.weight"].T + p["head.bias"]
    if logits.shape[1] == 1:  # the default data is binary: one logit, cross-entropy of σ
        t = logits[:, 0]
        ce = (np.logaddexp(0.0, -t) + (1 - ys) * t).mean()
    else:
        logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        ce = -logp[np.arange(5), ys].mean()
    assert float(loss) == pytest.approx(ce + mu * con.mean(), rel=1e-5)
    assert not np.allclose(con, np.log(2.0))  # the term is not trivial here
    # the running statistics follow the local model's batch (the valid rows)
    assert not torch.equal(post[layout.num_params :], theta[layout.num_params :])

    two = torch.stack([theta, glob])
    stacked_aux = {
        "glob": torch.stack([glob, prev]),
        "prev": torch.stack([prev, theta]),
        "mu": torch.full((2,), mu),
        "tau": torch.full((2,), tau),
    }
    rows, _ = torch.func.vmap(
        lambda w, a: contrastive_loss(ctx, "head", w, x, y, a, torch.zeros(0)),
        randomness="different",
    )(two, stacked_aux)
    other = {"glob": prev, "prev": theta, "mu": aux["mu"], "tau": aux["tau"]}
    alone = contrastive_loss(ctx, "head", glob, x, y, other, torch.zeros(0))[0]
    torch.testing.assert_close(rows, torch.stack([loss, alone]).detach())


def test_previous_model_is_kept_and_contrasted(small_cfg):
    """After a round each trained client's ``prev`` is its local model (the server's average
    is their weighted mean); a client not sampled keeps its own; the next round contrasts
    with exactly those (the objective's ``prev``), against the model it received."""
    e = build_engine(small_cfg(*MLP, *FAST, "algorithm=moon", "participation=0.6"))
    x0 = e.x0.clone()
    e.run_round()
    first = list(e.last_sampled)
    weights = torch.tensor([float(e.clients[n].num_train) for n in first])
    weights = weights / weights.sum()
    prevs = torch.stack([e.client_states[n]["prev"] for n in first])
    torch.testing.assert_close(e.server["x"], (weights[:, None] * prevs).sum(0))
    for n, s in enumerate(e.client_states):
        assert n in first or torch.equal(s["prev"], x0)
        assert n not in first or not torch.equal(s["prev"], x0)
    before = {n: s["prev"].clone() for n, s in enumerate(e.client_states)}
    x1 = e.server["x"].clone()

    seen = []
    original = e.ctx.train

    def spy(params, cohort, **kwargs):
        seen.append((list(cohort.clients), kwargs["objective"].aux))
        return original(params, cohort, **kwargs)

    e.ctx.train = spy
    e.run_round()
    assert seen
    for clients, aux in seen:
        for i, n in enumerate(clients):
            assert torch.equal(aux["prev"][i], before[n])
            assert torch.equal(aux["glob"][i], x1)


def test_first_round_contrasts_nothing(small_cfg):
    """Round 1: every previous model is x⁰, the global one, so ℓ_con = log 2 with a zero
    gradient (the authors' first round has no negative): any μ trains as FedAvg."""
    over = (*MLP, "local_steps=5")
    moon, m_moon = _rounds(build_engine(small_cfg("algorithm=moon", "algorithm.mu=5", *over)), 1)
    avg, m_avg = _rounds(build_engine(small_cfg("algorithm=fedavg", *over)), 1)
    torch.testing.assert_close(moon.server["x"], avg.server["x"])
    ratio = m_moon["train/train_loss"] - m_avg["train/train_loss"]
    assert ratio == pytest.approx(5 * np.log(2.0), rel=1e-4)


def test_larger_mu_pulls_representations_to_the_global_model(small_cfg):
    """Local training from the global model with previous models elsewhere: a larger μ leaves
    the representations of the clients' data nearer (cosine) the global model's than the
    previous model's: the margin sim(z, z_glob) − sim(z, z_prev) grows and ℓ_con falls.

    (Training starts at the global model, where sim(z, z_glob) = 1, so the term acts by
    pushing z away from z_prev; the similarity to z_glob alone does not grow.)"""
    e, _ = _rounds(build_engine(small_cfg(*MLP, "model.hidden=16", "local_steps=20")), 1)
    ctx, glob = e.ctx, e.server["x"].clone()
    m = len(e.clients)
    prev = e.x0 + 0.5 * torch.randn(m, e.x0.numel(), generator=torch.Generator().manual_seed(1))
    margin, con = {}, {}
    for mu in (0.0, 1.0, 10.0):
        start = glob.repeat(m, 1)
        objective = MOON(mu=mu).objective(ctx, start, prev)
        local = ctx.train(start, cohort_of(e, range(m)), objective=objective).params
        ctx.model.module.eval()
        gaps = []
        for n, data in enumerate(e.clients):
            z, z_glob, z_prev = (
                ctx.model.forward_with_input(v, data.x_train, "head")[2]
                for v in (local[n], glob, prev[n])
            )
            pos = F.cosine_similarity(z, z_glob, dim=-1)
            gaps.append(pos - F.cosine_similarity(z, z_prev, dim=-1))
        gap = torch.cat(gaps)
        margin[mu] = float(gap.mean())
        con[mu] = float(F.softplus(-gap / 0.5).mean())  # ℓ_con = log(1 + e^{-(pos-neg)/τ})
    assert margin[0.0] + 0.1 < margin[1.0] < margin[10.0], margin
    assert con[0.0] > con[1.0] > con[10.0], con


def test_models_without_a_body_are_refused(small_cfg):
    """logreg's head is the whole model: no representation to contrast, refused at build."""
    with pytest.raises(ConfigError, match="the whole model"):
        build_engine(small_cfg("algorithm=moon"))
    with pytest.raises(ConfigError, match="not one submodule"):
        build_engine(small_cfg(*MLP, "algorithm=moon", "algorithm.head=[body.0.weight,head.*]"))


def test_bad_arguments_are_refused():
    assert refused(MOON, mu=-1.0).startswith("algorithm.mu=-1.0: expected ≥ 0")
    assert refused(MOON, tau=0.0).startswith("algorithm.tau=0.0: expected > 0")
