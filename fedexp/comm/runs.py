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

Cohorts: ``encode_many`` / ``decode_many`` code every message in one pass (numpy, and the
Rice kernels of :mod:`fedexp.comm.golomb_cohort`), byte for byte as ``encode`` / ``decode``;
``sizes_many`` gives every message's length from the formula above on the messages' device.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from fedexp.comm.codec import Codec
from fedexp.comm.codec import Payloads
from fedexp.comm.codec import as_rows
from fedexp.comm.codec import overrides
from fedexp.comm.golomb import MAX_RICE_PARAMETER
from fedexp.comm.golomb import BitReader
from fedexp.comm.golomb import BitWriter
from fedexp.comm.golomb import best_rice_parameter
from fedexp.comm.golomb import check_padding
from fedexp.comm.golomb import rice_bits
from fedexp.comm.golomb_cohort import OUT_OF_RANGE
from fedexp.comm.golomb_cohort import best_rice_parameters
from fedexp.comm.golomb_cohort import best_rice_rows
from fedexp.comm.golomb_cohort import gaps_of_marked
from fedexp.comm.golomb_cohort import positions_to_gaps_many
from fedexp.comm.golomb_cohort import read_rice_many
from fedexp.comm.golomb_cohort import rice_bits_many
from fedexp.comm.golomb_cohort import rice_status_message
from fedexp.comm.topk import _gather
from fedexp.comm.topk import _spans
from fedexp.comm.topk import flat_cpu_float32
from fedexp.comm.topk import pack_sparse_many

