"""How an upload is clipped: all its parts together to C, or each part to its share of C.

Chosen once when the run is built (:func:`clipping_of`), used by both ends of
:class:`fedexp.privacy.uplink.PrivateUplink`.

* :class:`JointClip` (the default): the upload's parts taken as one vector, clipped to L2
  norm C ("Learning Differentially Private Recurrent Language Models", McMahan et al. 2018).
* :class:`PartClip` (``privacy.part_clip``): part p clipped to C·√s_p, with shares s_p > 0,
  Σ_p s_p = 1. An algorithm whose parts differ in scale (SCAFFOLD's model change Δy and
  control-variate change Δc; Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging
  for Federated Learning", ICML 2020) then gives each part a budget of its own, instead of
  letting the larger part decide how much the smaller one is shrunk.

**Per-part clipping keeps the joint bound, hence the accounting.** Let v = (v_1, ..., v_P)
be an upload and f_p = min(1, C√s_p/‖v_p‖) the factor of part p. Then

    ‖clip(v)‖² = Σ_p f_p² ‖v_p‖² ≤ Σ_p (C√s_p)² = C² Σ_p s_p = C²,

so a clipped upload's norm, all parts together, is at most C, as with joint clipping (the
factors are rounded down a hair, :func:`~fedexp.privacy.mechanisms.clip_factors`, so this
holds in the rows' own precision). Adding or removing one client moves the sum of the clipped
uploads by at most C in L2, and replacing one by at most 2C: the sensitivities the
accountant assumes. The noise is unchanged, N(0, z²C²) on every coordinate of every part, so
the release is the same Gaussian mechanism of multiplier z, sampled as before, and ε, the
calibration of ``target_epsilon`` and the drowning check are those of joint clipping.
Per-part clipping only decides how the budget C² is split between the parts.

**Adaptive clipping counts jointly.** Andrew et al. 2021 ("Differentially Private Learning
with Adaptive Clipping") privatise one bit per client, b_n = 1 when its update was not
clipped. With parts, b_n = 1 when *no* part of client n was clipped, i.e. when
r_n = max_p ‖v_{n,p}‖/√s_p ≤ C. It is still one bit per client, of sensitivity ½, so the
paper's Theorem 1 composes it with the update sum exactly as before, and C follows the
γ-quantile of r_n (at γ = ½ a client's upload is left whole half the time). A count per part
would spend privacy P times (z⁻² = z_Δ⁻² + P(2σ_b)⁻²) to move bounds whose sum of squares
the shares already fix, so it is not offered; the shares stay fixed, C moves them together.
Each part's clipped share is reported (``privacy/clipped/<part>``) as a diagnostic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedexp.privacy.mechanisms import clip_factors
from fedexp.privacy.mechanisms import joint_norms

#: how far from 1 the shares' sum may be
SUM_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Clipped:
    """One cohort's clip: each part's ``[m]`` factors and the counts the clients report.

    Attributes:
        factors: part -> ``[m]`` factors min(1, bound/‖v‖) (the same tensor for every part
            when clipped jointly).
        flags: ``[2 + K]`` one tensor to read at once: whether any row was clipped, how many
            uploads were left whole, then how many rows of each of :attr:`keys`' parts were.
        keys: the metric names of the per-part counts in ``flags`` (none when joint).
    """

    factors: dict[str, torch.Tensor]
    flags: torch.Tensor
    keys: tuple[str, ...] = ()


class JointClip:
    """Every part of an upload together to L2 norm C (today's clip, bit for bit)."""

    def factors(self, changes: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
        """Each part's ``[m]`` factors: one factor a row for all of its parts."""
        f = clip_factors(joint_norms(list(changes.values())), clip)
        return dict.fromkeys(changes, f)

    def clip(self, changes: dict[str, torch.Tensor], clip: float) -> Clipped:
        """:meth:`factors`, whether any row is clipped and how many are within C."""
        norms = joint_norms(list(changes.values()))
        f = clip_factors(norms, clip)
        flags = torch.stack([(f < 1).any(), (norms <= clip).sum()])
        return Clipped(dict.fromkeys(changes, f), flags)

    def describe(self) -> str:
        """Nothing: joint clipping is what C means."""
        return ""


class PartClip:
    """Part p of an upload to L2 norm C·√s_p (Σ_p s_p = 1): jointly still within C.

    Args:
        shares: s_p by part name, positive, summing to 1 (checked by
            :class:`fedexp.privacy.settings.Privacy` and :func:`clipping_of`).
    """

    def __init__(self, shares: Mapping[str, float]) -> None:
        self.shares = dict(shares)

    def _bounds(self, changes: dict[str, torch.Tensor], clip: float) -> dict[str, float]:
        extra = sorted(set(changes) - set(self.shares))
        if extra:  # an upload part the algorithm does not declare: it has no budget
            raise ValueError(
                f"privacy.part_clip: the upload has part(s) {', '.join(map(repr, extra))}, "
                f"which have no share (shares for: {', '.join(self.shares)}); the algorithm "
                "must declare every upload part in its uplink_parts"
            )
        # a part the upload lacks leaves its share unused: the rest still sums to <= C²
        return {name: clip * math.sqrt(self.shares[name]) for name in changes}

    def factors(self, changes: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
        """Each part's ``[m]`` factors min(1, C√s_p/‖v_p‖)."""
        bounds = self._bounds(changes, clip)
        return {k: clip_factors(joint_norms([v]), bounds[k]) for k, v in changes.items()}

    def clip(self, changes: dict[str, torch.Tensor], clip: float) -> Clipped:
        """:meth:`factors`; an upload is left whole when every part is within its bound."""
        bounds = self._bounds(changes, clip)
        factors, within = {}, []
        for name, v in changes.items():
            norms = joint_norms([v])
            factors[name] = clip_factors(norms, bounds[name])
            within.append(norms <= bounds[name])
        whole = torch.stack(within).all(dim=0)
        clipped = torch.stack([(f < 1).any() for f in factors.values()]).any()
        flags = torch.stack([clipped, whole.sum(), *(w.sum() for w in within)])
        keys = tuple(f"privacy/unclipped/{name}" for name in changes)
        return Clipped(factors, flags, keys)

    def describe(self) -> str:
        """``dy to C·√0.8, dc to C·√0.2``."""
        return ", ".join(f"{k} to C·√{v:g}" for k, v in self.shares.items())


def check_shares(shares: object) -> dict[str, float]:
    """``privacy.part_clip`` as a dict of shares, or ValueError in one line naming the key.

    Each share must be a positive finite number, the names non-empty, the sum 1 within
    :data:`SUM_TOLERANCE`.
    """
    key = "privacy.part_clip"
    if not isinstance(shares, Mapping) or not shares:
        raise ValueError(
            f"{key}={shares!r}: expected a share of C² for each upload part, e.g. "
            "{dy: 0.8, dc: 0.2} (positive, summing to 1)"
        )
    out = {}
    for name, value in shares.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{key}: part name {name!r}: expected a non-empty part name")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            raise ValueError(f"{key}.{name}={value!r}: expected a positive finite share of C²")
        out[name] = float(value)
    total = math.fsum(out.values())
    if abs(total - 1) > SUM_TOLERANCE:
        raise ValueError(
            f"{key}={show(out)}: the shares of C² must sum to 1 (within {SUM_TOLERANCE:g}), "
            f"not {total!r}, so that the whole upload stays within C"
        )
    return out


def show(shares: Mapping[str, float]) -> str:
    """``{dy: 0.8, dc: 0.2}``: shares as written on the command line."""
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shares.items()) + "}"


def clipping_of(
    shares: Mapping[str, float] | None, kinds: Mapping[str, str], algorithm: str | None = None
) -> JointClip | PartClip:
    """The clip of a run: joint without shares; per part when they name the upload's parts.

    Args:
        shares: ``privacy.part_clip`` (checked by :func:`check_shares`), or None.
        kinds: the algorithm's ``uplink_parts``; its parts of kind "exact" are not clipped.
        algorithm: the algorithm's name, for the message.

    Raises:
        ValueError: the shares do not name exactly the algorithm's clipped upload parts, in
            one line naming the key and those parts.
    """
    if shares is None:
        return JointClip()
    shares = check_shares(shares)
    who = algorithm or "the algorithm"
    parts = [name for name, kind in kinds.items() if kind != "exact" and name]
    if not parts:
        said = ", ".join(f"{k} ({v})" for k, v in kinds.items()) or "none"
        raise ValueError(
            f"privacy.part_clip={show(shares)}: {who} declares no named upload part to clip "
            f"(its uplink parts: {said}); its upload is clipped as one: remove privacy.part_clip"
        )
    if set(shares) != set(parts):
        unknown = [k for k in shares if k not in parts]
        missing = [k for k in parts if k not in shares]
        what = "; ".join(
            s
            for s in (
                f"no such part {', '.join(unknown)}" if unknown else "",
                f"no share for {', '.join(missing)}" if missing else "",
            )
            if s
        )
        raise ValueError(
            f"privacy.part_clip={show(shares)}: expected a share for each of {who}'s upload "
            f"parts {', '.join(parts)} ({what})"
        )
    return PartClip({name: shares[name] for name in parts})
