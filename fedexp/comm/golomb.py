"""Bit streams and Golomb-Rice coding of position gaps.

The sparse codecs (STC, top-k, random-k) send the positions of their non-zero entries as the
gaps between consecutive positions, Golomb-coded with a power-of-two parameter ``M = 2**b``
(Rice coding), as proposed for STC by Sattler et al. (2019), "Robust and
communication-efficient federated learning from non-i.i.d. data", IEEE TNNLS 31(9),
Sec. IV-C. A gap ``g >= 0`` is written as ``g >> b`` one-bits, a zero-bit, then the ``b`` low
bits of ``g``, most significant first: ``(g >> b) + 1 + b`` bits in all.

Bits are packed most significant bit first within each byte. The gap of the first position
``p_1`` is ``p_1`` itself, the following ones are ``p_j - p_{j-1} - 1`` (so gaps are >= 0 and
consecutive positions cost a gap of 0).

The two inner loops (Rice writing and reading) are compiled with numba. The batched form,
a cohort's messages coded in one pass, is :mod:`fedexp.comm.golomb_cohort`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

#: Largest Rice parameter accepted (a gap is at most 2**63 - 1).
MAX_RICE_PARAMETER = 62

_GOLDEN_RATIO = (1.0 + math.sqrt(5.0)) / 2.0


def golomb_parameter(q: float) -> int:
    """Rice parameter ``b*`` for positions of density ``q`` (Sattler et al. 2019, Eq. (17)).

    ``b* = 1 + floor(log2(ln(phi - 1) / ln(1 - q)))`` with ``phi`` the golden ratio, clipped to
    ``[0, MAX_RICE_PARAMETER]`` (the formula is negative for ``q`` above about 0.38, where
    ``b = 0``, i.e. unary coding, is the best power of two).

    Args:
        q: fraction of non-zero entries, in (0, 1].

    Returns:
        The exponent ``b`` of the Golomb parameter ``M = 2**b``.
    """
    if not 0.0 < q <= 1.0:
        raise ValueError(f"density q={q} must lie in (0, 1]")
    if q >= 1.0:
        return 0
    ratio = math.log(_GOLDEN_RATIO - 1.0) / math.log1p(-q)
    b = 1 + math.floor(math.log2(ratio))
    return int(min(max(b, 0), MAX_RICE_PARAMETER))


def expected_position_bits(q: float) -> float:
    """Mean Rice code length per position at density ``q`` (Sattler et al. 2019, Eq. (18)).

    ``b_pos = b* + 1 / (1 - (1 - q)**(2**b*))`` for geometrically distributed gaps.
    """
    b = golomb_parameter(q)
    return b + 1.0 / (1.0 - (1.0 - q) ** (2.0**b))


def positions_to_gaps(positions: np.ndarray) -> np.ndarray:
    """Gaps (int64, >= 0) of strictly increasing non-negative positions."""
    positions = np.asarray(positions, dtype=np.int64)
    if positions.size == 0:
        return np.zeros(0, dtype=np.int64)
    gaps = np.empty_like(positions)
    gaps[0] = positions[0]
    np.subtract(positions[1:], positions[:-1], out=gaps[1:])
    gaps[1:] -= 1
    if gaps.min() < 0:
        raise ValueError("positions must be non-negative and strictly increasing")
    return gaps


def gaps_to_positions(gaps: np.ndarray) -> np.ndarray:
    """Inverse of :func:`positions_to_gaps`."""
    return np.cumsum(np.asarray(gaps, dtype=np.int64) + 1) - 1


def rice_bits(gaps: np.ndarray, b: int) -> int:
    """Exact number of bits of the Rice code of ``gaps`` with parameter ``b``."""
    gaps = np.asarray(gaps, dtype=np.int64)
    return int(np.sum(gaps >> b)) + (1 + b) * int(gaps.size)


def best_rice_parameter(gaps: np.ndarray) -> int:
    """The ``b`` that minimises :func:`rice_bits` for these gaps (0 for an empty list)."""
    gaps = np.asarray(gaps, dtype=np.int64)
    if gaps.size == 0:
        return 0
    top = int(gaps.max()).bit_length()
    costs = [rice_bits(gaps, b) for b in range(min(top, MAX_RICE_PARAMETER) + 1)]
    return int(np.argmin(costs))


@njit(cache=True)
def _rice_write(buf, bitpos, gaps, b):  # noqa: ANN001, ANN202 - numba kernel
    """Write the Rice codes of ``gaps`` into the zeroed ``buf`` from ``bitpos``; new bitpos."""
    for j in range(gaps.size):
        g = gaps[j]
        quotient = g >> b
        for _ in range(quotient):
            buf[bitpos >> 3] |= np.uint8(0x80 >> (bitpos & 7))
            bitpos += 1
        bitpos += 1  # the terminating zero
        for t in range(b - 1, -1, -1):
            if (g >> t) & 1:
                buf[bitpos >> 3] |= np.uint8(0x80 >> (bitpos & 7))
            bitpos += 1
    return bitpos


@njit(cache=True)
def _rice_read(buf, bitpos, nbits, count, b, out):  # noqa: ANN001, ANN202 - numba kernel
    """Read ``count`` Rice codes from ``buf`` into ``out``; new bitpos, or -1 on overrun."""
    for j in range(count):
        quotient = 0
        while True:
            if bitpos >= nbits:
                return -1
            bit = (buf[bitpos >> 3] >> (7 - (bitpos & 7))) & 1
            bitpos += 1
            if bit == 0:
                break
            quotient += 1
        if bitpos + b > nbits:
            return -1
        rem = 0
        for _ in range(b):
            rem = (rem << 1) | ((buf[bitpos >> 3] >> (7 - (bitpos & 7))) & 1)
            bitpos += 1
        out[j] = (quotient << b) | rem
    return bitpos


class BitWriter:
    """Append-only bit stream of a size known in advance (MSB first within bytes).

    Args:
        nbits: total number of bits that will be written; the buffer holds
            ``ceil(nbits / 8)`` bytes and the unused low bits of the last byte stay zero.
    """

    def __init__(self, nbits: int) -> None:
        self.nbits = int(nbits)
        self.bitpos = 0
        self._buf = np.zeros((self.nbits + 7) // 8, dtype=np.uint8)

    def _reserve(self, n: int) -> None:
        if self.bitpos + n > self.nbits:
            raise ValueError(f"bit writer overflow: {self.bitpos} + {n} > {self.nbits} bits")

    def write_uint(self, value: int, nbits: int) -> None:
        """Write the ``nbits`` low bits of a non-negative integer, most significant first."""
        if value < 0 or value >> nbits:
            raise ValueError(f"{value} does not fit in {nbits} bits")
        bits = np.array([(value >> t) & 1 for t in range(nbits - 1, -1, -1)], dtype=np.uint8)
        self.write_bits(bits)

    def write_bits(self, bits: np.ndarray) -> None:
        """Write a vector of 0/1 values (anything non-zero counts as 1)."""
        bits = (np.asarray(bits) != 0).astype(np.uint8)
        self._reserve(bits.size)
        if bits.size == 0:
            return
        shift = self.bitpos & 7
        packed = np.packbits(np.concatenate([np.zeros(shift, np.uint8), bits]))
        start = self.bitpos >> 3
        self._buf[start : start + packed.size] |= packed
        self.bitpos += bits.size

    def write_rice(self, gaps: np.ndarray, b: int) -> None:
        """Write the Rice codes (parameter ``2**b``) of non-negative integers."""
        gaps = np.ascontiguousarray(gaps, dtype=np.int64)
        if gaps.size and gaps.min() < 0:
            raise ValueError("Rice coding needs non-negative integers")
        if not 0 <= b <= MAX_RICE_PARAMETER:
            raise ValueError(f"Rice parameter b={b} outside [0, {MAX_RICE_PARAMETER}]")
        self._reserve(rice_bits(gaps, b))
        self.bitpos = int(_rice_write(self._buf, np.int64(self.bitpos), gaps, np.int64(b)))

    def getvalue(self) -> bytes:
        """The bytes written so far (the whole buffer once ``nbits`` bits are written)."""
        return self._buf.tobytes()


class BitReader:
    """Reader of a bit stream written by :class:`BitWriter`.

    Args:
        data: the bytes.
        nbits: number of meaningful bits (defaults to ``8 * len(data)``).
    """

    def __init__(
        self, data: bytes | bytearray | memoryview | np.ndarray, nbits: int | None = None
    ) -> None:
        self._buf = np.frombuffer(bytes(data), dtype=np.uint8)
        self.nbits = 8 * self._buf.size if nbits is None else int(nbits)
        if self.nbits > 8 * self._buf.size:
            raise ValueError("bit count exceeds the data")
        self.bitpos = 0

    def _check(self, n: int) -> None:
        if self.bitpos + n > self.nbits:
            raise ValueError(f"bit stream too short: {self.bitpos} + {n} > {self.nbits} bits")

    def read_uint(self, nbits: int) -> int:
        """Read an unsigned integer of ``nbits`` bits."""
        value = 0
        for bit in self.read_bits(nbits):
            value = (value << 1) | int(bit)
        return value

    def read_bits(self, count: int) -> np.ndarray:
        """Read ``count`` bits as a uint8 vector of 0/1."""
        self._check(count)
        start = self.bitpos >> 3
        shift = self.bitpos & 7
        nbytes = (shift + count + 7) // 8
        bits = np.unpackbits(self._buf[start : start + nbytes])[shift : shift + count]
        self.bitpos += count
        return bits

    def read_rice(self, count: int, b: int) -> np.ndarray:
        """Read ``count`` Rice codes with parameter ``2**b`` (int64 values)."""
        if not 0 <= b <= MAX_RICE_PARAMETER:
            raise ValueError(f"Rice parameter b={b} outside [0, {MAX_RICE_PARAMETER}]")
        out = np.empty(int(count), dtype=np.int64)
        pos = _rice_read(
            self._buf, np.int64(self.bitpos), np.int64(self.nbits), np.int64(count),
            np.int64(b), out,
        )  # fmt: skip
        if pos < 0:
            raise ValueError("bit stream too short for the announced Rice codes")
        self.bitpos = int(pos)
        return out

    def remaining(self) -> int:
        """Bits left to read."""
        return self.nbits - self.bitpos


def encode_gaps(gaps: np.ndarray, b: int) -> bytes:
    """Rice-code a list of gaps into ``ceil(rice_bits(gaps, b) / 8)`` bytes."""
    writer = BitWriter(rice_bits(gaps, b))
    writer.write_rice(gaps, b)
    return writer.getvalue()


def decode_gaps(data: bytes, count: int, b: int) -> np.ndarray:
    """Inverse of :func:`encode_gaps`; the padding bits must be zero and nothing may remain."""
    reader = BitReader(data)
    gaps = reader.read_rice(count, b)
    check_padding(reader)
    return gaps


def check_padding(reader: BitReader) -> None:
    """Raise unless fewer than 8 bits remain in ``reader`` and all of them are zero."""
    left = reader.remaining()
    if left >= 8 or (left and reader.read_bits(left).any()):
        raise ValueError(f"{left} unexpected trailing bits in the bit stream")
