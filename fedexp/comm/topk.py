"""Top-k sparsification with float32 values and Golomb-coded positions.

Keeps the ``k = ceil(q * d)`` entries of largest magnitude (Aji & Heafield 2017; the
sparsification half of STC, Sattler et al. 2019) and sends them exactly as float32.

Wire format (little-endian)::

    uint32 n        number of non-zero entries sent
    uint8  b        Rice parameter of the position gaps (M = 2**b)
    bits            n Rice-coded position gaps (fedexp.comm.golomb), zero-padded to a byte
    float32[n]      the values, in position order

so a payload has ``5 + ceil(rice_bits / 8) + 4 n`` bytes. Entries of the ``compress`` output
that are exactly zero are not sent (a kept entry whose value is 0 costs nothing).
``sizes_many`` evaluates that formula for a cohort on the messages' device (the ascending
positions of each row's at most ``k`` non-zeros by one ``topk``, their gaps and Rice bits).

Cohorts (``compress_many`` / ``encode_many`` / ``decode_many``): one ``torch.topk`` over the
rows, then the payloads of all rows written (read) in one pass of numpy and one numba kernel
(:func:`fedexp.comm.golomb_cohort.write_rice_many`); each payload is byte for byte the row's own.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from fedexp.comm.codec import Codec
from fedexp.comm.codec import Payloads
from fedexp.comm.codec import Streams
from fedexp.comm.codec import as_rows
from fedexp.comm.codec import check_generators
from fedexp.comm.codec import overrides
from fedexp.comm.golomb import MAX_RICE_PARAMETER
from fedexp.comm.golomb import BitReader
from fedexp.comm.golomb import BitWriter
from fedexp.comm.golomb import best_rice_parameter
from fedexp.comm.golomb import check_padding
from fedexp.comm.golomb import gaps_to_positions
from fedexp.comm.golomb import golomb_parameter
from fedexp.comm.golomb import positions_to_gaps
from fedexp.comm.golomb import rice_bits
from fedexp.comm.golomb_cohort import best_rice_parameters
from fedexp.comm.golomb_cohort import best_rice_rows
from fedexp.comm.golomb_cohort import gaps_of_sorted
from fedexp.comm.golomb_cohort import positions_to_gaps_many
from fedexp.comm.golomb_cohort import read_rice_many
from fedexp.comm.golomb_cohort import rice_bits_many
from fedexp.comm.golomb_cohort import rice_bits_rows
from fedexp.comm.golomb_cohort import rice_status_message
from fedexp.comm.golomb_cohort import write_rice_many
from fedexp.config.ranges import PositiveFraction

_SPARSE_HEADER = struct.Struct("<IB")
#: The same header as a packed numpy record (for whole cohorts).
_SPARSE_HEADER_DTYPE = np.dtype([("n", "<u4"), ("b", "u1")])


def keep_count(q: float, numel: int) -> int:
    """``k = ceil(q * numel)`` clipped to ``[1, numel]`` (0 for an empty vector).

    ``q`` is read as the decimal it is written as (``Fraction(repr(q))``), so float noise does
    not add an entry: ``0.07 * 100`` is ``7.000000000000001`` in binary floating point, but
    ``keep_count(0.07, 100) == 7``.
    """
    if numel <= 0:
        return 0
    k = math.ceil(Fraction(repr(float(q))) * numel)
    return int(min(max(k, 1), numel))


def check_fraction(q: float) -> float:
    """Validate a kept fraction ``q`` in (0, 1] and return it as a float."""
    q = float(q)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"q={q} must lie in (0, 1] (the fraction of entries kept)")
    return q


def flat_cpu_float32(x: torch.Tensor) -> np.ndarray:
    """A flat float32 numpy view of ``x`` on the CPU."""
    return x.detach().reshape(-1).to("cpu", torch.float32).numpy()


def rice_parameter_for(gaps: np.ndarray, q: float, adaptive: bool) -> int:
    """Sattler's ``b*(q)``, or the best ``b`` for these very gaps when ``adaptive``."""
    return best_rice_parameter(gaps) if adaptive else golomb_parameter(q)


