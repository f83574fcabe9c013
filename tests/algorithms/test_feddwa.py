"""FedDWA against the properties its paper implies, and against hand computations."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fedexp.algorithms.feddwa import FedDWA
from fedexp.algorithms.feddwa import dwa_weights
from fedexp.contract import CohortStates
from fedexp.engine.runner import build_engine
from helpers import assert_eval_stack_is_eval_params
from helpers import assert_resume_exact
from helpers import refused
from helpers import solo

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = ("model=mlp", "model.hidden=8")


def _ctx(d: int, n: int):
    """The little of a Context the server hook reads."""
    return SimpleNamespace(
        num_clients=n, model=SimpleNamespace(layout=SimpleNamespace(num_params=d))
    )


def _rounds(engine, n):
    return [engine.run_round() for _ in range(n)][-1]


@pytest.mark.parametrize("k", [1, 3, 6, 10])
def test_weights_are_non_negative_and_each_column_sums_to_one(k):
    gen = torch.Generator().manual_seed(0)
    models, guides = torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen)
    w = dwa_weights(guides, models, k)
    assert w.shape == (6, 6) and bool((w >= 0).all())
    torch.testing.assert_close(w.sum(dim=0), torch.ones(6, dtype=torch.float64))
    assert bool(((w > 0).sum(dim=0) == min(k, 6)).all())


def test_equal_distances_give_the_plain_mean():
    """θ_j = 2 e_j, θ̂_i = 0: every ‖θ̂_i − θ_j‖² = 4, so K = N weighs all models 1/N."""
    m, d = 4, 8
    models = 2 * torch.eye(m, d)
    guides = torch.zeros(m, d)
    w = dwa_weights(guides, models, topk=m)
    torch.testing.assert_close(w, torch.full((m, m), 1 / m, dtype=torch.float64))

    # The server: each received client gets the mean; client 4 (not received) keeps its row.
    alg = FedDWA(topk=m)
    personal = torch.arange(5 * d, dtype=torch.float32).reshape(5, d)
    updates = {n: {"model": models[n], "guide": guides[n]} for n in range(m)}
    out = alg.server_update(_ctx(d, 5), {"personal": personal}, updates, {})
    for n in range(m):
        torch.testing.assert_close(out["personal"][n], models.mean(dim=0))
    assert torch.equal(out["personal"][4], personal[4])


def test_top_k_keeps_the_k_nearest_models_weighted_by_inverse_squared_distance():
    """Models on a line at 0..4, guides at 0.3, 1.6, 3.9: hand-computed weights."""
    models = torch.zeros(5, 3)
    models[:, 0] = torch.arange(5.0)
    spots = [0.3, 1.6, 3.9]
    guides = torch.zeros(3, 3)
    guides[:, 0] = torch.tensor(spots)
    k = 2
    w = dwa_weights(guides, models[:3], k, eps=0.0)  # the 3 received: models 0, 1, 2
    for i, g in enumerate(spots):
        d2 = [(j - g) ** 2 for j in range(3)]
        nearest = sorted(range(3), key=lambda j: d2[j])[:k]
        total = sum(1 / d2[j] for j in nearest)
        expected = [1 / d2[j] / total if j in nearest else 0.0 for j in range(3)]
        torch.testing.assert_close(w[:, i], torch.tensor(expected, dtype=torch.float64))
    # Server: Σ_j w_ji θ_j over the received models
    alg = FedDWA(topk=k, eps=0.0)
    updates = {n: {"model": models[n], "guide": guides[n]} for n in range(3)}
    out = alg.server_update(_ctx(3, 5), {"personal": torch.zeros(5, 3)}, updates, {})
    torch.testing.assert_close(out["personal"][:3], (w.T.float() @ models[:3]))


def test_a_zero_distance_stays_finite():
    models = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 3.0]])
    guides = models.clone()  # every guide equals its own model
    w = dwa_weights(guides, models, topk=3)
    assert bool(torch.isfinite(w).all())
    assert bool((w.diagonal() > 1 - 1e-9).all())


def test_guide_is_one_more_step_and_the_downlink_is_the_personal_row(small_cfg):
    """Full batch, ``guide_steps=1``: θ̂ = θ − η ∇f(θ); next round client i gets its row."""
    engine = build_engine(
        small_cfg("algorithm=feddwa", "algorithm.guide_steps=1", "batch_size=0", *MLP)
    )
    ctx, alg, x0 = engine.ctx, engine.algorithm, engine.x0
    data = engine.clients[1]
    out = alg.client_update(ctx, x0[None], CohortStates.of_rows([{"guide": x0}]), solo(data))
    theta, guide = out.updates["model"][0], out.updates["guide"][0]
    _, grad, _ = ctx.loss_grad_post(ctx.model_objective(), theta, data.x_train, data.y_train, None)
    torch.testing.assert_close(guide, theta - ctx.lr * grad)
    assert torch.equal(out.states[0]["guide"], guide)  # evaluated: the guide

    metrics = engine.run_round()
    assert metrics["bytes/up"] == 2 * metrics["bytes/down"]  # two models up, one down
    personal = engine.server["personal"]
    assert not torch.equal(personal[0], personal[1])
    for n in range(5):
        assert torch.equal(alg.downlink(ctx, engine.server, n), personal[n])
        assert torch.equal(
            alg.eval_params(ctx, engine.server, engine.client_states[n], n),
            engine.client_states[n]["guide"],
        )


def test_resume_is_exact(small_cfg, tmp_path):
    cfg = small_cfg("algorithm=feddwa", "rounds=4", "checkpoint_every=2", "participation=0.6")
    assert_resume_exact(cfg, tmp_path)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        MLP,
        (*MLP, "model.norm=batch", "algorithm.evaluate=personal"),
        (*MLP, "compressor=stc", "algorithm.evaluate=model"),
    ],
    ids=["default", "mlp", "batchnorm-personal", "stc-model"],
)
def test_runs(small_cfg, overrides):
    engine = build_engine(small_cfg("algorithm=feddwa", *overrides))
    _rounds(engine, 2)
    agg, per_client = engine.evaluate()
    assert math.isfinite(agg["acc/mean"]) and len(per_client) == 5
    assert bool(torch.isfinite(engine.server["personal"]).all())
    assert_eval_stack_is_eval_params(engine, [3, 0, 4, 1])


def test_bad_arguments_are_refused():
    assert refused(FedDWA, topk=0) == "algorithm.topk=0: expected ≥ 1"
    with pytest.raises(ValueError, match="evaluate"):
        FedDWA(evaluate="server")
