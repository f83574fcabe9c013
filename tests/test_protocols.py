"""The papers' protocols (issue 23): who trains in a round, and how the fine-tuning baselines
and IFCA are evaluated.

* pFedMe (Algorithm 1, lines 4-9) and TDPFed (Algorithm 1, lines 2-5): every client updates its
  personal model every round; the server aggregates the sampled clients only.
* FedAvg-FT / FedProx-FT (pFedSOP §V-B2): a client is tested with the *current* global model
  fine-tuned on its data.
* IFCA (Algorithm 1): a client is tested with the current cluster model of lowest training
  loss.
"""

from __future__ import annotations

import pytest
import torch

from fedexp import streams
from fedexp.engine.runner import build_engine
from fedexp.engine.solver import passes

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = ("model=mlp", "model.hidden=8")
ALL_TRAIN = {
    "pfedme": ("algorithm=pfedme", "algorithm.personal_steps=2", "algorithm.local_rounds=2"),
    "tdpfed": ("algorithm=tdpfed", *MLP, "algorithm.local_rounds=2",
               "algorithm.personal_steps=2", "algorithm.factor_steps=2"),
}  # fmt: skip


# ------------------------------------------------------------------ who trains
@pytest.mark.parametrize("alg", sorted(ALL_TRAIN))
def test_every_client_trains_and_the_sampled_ones_upload(small_cfg, alg):
    """At participation 0.6, round 0's client states equal those of a run where every client
    is sampled (all start from the same broadcast, each draws from its own stream); the
    uplink carries the sampled clients' messages only; the server differs (fewer uploads)."""
    part = build_engine(small_cfg(*ALL_TRAIN[alg], "participation=0.6"))
    full = build_engine(small_cfg(*ALL_TRAIN[alg], "participation=1.0"))
    assert part.algorithm.all_train
    part.setup(), full.setup()
    m_part, m_full = part.run_round(), full.run_round()
    sampled = part.last_sampled
    assert len(sampled) == 3 < len(part.clients)
    for n in range(len(part.clients)):
        for key, value in full.client_states[n].items():
            torch.testing.assert_close(part.client_states[n][key], value, msg=f"{n} {key}")
    assert m_part["clients/sampled"] == 3 and m_part["clients/trained"] == 5
    assert part.ledger.messages["up"] == 3 and full.ledger.messages["up"] == 5
    assert m_part["bytes/up"] * 5 == m_full["bytes/up"] * 3  # equal messages, 3 of 5 sent
    assert m_part["bytes/down"] == m_full["bytes/down"]  # the broadcast reaches everyone
    assert not all(torch.equal(part.server[k], full.server[k]) for k in full.server)


@pytest.mark.parametrize("alg", sorted(ALL_TRAIN))
def test_only_the_sampled_clients_train_when_asked(small_cfg, alg):
    engine = build_engine(
        small_cfg(*ALL_TRAIN[alg], "participation=0.6", "algorithm.all_train=false")
    )
    before = [dict(s) for s in engine.client_states]
    engine.setup()
    metrics = engine.run_round()
    assert "clients/trained" not in metrics
    for n, state in enumerate(engine.client_states):
        same = all(torch.equal(state[k], v) for k, v in before[n].items())
        assert same == (n not in engine.last_sampled), n


def test_channel_metrics_average_over_the_uploads(small_cfg):
    """CER's metrics describe the uploaded messages: with every client training and 3 of 5
    uploading, round 0's equal those of the run where only the sampled train (the same 3
    messages), while the training loss averages over all 5."""
    runs = {}
    for flag in ("true", "false"):
        engine = build_engine(
            small_cfg(*ALL_TRAIN["pfedme"], "participation=0.6", "compressor=cer",
                      f"algorithm.all_train={flag}")
        )  # fmt: skip
        engine.setup()
        runs[flag] = engine.run_round()
    every, sampled = runs["true"], runs["false"]
    assert every["train/cer/runs"] > 1
    for key in ("train/cer/runs", "train/cer/sparsity"):
        assert every[key] == pytest.approx(sampled[key], rel=1e-12), key
    assert every["train/train_loss"] != sampled["train/train_loss"]


