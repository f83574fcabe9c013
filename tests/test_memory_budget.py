"""The memory budget (issue 39 item 5): cohorts trained in slices that fit it, the same
results as whole, each round's peak memory logged."""

from __future__ import annotations

import pytest
import torch

from fedexp.config.schema import validate
from fedexp.engine import memory
from fedexp.engine.clients.pool import TrainPool
from fedexp.engine.runner import build_engine
from fedexp.engine.solver import steps
from fedexp.errors import ConfigError


def _run(small_cfg, *overrides, rounds=2):
    engine = build_engine(small_cfg("num_clients=6", *overrides))
    engine.setup()
    history = [engine.run_round() for _ in range(rounds)]
    return engine, history


@pytest.mark.parametrize(
    "overrides",
    [
        ("model=mlp", "model.hidden=8"),
        ("model=mlp", "model.hidden=8", "optimizer=adam", "algorithm=ditto"),
    ],
    ids=["fedavg-mlp", "ditto-adam"],
)
def test_a_cohort_sliced_to_its_memory_budget_equals_the_whole(small_cfg, monkeypatch, overrides):
    """A budget below two clients' steps trains the cohort one client a slice: the same
    models, states and training losses as the whole cohort in one slice."""
    whole, h_whole = _run(small_cfg, *overrides)
    assert whole.ctx.memory_budget > 2**20  # auto: from the free memory, the cohort whole
    sizes = []
    inner = steps._slice_rows
    monkeypatch.setattr(steps, "_slice_rows", lambda *a: sizes.append(inner(*a)) or sizes[-1])
    per_client = memory.client_step_bytes(
        whole.ctx, *(t[: whole.ctx.batch_size] for t in (TrainPool.of(whole.clients).x,
                                                          TrainPool.of(whole.clients).y))
    )  # fmt: skip
    budget_gib = 1.5 * per_client / 2**30
    sliced, h_sliced = _run(small_cfg, *overrides, f"memory_budget={budget_gib}")
    assert sizes and set(sizes) == {1}  # one client a slice
    torch.testing.assert_close(sliced.server["x"], whole.server["x"], rtol=1e-5, atol=1e-6)
    for a, b in zip(whole.client_states, sliced.client_states, strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    for a, b in zip(h_whole, h_sliced, strict=True):
        assert a["train/train_loss"] == pytest.approx(b["train/train_loss"], rel=1e-5)


def test_a_clients_step_estimate_follows_its_minibatch(small_cfg):
    """The estimate is of the activations autograd keeps: twice the batch, about twice the
    bytes beyond the parameters' fixed share; measured once per shape."""
    engine = build_engine(small_cfg("model=mlp", "model.hidden=64"))
    ctx = engine.ctx
    pool = TrainPool.of(engine.clients)
    fixed = 4 * ctx.model.layout.numel * 4
    small = memory.client_step_bytes(ctx, pool.x[:8], pool.y[:8]) - fixed
    large = memory.client_step_bytes(ctx, pool.x[:16], pool.y[:16]) - fixed
    assert small > 8 * 64 * 4  # at least the hidden layer's activations
    assert 1.6 < large / small < 2.4
    assert len(ctx.step_bytes) == 2
    memory.client_step_bytes(ctx, pool.x[:8], pool.y[:8])
    assert len(ctx.step_bytes) == 2


def test_the_budget_is_the_setting_or_a_share_of_what_is_free():
    cpu = torch.device("cpu")
    assert memory.resolve_budget(2.0, cpu) == 2 * 2**30
    auto = memory.resolve_budget(0.0, cpu)
    assert 0 < auto <= memory.available_ram()


def test_a_negative_budget_is_refused_naming_the_key(small_cfg):
    with pytest.raises(ConfigError, match=r"memory_budget=-1.0: expected ≥ 0 GiB"):
        validate(small_cfg("memory_budget=-1.0"))


def test_a_round_logs_its_peak_memory(small_cfg):
    _, history = _run(small_cfg, rounds=1)
    assert history[0]["memory/peak_mib"] > 0
