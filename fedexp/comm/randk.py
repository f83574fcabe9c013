"""Random-k sparsification ("FedAvg s.a.r." of the TDPFed paper).

Keeps ``k = ceil(q d)`` positions drawn uniformly without replacement from the sender's
random stream. The TDPFed paper's baseline "FedAvg (s.a.r.)" randomly selects the same
proportion of parameters in both directions and notes that the positions of the kept entries
must be sent too; here they are, as Rice-coded gaps (Sattler et al. 2019's ``b*(q)`` is the
optimal power-of-two Golomb parameter for uniformly random positions).

Wire format: identical to :class:`fedexp.comm.topk.TopKCodec` (``uint32 n, uint8 b``, Rice
gaps padded to a byte, ``n`` float32 values). With ``unbiased=True`` the kept values are scaled
by ``d / k`` so that ``E[compress(x)] = x`` (Stich et al. 2018; Wangni et al. 2018).
"""

from __future__ import annotations

import torch

from fedexp.comm.topk import TopKCodec, keep_count
from fedexp.config.ranges import PositiveFraction


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

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Zero all but ``k`` random entries, optionally scaled by ``d / k``.

        Positions come from ``generator`` (torch's global stream when it is None).
        """
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

    def __repr__(self) -> str:
        return f"RandKCodec(q={self.q}, unbiased={self.unbiased})"
