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

The two inner loops (Rice writing and reading) are compiled with numba.
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


# --------------------------------------------------------------------------- cohorts
#
# The batched (cohort) form of the sparse codecs: the messages of ``m`` senders coded in one
# pass. Their non-zeros are given as one flat array in message order plus ``offsets`` (int64,
# ``m + 1``): message ``i`` owns entries ``offsets[i]:offsets[i + 1]``. Each message is still
# coded exactly as on its own (Sattler et al. 2019, Sec. IV-C; MATH.md §7-§8): its own gaps,
# its own Rice parameter, its own byte-aligned stream; only the work is shared.

#: Status codes of :func:`read_rice_many` (0 = the message decoded cleanly).
RICE_OVERRUN, SIGNS_OVERRUN, BAD_PADDING, OUT_OF_RANGE = 1, 2, 3, 4


def segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-message sums (int64) of ``values`` over the segments that ``offsets`` delimit.

    Empty segments sum to 0 (unlike ``np.add.reduceat``).
    """
    cs = np.zeros(values.size + 1, dtype=np.int64)
    np.cumsum(values, out=cs[1:])
    return cs[offsets[1:]] - cs[offsets[:-1]]


def positions_to_gaps_many(positions: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """:func:`positions_to_gaps` of every message at once.

    Args:
        positions: int64, strictly increasing within each message.
        offsets: int64 [m + 1], the messages' segments of ``positions``.

    Returns:
        int64 gaps, the same layout as ``positions``: the first gap of a message is its first
        position, the next ones ``p_j - p_{j-1} - 1``.
    """
    positions = np.asarray(positions, dtype=np.int64)
    gaps = positions.copy()
    if positions.size:
        gaps[1:] -= positions[:-1] + 1
        firsts = offsets[:-1][np.diff(offsets) > 0]
        gaps[firsts] = positions[firsts]
        if gaps.min() < 0:
            raise ValueError("positions must be non-negative and strictly increasing")
    return gaps


def rice_bits_many(gaps: np.ndarray, offsets: np.ndarray, bs: np.ndarray) -> np.ndarray:
    """:func:`rice_bits` of each message's gaps with its own parameter ``bs[i]`` (int64 [m])."""
    counts = np.diff(offsets)
    bs = np.asarray(bs, dtype=np.int64)
    shifted = gaps >> np.repeat(bs, counts)
    return segment_sums(shifted, offsets) + (1 + bs) * counts


