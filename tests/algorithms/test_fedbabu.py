"""FedBABU: a frozen head that never moves nor crosses, and fine-tuned evaluation by hand."""

from __future__ import annotations

import pytest
import torch

from fedexp import streams
from fedexp.algorithms.fedbabu import FedBABU
from fedexp.contract import Cohort
from fedexp.engine.runner import build_engine
from fedexp.errors import ConfigError
from helpers import refused

pytestmark = pytest.mark.usefixtures("one_thread")

MLP = ("model=mlp", "model.hidden=8")
FAST = ("local_steps=3",)


def _rounds(engine, n):
    metrics = {}
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


def test_head_never_moves_nor_crosses(small_cfg):
    """With momentum and weight decay (which would move a merely zero-gradient head): the
    server's and every client's head stay the initial one, the body moves, and each sampled
    client sends and receives 4 bytes per body coordinate."""
    over = ("participation=0.6", "optimizer.momentum=0.9", "optimizer.weight_decay=0.01")
    e, metrics = _rounds(build_engine(small_cfg(*MLP, *FAST, "algorithm=fedbabu", *over)), 3)
    ctx, alg = e.ctx, e.algorithm
    head, body = alg.personal_idx(ctx), alg.body_idx(ctx)
    assert torch.equal(head, ctx.model.layout.indices(["head.*"]))
    assert torch.equal(e.server["x"][head], e.x0[head])
    assert not torch.equal(e.server["x"][body], e.x0[body])
    for s in e.client_states:
        assert torch.equal(s["head"], e.x0[head])
    sent = 4 * body.numel() * len(e.last_sampled)
    assert metrics["bytes/up"] == sent and metrics["bytes/down"] == sent


def test_training_is_fedavg_with_the_head_masked(small_cfg):
    """The global model follows FedAvg whose local steps move the body alone."""
    over = (*MLP, *FAST, "participation=0.6", "optimizer.momentum=0.9")
    babu, _ = _rounds(build_engine(small_cfg("algorithm=fedbabu", *over)), 3)
    avg = build_engine(small_cfg("algorithm=fedavg", *over))
    mask = babu.algorithm.train_mask(babu.ctx)
    original = avg.ctx.train
    avg.ctx.train = lambda *a, **k: original(*a, **{**k, "mask": mask})
    _rounds(avg, 3)
    torch.testing.assert_close(babu.server["x"], avg.server["x"], rtol=0, atol=1e-6)


def test_no_finetuning_evaluates_the_global_model(small_cfg):
    """τ_ft = 0: every client is evaluated with the global model itself (the frozen head)."""
    e, _ = _rounds(
        build_engine(small_cfg(*MLP, *FAST, "algorithm=fedbabu", "algorithm.finetune_steps=0")), 2
    )
    assert not e.algorithm.eval_with_data
    who = list(range(len(e.clients)))
    assert torch.equal(e.eval_vectors(who), e.server["x"].expand(len(who), -1))
    _, per_client = e.evaluate()
    for row, data in zip(per_client, e.clients, strict=True):
        alone = e.ctx.evaluate(e.server["x"], data)
        assert row["acc"] == alone["acc"]
        assert row["loss"] == pytest.approx(alone["loss"], rel=1e-6)


@pytest.mark.parametrize(
    "finetune",
    [
        ("algorithm.finetune_epochs=2",),
        ("algorithm.finetune_steps=4", "algorithm.finetune_lr=0.02"),
    ],
)
def test_finetuned_evaluation_by_hand(small_cfg, finetune):
    """Each client's evaluation vector is the current global model fine-tuned whole (head
    included) for τ_ft steps (epochs: ⌈τ · ⌈n/B⌉⌉) of the run's optimiser from a fresh
    state, on minibatches of its own evaluation stream, alone; clients whose τ_ft differ
    are fine-tuned in groups of equal τ_ft."""
    e, _ = _rounds(build_engine(small_cfg(*MLP, *FAST, "algorithm=fedbabu", *finetune)), 1)
    ctx, alg = e.ctx, e.algorithm
    who = list(range(len(e.clients)))
    got = e.eval_vectors(who)
    head = alg.personal_idx(ctx)
    steps = set()
    for n in who:
        data = e.clients[n]
        k = alg.finetune_steps_for(ctx, data)
        if alg.finetune_steps is None:
            assert k == 2 * -(-data.num_train // ctx.batch_size)
        steps.add(k)
        ids = torch.tensor([n], dtype=torch.int64)
        cohort = Cohort(
            [n],
            [data],
            ids,
            streams.stream_keys(e.seed, streams.EVAL, e.round, ids),
            torch.zeros(1, dtype=torch.int64),
            e.pool,
        )
        hand = ctx.train(e.server["x"][None].clone(), cohort, steps=k, lr=alg.finetune_lr)
        hand = hand.params[0]
        torch.testing.assert_close(got[n], hand, rtol=0, atol=1e-6)
        assert not torch.equal(hand[head], e.x0[head])  # the head is fine-tuned too
    if alg.finetune_steps is None:
        assert len(steps) > 1  # the clients' sizes differ: several groups were fine-tuned
    # the fine-tuning is for evaluation only: nothing of it is kept
    assert torch.equal(e.server["x"][head], e.x0[head])


def test_models_without_a_head_or_body_are_refused(small_cfg):
    with pytest.raises(ConfigError, match="no body"):
        build_engine(small_cfg("algorithm=fedbabu"))  # logreg: the head is the whole model
    with pytest.raises(ConfigError, match="no head"):
        build_engine(small_cfg(*MLP, "algorithm=fedbabu", "algorithm.head=[]"))


def test_bad_arguments_are_refused():
    assert refused(FedBABU, finetune_steps=-1).startswith("algorithm.finetune_steps=-1: expected")
    assert refused(FedBABU, finetune_epochs=-1.0).startswith("algorithm.finetune_epochs=-1.0")
    assert refused(FedBABU, finetune_lr=0.0).startswith("algorithm.finetune_lr=0.0: expected > 0")
