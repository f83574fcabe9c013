"""Golomb-Rice coding of a cohort's messages in one pass (the batched sparse codecs).

The batched (cohort) form of the sparse codecs: the messages of ``m`` senders coded in one
pass. Their non-zeros are given as one flat array in message order plus ``offsets`` (int64,
``m + 1``): message ``i`` owns entries ``offsets[i]:offsets[i + 1]``. Each message is still
coded exactly as on its own (Sattler et al. 2019, Sec. IV-C; ``docs/compression.md``): its own gaps,
its own Rice parameter, its own byte-aligned stream; only the work is shared.

The single-message code (bit streams, Rice parameters, gaps; the functions the docstrings
here name without a module, such as :func:`~fedexp.comm.golomb.rice_bits`) is
:mod:`fedexp.comm.golomb`; the write and read kernels here are compiled with numba.

The code lengths alone, without writing a bit, are tensor expressions over the cohort on the
messages' device (:func:`gaps_of_sorted`, :func:`gaps_of_marked`, :func:`rice_bits_rows`,
:func:`best_rice_rows`): the codecs' ``sizes_many``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from fedexp.comm.golomb import MAX_RICE_PARAMETER

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


# --------------------------------------------------------------------------- lengths on the device


def gaps_of_sorted(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """:func:`positions_to_gaps` of every row of ascending ``positions`` ``[m, K]``, as int64.

    Row ``i``'s positions are its entries where ``valid`` (a prefix of the row); the gaps of
    the other entries are 0.
    """
    p = positions.to(torch.int64)
    prev = torch.nn.functional.pad(p[:, :-1], (1, 0), value=-1)
    return torch.where(valid, p - prev - 1, 0)


def gaps_of_marked(mask: torch.Tensor) -> torch.Tensor:
    """:func:`positions_to_gaps` of the marked entries of every row of ``mask`` ``[m, d]``.

    int64 ``[m, d]``: the gap at each marked entry (its distance to the row's previous marked
    entry, less one; the first one's position), 0 elsewhere. One ``cummax`` over the rows.
    """
    d = mask.shape[1]
    small = torch.int32 if d < 2**31 else torch.int64
    j = torch.arange(d, dtype=small, device=mask.device)
    last = torch.where(mask, j, -1).cummax(dim=1).values  # the last marked entry <= j
    prev = torch.nn.functional.pad(last[:, :-1], (1, 0), value=-1)
    return torch.where(mask, (j - prev - 1).to(torch.int64), 0)


def rice_bits_rows(gaps: torch.Tensor, counts: torch.Tensor, b: int | torch.Tensor) -> torch.Tensor:
    """:func:`rice_bits` of each row's gaps (``[m, K]``, 0 where no gap) with parameter ``b``.

    ``b``: one for all rows, or int64 ``[m]``. Returns int64 ``[m]``.
    """
    shift = b[:, None] if isinstance(b, torch.Tensor) else b
    return (gaps >> shift).sum(dim=1) + (1 + b) * counts


def best_rice_rows(
    gaps: torch.Tensor, counts: torch.Tensor, numel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`best_rice_parameters` of every row and its :func:`rice_bits`, as tensors.

    Every ``b`` from 0 to the bit length of ``numel - 1`` (no gap is longer; capped at
    :data:`MAX_RICE_PARAMETER`) is costed and the smallest minimiser taken, as the numpy
    form does (a wider range changes nothing: its docstring). A fixed number of ops for any
    number of rows (it depends on ``numel``).

    Returns:
        (int64 ``[m]`` parameters, int64 ``[m]`` bits).
    """
    top = min(max(numel - 1, 0).bit_length(), MAX_RICE_PARAMETER)
    costs = torch.stack([rice_bits_rows(gaps, counts, b) for b in range(top + 1)], dim=1)
    best = costs.min(dim=1)
    return best.indices, best.values
