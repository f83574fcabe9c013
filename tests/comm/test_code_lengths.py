"""Code lengths on the device (issue 39 item 3): each message's exact byte count from its codec's
length formula, as a tensor over the cohort, equals the length of the payload really written;
the engine counts the same bytes, holds the same residuals and replicas and reaches the same
model whether it writes the payloads (a CPU run) or counts them by formula (elsewhere), and
either way a round's ops and host reads do not grow with the cohort."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedexp.comm.cer import CERTransform
from fedexp.comm.codec import Codec
from fedexp.comm.codec import DenseCodec
from fedexp.comm.entropy import EntropyCodec
from fedexp.comm.randk import RandKCodec
from fedexp.comm.randk import keyed_positions
from fedexp.comm.runs import RunLengthCodec
from fedexp.comm.stc import STCCodec
from fedexp.comm.stc import TwoMeanSTCCodec
from fedexp.comm.topk import TopKCodec
from fedexp.engine.round.transport import Transport
from fedexp.engine.runner import build_engine

FORMULA: dict[str, Codec] = {
    "dense": DenseCodec(),
    "runs": RunLengthCodec(),
    "stc": STCCodec(q=0.05),
    "stc_adaptive": STCCodec(q=0.2, adaptive_golomb=True),
    "stc_all": STCCodec(q=1.0),
    "twomean": TwoMeanSTCCodec(q=0.05),
    "twomean_adaptive": TwoMeanSTCCodec(q=0.3, adaptive_golomb=True),
    "topk": TopKCodec(q=0.01),
    "topk_adaptive": TopKCodec(q=0.1, adaptive_golomb=True),
    "topk_all": TopKCodec(q=1.0),
    "randk": RandKCodec(q=0.3, unbiased=True),
}


def _messages(m: int, d: int, seed: int) -> torch.Tensor:
    """Continuous rows, piecewise-constant rows (CER's), all-zero, one non-zero, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=g) * torch.rand(m, 1, generator=g).add(0.01)
    if m > 5 and d > 2:
        x[1] = 0.0
        x[2] = 0.0
        x[2, d - 1] = -3.0
        cer = CERTransform(gamma=0.5)
        x[3] = cer(x[3])[0]
        x[4] = torch.repeat_interleave(torch.randn(4, generator=g), d)[:d]  # few long runs
        x[5, ::2] = -0.0
    return x


@pytest.mark.parametrize("name", list(FORMULA))
@pytest.mark.parametrize(("m", "d"), [(1, 1), (7, 2), (9, 31), (8, 1000), (3, 5000)])
def test_the_length_formula_is_the_length_of_the_payload(name, m, d):
    codec = FORMULA[name]
    x = _messages(m, d, seed=m * 7919 + d)
    keys = torch.arange(m, dtype=torch.int64) * 977 if codec.randomised else None
    sent = codec.compress_many(x, keys) if not codec.lossless else x
    payloads = codec.encode_many(sent)
    sizes = codec.sizes_many(sent)
    assert sizes is not None and sizes.dtype == torch.int64 and sizes.shape == (m,)
    np.testing.assert_array_equal(sizes.numpy(), payloads.sizes, err_msg=name)
    decoded = codec.decode_many(payloads, d)
    received = codec.received_many(sent)
    assert torch.equal(received.view(torch.int32), decoded.view(torch.int32)), name


def test_a_codec_without_a_length_formula_writes_its_bytes():
    x = _messages(4, 100, seed=1)
    assert EntropyCodec(TopKCodec(q=0.1)).sizes_many(x) is None
    assert RunLengthCodec().sizes_many(x) is not None


def test_keyed_random_positions_are_distinct_uniform_and_the_streams_own():
    keys = torch.arange(2000, dtype=torch.int64) * 7_654_321
    idx = keyed_positions(keys, 10, 3)
    assert all(len(set(row)) == 3 for row in idx.tolist())
    counts = torch.bincount(idx.reshape(-1), minlength=10).double()
    assert (counts / counts.mean() - 1).abs().max() < 0.1  # 600 a position, expected
    # a stream's draw does not depend on the others drawn with it
    assert torch.equal(keyed_positions(keys[5:6], 10, 3).sort().values, idx[5:6].sort().values)
    codec = RandKCodec(q=0.3)
    x = _messages(6, 50, seed=3)
    alone = torch.stack([codec.compress(x[i], keys[i]) for i in range(6)])
    assert torch.equal(codec.compress_many(x, keys[:6]), alone)


def _engine(small_cfg, compressor: str, by_formula: bool):
    engine = build_engine(
        small_cfg(
            "algorithm=fedavg", f"compressor={compressor}", "participation=0.6", "num_clients=8"
        )
    )
    if by_formula:
        engine.transport.encode_on = ()  # count by the length formula, as off the CPU
    engine.setup()
    return engine


@pytest.mark.parametrize(
    "compressor", ["stc", "stc_twomean", "topk", "topk_zlib", "randk", "cer_runs", "cer_stc"]
)
def test_an_engine_counting_by_formula_counts_the_bytes_it_would_write(small_cfg, compressor):
    written = _engine(small_cfg, compressor, by_formula=False)
    counted = _engine(small_cfg, compressor, by_formula=True)
    for _ in range(3):
        a, b = written.run_round(), counted.run_round()
        assert {k: v for k, v in a.items() if k.startswith("bytes/")} == {
            k: v for k, v in b.items() if k.startswith("bytes/")
        }
    assert written.ledger.total == counted.ledger.total
    assert written.ledger.messages == counted.ledger.messages
    assert torch.equal(written.server["x"], counted.server["x"])
    for d in ("up", "down"):
        for store in ("residual", "replica", "reference"):
            one, other = getattr(written.transport, store)[d], getattr(counted.transport, store)[d]
            assert dict(one.items()).keys() == dict(other.items()).keys()
            assert all(torch.equal(other[k], v) for k, v in one.items())


@pytest.mark.slow  # (two runs each, as tests/test_round_census.py's)
@pytest.mark.parametrize("compressor", ["stc", "topk_zlib", "randk"])
def test_counting_by_formula_dispatches_as_many_ops_for_any_cohort(compressor, monkeypatch):
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from test_round_census import census

    monkeypatch.setattr(Transport, "encode_on", ())
    small, large = (
        census(f"compressor={compressor}", n, [f"compressor={compressor}"])[0] for n in (10, 40)
    )  # fmt: skip  (the training round's)
    assert large.total_ops == small.total_ops, large.summary()
    assert large.total_reads == small.total_reads, large.summary()


def _uploads(engine, m: int, seed: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(range(m)), 0.01 * torch.randn(m, engine.x0.numel(), generator=g)


@pytest.mark.parametrize("compressor", ["cer", "cer_runs", "cer_stc"])
@pytest.mark.parametrize("by_formula", [False, True])
def test_cer_uploads_in_one_pass_equal_message_by_message(small_cfg, compressor, by_formula):
    """CER's DP for a cohort at once, and its metrics summed as the per-message path sums them;
    error feedback over rounds (cer_stc). Without a dict for the metrics the cohort's pass
    declines (the caller would lose them)."""
    engines = [_engine(small_cfg, compressor, by_formula) for _ in range(2)]
    together, alone = engines
    for t in range(3):
        clients, ups = _uploads(together, 8, seed=t)
        sent = together.transport.send_cohort
        assert sent("up", clients, ups, together.round, together.ledger) is None
        sums: dict[str, float] = {}
        received = sent("up", clients, ups, together.round, together.ledger, sums)
        expect, expect_sums = [], {}
        for i, n in enumerate(clients):
            row, metrics = alone.transport.send("up", n, ups[i], alone.round, alone.ledger)
            expect.append(row)
            for k, v in metrics.items():
                expect_sums[k] = expect_sums.get(k, 0.0) + v
        assert torch.equal(received, torch.stack(expect))
        assert sums == expect_sums and set(sums) == {"cer/runs", "cer/sparsity"}
        assert together.ledger.round == alone.ledger.round
        assert together.ledger.messages == alone.ledger.messages
    for k, v in alone.transport.residual["up"].items():
        assert torch.equal(together.transport.residual["up"][k], v)


@pytest.mark.slow  # (two runs each, as tests/test_round_census.py's)
@pytest.mark.parametrize("compressor", ["cer_runs", "cer_stc"])
def test_cer_uploads_dispatch_as_many_ops_for_any_cohort(small_cfg, compressor):
    from fedexp.engine.round.census import Census

    engine = _engine(small_cfg, compressor, by_formula=False)
    counts = []
    for m in (3, 8, 3, 8):  # (the second pass of each size: its residuals exist)
        clients, ups = _uploads(engine, m, seed=m)
        with Census() as counted:
            engine.transport.send_cohort("up", clients, ups, engine.round, engine.ledger, {})
        counts.append((counted.total_ops, counted.total_reads))
    assert counts[2] == counts[3]
