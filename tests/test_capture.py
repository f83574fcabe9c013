"""A captured round's client work (issue 69): static buffers, a replayable step function, a
cache per (cohort size, step count), and on a GPU its CUDA graph.

On the CPU the "replay" runs the same static-buffer function eagerly
(``CapturedSolver(graphs=False)``): its rounds must equal the eager solver's within 1e-6
relative, for plain SGD, momentum, Adam, a proximal objective (``aux``), a linear term
(SCAFFOLD), short batches (the default data's clients end their epochs short) and a vmapped
model with frozen coordinates (BatchNorm). The CUDA test compares a captured run on the
device with the eager one there (skipped without CUDA; the device check runs it).
"""

from __future__ import annotations

import logging

import pytest
import torch

from fedexp.engine.runner import build_engine
from fedexp.engine.solver import steps
from fedexp.engine.solver.capture import CapturedSolver
from fedexp.engine.solver.capture import solver_for

CASES = {
    "fedavg": ["algorithm=fedavg"],
    "fedavg-momentum-wd": [
        "algorithm=fedavg", "optimizer=sgd", "optimizer.momentum=0.9",
        "optimizer.weight_decay=0.01",
    ],
    "fedprox-nesterov": [
        "algorithm=fedprox", "algorithm.mu=0.5", "optimizer=sgd", "optimizer.momentum=0.9",
        "optimizer.nesterov=true",
    ],
    "local-adam": ["algorithm=local", "optimizer=adam"],
    "ditto-adam": ["algorithm=ditto", "algorithm.lam=0.5", "optimizer=adam"],
    "scaffold": ["algorithm=scaffold"],
    "fedavg-mlp-batchnorm": ["algorithm=fedavg", "model=mlp", "model.hidden=8", "model.norm=batch"],
}  # fmt: skip


def _engine(small_cfg, overrides: list[str], solver=None):  # noqa: ANN001, ANN202
    engine = build_engine(small_cfg(*overrides, "num_clients=4", "tracker=none"))
    if solver is not None:
        engine.ctx.solver = solver
    engine.setup()
    return engine


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _assert_same(eager, replayed) -> None:  # noqa: ANN001
    assert sorted(eager.server) == sorted(replayed.server)
    for key, value in eager.server.items():
        if isinstance(value, torch.Tensor):
            _close(replayed.server[key], value)
    for sa, sb in zip(eager.client_states, replayed.client_states, strict=True):
        assert sorted(sa) == sorted(sb)
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                _close(sb[key], value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_replayed_round_equals_the_eager_one(small_cfg, case):
    """Three rounds through the static buffers equal three eager rounds (1e-6 relative), and
    the static path was taken (one cache entry per (m, steps) call site, reused)."""
    eager = _engine(small_cfg, CASES[case])
    captured = CapturedSolver(graphs=False)
    replayed = _engine(small_cfg, CASES[case], captured)
    for r in range(3):
        a, b = eager.run_round(), replayed.run_round()
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float) and key.startswith("train"):
                assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (r, key)
        entries = len(captured.cache)
        assert entries >= 1, "no call took the static path"
    _assert_same(eager, replayed)
    assert len(captured.cache) == entries  # reused across rounds, not one per round


def test_the_cache_is_keyed_by_cohort_size_and_steps(small_cfg):
    """Another cohort size or step count is another entry; the same ones reuse it."""
    captured = CapturedSolver(graphs=False)
    engine = _engine(small_cfg, ["algorithm=fedavg"], captured)
    engine.run_round()
    assert len(captured.cache) == 1
    ((m, count, *_),) = captured.cache
    assert (m, count) == (4, engine.ctx.local_steps)
    engine.run_round()
    assert len(captured.cache) == 1
    engine.ctx.local_steps += 1
    engine.run_round()
    assert sorted(k[:2] for k in captured.cache) == [(4, count), (4, count + 1)]


def test_calls_the_static_form_cannot_take_run_eagerly(small_cfg):
    """Noise draws (SuPerFed) go to the eager solver: no entry made, the same results."""
    overrides = ["algorithm=superfed", "algorithm.warmup_rounds=0"]
    captured = CapturedSolver(graphs=False)
    eager, replayed = _engine(small_cfg, overrides), _engine(small_cfg, overrides, captured)
    for _ in range(2):
        eager.run_round()
        replayed.run_round()
    assert not captured.cache
    _assert_same(eager, replayed)


def test_the_setting_chooses_the_solver():
    """``capture=auto`` records graphs on a CUDA device only; ``off`` never."""
    assert solver_for("auto", torch.device("cpu")) is steps.train
    assert solver_for("off", torch.device("cuda")) is steps.train
    assert isinstance(solver_for("auto", torch.device("cuda")), CapturedSolver)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["fedavg", "fedavg-momentum-wd", "local-adam"])
def test_a_captured_round_on_cuda_equals_the_eager_one(small_cfg, case, caplog):
    """On the device: graphs recorded once per key and replayed; 1e-6 relative to eager."""
    cuda = [*CASES[case], "device=cuda"]
    eager = _engine(small_cfg, [*cuda, "capture=off"])
    replayed = _engine(small_cfg, [*cuda, "capture=auto"])
    assert isinstance(replayed.ctx.solver, CapturedSolver)
    with caplog.at_level(logging.WARNING, logger="fedexp"):
        for _ in range(3):
            eager.run_round()
            replayed.run_round()
    assert "capture: cannot record" not in caplog.text
    assert all(e.graph is not None for e in replayed.ctx.solver.cache.values())
    _assert_same(eager, replayed)


def test_an_unknown_capture_setting_is_refused_naming_it(small_cfg):
    """``capture=always``: one line naming the key and the values allowed, before a run."""
    from fedexp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"capture='always': expected one of auto, off"):
        build_engine(small_cfg("capture=always", "tracker=none"))
