"""Codecs: exact byte round trips, STC's bit count, error feedback, Golomb coding, configs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fedexp.comm.channel import Channel
from fedexp.comm.codec import Codec
from fedexp.comm.codec import DenseCodec
from fedexp.comm.entropy import EntropyCodec
from fedexp.comm.entropy import zstd_available
from fedexp.comm.golomb import BitReader
from fedexp.comm.golomb import BitWriter
from fedexp.comm.golomb import best_rice_parameter
from fedexp.comm.golomb import decode_gaps
from fedexp.comm.golomb import encode_gaps
from fedexp.comm.golomb import expected_position_bits
from fedexp.comm.golomb import gaps_to_positions
from fedexp.comm.golomb import golomb_parameter
from fedexp.comm.golomb import positions_to_gaps
from fedexp.comm.golomb import rice_bits
from fedexp.comm.randk import RandKCodec
from fedexp.comm.runs import RunLengthCodec
from fedexp.comm.runs import count_runs
from fedexp.comm.runs import find_runs
from fedexp.comm.stc import STCCodec
from fedexp.comm.stc import TwoMeanSTCCodec
from fedexp.comm.topk import TopKCodec
from fedexp.comm.topk import keep_count
from fedexp.config.instantiate import instantiate_checked

CONF = Path(__file__).resolve().parents[2] / "conf" / "compressor"


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs() -> dict[str, torch.Tensor]:
    g = _gen(1)
    normal = torch.randn(1000, generator=g)
    with_zeros = normal.clone()
    with_zeros[::3] = 0.0
    piecewise = torch.repeat_interleave(
        torch.randn(7, generator=g), torch.tensor([1, 5, 200, 3, 1, 90, 700])
    )
    return {
        "normal": normal,
        "zeros": torch.zeros(257),
        "d1_pos": torch.tensor([2.5]),
        "d1_neg": torch.tensor([-0.75]),
        "d1_zero": torch.zeros(1),
        "all_negative": -torch.rand(300, generator=g) - 0.1,
        "all_positive": torch.rand(300, generator=g) + 0.1,
        "constant": torch.full((64,), 3.0),
        "with_zeros": with_zeros,
        "piecewise": piecewise,
        "large": torch.randn(100_003, generator=g) * 1e-3,
        "tiny_values": torch.randn(500, generator=g) * 1e-38,
    }


def _codecs() -> dict[str, Codec]:
    return {
        "dense": DenseCodec(),
        "stc_q0.01": STCCodec(q=0.01),
        "stc_q1": STCCodec(q=1.0),
        "stc_tiny": STCCodec(q=1e-9),
        "stc_q0.3_adaptive": STCCodec(q=0.3, adaptive_golomb=True),
        "twomean_q0.05": TwoMeanSTCCodec(q=0.05),
        "twomean_q1": TwoMeanSTCCodec(q=1.0),
        "topk_q0.01": TopKCodec(q=0.01),
        "topk_q1": TopKCodec(q=1.0),
        "topk_tiny": TopKCodec(q=1e-9, adaptive_golomb=True),
        "randk_q0.5": RandKCodec(q=0.5),
        "randk_unbiased": RandKCodec(q=0.1, unbiased=True),
        "randk_q1": RandKCodec(q=1.0),
        "runs": RunLengthCodec(),
        "zlib_dense": EntropyCodec(DenseCodec(), method="zlib"),
        "lzma_runs": EntropyCodec(RunLengthCodec(), method="lzma"),
        "zlib_topk": EntropyCodec(TopKCodec(q=0.05), method="zlib", level=9),
        "zlib_stc": EntropyCodec(STCCodec(q=0.02), method="zlib"),
    }


# --------------------------------------------------------------------------- Golomb / bits


@pytest.mark.parametrize("b", [0, 1, 2, 5, 9, 20])
def test_golomb_round_trips_arbitrary_gaps(b: int) -> None:
    rng = np.random.default_rng(b)
    cases = [
        np.zeros(0, np.int64),
        np.zeros(17, np.int64),
        rng.geometric(0.01, size=3000) - 1,
        rng.integers(0, 2**12, size=500),
        np.array([0, 2 ** (b + 14), 1, 2**b, 2**b - 1, 2**b + 1, 5]),
    ]
    for gaps in cases:
        gaps = np.asarray(gaps, np.int64)
        data = encode_gaps(gaps, b)
        assert len(data) == math.ceil(rice_bits(gaps, b) / 8)
        np.testing.assert_array_equal(decode_gaps(data, gaps.size, b), gaps)


def test_positions_gaps_inverse_and_rice_layout() -> None:
    pos = np.array([0, 1, 5, 6, 100], np.int64)
    gaps = positions_to_gaps(pos)
    np.testing.assert_array_equal(gaps, [0, 0, 3, 0, 93])
    np.testing.assert_array_equal(gaps_to_positions(gaps), pos)
    with pytest.raises(ValueError):
        positions_to_gaps(np.array([3, 3]))
    # gap 5 with b = 1: quotient 2 -> "110", remainder 1 -> "1": 1101 then zero padding
    assert encode_gaps(np.array([5]), 1) == bytes([0b11010000])


def test_bit_writer_reader_mixed_fields() -> None:
    w = BitWriter(3 + 5 + rice_bits(np.array([7, 0, 12]), 2) + 11)
    w.write_uint(5, 3)
    w.write_bits(np.array([1, 0, 1, 1, 0]))
    w.write_rice(np.array([7, 0, 12]), 2)
    w.write_uint(1234, 11)
    with pytest.raises(ValueError):
        w.write_bits(np.ones(1))
    r = BitReader(w.getvalue(), w.bitpos)
    assert r.read_uint(3) == 5
    np.testing.assert_array_equal(r.read_bits(5), [1, 0, 1, 1, 0])
    np.testing.assert_array_equal(r.read_rice(3, 2), [7, 0, 12])
    assert r.read_uint(11) == 1234
    assert r.remaining() == 0
    with pytest.raises(ValueError):
        r.read_rice(1, 0)


def test_truncated_rice_stream_is_an_error() -> None:
    data = encode_gaps(np.array([100, 3, 50]), 2)
    with pytest.raises(ValueError):
        decode_gaps(data[:-1], 3, 2)
    with pytest.raises(ValueError):
        decode_gaps(data + b"\x00", 3, 2)


def test_golomb_parameter_formula() -> None:
    phi = (1 + 5**0.5) / 2
    for q in [1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.2]:
        expected = 1 + math.floor(math.log2(math.log(phi - 1) / math.log(1 - q)))
        assert golomb_parameter(q) == max(expected, 0)
    assert golomb_parameter(0.5) == 0 and golomb_parameter(1.0) == 0
    # b*(q) is the best power-of-two parameter for geometric gaps of density q
    rng = np.random.default_rng(0)
    for q in [0.001, 0.01, 0.1]:
        gaps = rng.geometric(q, size=200_000) - 1
        assert abs(best_rice_parameter(gaps) - golomb_parameter(q)) <= 1
        assert rice_bits(gaps, golomb_parameter(q)) / gaps.size == pytest.approx(
            expected_position_bits(q), rel=0.02
        )


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec_name", list(_codecs()))
def test_decode_encode_compress_is_exact(codec_name: str) -> None:
    codec = _codecs()[codec_name]
    for name, x in _inputs().items():
        x_hat = codec.compress(x, _gen(7))
        assert x_hat.dtype == torch.float32 and x_hat.shape == (x.numel(),)
        payload = codec.encode(x_hat)
        assert isinstance(payload, bytes)
        back = codec.decode(payload, x.numel())
        assert back.dtype == torch.float32 and back.device.type == "cpu"
        assert torch.equal(back, x_hat), (codec_name, name)
        if codec.lossless:
            assert torch.equal(back, x), (codec_name, name)


@pytest.mark.parametrize("codec", [DenseCodec(), RunLengthCodec(), EntropyCodec(DenseCodec())])
def test_lossless_codecs_keep_every_bit(codec: Codec) -> None:
    x = torch.tensor([0.0, -0.0, -0.0, 1.0, float("inf"), float("nan"), float("nan"), -1e-45, 3.0])
    back = codec.decode(codec.encode(codec.compress(x)), x.numel())
    assert torch.equal(back.view(torch.int32), x.view(torch.int32))


def test_empty_vectors() -> None:
    x = torch.zeros(0)
    for codec in _codecs().values():
        back = codec.decode(codec.encode(codec.compress(x, _gen())), 0)
        assert back.numel() == 0


def test_compress_properties() -> None:
    x = torch.randn(10_000, generator=_gen(3))
    k = keep_count(0.01, x.numel())
    assert k == 100 and keep_count(0.07, 100) == 7 and keep_count(1e-9, 10) == 1
    assert keep_count(1.0, 10**10) == 10**10 and keep_count(0.3, 10**10 + 1) == 3 * 10**9 + 1
    t = STCCodec(q=0.01).compress(x)
    nz = t != 0
    assert int(nz.sum()) == k
    top = torch.topk(x.abs(), k).values
    assert torch.allclose(t[nz].abs(), top.mean().expand(k))
    assert torch.equal(torch.sign(t[nz]), torch.sign(x[nz]))
    assert x.abs()[nz].min() >= x.abs()[~nz].max()
    tk = TopKCodec(q=0.01).compress(x)
    assert torch.equal(tk[nz], x[nz]) and not tk[~nz].any()
    tm = TwoMeanSTCCodec(q=0.01).compress(x)
    pos, neg = nz & (x > 0), nz & (x < 0)
    assert torch.allclose(tm[pos], x[pos].mean().expand(int(pos.sum())))
    assert torch.allclose(tm[neg], x[neg].mean().expand(int(neg.sum())))


def test_randk_uses_the_generator_and_is_unbiased_when_asked() -> None:
    x = torch.randn(40, generator=_gen(5))
    codec = RandKCodec(q=0.25, unbiased=True)
    a, b = codec.compress(x, _gen(11)), codec.compress(x, _gen(11))
    assert torch.equal(a, b)
    assert int((a != 0).sum()) == 10
    assert torch.allclose(a[a != 0], x[a != 0] * 4.0)
    g = _gen(12)
    mean = torch.stack([codec.compress(x, g) for _ in range(4000)]).mean(0)
    assert (mean - x).abs().max() < 0.35 * x.abs().max()
    biased = RandKCodec(q=0.25).compress(x, _gen(11))
    assert torch.equal(biased[a != 0], x[a != 0])


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("q", [1e-4, 0.001, 0.01, 0.1, 0.4, 1.0])
@pytest.mark.parametrize("cls", [STCCodec, TwoMeanSTCCodec])
def test_stc_size_matches_bit_count_formula(q: float, cls: type[STCCodec]) -> None:
    for seed, d in [(0, 1), (1, 1000), (2, 50_001)]:
        x = torch.randn(d, generator=_gen(seed))
        codec = cls(q=q)
        t = codec.compress(x)
        payload = codec.encode(t)
        positions = torch.nonzero(t).reshape(-1).numpy()
        bits = STCCodec.payload_bits(positions, golomb_parameter(q))
        assert len(payload) == math.ceil(bits / 8) + cls.HEADER_BYTES
        assert len(payload) == cls.payload_bytes(positions, golomb_parameter(q))
    assert STCCodec.HEADER_BYTES == 9 and TwoMeanSTCCodec.HEADER_BYTES == 13


def test_stc_size_close_to_paper_estimate_for_random_positions() -> None:
    d, q = 200_000, 0.01
    x = torch.randn(d, generator=_gen(4))
    payload = STCCodec(q=q).encode(STCCodec(q=q).compress(x))
    estimate_bytes = STCCodec.expected_bits(d, q) / 8
    assert len(payload) == pytest.approx(estimate_bytes, rel=0.02)
    assert len(payload) < 4 * d / 30  # far below dense float32


def test_topk_and_randk_sizes() -> None:
    d = 10_000
    x = torch.randn(d, generator=_gen(6))
    for codec in [TopKCodec(q=0.01), RandKCodec(q=0.01)]:
        t = codec.compress(x, _gen(0))
        positions = torch.nonzero(t).reshape(-1).numpy()
        bits = rice_bits(positions_to_gaps(positions), golomb_parameter(0.01))
        assert len(codec.encode(t)) == 5 + math.ceil(bits / 8) + 4 * positions.size


def test_runlength_sizes_and_fallback() -> None:
    x = _inputs()["piecewise"]
    payload = RunLengthCodec().encode(x)
    _, lengths = find_runs(x.numpy())
    assert lengths.size == count_runs(x) == 7
    assert len(payload) == RunLengthCodec.runs_bytes(lengths) < 60
    noise = torch.randn(1000, generator=_gen(8))
    assert len(RunLengthCodec().encode(noise)) == 4 * 1000 + 1


def test_entropy_stage_sizes() -> None:
    x = _inputs()["piecewise"]
    assert len(EntropyCodec(DenseCodec()).encode(x)) < 4 * x.numel() / 10
    noise = torch.randn(1000, generator=_gen(9))
    assert len(EntropyCodec(DenseCodec(), method="lzma").encode(noise)) <= 4 * 1000 + 1
    with pytest.raises(ValueError):
        EntropyCodec(method="gzip")


@pytest.mark.skipif(not zstd_available(), reason="zstandard not installed")
def test_entropy_zstd_round_trip() -> None:
    codec = EntropyCodec(TopKCodec(q=0.1), method="zstd")
    x = _inputs()["large"]
    t = codec.compress(x)
    assert torch.equal(codec.decode(codec.encode(t), x.numel()), t)


def test_malformed_payloads_raise() -> None:
    x = torch.randn(500, generator=_gen(10))
    for codec in [STCCodec(0.05), TwoMeanSTCCodec(0.05), TopKCodec(0.05), RunLengthCodec()]:
        payload = codec.encode(codec.compress(x))
        for bad in [payload[:3], payload[:-1], payload + b"\x01"]:
            with pytest.raises(ValueError):
                codec.decode(bad, x.numel())
        with pytest.raises(ValueError):
            codec.decode(payload, 10)  # positions beyond numel
    with pytest.raises(ValueError):
        STCCodec(0.1).encode(torch.tensor([1.0, 2.0]))  # not ternary
    with pytest.raises(ValueError):
        STCCodec(q=0.0)


# --------------------------------------------------------------------------- error feedback


@pytest.mark.parametrize("codec", [STCCodec(q=0.05), TopKCodec(q=0.02)])
def test_error_feedback_conserves_the_sum(codec: Codec) -> None:
    channel = Channel(codec=codec, error_feedback=True)
    g = _gen(13)
    d = 2000
    residual = None
    total_sent = torch.zeros(d, dtype=torch.float64)
    total_updates = torch.zeros(d, dtype=torch.float64)
    for _ in range(12):
        update = torch.randn(d, generator=g) * torch.rand(1, generator=g)
        payload, residual, _ = channel.send(update, residual, g)
        sent = channel.receive(payload, d, "cpu")
        total_sent += sent.double()
        total_updates += update.double()
        assert residual is not None
    torch.testing.assert_close(total_sent + residual.double(), total_updates, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- configs


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_compressor_configs_build_and_round_trip(path: Path) -> None:
    cfg = OmegaConf.load(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith(f"# conf/compressor/{path.name}") and "fedexp run" in first
    d = 3000
    x = torch.randn(d, generator=_gen(14)) * 1e-2
    for direction in ("uplink", "downlink"):
        node = cfg[direction]
        channel = Channel(
            codec=instantiate_checked(node.codec, f"compressor.{direction}.codec"),
            transforms=[
                instantiate_checked(t, f"compressor.{direction}.transforms[{i}]")
                for i, t in enumerate(node.transforms)
            ],
            error_feedback=bool(node.error_feedback),
        )
        payload, residual, metrics = channel.send(x, None, _gen(15))
        back = channel.receive(payload, d, "cpu")
        assert (residual is not None) == channel.error_feedback
        assert len(payload) <= 4 * d + 1
        if channel.error_feedback:
            assert torch.allclose(
                back + residual, channel.transforms[0](x)[0] if channel.transforms else x
            )
        if channel.codec.lossless and not channel.transforms:
            assert torch.equal(back, x)
        if channel.transforms:
            assert {"cer/runs", "cer/sparsity"} <= set(metrics)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_codecs_accept_device_tensors() -> None:
    x = torch.randn(5000, generator=_gen(16)).cuda()
    for name, codec in _codecs().items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        x_hat = codec.compress(x, gen)
        assert x_hat.device == x.device, name
        back = codec.decode(codec.encode(x_hat), x.numel())
        assert back.device.type == "cpu" and torch.equal(back, x_hat.cpu()), name
