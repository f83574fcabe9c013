"""Random-k sparsification ("FedAvg s.a.r." of the TDPFed paper).

Keeps ``k = ceil(q d)`` positions drawn uniformly without replacement from the sender's
random stream. The TDPFed paper's baseline "FedAvg (s.a.r.)" randomly selects the same
proportion of parameters in both directions and notes that the positions of the kept entries
must be sent too; here they are, as Rice-coded gaps (Sattler et al. 2019's ``b*(q)`` is the
optimal power-of-two Golomb parameter for uniformly random positions).

Wire format: identical to :class:`fedexp.comm.topk.TopKCodec` (``uint32 n, uint8 b``, Rice
gaps padded to a byte, ``n`` float32 values). With ``unbiased=True`` the kept values are scaled
by ``d / k`` so that ``E[compress(x)] = x`` (Stich et al. 2018; Wangni et al. 2018).

A sender's stream is a torch generator (``torch.randperm``), or, as the engine gives it, an
int64 stream key: then the kept positions are the ``k`` smallest of ``d`` SplitMix64 values of
the key (:func:`keyed_positions`), a uniform ``k``-subset drawn for a whole cohort by one
tensor expression and one ``topk``, the same for a message alone or in any cohort, on any
device.
"""

from __future__ import annotations

import torch

from fedexp.comm.codec import Codec
from fedexp.comm.codec import Streams
from fedexp.comm.codec import as_rows
from fedexp.comm.codec import check_generators
from fedexp.comm.codec import overrides
from fedexp.comm.topk import TopKCodec
from fedexp.comm.topk import keep_count
from fedexp.config.ranges import PositiveFraction
from fedexp.streams import mix64

#: SplitMix64's increment (the golden ratio), as a signed 64-bit integer.
_PHI = 0x9E3779B97F4A7C15 - (1 << 64)


def keyed_positions(keys: torch.Tensor, d: int, k: int) -> torch.Tensor:
    """``k`` distinct positions in ``[0, d)`` of each stream key, uniformly at random.

    Position ``j`` of the stream with key ``s`` scores ``mix64(s + j φ)``, the ``j``-th value
    of SplitMix64 seeded with ``s`` (Steele, Lea & Flood 2014); the ``k`` smallest scores are
    kept. The scores are i.i.d. uniform 64-bit values (ties have probability below
    ``d² / 2⁶⁴``), so the kept set is a uniform ``k``-subset.

    Args:
        keys: int64 ``[m]`` stream keys.
        d: entries of a message.
        k: positions to keep, ``0 <= k <= d``.

    Returns:
        int64 ``[m, k]`` on ``keys``' device (in no particular order).
    """
    j = torch.arange(d, dtype=torch.int64, device=keys.device)
    scores = mix64(keys.to(torch.int64)[:, None] + j * _PHI)
    return torch.topk(scores, k, dim=1, largest=False, sorted=False).indices


class RandKCodec(TopKCodec):
    """Keep ``ceil(q d)`` uniformly random entries, sent as float32 with coded positions.

    Only the choice of entries differs from :class:`TopKCodec`; the byte format is its own.

    Args:
        q: fraction of entries kept, in (0, 1].
        unbiased: scale the kept values by ``d / k`` (unbiased estimator of ``x``).
        adaptive_golomb: as in :class:`fedexp.comm.topk.TopKCodec`.
    """

    def __init__(
        self, q: PositiveFraction = 0.5, unbiased: bool = False, adaptive_golomb: bool = False
    ) -> None:
        super().__init__(q, adaptive_golomb)
        self.unbiased = bool(unbiased)
        self.randomised = True

    def compress(
        self, x: torch.Tensor, generator: torch.Generator | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Zero all but ``k`` random entries, optionally scaled by ``d / k``.

        Positions come from ``generator``: a torch generator (``torch.randperm``; torch's
        global stream when None), or an int64 stream key (:func:`keyed_positions`).
        """
        if isinstance(generator, torch.Tensor):
            return self.compress_many(x.reshape(1, -1), generator.reshape(1))[0]
        a = x.detach().reshape(-1).to(torch.float32)
        out = torch.zeros_like(a)
        d = a.numel()
        k = keep_count(self.q, d)
        if k == 0:
            return out
        if generator is None:
            idx = torch.randperm(d)[:k]
        else:
            idx = torch.randperm(d, generator=generator, device=generator.device)[:k]
        idx = idx.to(a.device)
        kept = a[idx]
        if self.unbiased:
            kept = kept * (d / k)
        out[idx] = kept
        return out

    def compress_many(self, x: torch.Tensor, generators: Streams | None = None) -> torch.Tensor:
        """``compress`` of every row; with stream keys, for the whole cohort at once.

        Args:
            x: ``[m, d]`` stacked messages.
            generators: int64 stream keys ``[m]`` (one :func:`keyed_positions` and one
                scatter for all rows), or one torch generator (or None) per row (row by row).
        """
        if not isinstance(generators, torch.Tensor) or overrides(self, RandKCodec, "compress"):
            return Codec.compress_many(self, x, generators)
        a = as_rows(x)
        check_generators(generators, a.shape[0])
        out = torch.zeros_like(a)
        d = a.shape[1]
        k = keep_count(self.q, d)
        if k == 0 or a.shape[0] == 0:
            return out
        idx = keyed_positions(generators.to(a.device), d, k)
        kept = a.gather(1, idx)
        if self.unbiased:
            kept = kept * (d / k)
        return out.scatter_(1, idx, kept)

    def __repr__(self) -> str:
        return f"RandKCodec(q={self.q}, unbiased={self.unbiased})"
