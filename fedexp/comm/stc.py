"""Sparse ternary compression (STC) with a real Golomb-coded bit stream.

Sattler, Wiedemann, Müller & Samek (2019), "Robust and communication-efficient federated
learning from non-i.i.d. data", IEEE TNNLS 31(9), Algorithm 1 and Sec. IV-C.

Given the message ``A`` (update plus error-feedback residual, see ``fedexp.comm.channel``),
keep the ``k = ceil(q d)`` entries of largest ``|A_i|``, let ``mu`` be the mean of those
magnitudes and send ``T = mu * sign(A)`` on them, 0 elsewhere.

Wire format of :class:`STCCodec` (little-endian)::

    uint32  n       number of non-zeros of T (= k unless kept entries are exactly 0)
    float32 mu      the common magnitude
    uint8   b       Rice parameter of the gaps (M = 2**b), b*(q) by default
    bits            n Rice-coded gaps between non-zero positions (fedexp.comm.golomb),
                    then n sign bits (1 = negative), zero-padded to a whole byte

so ``len(payload) == 9 + ceil(STCCodec.payload_bits(positions, b) / 8)`` exactly.

:class:`TwoMeanSTCCodec` is the variant of the pFedNet authors' code: positive and negative
kept entries get their own mean (``mu+`` and ``mu-``), used without error feedback. Its header
holds both means (13 bytes); the bit stream is the same.

Cohorts (``compress_many`` / ``encode_many`` / ``decode_many``): one ``torch.topk`` over the
stacked messages, ``mu`` of every row as one tensor reduction, then all payloads written and
read in one pass (numpy plus one numba kernel for the gaps and sign bits of every message);
each payload is byte for byte the single-message one, so every sender's bytes are counted.
``sizes_many`` gives the payloads' lengths from the formula above on the messages' device,
without writing them.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedexp.comm.codec import Codec
from fedexp.comm.codec import Payloads
from fedexp.comm.codec import Streams
from fedexp.comm.codec import as_rows
from fedexp.comm.codec import check_generators
from fedexp.comm.codec import overrides
from fedexp.comm.golomb import BitReader
from fedexp.comm.golomb import BitWriter
from fedexp.comm.golomb import check_padding
from fedexp.comm.golomb import expected_position_bits
from fedexp.comm.golomb import gaps_to_positions
from fedexp.comm.golomb import positions_to_gaps
from fedexp.comm.golomb import rice_bits
from fedexp.comm.golomb_cohort import positions_to_gaps_many
from fedexp.comm.topk import check_fraction
from fedexp.comm.topk import flat_cpu_float32
from fedexp.comm.topk import keep_count
from fedexp.comm.topk import pack_sparse_many
from fedexp.comm.topk import read_sparse_many
from fedexp.comm.topk import rice_parameter_for
from fedexp.comm.topk import rice_parameters_for_many
from fedexp.comm.topk import sparse_bits_rows
from fedexp.comm.topk import sparse_rows
from fedexp.config.ranges import PositiveFraction

#: ATen's ``internal::GRAIN_SIZE``: a CPU reduction over at least this many elements may be
#: split across threads, so a 1-D ``mean`` and a row of a 2-D ``mean(dim=1)`` can then sum in
#: different orders. Rows this long are reduced one by one (as ``compress`` does).
_GRAIN_SIZE = 32768

#: The headers as packed numpy records (``STCCodec.HEADER``, ``TwoMeanSTCCodec.HEADER``).
_STC_HEADER_DTYPE = np.dtype([("n", "<u4"), ("mu", "<f4"), ("b", "u1")])
_TWO_MEAN_HEADER_DTYPE = np.dtype([("n", "<u4"), ("mu_pos", "<f4"), ("mu_neg", "<f4"), ("b", "u1")])


def _top_k(a: torch.Tensor, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the ``ceil(q d)`` largest ``|a_i|`` and the values there."""
    k = keep_count(q, a.numel())
    idx = torch.topk(a.abs(), k, sorted=False).indices
    return idx, a[idx]


def _write_positions_and_signs(
    positions: np.ndarray, negative: np.ndarray, q: float, adaptive: bool
) -> tuple[int, bytes]:
    """Rice parameter and bit stream (gaps, then sign bits) of the non-zeros."""
    gaps = positions_to_gaps(positions)
    b = rice_parameter_for(gaps, q, adaptive)
    writer = BitWriter(rice_bits(gaps, b) + positions.size)
    writer.write_rice(gaps, b)
    writer.write_bits(negative)
    return b, writer.getvalue()


