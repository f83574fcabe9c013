"""The lockstep backend (batched local SGD over greenlets, no threads) equals the sequential one."""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.runner import build_engine
from fedexp.errors import ConfigError, DivergenceError


def _run(small_cfg, backend, *overrides, rounds=3):
    engine = build_engine(small_cfg(f"backend={backend}", *overrides))
    engine.setup()
    for _ in range(rounds):
        metrics = engine.run_round()
    return engine, metrics


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm=fedavg", "participation=0.6"),
        ("algorithm=local",),
        ("algorithm=ditto", "algorithm.lam=0.5"),
        ("algorithm=pfednet", "model=mlp", "model.hidden=8"),
        ("algorithm=fedavg", "compressor=stc", "model=mlp", "model.hidden=8"),
        (
            "algorithm=fedavg",
            "dataset=synthetic",
            "dataset.num_classes=3",
            "partition=iid",
            "num_clients=12",
            "local_epochs=1",
        ),
    ],
    ids=["fedavg", "local", "ditto", "pfednet", "fedavg-stc", "multiclass-epochs"],
)
def test_lockstep_equals_sequential(small_cfg, overrides):
    seq, m_seq = _run(small_cfg, "sequential", *overrides)
    lock, m_lock = _run(small_cfg, "lockstep", *overrides)
    for key in seq.server:
        torch.testing.assert_close(lock.server[key], seq.server[key], rtol=1e-4, atol=1e-5)
    for a, b in zip(seq.client_states, lock.client_states, strict=True):
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)
    assert m_lock["bytes/up"] == m_seq["bytes/up"]
    assert m_lock["train/train_loss"] == pytest.approx(m_seq["train/train_loss"], rel=1e-4)


def test_lockstep_full_batch_falls_back_and_still_matches(small_cfg):
    seq, _ = _run(small_cfg, "sequential", "batch_size=0")
    lock, _ = _run(small_cfg, "lockstep", "batch_size=0")
    torch.testing.assert_close(lock.server["x"], seq.server["x"])


def test_lockstep_divergence_names_the_client(small_cfg):
    engine = build_engine(small_cfg("backend=lockstep", "lr=1e38"))
    with pytest.raises(DivergenceError, match=r"client 0: training loss is (nan|inf)"):
        for _ in range(2):
            engine.run_round()


def test_unknown_backend_is_refused(small_cfg):
    with pytest.raises(ConfigError, match="backend='gpu'"):
        build_engine(small_cfg("backend=gpu"))


def test_lockstep_falls_back_when_the_loss_cannot_be_vmapped(small_cfg):
    """An in-place op vmap refuses (MONAI's one_hot does this): same draws, same models.

    FedAvg runs the cohort path (tests/test_cohort.py): its fallback is checked here."""

    def patch(engine):
        original = engine.ctx.task.loss

        def loss(logits, y):
            onehot = torch.zeros(y.shape[0], 2)
            onehot.scatter_(1, y[:, None].long(), 1.0)  # not vmappable: y batched, onehot not
            return original(logits, y) + 0.0 * onehot.sum()

        engine.ctx.task.loss = loss
        return engine

    seq = patch(build_engine(small_cfg("backend=sequential")))
    lock = patch(build_engine(small_cfg("backend=lockstep")))
    for _ in range(2):
        seq.run_round()
        lock.run_round()
    assert lock.ctx.vmap_ok is False
    assert torch.equal(lock.server["x"], seq.server["x"])


def test_lockstep_starts_no_thread(small_cfg, monkeypatch):
    """The cohort's hooks are greenlets of the calling thread, not a thread per client."""
    import threading

    started = []
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self))
    engine = build_engine(small_cfg("backend=lockstep", "num_clients=8"))
    engine.setup()
    engine.run_round()
    assert started == [] and engine.round == 1


def test_auto_backend_batches_unless_batchnorm(small_cfg):
    assert build_engine(small_cfg("backend=auto")).backend == "lockstep"
    bn = build_engine(small_cfg("backend=auto", "model=mlp", "model.hidden=8", "model.norm=batch"))
    assert bn.backend == "sequential"