# --------------------------------------------------------- fine-tuning baselines
def _plain_finetune(engine, n: int, x: torch.Tensor, steps: int) -> torch.Tensor:
    """Client n fine-tunes ``x``: plain SGD on the module, minibatches of its evaluation
    stream of the engine's current round (independent of the solver)."""
    ctx, data = engine.ctx, engine.clients[n]
    key = int(streams.stream_keys(engine.seed, streams.EVAL, engine.round, [n])[0])
    stream = passes.Stream(key, ctx.sampling)
    module = ctx.model.module
    module.train()
    params = x.clone()
    for _ in range(steps):
        xb, yb = data.batch(ctx.batch_size, stream)
        p = params.clone().requires_grad_(True)
        loss = ctx.task.loss(ctx.model(p, xb), yb)
        (grad,) = torch.autograd.grad(loss, p)
        params = params - ctx.lr * grad
    return params


@pytest.mark.parametrize("alg", ["fedavg_ft", "fedprox_ft"])
def test_finetuning_baselines_test_the_current_global_model_finetuned(small_cfg, alg):
    engine = build_engine(small_cfg(f"algorithm={alg}", "participation=0.2", "local_steps=3"))
    engine.setup()
    for _ in range(3):
        engine.run_round()
    states = [dict(s) for s in engine.client_states]
    vectors = engine.eval_vectors(list(range(len(engine.clients))))
    for n, vector in enumerate(vectors):
        want = _plain_finetune(engine, n, engine.server["x"], 3)
        torch.testing.assert_close(vector, want, rtol=1e-5, atol=1e-6)
        last = states[n].get("ft")
        if last is not None:  # not the (stale) model of its last participation
            assert not torch.allclose(vector, last)
    for n, state in enumerate(engine.client_states):  # evaluation keeps nothing
        assert state.keys() == states[n].keys()
        assert all(torch.equal(state[k], states[n][k]) for k in state)


def test_finetune_evaluation_leaves_training_alone(small_cfg):
    """Evaluating by fine-tuning draws from the evaluation streams: the training is the same
    whichever evaluation runs, and ``evaluate=last`` reads the stored models."""
    runs = {}
    for how in ("finetune", "last"):
        engine = build_engine(
            small_cfg("algorithm=fedavg_ft", "participation=0.6", f"algorithm.evaluate={how}")
        )
        engine.setup()
        history = []
        for _ in range(3):
            engine.run_round()
            history.append(engine.evaluate()[0]["acc/mean"])
        runs[how] = (engine, history)
    a, b = runs["finetune"][0], runs["last"][0]
    assert torch.equal(a.server["x"], b.server["x"])
    last = b.eval_vectors([0, 1, 2, 3, 4])
    for n, vector in enumerate(last):
        assert torch.equal(vector, b.client_states[n].get("ft", b.server["x"]))


# --------------------------------------------------------------------- IFCA
def test_ifca_tests_each_client_with_the_cluster_it_estimates_now(small_cfg):
    engine = build_engine(small_cfg("algorithm=ifca", "algorithm.k=3", "participation=0.4"))
    engine.setup()
    for _ in range(3):
        engine.run_round()
    clusters = engine.server["clusters"]
    module = engine.ctx.model
    vectors = engine.eval_vectors(list(range(len(engine.clients))))
    disagree = 0
    for n, data in enumerate(engine.clients):
        module.module.eval()
        with torch.no_grad():
            losses = [
                float(engine.ctx.task.loss(module(c, data.x_train), data.y_train)) for c in clusters
            ]
        best = min(range(len(losses)), key=losses.__getitem__)
        assert torch.equal(vectors[n], clusters[best]), n
        disagree += best != max(int(engine.client_states[n]["cluster"][0]), 0)
    # a client's last choice is stale here for some (never sampled, or clusters moved since)
    assert disagree > 0
    engine.algorithm.eval_with_data = False  # evaluate=last: the stored choice
    for n, vector in enumerate(engine.eval_vectors(list(range(len(engine.clients))))):
        assert torch.equal(vector, clusters[max(int(engine.client_states[n]["cluster"][0]), 0)])
