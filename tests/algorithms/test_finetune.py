"""FedAvg-FT and FedProx-FT (pFedSOP's baselines) against FedAvg / FedProx and by hand."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.algorithms.finetune import FedAvgFT
from fedexp.algorithms.finetune import FedProxFT
from fedexp.engine.runner import build_engine
from helpers import cohort_of
from helpers import deterministic
from helpers import refused

pytestmark = pytest.mark.usefixtures("one_thread")

#: few local steps keep the file fast; no property here depends on their number
FAST = ("local_steps=2",)


def _rounds(engine, n):
    metrics = {}
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


@pytest.mark.parametrize(
    ("ft", "plain"),
    [("fedavg_ft", "fedavg"), ("fedprox_ft", "fedprox")],
    ids=["fedavg", "fedprox"],
)
def test_zero_finetune_steps_is_the_plain_algorithm(small_cfg, ft, plain):
    """Server, client states, training metrics and evaluation all bit for bit."""
    extra = (
        ("participation=0.6", "algorithm.mu=0.5") if plain == "fedprox" else ("participation=0.6",)
    )
    a, m_a = _rounds(
        build_engine(small_cfg(*FAST, f"algorithm={ft}", "algorithm.finetune_steps=0", *extra)), 3
    )
    b, m_b = _rounds(build_engine(small_cfg(*FAST, f"algorithm={plain}", *extra)), 3)
    assert torch.equal(a.server["x"], b.server["x"])
    for sa, sb in zip(a.client_states, b.client_states, strict=True):
        assert sa.keys() == sb.keys()
    assert deterministic(m_a) == deterministic(m_b)
    assert a.evaluate() == b.evaluate()


def test_local_training_starts_from_the_finetuned_model(small_cfg):
    """One round by hand: k fine-tuning steps, then E local steps from x^FT on the same stream;
    ``ft`` is kept and evaluated, the server averages the results (FedAvg)."""
    e, metrics = _rounds(
        build_engine(small_cfg(*FAST, "algorithm=fedavg_ft", "algorithm.finetune_steps=3")), 1
    )
    ctx, x0 = e.ctx, e.x0
    weights = torch.tensor([float(c.num_train) for c in e.clients])
    weights = weights / weights.sum()
    expected = torch.zeros_like(x0)
    clients = list(range(len(e.clients)))
    cohort = cohort_of(e, clients, 0)  # every client's stream of round 0
    fts = ctx.train(x0.expand(len(clients), -1), cohort, steps=3).params
    locals_ = ctx.train(fts, cohort).params
    for n, s, ft, local in zip(clients, e.client_states, fts, locals_, strict=True):
        assert torch.equal(s["ft"], ft)
        assert torch.equal(e.algorithm.eval_params(ctx, e.server, s, n), ft)
        expected += weights[n] * (x0 - local)
    torch.testing.assert_close(e.server["x"], x0 - expected)
    assert "train/finetune_loss" in metrics


def test_finetuning_lowers_the_clients_training_loss(small_cfg):
    """Full-batch fine-tuning of the received global model (x0 in round 1) on a client's data
    lowers its training loss there."""
    e, _ = _rounds(
        build_engine(
            small_cfg(*FAST, "algorithm=fedavg_ft", "algorithm.finetune_steps=5", "batch_size=0")
        ),
        1,
    )
    for s, data in zip(e.client_states, e.clients, strict=True):
        objective = e.ctx.model_objective()
        before, _, _ = e.ctx.loss_grad_post(objective, e.x0, data.x_train, data.y_train, None)
        after, _, _ = e.ctx.loss_grad_post(objective, s["ft"], data.x_train, data.y_train, None)
        assert float(after) < float(before) - 1e-3


def test_never_sampled_clients_are_evaluated_with_the_global_model(small_cfg):
    e, _ = _rounds(build_engine(small_cfg(*FAST, "algorithm=fedprox_ft", "participation=0.4")), 1)
    for n, s in enumerate(e.client_states):
        params = e.algorithm.eval_params(e.ctx, e.server, s, n)
        if n in e.last_sampled:
            assert torch.equal(params, s["ft"])
        else:
            assert "ft" not in s and torch.equal(params, e.server["x"])


@pytest.mark.parametrize(
    ("algorithm", "overrides"),
    [
        ("fedavg_ft", ()),
        ("fedprox_ft", ("model=mlp", "model.hidden=8")),
        ("fedavg_ft", ("model=mlp", "model.hidden=8", "model.norm=batch")),
    ],
    ids=["fedavg-logreg", "fedprox-mlp", "fedavg-mlp-batchnorm"],
)
def test_runs_and_evaluates_the_finetuned_models(small_cfg, algorithm, overrides):
    e, metrics = _rounds(build_engine(small_cfg(*FAST, f"algorithm={algorithm}", *overrides)), 2)
    out, per_client = e.evaluate()
    assert 0.0 <= out["acc/mean"] <= 1.0 and len(per_client) == 5
    assert math.isfinite(metrics["train/finetune_loss"])
    s = e.client_states[0]
    assert not torch.equal(s["ft"], e.server["x"])


def test_bad_arguments_are_refused():
    assert refused(FedAvgFT, finetune_steps=-1).startswith("algorithm.finetune_steps=-1: expected")
    assert refused(FedProxFT, mu=-1.0).startswith("algorithm.mu=-1.0: expected ≥ 0")