def _read_positions_and_signs(
    stream: bytes, n: int, b: int, numel: int
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`_write_positions_and_signs`: positions and negative flags."""
    if n > numel:
        raise ValueError(f"STC payload announces {n} non-zeros for {numel} entries")
    reader = BitReader(stream)
    positions = gaps_to_positions(reader.read_rice(n, b))
    negative = reader.read_bits(n).astype(bool)
    check_padding(reader)
    if n and positions[-1] >= numel:
        raise ValueError(f"position {positions[-1]} out of range for {numel} entries")
    return positions, negative


def _top_k_rows(a: torch.Tensor, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_top_k` of every row of ``a`` ``[m, d]``: indices ``[m, k]`` and the values."""
    k = keep_count(q, a.shape[1])
    idx = torch.topk(a.abs(), k, dim=1, sorted=False).indices
    return idx, a.gather(1, idx)


def _row_reduce(v: torch.Tensor, how: str) -> torch.Tensor:
    """``v[i].sum()`` or ``v[i].mean()`` of every row of ``v`` ``[r, c]``, bit for bit.

    ``sum(dim=1)`` / ``mean(dim=1)`` reduce each row with the same kernel, in the same order,
    as that row on its own (CPU, ``c`` below ATen's grain size; checked by the tests); longer
    rows, where a 1-D reduction may be split across threads, are reduced row by row on the
    CPU (their length dwarfs the per-row call). On other devices the reduction order of the
    two forms is not guaranteed to agree, so a result may differ in its last bit from the
    single-message one.
    """
    if v.shape[1] >= _GRAIN_SIZE and v.device.type == "cpu":
        return torch.stack([getattr(row, how)() for row in v.contiguous()])
    return getattr(v, how)(dim=1)


def row_means(v: torch.Tensor) -> torch.Tensor:
    """``v[i].mean()`` of every row of ``v`` ``[r, c]``, bit for bit (:func:`_row_reduce`)."""
    return _row_reduce(v, "mean")


def masked_row_means(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of the masked entries of every row of ``v`` ``[r, c]`` (0 for rows with none).

    Their sum (the row with its other entries as 0, reduced by :func:`_row_reduce`) over their
    count: a fixed number of ops for any ``r``, and a row's mean does not depend on the
    other rows (the single-message ``compress`` takes it of a ``[1, c]`` block).
    """
    counts = mask.sum(dim=1)
    sums = _row_reduce(torch.where(mask, v, 0), "sum")
    return torch.where(counts > 0, sums / counts.clamp(min=1), 0)


class STCCodec(Codec):
    """Sparse ternary compression (Sattler et al. 2019) with Golomb-coded positions.

    Args:
        q: sparsity rate, the fraction of entries kept, in (0, 1].
        adaptive_golomb: choose the Rice parameter minimising each message's size (it is in
            the header anyway) instead of the paper's ``b*(q)``.
    """

    #: Bytes before the bit stream: uint32 n, float32 mu, uint8 b.
    HEADER = struct.Struct("<IfB")
    HEADER_BYTES = HEADER.size

    def __init__(self, q: PositiveFraction = 0.01, adaptive_golomb: bool = False) -> None:
        self.q = check_fraction(q)
        self.adaptive_golomb = bool(adaptive_golomb)

    @staticmethod
    def payload_bits(positions: np.ndarray, b: int) -> int:
        """Bits of the stream after the header: Rice-coded gaps plus one sign bit each.

        ``sum_j (floor(gap_j / 2**b) + 1 + b) + n`` for the ``n`` non-zero positions.
        """
        positions = np.asarray(positions, dtype=np.int64)
        return rice_bits(positions_to_gaps(positions), b) + int(positions.size)

    @staticmethod
    def payload_bytes(positions: np.ndarray, b: int) -> int:
        """Exact ``len(encode(...))``: header plus the bit stream rounded up to bytes."""
        return STCCodec.HEADER_BYTES + math.ceil(STCCodec.payload_bits(positions, b) / 8)

    @staticmethod
    def expected_bits(numel: int, q: float) -> float:
        """Sattler et al.'s estimate for uniform positions: ``k (b_pos + 1) + 32``.

        ``b_pos = b* + 1 / (1 - (1 - q)**(2**b*))`` bits per position (Eq. (18)), one sign bit
        per entry and 32 bits for ``mu`` (our header also carries n and b: 40 more bits).
        """
        k = keep_count(q, numel)
        return k * (expected_position_bits(q) + 1.0) + 32.0

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``mu * sign(x)`` on the ``k`` largest ``|x_i|``, 0 elsewhere (float32, x's device)."""
        a = x.detach().reshape(-1).to(torch.float32)
        out = torch.zeros_like(a)
        if a.numel() == 0:
            return out
        idx, kept = _top_k(a, self.q)
        mu = kept.abs().mean()
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        out[idx] = torch.where(kept > 0, mu, torch.where(kept < 0, -mu, zero))
        return out

    def encode(self, x: torch.Tensor) -> bytes:
        """Header, then Rice-coded gaps and sign bits; ``x`` must be ternary (0, +-mu)."""
        v = flat_cpu_float32(x)
        positions = np.flatnonzero(v)
        values = v[positions]
        mu = np.float32(abs(values[0])) if positions.size else np.float32(0.0)
        if not np.all(np.abs(values) == mu):
            raise ValueError("STC can only encode ternary vectors (0 and +-mu)")
        if positions.size >= 2**32:
            raise ValueError("too many non-zeros for a uint32 count")
        b, stream = _write_positions_and_signs(positions, values < 0, self.q, self.adaptive_golomb)
        return self.HEADER.pack(positions.size, mu, b) + stream

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Rebuild the ternary float32 vector."""
        if len(payload) < self.HEADER_BYTES:
            raise ValueError("STC payload shorter than its header")
        n, mu, b = self.HEADER.unpack_from(payload)
        positions, negative = _read_positions_and_signs(payload[self.HEADER_BYTES :], n, b, numel)
        out = np.zeros(numel, dtype=np.float32)
        mu = np.float32(mu)
        out[positions] = np.where(negative, -mu, mu)
        return torch.from_numpy(out)

    def compress_many(self, x: torch.Tensor, generators: Streams | None = None) -> torch.Tensor:
        """``compress`` of every row: one ``torch.topk(|x|, k, dim=1)``, ``mu`` per row.

        ``mu_i`` is the mean of row ``i``'s kept magnitudes taken over the same values in
        the same order as ``compress`` (the row's ``topk`` indices), by :func:`row_means`;
        so row ``i`` equals ``compress(x[i])`` bit for bit on the CPU whenever the row has no
        tie at the ``k``-th magnitude (with a tie, both are valid STC messages: Sattler et
        al. 2019, Algorithm 1).

        Args:
            x: ``[m, d]`` stacked messages.
            generators: unused (checked for length); STC is deterministic.
        """
        if overrides(self, STCCodec, "compress"):
            return super().compress_many(x, generators)
        a = as_rows(x)
        check_generators(generators, a.shape[0])
        out = torch.zeros_like(a)
        if a.numel() == 0:
            return out
        idx, kept = _top_k_rows(a, self.q)
        mu = row_means(kept.abs())[:, None]
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        return out.scatter_(1, idx, torch.where(kept > 0, mu, torch.where(kept < 0, -mu, zero)))

    def encode_many(self, x_hat: torch.Tensor) -> Payloads:
        """Every row's payload, byte for byte ``encode(row)``, in one vectorised pass.

        Raises:
            ValueError: naming the first row that is not ternary (0 and +-mu).
        """
        if overrides(self, STCCodec, "encode"):
            return super().encode_many(x_hat)
        v = np.ascontiguousarray(as_rows(x_hat).to("cpu").numpy())
        positions, values, offsets = sparse_rows(v)
        counts = np.diff(offsets)
        mu = np.zeros(counts.size, dtype=np.float32)
        mu[counts > 0] = np.abs(values[offsets[:-1][counts > 0]])
        bad = np.abs(values) != np.repeat(mu, counts)
        if bad.any():
            i = int(np.searchsorted(offsets, np.flatnonzero(bad)[0], side="right") - 1)
            raise ValueError(f"message {i}: STC can only encode ternary vectors (0 and +-mu)")
        gaps = positions_to_gaps_many(positions, offsets)
        bs = rice_parameters_for_many(gaps, offsets, self.q, self.adaptive_golomb)
        header = np.zeros(counts.size, dtype=_STC_HEADER_DTYPE)
        header["mu"] = mu
        return pack_sparse_many(header, gaps, offsets, bs, signs=values < 0)

    def decode_many(self, payloads: Payloads, numel: int) -> torch.Tensor:
        """Every message decoded (CPU float32 ``[m, numel]``) in one pass.

        Raises:
            ValueError: as ``decode`` would, for the first malformed message (named).
        """
        if overrides(self, STCCodec, "decode"):
            return super().decode_many(payloads, numel)
        msgs = read_sparse_many(
            payloads,
            numel,
            _STC_HEADER_DTYPE,
            "STC payload shorter than its header",
            "STC",
            with_signs=True,
        )
        mu = msgs.header["mu"][msgs.rows]
        out = np.zeros((len(payloads), numel), dtype=np.float32)
        out[msgs.rows, msgs.positions] = np.where(msgs.negative.astype(bool), -mu, mu)
        return torch.from_numpy(out)

    def _sizes(self, x_hat: torch.Tensor) -> torch.Tensor:
        """Header plus ``ceil((rice_bits + n) / 8)`` of every row (:meth:`payload_bytes`)."""
        k = keep_count(self.q, x_hat.shape[1])
        bits, n = sparse_bits_rows(x_hat, k, self.q, self.adaptive_golomb)
        return self.HEADER_BYTES + (bits + n + 7) // 8

    def sizes_many(self, x_hat: torch.Tensor) -> torch.Tensor | None:
        """:meth:`payload_bytes` of every row of a ``compress_many`` output, on its device."""
        return None if overrides(self, STCCodec, "encode") else self._sizes(x_hat)

    def received_many(self, x_hat: torch.Tensor) -> torch.Tensor:
        """The rows with ``-0.0`` as ``0.0`` (a zero is not sent, whatever its sign)."""
        if overrides(self, STCCodec, "decode"):
            return Codec.received_many(self, x_hat)
        return x_hat + 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(q={self.q}, adaptive_golomb={self.adaptive_golomb})"


class TwoMeanSTCCodec(STCCodec):
    """The pFedNet authors' STC variant: one mean for positive and one for negative entries.

    Keeps the ``k = ceil(q d)`` largest ``|A_i|``; kept positive entries become ``mu+`` (their
    mean), kept negative ones ``-mu-`` (the mean of their magnitudes). The authors use it
    without error feedback; keep it as an option to compare with :class:`STCCodec`.

    Wire format: ``uint32 n, float32 mu+, float32 mu-, uint8 b`` (13 bytes), then the same bit
    stream as :class:`STCCodec`.

    Args:
        q: fraction of entries kept, in (0, 1].
        adaptive_golomb: as in :class:`STCCodec`.
    """

    HEADER = struct.Struct("<IffB")
    HEADER_BYTES = HEADER.size

    @staticmethod
    def payload_bytes(positions: np.ndarray, b: int) -> int:
        """Exact ``len(encode(...))``: 13-byte header plus the bit stream in bytes."""
        bits = STCCodec.payload_bits(positions, b)
        return TwoMeanSTCCodec.HEADER_BYTES + math.ceil(bits / 8)

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """``mu+`` on kept positive entries, ``-mu-`` on kept negative ones, 0 elsewhere."""
        a = x.detach().reshape(-1).to(torch.float32)
        out = torch.zeros_like(a)
        if a.numel() == 0:
            return out
        idx, kept = _top_k(a, self.q)
        pos, neg = kept > 0, kept < 0
        mu_pos = masked_row_means(kept[None], pos[None])[0]
        mu_neg = masked_row_means(kept[None], neg[None])[0]
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        return out.index_put_((idx,), torch.where(pos, mu_pos, torch.where(neg, mu_neg, zero)))

    def encode(self, x: torch.Tensor) -> bytes:
        """Header with both means, then gaps and sign bits; ``x`` takes values 0, mu+, -mu-."""
        v = flat_cpu_float32(x)
        positions = np.flatnonzero(v)
        values = v[positions]
        negative = values < 0
        mu_pos = values[~negative][0] if (~negative).any() else np.float32(0.0)
        mu_neg = -values[negative][0] if negative.any() else np.float32(0.0)
        if not (np.all(values[~negative] == mu_pos) and np.all(values[negative] == -mu_neg)):
            raise ValueError("two-mean STC can only encode vectors with values 0, mu+ and -mu-")
        if positions.size >= 2**32:
            raise ValueError("too many non-zeros for a uint32 count")
        b, stream = _write_positions_and_signs(positions, negative, self.q, self.adaptive_golomb)
        return self.HEADER.pack(positions.size, mu_pos, mu_neg, b) + stream

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Rebuild the float32 vector with values 0, mu+ and -mu-."""
        if len(payload) < self.HEADER_BYTES:
            raise ValueError("two-mean STC payload shorter than its header")
        n, mu_pos, mu_neg, b = self.HEADER.unpack_from(payload)
        positions, negative = _read_positions_and_signs(payload[self.HEADER_BYTES :], n, b, numel)
        out = np.zeros(numel, dtype=np.float32)
        out[positions] = np.where(negative, -np.float32(mu_neg), np.float32(mu_pos))
        return torch.from_numpy(out)

    def compress_many(self, x: torch.Tensor, generators: Streams | None = None) -> torch.Tensor:
        """``compress`` of every row: one ``topk`` over the rows, ``mu+`` / ``mu-`` per row.

        Each mean is taken as ``compress`` takes it (:func:`masked_row_means` of the row), so
        a row without a tie at the ``k``-th magnitude equals ``compress(x[i])`` bit for bit on
        the CPU; with a tie both are valid.

        Args:
            x: ``[m, d]`` stacked messages.
            generators: unused (checked for length).
        """
        if overrides(self, TwoMeanSTCCodec, "compress"):
            return Codec.compress_many(self, x, generators)
        a = as_rows(x)
        check_generators(generators, a.shape[0])
        out = torch.zeros_like(a)
        if a.numel() == 0:
            return out
        idx, kept = _top_k_rows(a, self.q)
        pos, neg = kept > 0, kept < 0
        mu_pos = masked_row_means(kept, pos)[:, None]
        mu_neg = masked_row_means(kept, neg)[:, None]
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        return out.scatter_(1, idx, torch.where(pos, mu_pos, torch.where(neg, mu_neg, zero)))

    def encode_many(self, x_hat: torch.Tensor) -> Payloads:
        """Every row's payload, byte for byte ``encode(row)``, in one vectorised pass.

        Raises:
            ValueError: naming the first row whose values are not 0, mu+ and -mu-.
        """
        if overrides(self, TwoMeanSTCCodec, "encode"):
            return Codec.encode_many(self, x_hat)
        v = np.ascontiguousarray(as_rows(x_hat).to("cpu").numpy())
        positions, values, offsets = sparse_rows(v)
        m = offsets.size - 1
        rows = np.repeat(np.arange(m), np.diff(offsets))
        negative = values < 0
        header = np.zeros(m, dtype=_TWO_MEAN_HEADER_DTYPE)
        for field, sel, sign in (("mu_pos", ~negative, 1), ("mu_neg", negative, -1)):
            at = np.flatnonzero(sel)
            first = at[np.r_[True, rows[at][1:] != rows[at][:-1]]] if at.size else at
            header[field][rows[first]] = sign * values[first]
        expect = np.where(negative, -header["mu_neg"][rows], header["mu_pos"][rows])
        bad = values != expect
        if bad.any():
            i = int(rows[np.flatnonzero(bad)[0]])
            raise ValueError(
                f"message {i}: two-mean STC can only encode vectors with values 0, mu+ and -mu-"
            )
        gaps = positions_to_gaps_many(positions, offsets)
        bs = rice_parameters_for_many(gaps, offsets, self.q, self.adaptive_golomb)
        return pack_sparse_many(header, gaps, offsets, bs, signs=negative)

    def decode_many(self, payloads: Payloads, numel: int) -> torch.Tensor:
        """Every message decoded (CPU float32 ``[m, numel]``) in one pass.

        Raises:
            ValueError: as ``decode`` would, for the first malformed message (named).
        """
        if overrides(self, TwoMeanSTCCodec, "decode"):
            return Codec.decode_many(self, payloads, numel)
        msgs = read_sparse_many(
            payloads,
            numel,
            _TWO_MEAN_HEADER_DTYPE,
            "two-mean STC payload shorter than its header",
            "STC",
            with_signs=True,
        )
        mu_pos = msgs.header["mu_pos"][msgs.rows]
        mu_neg = msgs.header["mu_neg"][msgs.rows]
        out = np.zeros((len(payloads), numel), dtype=np.float32)
        out[msgs.rows, msgs.positions] = np.where(msgs.negative.astype(bool), -mu_neg, mu_pos)
        return torch.from_numpy(out)

    def sizes_many(self, x_hat: torch.Tensor) -> torch.Tensor | None:
        """:meth:`payload_bytes` of every row of a ``compress_many`` output, on its device."""
        return None if overrides(self, TwoMeanSTCCodec, "encode") else self._sizes(x_hat)

    def received_many(self, x_hat: torch.Tensor) -> torch.Tensor:
        """The rows with ``-0.0`` as ``0.0`` (a zero is not sent, whatever its sign)."""
        if overrides(self, TwoMeanSTCCodec, "decode"):
            return Codec.received_many(self, x_hat)
        return x_hat + 0.0