def best_rice_parameters(gaps: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """:func:`best_rice_parameter` of each message (int64 [m]), vectorised over messages.

    The cost of every ``b`` in ``0..B`` (``B`` the bit length of the largest gap of all
    messages, at most :data:`MAX_RICE_PARAMETER`) is computed for every message and the
    smallest minimiser taken (``np.argmin``, as the single-message function). Extending a
    message's range beyond its own largest gap's bit length ``B_i`` changes nothing: there every
    quotient is 0 and the cost ``(1 + b) n_i`` grows with ``b``, so it exceeds the cost at
    ``B_i``; an empty message costs 0 everywhere and gets ``b = 0``.
    """
    counts = np.diff(offsets)
    m = counts.size
    if gaps.size == 0:
        return np.zeros(m, dtype=np.int64)
    top = min(int(gaps.max()).bit_length(), MAX_RICE_PARAMETER)
    costs = np.empty((m, top + 1), dtype=np.int64)
    for b in range(top + 1):
        costs[:, b] = segment_sums(gaps >> b, offsets) + (1 + b) * counts
    return np.argmin(costs, axis=1).astype(np.int64)


#: Number of leading one-bits of each byte value (for reading unary quotients a byte at a time).
_LEADING_ONES = np.array([8 - (255 - v).bit_length() for v in range(256)], dtype=np.int64)


@njit(cache=True)
def _rice_write_many(buf, start_bits, gaps, offsets, bs, signs, with_signs):  # noqa: ANN001, ANN202
    """Write every message's Rice-coded gaps (then its sign bits) into the zeroed ``buf``.

    Message ``i`` starts at bit ``start_bits[i]`` of the shared buffer and owns the gaps (and
    0/1 ``signs``) ``offsets[i]:offsets[i + 1]``, coded with parameter ``bs[i]``: the same
    bits as :func:`_rice_write` (then one bit per sign), gathered in an integer accumulator
    of fewer than 40 bits and stored a byte at a time. The bytes after a message's last bit
    must be zero; the bits before its start in its first byte are kept.
    """
    for i in range(start_bits.size):
        b = bs[i]
        low = (np.int64(1) << b) - 1
        byte = start_bits[i] >> 3
        nacc = start_bits[i] & 7
        acc = np.int64(buf[byte]) >> (8 - nacc) if nacc else np.int64(0)
        for j in range(offsets[i], offsets[i + 1]):
            g = gaps[j]
            q = g >> b
            while q > 0:  # the quotient's one-bits, at most 32 at a time
                t = 32 if q > 32 else q
                q -= t
                acc = (acc << t) | ((np.int64(1) << t) - 1)
                nacc += t
                while nacc >= 8:
                    nacc -= 8
                    buf[byte] = np.uint8((acc >> nacc) & 0xFF)
                    byte += 1
                acc &= (np.int64(1) << nacc) - 1
            r = g & low
            left = b + 1  # the terminating zero, then the b low bits of g
            while left > 0:
                t = 32 if left > 32 else left
                left -= t
                acc = (acc << t) | ((r >> left) & ((np.int64(1) << t) - 1))
                nacc += t
                while nacc >= 8:
                    nacc -= 8
                    buf[byte] = np.uint8((acc >> nacc) & 0xFF)
                    byte += 1
                acc &= (np.int64(1) << nacc) - 1
        if with_signs:
            for j in range(offsets[i], offsets[i + 1]):
                acc = (acc << 1) | (1 if signs[j] else 0)
                nacc += 1
                if nacc == 8:
                    buf[byte] = np.uint8(acc)
                    byte += 1
                    acc = 0
                    nacc = 0
        if nacc > 0:
            buf[byte] = np.uint8((acc << (8 - nacc)) & 0xFF)


@njit(cache=True)
def _rice_read_codes(buf, bitpos, end, count, b, out):  # noqa: ANN001, ANN202 - numba kernel
    """:func:`_rice_read` reading the unary part a byte at a time; new bitpos, -1 on overrun."""
    for j in range(count):
        quotient = 0
        while True:
            if bitpos >= end:
                return -1
            off = bitpos & 7
            avail = 8 - off
            if end - bitpos < avail:
                avail = end - bitpos
            ones = _LEADING_ONES[(np.int64(buf[bitpos >> 3]) << off) & 0xFF]
            if ones < avail:
                quotient += ones
                bitpos += ones + 1
                break
            quotient += avail
            bitpos += avail
        if bitpos + b > end:
            return -1
        rem = np.int64(0)
        need = b
        while need > 0:
            off = bitpos & 7
            t = 8 - off
            if need < t:
                t = need
            bits = (np.int64(buf[bitpos >> 3]) >> (8 - off - t)) & ((1 << t) - 1)
            rem = (rem << t) | bits
            bitpos += t
            need -= t
        out[j] = (quotient << b) | rem
    return bitpos


@njit(cache=True)
def _rice_read_many(  # noqa: ANN202 - numba kernel
    buf, start_bits, end_bits, offsets, bs, with_signs, numel, positions, negative, status, detail
):  # fmt: skip
    """Read every message's Rice gaps (and sign bits) and turn the gaps into positions.

    Messages whose ``status`` is already non-zero are skipped. Otherwise the status becomes
    one of the module's codes; ``detail[i]`` holds the bit position (relative to the start
    of the stream) of a sign-bit overrun, the number of trailing bits of a bad padding, or
    the last position of an out-of-range message. Positions are checked to lie in
    ``[0, numel)`` before anything is written at them by the caller.
    """
    for i in range(start_bits.size):
        if status[i] != 0:
            continue
        lo = offsets[i]
        hi = offsets[i + 1]
        count = hi - lo
        end = end_bits[i]
        bitpos = _rice_read_codes(buf, start_bits[i], end, count, bs[i], positions[lo:hi])
        if bitpos < 0:
            status[i] = RICE_OVERRUN
            continue
        if with_signs:
            if bitpos + count > end:
                status[i] = SIGNS_OVERRUN
                detail[i] = bitpos - start_bits[i]
                continue
            for j in range(lo, hi):
                negative[j] = (buf[bitpos >> 3] >> (7 - (bitpos & 7))) & 1
                bitpos += 1
        left = end - bitpos
        bad = left >= 8
        while not bad and bitpos < end:
            bad = ((buf[bitpos >> 3] >> (7 - (bitpos & 7))) & 1) != 0
            bitpos += 1
        if bad:
            status[i] = BAD_PADDING
            detail[i] = left
            continue
        p = np.int64(-1)
        inside = True
        for j in range(lo, hi):
            p = p + positions[j] + 1
            positions[j] = p
            if p < 0 or p >= numel:
                inside = False
        if not inside:
            status[i] = OUT_OF_RANGE
            detail[i] = p


def write_rice_many(
    buf: np.ndarray,
    start_bits: np.ndarray,
    gaps: np.ndarray,
    offsets: np.ndarray,
    bs: np.ndarray,
    signs: np.ndarray | None = None,
) -> None:
    """Rice-code every message's gaps (and sign bits) into the zeroed ``buf`` in one call.

    Args:
        buf: uint8 buffer holding all messages, zeroed where the bit streams go.
        start_bits: int64 [m], the bit at which message ``i``'s stream starts.
        gaps: int64 gaps of all messages, in message order (non-negative).
        offsets: int64 [m + 1], the messages' segments of ``gaps`` (and ``signs``).
        bs: int64 [m], Rice parameters in ``[0, MAX_RICE_PARAMETER]``.
        signs: 0/1 per gap, written after a message's gaps (STC's sign bits), or None.
    """
    gaps = np.ascontiguousarray(gaps, dtype=np.int64)
    bs = np.ascontiguousarray(bs, dtype=np.int64)
    if gaps.size and gaps.min() < 0:
        raise ValueError("Rice coding needs non-negative integers")
    if bs.size and (bs.min() < 0 or bs.max() > MAX_RICE_PARAMETER):
        raise ValueError(f"Rice parameters outside [0, {MAX_RICE_PARAMETER}]")
    with_signs = signs is not None
    signs = np.zeros(0, np.uint8) if signs is None else np.ascontiguousarray(signs, np.uint8)
    _rice_write_many(
        buf, np.ascontiguousarray(start_bits, dtype=np.int64), gaps,
        np.ascontiguousarray(offsets, dtype=np.int64), bs, signs, with_signs,
    )  # fmt: skip


def read_rice_many(
    buf: np.ndarray,
    start_bits: np.ndarray,
    end_bits: np.ndarray,
    offsets: np.ndarray,
    bs: np.ndarray,
    numel: int,
    status: np.ndarray,
    with_signs: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of :func:`write_rice_many` with the checks of a single message's decoder.

    Args:
        buf: uint8 buffer of all messages.
        start_bits: int64 [m], the first bit of each message's stream.
        end_bits: int64 [m], the bit after each message's stream.
        offsets: int64 [m + 1], where each message's positions go (its count of codes).
        bs: int64 [m], Rice parameters in ``[0, MAX_RICE_PARAMETER]`` (checked by the caller
            for messages with ``status == 0``).
        numel: entries of a decoded message; positions must lie in ``[0, numel)``.
        status: int64 [m], updated in place (messages already non-zero are skipped).
        with_signs: read one sign bit per code after a message's gaps (STC).

    Returns:
        (positions int64, negative flags uint8, detail int64 [m]); see the status codes.
    """
    positions = np.zeros(int(offsets[-1]), dtype=np.int64)
    negative = np.zeros(positions.size if with_signs else 0, dtype=np.uint8)
    detail = np.zeros(status.size, dtype=np.int64)
    _rice_read_many(
        buf, np.ascontiguousarray(start_bits, dtype=np.int64),
        np.ascontiguousarray(end_bits, dtype=np.int64),
        np.ascontiguousarray(offsets, dtype=np.int64), np.ascontiguousarray(bs, dtype=np.int64),
        bool(with_signs), np.int64(numel), positions, negative, status, detail,
    )  # fmt: skip
    return positions, negative, detail


def rice_status_message(code: int, detail: int, count: int, nbits: int, numel: int) -> str:
    """The error text of a single-message decoder for a :func:`read_rice_many` status."""
    if code == RICE_OVERRUN:
        return "bit stream too short for the announced Rice codes"
    if code == SIGNS_OVERRUN:
        return f"bit stream too short: {detail} + {count} > {nbits} bits"
    if code == BAD_PADDING:
        return f"{detail} unexpected trailing bits in the bit stream"
    if code == OUT_OF_RANGE:
        return f"position {detail} out of range for {numel} entries"
    raise AssertionError(f"unknown status {code}")  # pragma: no cover