def encode_sparse_values(v: np.ndarray, b_of_gaps: Callable[[np.ndarray], int]) -> bytes:
    """Encode the non-zeros of ``v`` (float32) as header, Rice-coded gaps and float32 values.

    Args:
        v: flat float32 vector.
        b_of_gaps: callable mapping the gap vector to the Rice parameter to use.
    """
    positions = np.flatnonzero(v)
    if positions.size >= 2**32:
        raise ValueError("too many non-zeros for a uint32 count")
    gaps = positions_to_gaps(positions)
    b = int(b_of_gaps(gaps))
    writer = BitWriter(rice_bits(gaps, b))
    writer.write_rice(gaps, b)
    values = v[positions].astype("<f4", copy=False).tobytes()
    return _SPARSE_HEADER.pack(positions.size, b) + writer.getvalue() + values


def decode_sparse_values(payload: bytes, numel: int) -> torch.Tensor:
    """Inverse of :func:`encode_sparse_values`: a CPU float32 vector of ``numel`` entries."""
    if len(payload) < _SPARSE_HEADER.size:
        raise ValueError("sparse payload shorter than its header")
    n, b = _SPARSE_HEADER.unpack_from(payload)
    if n > numel:
        raise ValueError(f"sparse payload announces {n} non-zeros for {numel} entries")
    body = len(payload) - _SPARSE_HEADER.size - 4 * n
    if body < 0:
        raise ValueError("sparse payload too short for its values")
    reader = BitReader(payload[_SPARSE_HEADER.size : _SPARSE_HEADER.size + body])
    positions = gaps_to_positions(reader.read_rice(n, b))
    check_padding(reader)
    if n and positions[-1] >= numel:
        raise ValueError(f"position {positions[-1]} out of range for {numel} entries")
    out = np.zeros(numel, dtype=np.float32)
    out[positions] = np.frombuffer(payload, dtype="<f4", count=n, offset=len(payload) - 4 * n)
    return torch.from_numpy(out)


# --------------------------------------------------------------------------- cohorts


def rice_parameters_for_many(
    gaps: np.ndarray, offsets: np.ndarray, q: float, adaptive: bool
) -> np.ndarray:
    """:func:`rice_parameter_for` of every message (int64 [m]): ``b*(q)`` or each one's best."""
    if adaptive:
        return best_rice_parameters(gaps, offsets)
    return np.full(offsets.size - 1, golomb_parameter(q), dtype=np.int64)


