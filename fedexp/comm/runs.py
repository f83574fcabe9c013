"""Lossless run-length coding of piecewise-constant vectors (the natural codec after CER).

CER (pFedNet paper, Sec. IV-A) makes an update piecewise constant: ``d`` entries
in ``R << d`` runs of equal values. :class:`RunLengthCodec` sends each run once: its length
(Rice-coded, with the parameter that minimises the size of this very message) and its value
(float32). Runs are maximal blocks of bit-identical float32 values, so the round trip is exact
for any input (``-0.0``, NaN payloads included).

Wire format (little-endian)::

    uint8   mode    0 = runs, 1 = dense (chosen when it is smaller)
    mode 0: uint32 R, uint8 b, Rice codes of (length_r - 1) for r = 1..R zero-padded to a
            byte, then R float32 values
    mode 1: d float32 values

so a message costs at most one byte more than :class:`fedexp.comm.codec.DenseCodec`.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedexp.comm.codec import Codec
from fedexp.comm.golomb import BitReader, BitWriter, best_rice_parameter, check_padding, rice_bits
from fedexp.comm.topk import flat_cpu_float32

_RUNS, _DENSE = 0, 1
_RUN_HEADER = struct.Struct("<BIB")


def find_runs(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start indices and lengths of the maximal runs of bit-identical float32 values."""
    if v.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    bits = np.ascontiguousarray(v, dtype=np.float32).view(np.int32)
    starts = np.concatenate([[0], np.flatnonzero(bits[1:] != bits[:-1]) + 1]).astype(np.int64)
    lengths = np.diff(np.append(starts, v.size))
    return starts, lengths


def count_runs(x: torch.Tensor) -> int:
    """Number of maximal runs of equal values of a flat tensor (0 for an empty one)."""
    if x.numel() == 0:
        return 0
    return 1 + int((x[1:] != x[:-1]).sum())


class RunLengthCodec(Codec):
    """Lossless run-length codec: Rice-coded run lengths plus one float32 value per run."""

    lossless = True

    @staticmethod
    def runs_bytes(lengths: np.ndarray) -> int:
        """Size in bytes of the run-mode payload for these run lengths."""
        lengths = np.asarray(lengths, dtype=np.int64)
        b = best_rice_parameter(lengths - 1)
        return _RUN_HEADER.size + math.ceil(rice_bits(lengths - 1, b) / 8) + 4 * lengths.size

    def encode(self, x: torch.Tensor) -> bytes:
        """Runs (or dense float32 if that is smaller); see the module docstring."""
        v = flat_cpu_float32(x)
        starts, lengths = find_runs(v)
        if starts.size >= 2**32:
            raise ValueError("too many runs for a uint32 count")
        gaps = lengths - 1
        b = best_rice_parameter(gaps)
        nbits = rice_bits(gaps, b)
        if _RUN_HEADER.size + math.ceil(nbits / 8) + 4 * starts.size > 4 * v.size:
            return bytes([_DENSE]) + v.astype("<f4", copy=False).tobytes()
        writer = BitWriter(nbits)
        writer.write_rice(gaps, b)
        values = v[starts].astype("<f4", copy=False).tobytes()
        return _RUN_HEADER.pack(_RUNS, starts.size, b) + writer.getvalue() + values

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Expand the runs (or read the dense fallback) into a CPU float32 vector."""
        if not payload:
            raise ValueError("empty run-length payload")
        if payload[0] == _DENSE:
            if len(payload) != 1 + 4 * numel:
                raise ValueError(f"dense run-length payload has {len(payload)} bytes")
            return torch.from_numpy(np.frombuffer(payload, dtype="<f4", offset=1).copy())
        if payload[0] != _RUNS or len(payload) < _RUN_HEADER.size:
            raise ValueError("malformed run-length payload")
        _, n_runs, b = _RUN_HEADER.unpack_from(payload)
        stream_len = len(payload) - _RUN_HEADER.size - 4 * n_runs
        if stream_len < 0 or n_runs > numel:
            raise ValueError("run-length payload too short for its runs")
        reader = BitReader(payload[_RUN_HEADER.size : _RUN_HEADER.size + stream_len])
        lengths = reader.read_rice(n_runs, b) + 1
        check_padding(reader)
        if (n_runs and int(lengths.max()) > numel) or int(lengths.sum()) != numel:
            raise ValueError(f"runs cover {int(lengths.sum())} entries, expected {numel}")
        values = np.frombuffer(payload, dtype="<f4", count=n_runs, offset=len(payload) - 4 * n_runs)
        return torch.from_numpy(np.repeat(values, lengths).astype(np.float32, copy=False))

    def __repr__(self) -> str:
        return "RunLengthCodec()"
