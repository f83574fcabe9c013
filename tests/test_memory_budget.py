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


def _round_budget_gib(engine, clients: int) -> float:
    """A budget whose round slices hold ``clients`` clients (``Engine._round_slices``)."""
    from fedexp.engine.round import engine as round_engine

    per_client = round_engine._ROUND_COPIES * engine.x0.numel() * engine.x0.element_size()
    return (clients + 0.5) * per_client / 2**30


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm=fedavg",),
        ("algorithm=ditto", "participation=0.6", "compressor=stc"),
        ("algorithm=fedprox", "model=mlp", "model.hidden=8", "optimizer=sgd",
         "optimizer.momentum=0.9"),
        # servers that scale the mean by |S|/N: the senders' count whatever the slices
        ("algorithm=scaffold", "participation=0.6"),
        ("algorithm=feddyn", "participation=0.6", "algorithm.weighting=samples"),
        ("algorithm=fednova", "local_epochs=1", "participation=0.6"),  # unequal τ_n
    ],
    ids=["fedavg", "ditto-partial-stc", "fedprox-mlp-momentum", "scaffold-partial",
         "feddyn-partial-samples", "fednova-epochs"],
)  # fmt: skip
def test_a_round_too_big_for_its_budget_runs_in_slices_as_it_runs_whole(
    small_cfg, monkeypatch, overrides
):
    """Where the server reads Σ ω_n u_n alone, a round whose stacks do not fit the budget goes
    through its client work and uplink slice by slice, each slice's weighted sum added: the
    same models, states, channel memories and training metrics as the whole round (up to the
    order of the sums), and the same bytes on the wire, exactly."""
    from fedexp.engine.round.engine import Engine

    whole, h_whole = _run(small_cfg, *overrides, rounds=3)
    cuts = []
    inner = Engine._round_slices
    monkeypatch.setattr(
        Engine, "_round_slices", lambda self, who: cuts.append(inner(self, who)) or cuts[-1]
    )
    budget = _round_budget_gib(whole, 2)
    sliced, h_sliced = _run(small_cfg, *overrides, f"memory_budget={budget}", rounds=3)
    assert all(c is not None and max(len(w.my_trainers) for w in c) == 2 for c in cuts)
    assert all(len(c) > 1 for c in cuts)
    for key in whole.server:
        torch.testing.assert_close(sliced.server[key], whole.server[key], rtol=1e-5, atol=1e-6)
    for a, b in zip(whole.client_states, sliced.client_states, strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    for direction in ("up", "down"):  # the channels' error-feedback residuals
        torch.testing.assert_close(
            sliced.transport.residual[direction].export(),
            whole.transport.residual[direction].export(),
            rtol=1e-5, atol=1e-6,
        )  # fmt: skip
    assert sliced.ledger.total == whole.ledger.total
    for a, b in zip(h_whole, h_sliced, strict=True):
        for key, value in a.items():
            if key.startswith(("bytes/", "clients/", "messages/")):
                assert b[key] == value, key
            elif key.startswith("train/"):
                assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize(
    "overrides",
    [("algorithm=pfednet", "algorithm.k=2"), ("privacy=central", "privacy.noise_multiplier=1.0")],
    ids=["server-reads-each", "central-dp"],
)
def test_a_round_whose_server_reads_each_upload_is_not_sliced(small_cfg, overrides):
    """pFedNet's server reads every upload, and central DP re-clips each: whole rounds."""
    engine = build_engine(small_cfg("num_clients=6", *overrides))
    engine.setup()
    budget = _round_budget_gib(engine, 2)
    engine.ctx.memory_budget = int(budget * 2**30)
    who = engine.sampler(0)
    assert len(who.my_trainers) > 2 and engine._round_slices(who) is None


_MAPPED_AFTER_A_FREE = """
import ctypes, sys
import torch
from fedexp.engine.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
t = torch.ones(2**24)  # 64 MiB
del t
t = torch.ones(2**24)
print(libc.mallinfo2().hblkhd, libc.mallinfo2().arena)
"""


@pytest.mark.skipif(
    not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="glibc >= 2.33 only"
)
def test_a_runs_large_tensors_come_from_the_heap_it_keeps():
    """``memory.keep_freed_memory`` (which ``runner.run`` calls): a 64 MiB tensor made after
    one of its size was freed lies in malloc's heap, not in a fresh mapping from the kernel
    (glibc's ``mallinfo2``: ``hblkhd``, the bytes in mappings; ``arena``, the heap's)."""
    import subprocess
    import sys

    def mapped(mode: str) -> tuple[int, int]:
        out = subprocess.run(
            [sys.executable, "-c", _MAPPED_AFTER_A_FREE, mode],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        hblkhd, arena = out.stdout.split()
        return int(hblkhd), int(arena)

    default, kept = mapped("default"), mapped("keep")
    assert default[0] >= 2**26  # glibc's default: the block is a mapping of its own
    assert kept[0] < 2**26 and kept[1] >= 2**26  # kept: in the heap