def sorted_nonzeros(x_hat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ascending positions of the non-zeros of every row of ``x_hat`` ``[m, d]``.

    For rows of at most ``k`` non-zeros (a sparse codec's ``compress`` output): ``[m, k]``
    positions (the row's non-zeros first, in order, then ``d``) and the mask of the real ones,
    by one ``topk`` of the smallest ``k`` of (position where non-zero, else ``d``), on the
    rows' device.
    """
    d = x_hat.shape[1]
    small = torch.int32 if d < 2**31 else torch.int64
    j = torch.arange(d, dtype=small, device=x_hat.device)
    key = torch.where(x_hat != 0, j, d)
    positions = torch.topk(key, k, dim=1, largest=False, sorted=True).values
    return positions, positions < d


def sparse_bits_rows(
    x_hat: torch.Tensor, k: int, q: float, adaptive: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Rice bits of every row's position gaps and its number of non-zeros (int64 ``[m]``).

    With the parameter a codec writes: ``b*(q)``, or each row's best when ``adaptive``
    (:func:`rice_parameter_for`); rows of at most ``k`` non-zeros (:func:`sorted_nonzeros`).
    """
    positions, valid = sorted_nonzeros(x_hat, k)
    counts = valid.sum(dim=1)
    gaps = gaps_of_sorted(positions, valid)
    if adaptive:
        return best_rice_rows(gaps, counts, x_hat.shape[1])[1], counts
    return rice_bits_rows(gaps, counts, golomb_parameter(q)), counts


def sparse_rows(v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The non-zeros of every row of ``v`` ``[m, d]``: positions, values and offsets.

    Returns:
        (positions int64 in row-major order, their values, offsets int64 [m + 1]); row ``i``
        owns entries ``offsets[i]:offsets[i + 1]``, as ``np.flatnonzero(v[i])`` would give.
    """
    m, d = v.shape
    flat = np.flatnonzero(v != 0)  # as np.flatnonzero(v) (NaN counts, -0.0 does not), faster
    rows = flat // max(d, 1)
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=m), out=offsets[1:])
    return (flat - rows * d).astype(np.int64, copy=False), v.reshape(-1)[flat], offsets


def _place(buf: np.ndarray, starts: np.ndarray, block: np.ndarray) -> None:
    """Copy row ``i`` of the uint8 ``block`` ``[r, w]`` to ``buf[starts[i]:starts[i] + w]``."""
    if block.size:
        buf[starts[:, None] + np.arange(block.shape[1])] = block


def _gather(buf: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """``[r, width]`` uint8: the ``width`` bytes of ``buf`` from each of ``starts``."""
    return buf[starts[:, None] + np.arange(width)]


def _spans(nbytes: int, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Boolean mask of ``nbytes`` bytes covering the disjoint spans ``[starts, starts + sizes)``.

    ``buf[mask]`` lists the bytes of every span in order, without a per-byte index array.
    """
    keep = sizes > 0
    delta = np.zeros(nbytes + 1, dtype=np.int32)
    delta[starts[keep]] += 1
    delta[(starts + sizes)[keep]] -= 1
    return np.cumsum(delta[:-1], dtype=np.int32) > 0


def pack_sparse_many(
    header: np.ndarray,
    gaps: np.ndarray,
    offsets: np.ndarray,
    bs: np.ndarray,
    values: np.ndarray | None = None,
    signs: np.ndarray | None = None,
) -> Payloads:
    """Write a cohort's sparse payloads: header, Rice gaps (then sign bits), padding, values.

    Message ``i`` is ``header[i]`` (a packed record whose fields ``n`` and ``b`` are filled
    here), the Rice codes of its position gaps with parameter ``bs[i]`` (Sattler et al. 2019,
    Sec. IV-C), its sign bits when ``signs`` is given (STC), zero bits to a whole byte, then
    its float32 ``values`` when given (top-k): exactly the bytes of the single-message
    encoders (:func:`encode_sparse_values`, ``STCCodec.encode``).

    Args:
        header: structured array [m] of the header fields (any besides ``n`` and ``b`` set).
        gaps: int64 position gaps of the non-zeros (:func:`positions_to_gaps_many`),
            row-major.
        offsets: int64 [m + 1], each message's segment of ``gaps``.
        bs: int64 [m] Rice parameters.
        values: float32 per position, or None.
        signs: 0/1 per position, or None.
    """
    m = offsets.size - 1
    counts = np.diff(offsets)
    if counts.size and counts.max() >= 2**32:
        raise ValueError("too many non-zeros for a uint32 count")
    nbits = rice_bits_many(gaps, offsets, bs) + (0 if signs is None else counts)
    head = header.dtype.itemsize
    sizes = head + (nbits + 7) // 8 + (0 if values is None else 4 * counts)
    out = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    buf = np.zeros(int(out[-1]), dtype=np.uint8)
    header["n"] = counts
    header["b"] = bs
    _place(buf, out[:-1], header.view(np.uint8).reshape(m, head))
    write_rice_many(buf, 8 * (out[:-1] + head), gaps, offsets, bs, signs)
    if values is not None and values.size:
        raw = np.ascontiguousarray(values, dtype="<f4").view(np.uint8)
        buf[_spans(buf.size, out[1:] - 4 * counts, 4 * counts)] = raw
    return Payloads(buf, out)


@dataclass
class SparseMessages:
    """What :func:`read_sparse_many` read from a cohort's payloads.

    Attributes:
        header: the header records [m].
        offsets: int64 [m + 1], each message's segment of ``positions`` (and the rest).
        rows: int64, the message of each position.
        positions: int64 positions of the non-zeros.
        negative: 0/1 sign bits (STC; empty otherwise).
        values: float32 trailing values (top-k; None otherwise).
    """

    header: np.ndarray
    offsets: np.ndarray
    rows: np.ndarray
    positions: np.ndarray
    negative: np.ndarray
    values: np.ndarray | None


def read_sparse_many(
    payloads: Payloads,
    numel: int,
    header_dtype: np.dtype,
    short_text: str,
    count_label: str,
    trailing_values: bool = False,
    with_signs: bool = False,
) -> SparseMessages:
    """Read a cohort's sparse payloads (inverse of :func:`pack_sparse_many`) in one pass.

    Every message gets the checks of the single-message decoders, in their order: a header
    shorter than ``header_dtype``, more non-zeros than ``numel``, (top-k) too few bytes for
    the values, a Rice parameter above ``MAX_RICE_PARAMETER``, a Rice-code or sign-bit
    overrun, non-zero or too much padding, a position out of range.

    Args:
        payloads: the messages.
        numel: entries of each decoded vector.
        header_dtype: packed record with at least ``n`` (uint32) and ``b`` (uint8).
        short_text: error text of a message shorter than its header.
        count_label: the codec's name in "... payload announces n non-zeros" errors.
        trailing_values: the message ends with ``4 n`` bytes of float32 values (top-k).
        with_signs: ``n`` sign bits follow the gaps (STC).

    Raises:
        ValueError: for the first malformed message, naming its index.
    """
    m = len(payloads)
    head = header_dtype.itemsize
    buf = payloads.buffer
    starts = payloads.offsets[:-1]
    sizes = payloads.sizes
    status = np.zeros(m, dtype=np.int64)
    header = np.zeros(m, dtype=header_dtype)
    whole = sizes >= head
    if whole.any():
        header[whole] = _gather(buf, starts[whole], head).view(header_dtype)[:, 0]
    n = header["n"].astype(np.int64)
    b = header["b"].astype(np.int64)
    stream_bytes = sizes - head - (4 * n if trailing_values else 0)
    # single-message checks, first failing one wins: -1 short header, -2 count, -3 values, -4 b
    for code, bad in (
        (-1, ~whole),
        (-2, n > numel),
        (-3, stream_bytes < 0),
        (-4, b > MAX_RICE_PARAMETER),
    ):
        status[(status == 0) & bad] = code
    counts = np.where(status == 0, n, 0)
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    start_bits = 8 * (starts + head)
    end_bits = start_bits + 8 * np.maximum(stream_bytes, 0)
    positions, negative, detail = read_rice_many(
        buf, start_bits, end_bits, offsets, b, numel, status, with_signs
    )
    bad = np.flatnonzero(status)
    if bad.size:
        i = int(bad[0])
        code = int(status[i])
        if code == -1:
            text = short_text
        elif code == -2:
            text = f"{count_label} payload announces {n[i]} non-zeros for {numel} entries"
        elif code == -3:
            text = "sparse payload too short for its values"
        elif code == -4:
            text = f"Rice parameter b={b[i]} outside [0, {MAX_RICE_PARAMETER}]"
        else:
            nbits = int(end_bits[i] - start_bits[i])
            text = rice_status_message(code, int(detail[i]), int(n[i]), nbits, numel)
        raise ValueError(f"message {i}: {text}")
    values = None
    if trailing_values:
        values = buf[_spans(buf.size, starts + sizes - 4 * counts, 4 * counts)].view("<f4")
    rows = np.repeat(np.arange(m, dtype=np.int64), counts)
    return SparseMessages(header, offsets, rows, positions, negative, values)


class TopKCodec(Codec):
    """Keep the ``ceil(q * d)`` largest-magnitude entries, sent as float32 values.

    Positions are Rice-coded gaps as in STC (Sattler et al. 2019); see the module docstring
    for the byte layout. Use with error feedback (``Channel(error_feedback=True)``).

    Args:
        q: fraction of entries kept, in (0, 1].
        adaptive_golomb: choose the Rice parameter that minimises the size of each message
            (stored in its header) instead of Sattler's ``b*(q)`` for uniform positions.
    """

    def __init__(self, q: PositiveFraction = 0.01, adaptive_golomb: bool = False) -> None:
        self.q = check_fraction(q)
        self.adaptive_golomb = bool(adaptive_golomb)

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Zero all but the ``k`` entries of largest ``|x_i|`` (ties broken by torch.topk)."""
        a = x.detach().reshape(-1).to(torch.float32)
        out = torch.zeros_like(a)
        k = keep_count(self.q, a.numel())
        if k == 0:
            return out
        idx = torch.topk(a.abs(), k, sorted=False).indices
        out[idx] = a[idx]
        return out

    def encode(self, x: torch.Tensor) -> bytes:
        """Header, Rice-coded positions of the non-zeros, then their float32 values."""
        return encode_sparse_values(
            flat_cpu_float32(x),
            lambda gaps: rice_parameter_for(gaps, self.q, self.adaptive_golomb),
        )

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Rebuild the sparse float32 vector."""
        return decode_sparse_values(payload, numel)

    def compress_many(self, x: torch.Tensor, generators: Streams | None = None) -> torch.Tensor:
        """``compress`` of every row with one ``torch.topk(|x|, k, dim=1)`` and a scatter.

        Row ``i`` equals ``compress(x[i])`` exactly whenever the row has no tie at the
        ``k``-th largest magnitude; with a tie, either result is a valid top-k (both use
        ``torch.topk``, whose choice among tied entries is not specified).

        Args:
            x: ``[m, d]`` stacked messages.
            generators: unused (checked for length); top-k is deterministic.
        """
        if overrides(self, TopKCodec, "compress"):
            return super().compress_many(x, generators)
        a = as_rows(x)
        check_generators(generators, a.shape[0])
        out = torch.zeros_like(a)
        k = keep_count(self.q, a.shape[1])
        if k == 0 or a.shape[0] == 0:
            return out
        idx = torch.topk(a.abs(), k, dim=1, sorted=False).indices
        return out.scatter_(1, idx, a.gather(1, idx))

    def encode_many(self, x_hat: torch.Tensor) -> Payloads:
        """Every row's payload (byte for byte ``encode(row)``) in one vectorised pass.

        Positions, gaps, headers and values are numpy array work over the whole cohort, the
        Rice codes of all messages one numba call; each message has its own Rice parameter
        (``b*(q)``, or with ``adaptive_golomb`` its own best, Sattler et al. 2019 Sec. IV-C).
        """
        if overrides(self, TopKCodec, "encode"):
            return super().encode_many(x_hat)
        v = np.ascontiguousarray(as_rows(x_hat).to("cpu").numpy())
        positions, values, offsets = sparse_rows(v)
        gaps = positions_to_gaps_many(positions, offsets)
        bs = rice_parameters_for_many(gaps, offsets, self.q, self.adaptive_golomb)
        header = np.zeros(v.shape[0], dtype=_SPARSE_HEADER_DTYPE)
        return pack_sparse_many(header, gaps, offsets, bs, values=values)

    def decode_many(self, payloads: Payloads, numel: int) -> torch.Tensor:
        """Every message decoded (CPU float32 ``[m, numel]``) in one pass.

        Raises:
            ValueError: as ``decode`` would, for the first malformed message (named).
        """
        if overrides(self, TopKCodec, "decode"):
            return super().decode_many(payloads, numel)
        msgs = read_sparse_many(
            payloads,
            numel,
            _SPARSE_HEADER_DTYPE,
            "sparse payload shorter than its header",
            "sparse",
            trailing_values=True,
        )
        out = np.zeros((len(payloads), numel), dtype=np.float32)
        out[msgs.rows, msgs.positions] = msgs.values
        return torch.from_numpy(out)

    def sizes_many(self, x_hat: torch.Tensor) -> torch.Tensor | None:
        """``5 + ceil(rice_bits / 8) + 4 n`` of every row of a ``compress_many`` output.

        On ``x_hat``'s device (at most ``k`` non-zeros a row: :func:`sparse_bits_rows`).
        """
        if overrides(self, TopKCodec, "encode"):
            return None
        k = keep_count(self.q, x_hat.shape[1])
        bits, n = sparse_bits_rows(x_hat, k, self.q, self.adaptive_golomb)
        return _SPARSE_HEADER.size + (bits + 7) // 8 + 4 * n

    def received_many(self, x_hat: torch.Tensor) -> torch.Tensor:
        """The rows with ``-0.0`` as ``0.0``: a kept zero is not sent, whatever its sign."""
        if overrides(self, TopKCodec, "decode"):
            return Codec.received_many(self, x_hat)
        return x_hat + 0.0

    def __repr__(self) -> str:
        return f"TopKCodec(q={self.q}, adaptive_golomb={self.adaptive_golomb})"
