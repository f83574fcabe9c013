"""Sparse ternary compression (STC) with a real Golomb-coded bit stream.

Sattler, Wiedemann, Müller & Samek (2019), "Robust and communication-efficient federated
learning from non-i.i.d. data", IEEE TNNLS 31(9), Algorithm 1 and Sec. IV-C; MATH.md §7.

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
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedexp.comm.codec import Codec
from fedexp.comm.golomb import (
    BitReader,
    BitWriter,
    check_padding,
    expected_position_bits,
    gaps_to_positions,
    positions_to_gaps,
    rice_bits,
)
from fedexp.comm.topk import check_fraction, flat_cpu_float32, keep_count, rice_parameter_for


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

    def __init__(self, q: float = 0.01, adaptive_golomb: bool = False) -> None:
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(q={self.q}, adaptive_golomb={self.adaptive_golomb})"


class TwoMeanSTCCodec(STCCodec):
    """The pFedNet authors' STC variant: one mean for positive and one for negative entries.

    Keeps the ``k = ceil(q d)`` largest ``|A_i|``; kept positive entries become ``mu+`` (their
    mean), kept negative ones ``-mu-`` (the mean of their magnitudes). The authors use it
    without error feedback; keep it as an option to compare with :class:`STCCodec` (MATH §7).

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
        if bool(pos.any()):
            out[idx[pos]] = kept[pos].mean()
        if bool(neg.any()):
            out[idx[neg]] = kept[neg].mean()
        return out

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