_RUNS, _DENSE = 0, 1
_RUN_HEADER = struct.Struct("<BIB")
#: The run-mode header as a packed numpy record (for whole cohorts).
_RUN_HEADER_DTYPE = np.dtype([("mode", "u1"), ("n", "<u4"), ("b", "u1")])


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

    def encode_many(self, x_hat: torch.Tensor) -> Payloads:
        """Every row's payload, byte for byte ``encode(row)``, in one vectorised pass.

        The runs of all rows are found at once (the ends of the runs: where a row's float32
        bits change), each row gets its best Rice parameter, and the rows whose run-mode
        payload would be larger than dense float32 are sent dense.
        """
        if overrides(self, RunLengthCodec, "encode"):
            return super().encode_many(x_hat)
        v = np.ascontiguousarray(as_rows(x_hat).to("cpu").numpy())
        m, d = v.shape
        ends = np.ones((m, d), dtype=bool)  # the last entry of each run
        if d:
            bits = v.view(np.int32)
            ends[:, :-1] = bits[:, 1:] != bits[:, :-1]
        flat = np.flatnonzero(ends)
        rows = flat // max(d, 1)
        offsets = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=m), out=offsets[1:])
        gaps = positions_to_gaps_many(flat - rows * d, offsets)  # each run's length - 1
        bs = best_rice_parameters(gaps, offsets)
        counts = np.diff(offsets)
        runs_size = _RUN_HEADER.size + (rice_bits_many(gaps, offsets, bs) + 7) // 8 + 4 * counts
        dense = runs_size > 4 * d
        sizes = np.where(dense, 1 + 4 * d, runs_size)
        out = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(sizes, out=out[1:])
        buf = np.zeros(int(out[-1]), dtype=np.uint8)
        if dense.any():
            block = np.empty((int(dense.sum()), 1 + 4 * d), dtype=np.uint8)
            block[:, 0] = _DENSE
            block[:, 1:] = v[dense].astype("<f4", copy=False).view(np.uint8)
            buf[_spans(buf.size, out[:-1][dense], sizes[dense])] = block.reshape(-1)
        keep = ~dense
        if keep.any():
            entries = keep[rows]
            sub = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
            np.cumsum(counts[keep], out=sub[1:])
            header = np.zeros(sub.size - 1, dtype=_RUN_HEADER_DTYPE)
            runs = pack_sparse_many(
                header, gaps[entries], sub, bs[keep], values=v.reshape(-1)[flat[entries]]
            )
            buf[_spans(buf.size, out[:-1][keep], sizes[keep])] = runs.buffer
        return Payloads(buf, out)

    def decode_many(self, payloads: Payloads, numel: int) -> torch.Tensor:
        """Every message decoded (CPU float32 ``[m, numel]``) in one pass.

        Raises:
            ValueError: as ``decode`` would, for the first malformed message (named).
        """
        if overrides(self, RunLengthCodec, "decode"):
            return super().decode_many(payloads, numel)
        m, head = len(payloads), _RUN_HEADER.size
        buf, starts, sizes = payloads.buffer, payloads.offsets[:-1], payloads.sizes
        mode = np.full(m, 255, dtype=np.int64)
        some = sizes > 0
        mode[some] = buf[starts[some]]
        dense = some & (mode == _DENSE)
        whole = some & (mode == _RUNS) & (sizes >= head)
        header = np.zeros(m, dtype=_RUN_HEADER_DTYPE)
        if whole.any():
            header[whole] = _gather(buf, starts[whole], head).view(_RUN_HEADER_DTYPE)[:, 0]
        n, b = header["n"].astype(np.int64), header["b"].astype(np.int64)
        stream = sizes - head - 4 * n
        # the single decoder's checks, first failing one wins (negative codes)
        status = np.zeros(m, dtype=np.int64)
        for code, bad in (
            (-1, ~some),
            (-2, dense & (sizes != 1 + 4 * numel)),
            (-3, ~dense & ~whole),
            (-4, whole & ((stream < 0) | (n > numel))),
            (-5, whole & (b > MAX_RICE_PARAMETER)),
        ):
            status[(status == 0) & bad] = code
        runs = (status == 0) & ~dense
        counts = np.where(runs, n, 0)
        offsets = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        start_bits = 8 * (starts + head)
        end_bits = start_bits + 8 * np.maximum(stream, 0)
        kernel = np.where(runs, 0, 1)  # the kernel skips the rest
        ends, _, detail = read_rice_many(
            buf, start_bits, end_bits, offsets, np.where(runs, b, 0), numel, kernel
        )
        status[runs] = kernel[runs]
        covered = np.zeros(m, dtype=np.int64)
        filled = runs & (counts > 0)
        covered[filled] = ends[offsets[1:][filled] - 1] + 1
        status[runs & (status == 0) & (covered != numel)] = -6
        bad = np.flatnonzero(status)
        if bad.size:
            i = int(bad[0])
            text = self._error(
                int(status[i]), int(sizes[i]), int(b[i]), int(detail[i]), int(covered[i]), numel
            )
            raise ValueError(f"message {i}: {text}")
        out = np.empty((m, numel), dtype=np.float32)
        if dense.any():
            raw = buf[_spans(buf.size, starts[dense] + 1, sizes[dense] - 1)]
            out[dense] = raw.view("<f4").reshape(int(dense.sum()), numel)
        if runs.any():
            values = buf[_spans(buf.size, starts + sizes - 4 * counts, 4 * counts)].view("<f4")
            lengths = np.diff(ends, prepend=-1)
            firsts = offsets[:-1][counts > 0]
            lengths[firsts] = ends[firsts] + 1
            out[runs] = np.repeat(values, lengths).reshape(int(runs.sum()), numel)
        return torch.from_numpy(out)

    @staticmethod
    def _error(code: int, size: int, b: int, detail: int, covered: int, numel: int) -> str:
        """The single decoder's error text for a message's status ``code``."""
        texts = {
            -1: "empty run-length payload",
            -2: f"dense run-length payload has {size} bytes",
            -3: "malformed run-length payload",
            -4: "run-length payload too short for its runs",
            -5: f"Rice parameter b={b} outside [0, {MAX_RICE_PARAMETER}]",
            -6: f"runs cover {covered} entries, expected {numel}",
            OUT_OF_RANGE: f"runs cover {detail + 1} entries, expected {numel}",
        }
        return texts.get(code) or rice_status_message(code, detail, 0, 0, numel)

    def sizes_many(self, x_hat: torch.Tensor) -> torch.Tensor | None:
        """``len(encode(row))`` of every row on its device: runs, or dense when smaller.

        The ends of the runs (where a row's float32 bits change), their gaps (each run's
        length - 1) and each row's best Rice parameter (:func:`best_rice_rows`).
        """
        if overrides(self, RunLengthCodec, "encode"):
            return None
        m, d = x_hat.shape
        bits = x_hat.to(torch.float32).contiguous().view(torch.int32)
        ends = torch.ones((m, d), dtype=torch.bool, device=x_hat.device)
        ends[:, :-1] = bits[:, 1:] != bits[:, :-1]
        counts = ends.sum(dim=1)
        nbits = best_rice_rows(gaps_of_marked(ends), counts, d)[1]
        runs = _RUN_HEADER.size + (nbits + 7) // 8 + 4 * counts
        return torch.where(runs > 4 * d, 1 + 4 * d, runs)

    def __repr__(self) -> str:
        return "RunLengthCodec()"
