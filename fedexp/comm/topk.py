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
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import torch

from fedexp.comm.codec import Codec
from fedexp.comm.golomb import (
    BitReader,
    BitWriter,
    best_rice_parameter,
    check_padding,
    gaps_to_positions,
    golomb_parameter,
    positions_to_gaps,
    rice_bits,
)

_SPARSE_HEADER = struct.Struct("<IB")


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


class TopKCodec(Codec):
    """Keep the ``ceil(q * d)`` largest-magnitude entries, sent as float32 values.

    Positions are Rice-coded gaps as in STC (Sattler et al. 2019); see the module docstring
    for the byte layout. Use with error feedback (``Channel(error_feedback=True)``).

    Args:
        q: fraction of entries kept, in (0, 1].
        adaptive_golomb: choose the Rice parameter that minimises the size of each message
            (stored in its header) instead of Sattler's ``b*(q)`` for uniform positions.
    """

    def __init__(self, q: float = 0.01, adaptive_golomb: bool = False) -> None:
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

    def __repr__(self) -> str:
        return f"TopKCodec(q={self.q}, adaptive_golomb={self.adaptive_golomb})"
