"""The DP mechanisms' arithmetic: joint clipping, Gaussian noise, adaptive clipping.

Pure functions over stacked ``[m, d]`` rows (one row a client); where they apply in a round
is :mod:`fedexp.privacy.uplink`'s business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def joint_norms(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """[m] the L2 norm of each client's parts taken together (``parts``: ``[m, d_i]`` each)."""
    total = sum(p.to(torch.float64).square().sum(dim=1) for p in parts)
    return torch.sqrt(total)  # type: ignore[arg-type]


def clip_factors(norms: torch.Tensor, bound: float) -> torch.Tensor:
    """[m] the factor min(1, C/‖v‖) that clips each row to norm ``bound`` (1 for C = inf, v = 0).

    "Learning Differentially Private Recurrent Language Models" (McMahan et al. 2018), the
    per-user clip π(Δ, S) = Δ · min(1, S/‖Δ‖). The factor is computed in float64 and rounded
    down a hair so that the clipped norm never exceeds C in the rows' own precision.
    """
    if math.isinf(bound):
        return torch.ones_like(norms)
    scale = torch.where(norms > bound, bound / norms.clamp_min(1e-300), torch.ones_like(norms))
    return torch.where(scale < 1, scale * (1 - 1e-6), scale)


def gaussian(
    generator: torch.Generator, numel: int, std: float, like: torch.Tensor
) -> torch.Tensor:
    """``numel`` draws of N(0, std²) from ``generator`` (CPU), on ``like``'s device and dtype."""
    draw = torch.randn(numel, generator=generator, dtype=torch.float64)
    return (std * draw).to(device=like.device, dtype=like.dtype)


def update_noise_multiplier(total: float, count_stddev: float) -> float:
    """z_Δ of the update sum when the clip count also spends privacy.

    Andrew et al. 2021 ("Differentially Private Learning with Adaptive Clipping", Thm. 1): the
    centred count Σ (b_n − ½) (sensitivity ½) with noise σ_b and the update sum with z_Δ
    compose to one Gaussian of multiplier z with z⁻² = z_Δ⁻² + (2σ_b)⁻².

    Raises:
        ValueError: 2σ_b ≤ z, so no z_Δ reaches the total ``z``.
    """
    if total == 0:
        return 0.0
    rest = total**-2 - (2 * count_stddev) ** -2
    if rest <= 0:
        raise ValueError(
            f"privacy.count_stddev={count_stddev:g}: adaptive clipping needs 2·count_stddev > "
            f"noise_multiplier={total:g}; raise count_stddev (or the cohort, whose size / 20 is "
            "its default)"
        )
    return rest**-0.5


def adaptive_clip(
    clip: float,
    unclipped: float,
    count: int,
    expected: float,
    count_noise: float,
    target_quantile: float,
    lr: float,
) -> float:
    """The next C of geometric adaptive clipping (Andrew et al. 2021, Algorithm 1).

    b̄ = (Σ_n (b_n − ½) + N(0, σ_b²)) / E + ½, with b_n = 1 when client n's update was not
    clipped, E the expected cohort size; then C ← C · exp(−η_C (b̄ − γ)).

    Args:
        clip: the round's C.
        unclipped: Σ b_n over the round's uploads.
        count: how many uploaded.
        expected: E.
        count_noise: the round's draw of N(0, σ_b²).
        target_quantile: γ.
        lr: η_C.
    """
    b = (unclipped - count / 2 + count_noise) / expected + 0.5
    return clip * math.exp(-lr * (b - target_quantile))
