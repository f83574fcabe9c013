"""Cohort (batched) codecs: compress_many / encode_many / decode_many equal the row loop.

Every message of a batched call must be the single-message result bit for bit (values) and
byte for byte (payloads), so each sender's bytes are still counted; malformed
payloads raise the single-message error, naming the message.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedexp.comm.cer import CERTransform
from fedexp.comm.channel import Channel
from fedexp.comm.codec import Codec
from fedexp.comm.codec import DenseCodec
from fedexp.comm.codec import Payloads
from fedexp.comm.entropy import EntropyCodec
from fedexp.comm.golomb import MAX_RICE_PARAMETER
from fedexp.comm.golomb import BitWriter
from fedexp.comm.golomb import best_rice_parameter
from fedexp.comm.golomb import positions_to_gaps
from fedexp.comm.golomb import rice_bits
from fedexp.comm.golomb_cohort import OUT_OF_RANGE
from fedexp.comm.golomb_cohort import best_rice_parameters
from fedexp.comm.golomb_cohort import positions_to_gaps_many
from fedexp.comm.golomb_cohort import read_rice_many
from fedexp.comm.golomb_cohort import rice_bits_many
from fedexp.comm.golomb_cohort import write_rice_many
from fedexp.comm.randk import RandKCodec
from fedexp.comm.runs import RunLengthCodec
from fedexp.comm.stc import STCCodec
from fedexp.comm.stc import TwoMeanSTCCodec
from fedexp.comm.stc import masked_row_means
from fedexp.comm.stc import row_means
from fedexp.comm.topk import TopKCodec


def _codecs() -> dict[str, Codec]:
    codecs: dict[str, Codec] = {"dense": DenseCodec()}
    for q in (0.01, 0.1, 0.5, 1.0):
        for adaptive in (False, True):
            codecs[f"topk_q{q}_a{int(adaptive)}"] = TopKCodec(q=q, adaptive_golomb=adaptive)
    for q in (0.01, 0.1, 1.0):
        for adaptive in (False, True):
            codecs[f"stc_q{q}_a{int(adaptive)}"] = STCCodec(q=q, adaptive_golomb=adaptive)
    codecs["twomean_q0.05"] = TwoMeanSTCCodec(q=0.05)
    codecs["twomean_q0.5_a1"] = TwoMeanSTCCodec(q=0.5, adaptive_golomb=True)
    codecs["twomean_q1"] = TwoMeanSTCCodec(q=1.0)
    # the row-by-row defaults: a randomised codec (generators), an entropy stage, run-length
    codecs["randk_q0.3"] = RandKCodec(q=0.3)
    codecs["randk_unbiased"] = RandKCodec(q=0.1, unbiased=True)
    codecs["zlib_topk"] = EntropyCodec(TopKCodec(q=0.1), method="zlib")
    codecs["runs"] = RunLengthCodec()
    return codecs


CODECS = _codecs()


def _gens(m: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(m)]


def _block(m: int, d: int, seed: int = 0) -> torch.Tensor:
    """Continuous random rows (no ties at the k-th magnitude), plus special rows when m > 2.

    Row 1 is all zeros; row 2 has exactly two non-zeros, so a codec keeping k > 2 entries
    keeps exact zeros (ties among zeros only: the kept values, and STC's mean of two
    magnitudes plus zeros, do not depend on which zeros are chosen).
    """
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(m, d, generator=g) * torch.rand(m, 1, generator=g).add(0.1)
    if m > 2:
        x[1] = 0.0
        x[2] = 0.0
        x[2, d // 3] = 1.7
        x[2, (2 * d) // 3] = -0.3
    if m > 4:
        x[3] = x[3].abs()  # all positive (two-mean STC: no negative mean)
        x[4] = -x[4].abs()  # all negative
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _loop_compress(codec: Codec, x: torch.Tensor, gens: list | None) -> torch.Tensor:
    rows = [codec.compress(r, None if gens is None else gens[i]) for i, r in enumerate(x)]
    return torch.stack(rows)


# --------------------------------------------------------------------------- the three steps


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("d", [1, 31, 1000])
def test_batched_equals_row_by_row(name: str, m: int, d: int) -> None:
    codec = CODECS[name]
    x = _block(m, d, seed=m * 10_000 + d)
    gens = _gens(m) if codec.randomised else None
    batched = codec.compress_many(x, _gens(m) if codec.randomised else None)
    looped = _loop_compress(codec, x, gens)
    assert batched.shape == (m, d) and batched.dtype == torch.float32
    assert torch.equal(_bits(batched), _bits(looped)), name

    payloads = codec.encode_many(batched)
    assert isinstance(payloads, Payloads) and len(payloads) == m
    singles = [codec.encode(r) for r in batched]
    assert [payloads[i] for i in range(m)] == singles
    assert list(payloads) == singles
    np.testing.assert_array_equal(payloads.sizes, [len(s) for s in singles])
    assert payloads.sizes.dtype == np.int64

    decoded = codec.decode_many(payloads, d)
    stacked = torch.stack([codec.decode(s, d) for s in singles])
    assert decoded.dtype == torch.float32 and decoded.device.type == "cpu"
    assert decoded.shape == (m, d)
    assert torch.equal(_bits(decoded), _bits(stacked))
    assert torch.equal(decoded, batched)  # round trip exact
    # decoding separately concatenated payloads (a read-only buffer) gives the same
    assert torch.equal(codec.decode_many(Payloads.of(singles), d), decoded)


@pytest.mark.parametrize("name", list(CODECS))
def test_empty_cohort_and_empty_messages(name: str) -> None:
    codec = CODECS[name]
    for m, d in [(0, 0), (0, 31), (3, 0)]:
        x = torch.zeros(m, d)
        c = codec.compress_many(x, _gens(m) if codec.randomised else None)
        assert c.shape == (m, d)
        p = codec.encode_many(c)
        assert len(p) == m and list(p) == [codec.encode(r) for r in c]
        back = codec.decode_many(p, d)
        assert back.shape == (m, d) and back.dtype == torch.float32


@pytest.mark.parametrize(
    "codec", [TopKCodec(q=0.5), STCCodec(q=0.5), TwoMeanSTCCodec(q=0.5)], ids=repr
)
def test_long_rows_reduce_like_one_vector(codec: Codec) -> None:
    # k = 35,000 kept entries: longer than ATen's reduction grain, where a 2-D mean(dim=1)
    # and a 1-D mean can sum in different orders on several threads
    x = _block(3, 70_000, seed=5)
    assert torch.equal(_bits(codec.compress_many(x)), _bits(_loop_compress(codec, x, None)))


def test_row_means_match_one_dimensional_means() -> None:
    g = torch.Generator().manual_seed(3)
    for c in [1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 1000, 4099, 40_000]:
        v = torch.rand(5, c, generator=g) * torch.rand(5, 1, generator=g) * 100
        expect = torch.stack([r.clone().mean() for r in v])
        assert torch.equal(_bits(row_means(v)), _bits(expect)), c
        mask = torch.rand(5, c, generator=g) > 0.4
        mask[0] = False
        got = masked_row_means(v, mask)
        for i in range(5):
            if mask[i].any():
                # a row's mean does not depend on the others: the row alone, as one vector
                alone = torch.where(mask[i], v[i], 0).clone().sum() / mask[i].sum()
                assert torch.equal(_bits(got[i]), _bits(alone)), (c, i)
                assert torch.equal(_bits(masked_row_means(v[i : i + 1], mask[i : i + 1])[0]),
                                   _bits(got[i])), (c, i)  # fmt: skip
                torch.testing.assert_close(got[i], v[i][mask[i]].mean(), rtol=1e-6, atol=0)
        assert got[0] == 0


def test_tied_rows_still_give_valid_top_k() -> None:
    # ties at the k-th magnitude: either choice is a valid top-k; here check validity only
    x = torch.tensor([[1.0, -1.0, 1.0, 0.5, -1.0, 0.25]] * 3)
    for codec in (TopKCodec(q=0.5), STCCodec(q=0.5), TwoMeanSTCCodec(q=0.5)):
        out = codec.compress_many(x)
        for row in out:
            kept = row != 0
            assert int(kept.sum()) == 3 and not kept[3] and not kept[5]
            np.testing.assert_array_equal(codec.decode(codec.encode(row), 6), row)


def test_subclass_overriding_compress_uses_its_own() -> None:
    # RandKCodec inherits TopKCodec's batched methods but has its own compress
    codec = RandKCodec(q=0.2)
    x = _block(4, 50)
    got = codec.compress_many(x, _gens(4, seed=9))
    assert torch.equal(got, _loop_compress(codec, x, _gens(4, seed=9)))
    assert not torch.equal(got, TopKCodec(q=0.2).compress_many(x))


def test_generators_must_match_rows() -> None:
    with pytest.raises(ValueError, match="generators"):
        TopKCodec(q=0.1).compress_many(torch.randn(3, 10), _gens(2))
    with pytest.raises(ValueError, match="generators"):
        RandKCodec(q=0.1).compress_many(torch.randn(3, 10), _gens(4))
    with pytest.raises(ValueError, match=r"\[m, d\]"):
        STCCodec(q=0.1).compress_many(torch.randn(10))
    with pytest.raises(ValueError, match=r"\[m, d\]"):
        DenseCodec().encode_many(torch.randn(10))


def test_encode_many_rejects_values_the_single_encoder_rejects() -> None:
    ok = STCCodec(q=0.5).compress_many(_block(3, 20))
    bad = ok.clone()
    bad[2, 0] = 0.123456
    bad[2, 1] = 0.5
    with pytest.raises(ValueError, match="message 2: STC can only encode ternary"):
        STCCodec(q=0.5).encode_many(bad)
    with pytest.raises(ValueError):
        STCCodec(q=0.5).encode(bad[2])
    two = TwoMeanSTCCodec(q=0.5)
    ok = two.compress_many(_block(3, 20))
    bad = ok.clone()
    bad[1, 0], bad[1, 1] = 0.25, 0.5
    with pytest.raises(ValueError, match="message 1: two-mean STC can only encode"):
        two.encode_many(bad)
    with pytest.raises(ValueError):
        two.encode(bad[1])


def test_dense_block_is_one_buffer() -> None:
    x = torch.tensor([[0.0, -0.0, float("inf"), float("nan")], [1.0, 2.0, -1e-45, 3.0]])
    p = DenseCodec().encode_many(x)
    assert p.buffer.size == 32 and p.sizes.tolist() == [16, 16]
    assert p[0] == DenseCodec().encode(x[0]) and p[1] == DenseCodec().encode(x[1])
    assert torch.equal(_bits(DenseCodec().decode_many(p, 4)), _bits(x))


# --------------------------------------------------------------------------- Payloads


def test_payloads_container() -> None:
    p = Payloads.of([b"ab", b"", b"cde"])
    assert len(p) == 3 and p.sizes.tolist() == [2, 0, 3] and p.offsets.dtype == np.int64
    assert p[0] == b"ab" and p[1] == b"" and p[2] == b"cde" and p[-1] == b"cde"
    assert list(p) == [b"ab", b"", b"cde"]
    with pytest.raises(IndexError):
        p[3]
    empty = Payloads.of([])
    assert len(empty) == 0 and empty.sizes.size == 0 and list(empty) == []
    # a view into a larger buffer
    q = Payloads(np.frombuffer(b"xxabcd", np.uint8), np.array([2, 4, 6]))
    assert list(q) == [b"ab", b"cd"]
    for buffer, offsets in [
        (np.zeros(4, np.uint8), np.array([0, 5])),
        (np.zeros(4, np.uint8), np.array([2, 1])),
        (np.zeros(4, np.uint8), np.array([], np.int64)),
        (np.zeros(4, np.float32), np.array([0, 4])),
    ]:
        with pytest.raises(ValueError):
            Payloads(buffer, offsets)


# --------------------------------------------------------------------------- Golomb kernels


def test_vectorised_rice_parameters_and_bits() -> None:
    rng = np.random.default_rng(0)
    messages = [
        np.zeros(0, np.int64),
        rng.geometric(0.01, 500) - 1,
        np.zeros(9, np.int64),
        rng.integers(0, 2**20, 40),
        np.array([2**40]),
        rng.geometric(0.3, 50) - 1,
        np.zeros(0, np.int64),
        np.array([3, 3, 3, 3]),  # equal costs for b = 0 and 1 ... smallest b wins
    ]
    gaps = np.concatenate(messages).astype(np.int64)
    offsets = np.cumsum([0] + [g.size for g in messages]).astype(np.int64)
    best = best_rice_parameters(gaps, offsets)
    assert best.tolist() == [best_rice_parameter(g) for g in messages]
    bs = np.array([0, 5, 1, 62, 3, 0, 7, 2], np.int64)
    assert rice_bits_many(gaps, offsets, bs).tolist() == [
        rice_bits(g, int(b)) for g, b in zip(messages, bs, strict=True)
    ]
    positions = [np.flatnonzero(rng.random(50) < 0.2) for _ in range(5)]
    flat = np.concatenate(positions).astype(np.int64)
    offs = np.cumsum([0] + [p.size for p in positions]).astype(np.int64)
    np.testing.assert_array_equal(
        positions_to_gaps_many(flat, offs),
        np.concatenate([positions_to_gaps(p) for p in positions]),
    )


def test_rice_kernels_match_the_bit_writer_at_any_bit_offset() -> None:
    rng = np.random.default_rng(1)
    messages, bs = [], []
    for b in [0, 1, 2, 3, 7, 8, 9, 31, 32, 33, 40, 61, MAX_RICE_PARAMETER]:
        hi = min(2**62, 2 ** (b + 6))
        gaps = rng.integers(0, hi, size=int(rng.integers(0, 30)), dtype=np.int64)
        edges = [0, 2**b - 1, 2**b, min((70 << b) - 1, 2**63 - 1)]
        messages.append(np.concatenate([gaps, np.array(edges, np.int64)]))
        bs.append(b)
    messages.append(np.array([2**63 - 1], np.int64))
    bs.append(MAX_RICE_PARAMETER)
    signs = [rng.integers(0, 2, g.size).astype(np.uint8) for g in messages]
    for with_signs in (False, True):
        for gap_bits in (0, 3):  # byte-aligned streams (as the codecs write), then not
            # expected stream of each message, written by BitWriter after `gap_bits` ones
            starts, expected, total = [], [], 0
            for g, s, b in zip(messages, signs, bs, strict=True):
                nbits = gap_bits + rice_bits(g, b) + (g.size if with_signs else 0)
                w = BitWriter(nbits)
                w.write_bits(np.ones(gap_bits))
                w.write_rice(g, b)
                if with_signs:
                    w.write_bits(s)
                starts.append(8 * total + gap_bits)
                expected.append(w.getvalue())
                total += len(expected[-1])
            buf = np.zeros(total, np.uint8)
            for start, e in zip(starts, expected, strict=True):  # the leading ones only
                head = (start & ~7) // 8
                buf[head] = e[0] & (0xFF << (8 - gap_bits)) & 0xFF if gap_bits else 0
            gaps = np.concatenate(messages)
            offsets = np.cumsum([0] + [g.size for g in messages]).astype(np.int64)
            write_rice_many(
                buf,
                np.array(starts),
                gaps,
                offsets,
                np.array(bs),
                np.concatenate(signs) if with_signs else None,
            )
            assert buf.tobytes() == b"".join(expected)
            ends = np.cumsum([8 * len(e) for e in expected])
            status = np.zeros(len(messages), np.int64)
            positions, negative, _ = read_rice_many(
                buf, np.array(starts), ends, offsets, np.array(bs), 2**63 - 1, status, with_signs
            )
            for i, g in enumerate(messages):
                expect = np.cumsum([int(v) + 1 for v in g], dtype=object) - 1
                fits = expect.size == 0 or expect[-1] < 2**63 - 1
                assert status[i] == (0 if fits else OUT_OF_RANGE), i
                if fits:
                    got = positions[offsets[i] : offsets[i + 1]]
                    np.testing.assert_array_equal(got, expect.astype(np.int64))
            if with_signs:
                np.testing.assert_array_equal(negative, np.concatenate(signs))


# --------------------------------------------------------------------------- malformed input


def _corruptions(codec: Codec, numel: int) -> dict[str, tuple[bytes, int]]:
    """Malformed payloads (and the numel to decode them with) for one codec."""
    row = torch.zeros(numel)
    row[[3, 10, numel - 1]] = torch.tensor([1.5, -2.0, 0.75])
    good = codec.encode(codec.compress(row))
    head = {TopKCodec: 5, STCCodec: 9, TwoMeanSTCCodec: 13}[type(codec)]
    out = {
        "short header": (good[: head - 1], numel),
        "too many non-zeros": (good, 2),
        "out of range": (good, numel - 1),
        "rice parameter": (good[: head - 1] + bytes([63]) + good[head:], numel),
        "trailing byte": (good[:head] + good[head:] + b"\x00", numel),
    }
    n = int.from_bytes(good[:4], "little")
    if isinstance(codec, TopKCodec):
        out["too short for values"] = (good[: head + 4 * n - 1], numel)
        stream = good[head : len(good) - 4 * n]
        values = good[len(good) - 4 * n :]
        out["rice overrun"] = (good[:head] + stream[:-1] + values, numel)
        out["padding bit"] = (good[:head] + stream[:-1] + bytes([stream[-1] | 1]) + values, numel)
    else:
        out["overrun"] = (good[:-1], numel)
        out["padding bit"] = (good[:-1] + bytes([good[-1] | 1]), numel)
        # one more announced non-zero: the sign bits no longer fit
        more = (n + 1).to_bytes(4, "little") + good[4:]
        out["sign overrun"] = (more, numel)
    return out


@pytest.mark.parametrize(
    "codec", [TopKCodec(q=0.05), STCCodec(q=0.05), TwoMeanSTCCodec(q=0.05)], ids=repr
)
def test_malformed_payloads_raise_the_single_message_error_naming_the_message(
    codec: Codec,
) -> None:
    numel = 60
    x = _block(3, numel, seed=2)
    singles = [codec.encode(r) for r in codec.compress_many(x)]

    def empty(n: int) -> bytes:
        return codec.encode(torch.zeros(n))

    for what, (bad, n_decode) in _corruptions(codec, numel).items():
        with pytest.raises(ValueError) as single:
            codec.decode(bad, n_decode)
        for at in (0, 2):
            # the other messages are valid for the numel decoded with
            payloads = list(singles) if n_decode == numel else [empty(n_decode)] * 3
            payloads[at] = bad
            with pytest.raises(ValueError) as batched:
                codec.decode_many(Payloads.of(payloads), n_decode)
            assert str(batched.value) == f"message {at}: {single.value}", what


def test_the_first_malformed_message_is_reported() -> None:
    codec = STCCodec(q=0.1)
    p = [codec.encode(r) for r in codec.compress_many(_block(4, 40))]
    bad = list(p)
    bad[2] = p[2][:-1]  # overrun: found by the bit kernel
    bad[3] = p[3][:5]  # short header: found before the kernel runs
    with pytest.raises(ValueError, match="^message 2: bit stream too short"):
        codec.decode_many(Payloads.of(bad), 40)


def test_dense_sizes_are_checked_per_message() -> None:
    p = Payloads.of([b"\x00" * 8, b"\x00" * 8, b"\x00" * 4])
    with pytest.raises(ValueError, match="^message 2: dense payload has 4 bytes, expected 8$"):
        DenseCodec().decode_many(p, 2)


# --------------------------------------------------------------------------- channel


@pytest.mark.parametrize(
    "codec",
    [STCCodec(q=0.1), TopKCodec(q=0.05, adaptive_golomb=True), DenseCodec(), RandKCodec(q=0.3)],
    ids=repr,
)
@pytest.mark.parametrize("error_feedback", [True, False])
def test_send_many_equals_send_per_row_over_rounds(codec: Codec, error_feedback: bool) -> None:
    channel = Channel(codec=codec, error_feedback=error_feedback)
    m, d = 6, 200
    residuals = None
    row_residuals: list[torch.Tensor | None] = [None] * m
    for rnd in range(3):
        x = _block(m, d, seed=100 + rnd)
        gens = _gens(m, seed=10 * rnd) if codec.randomised else None
        payloads, residuals = channel.send_many(x, residuals, gens)
        for i in range(m):
            gen = _gens(m, seed=10 * rnd)[i] if codec.randomised else None
            payload, row_residuals[i], _ = channel.send(x[i], row_residuals[i], gen)
            assert payloads[i] == payload, (rnd, i)
        if error_feedback:
            assert torch.equal(residuals, torch.stack(row_residuals)), rnd
        else:
            assert residuals is None and all(r is None for r in row_residuals)
        received = channel.receive_many(payloads, d, "cpu")
        expect = torch.stack([channel.receive(payloads[i], d, "cpu") for i in range(m)])
        assert torch.equal(received, expect)


@pytest.mark.parametrize("error_feedback", [True, False])
def test_send_many_with_transforms_equals_send_per_row(error_feedback: bool) -> None:
    """A transform without a batched form runs row by row; CER's batched form is its own."""

    def double(x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, dict[str, float]]:
        return 2 * x, {"twice": float(x.abs().sum())}

    cer = CERTransform(gamma=0.3, eta=0.1, scope="per_tensor", layout=[30, 0, 70, 100])
    channel = Channel(STCCodec(q=0.1), transforms=[double, cer], error_feedback=error_feedback)
    m, d = 5, 200
    x = _block(m, d, seed=7)
    residuals = _block(m, d, seed=8) if error_feedback else None
    sent, new, metrics = channel.compress_many(x, residuals, None, scale=0.5)
    payloads, again = channel.send_many(x, residuals, None, scale=0.5)
    assert set(metrics) == {"twice", "cer/runs", "cer/sparsity"}
    for i in range(m):
        payload, res, row_metrics = channel.send(
            x[i], None if residuals is None else residuals[i], None, 0.5
        )
        assert payloads[i] == payload == channel.codec.encode(sent[i]), i
        assert row_metrics == {k: float(v[i]) for k, v in metrics.items()}, i
        if error_feedback:
            assert torch.equal(new[i], res) and torch.equal(again[i], res)
        else:
            assert res is None and new is None and again is None
