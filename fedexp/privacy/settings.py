"""The ``privacy`` config group: client-level differential privacy of the uploads.

``fedexp run privacy=central`` (DP-FedAvg: each upload clipped to L2 norm C, the server noises
the sum with N(0, z²C²)), ``privacy=adaptive`` (the same, C following a quantile of the update
norms), ``privacy=local`` (each client noises its own clipped upload); ``privacy=none`` (the
default) changes nothing. The mechanisms: :mod:`fedexp.privacy.uplink`; their accounting:
:mod:`fedexp.privacy.accountant`; the reasoning: docs/privacy.md.
"""

from __future__ import annotations

from typing import Annotated

from fedexp.config.ranges import Fraction
from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import Range
from fedexp.privacy.clipping import check_shares

MODES = ("none", "central", "local")
SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("auto", "pld", "rdp")

#: L2 bound C of each client's upload (inf: no clipping).
ClipBound = Annotated[float, Range(gt=0, inf=True, note="inf: no clipping")]


class Privacy:
    """Client-level DP settings of a run.

    Args:
        mode: "none", "central" (the trusted server noises the sum of the clipped uploads;
            "Learning Differentially Private Recurrent Language Models", McMahan et al. 2018)
            or "local" (each client noises its own clipped upload before it leaves).
        clip: C, the L2 norm every client's upload is clipped to (all its parts together); the
            initial C with ``adaptive``. ``inf`` (no clipping) only without noise
            (``noise_multiplier=0``, no ``target_epsilon``): noise of std z·C needs a finite C.
        noise_multiplier: z; the noise's standard deviation is z·C. Ignored when
            ``target_epsilon`` is set.
        target_epsilon: the ε at ``delta`` the planned rounds may spend; z is calibrated to it
            before round 0 (null: use ``noise_multiplier``).
        delta: the δ every reported ε is computed at.
        sampling: "poisson" (each client joins a round with probability ``participation``, what
            the subsampled-Gaussian analysis assumes) or "fixed" (exactly round(q·N) clients,
            accounted as sampling without replacement).
        accountant: "auto" (PLD wherever the library's PLD accountant has the plan's event,
            RDP for central + fixed sampling), "pld" (privacy loss distributions: the tight
            ε) or "rdp" (Rényi DP: an upper bound, 4.5 % to 7x above PLD's).
        adaptive: C follows the ``target_quantile`` of the clients' update norms ("Differentially
            Private Learning with Adaptive Clipping", Andrew et al. 2021); central mode only.
        target_quantile: γ, the share of updates meant to be left unclipped.
        clip_lr: η_C of the geometric update C ← C·exp(−η_C (b̄ − γ)).
        count_stddev: σ_b, the noise on the count of unclipped updates (null: the paper's
            expected cohort size / 20, or z where that is more).
        part_clip: null (the default): all parts of an upload clipped together to C; or a share
            s_p of C² for each of the algorithm's upload parts (``{dy: 0.8, dc: 0.2}`` for
            SCAFFOLD): part p is clipped to C·√s_p. The shares must be positive and sum to 1,
            so that a whole upload stays within C and ε is that of joint clipping
            (:mod:`fedexp.privacy.clipping`); the names are checked against the algorithm's
            upload parts before round 0.
    """

    def __init__(
        self,
        mode: str = "none",
        clip: ClipBound = 1.0,
        noise_multiplier: NonNegative = 1.0,
        target_epsilon: Annotated[float | None, Range(gt=0)] = None,
        delta: Annotated[float, Range(gt=0, lt=1)] = 1e-5,
        sampling: str = "poisson",
        accountant: str = "auto",
        adaptive: bool = False,
        target_quantile: Fraction = 0.5,
        clip_lr: Annotated[float, Range(gt=0)] = 0.2,
        count_stddev: Annotated[float | None, Range(gt=0)] = None,
        part_clip: dict[str, float] | None = None,
    ) -> None:
        for key, value, allowed in (
            ("mode", mode, MODES),
            ("sampling", sampling, SAMPLINGS),
            ("accountant", accountant, ACCOUNTANTS),
        ):
            if value not in allowed:
                raise ValueError(f"privacy.{key}={value!r}: expected one of {', '.join(allowed)}")
        if adaptive and mode != "central":
            raise ValueError(
                f"privacy.adaptive=true: adaptive clipping needs privacy.mode=central, not {mode!r}"
            )
        if adaptive and clip == float("inf"):
            raise ValueError("privacy.clip=inf: adaptive clipping needs a finite initial C")
        if mode != "none" and clip == float("inf") and (noise_multiplier or target_epsilon):
            noise = (
                f"privacy.target_epsilon={target_epsilon:g} calibrates"
                if target_epsilon
                else f"privacy.noise_multiplier={noise_multiplier:g} asks for"
            )
            raise ValueError(
                f"privacy.clip=inf: {noise} noise of std z·C, which needs a finite clip bound C "
                "(set privacy.clip to one, or privacy.noise_multiplier=0 to clip nothing and "
                "add no noise)"
            )
        self.mode, self.clip, self.noise_multiplier = mode, float(clip), float(noise_multiplier)
        self.target_epsilon = None if target_epsilon is None else float(target_epsilon)
        self.delta, self.sampling, self.accountant = float(delta), sampling, accountant
        self.adaptive, self.target_quantile = adaptive, float(target_quantile)
        self.clip_lr = float(clip_lr)
        self.count_stddev = None if count_stddev is None else float(count_stddev)
        self.part_clip = None if part_clip is None else check_shares(part_clip)

    @property
    def enabled(self) -> bool:
        """Whether the uploads are privatised at all."""
        return self.mode != "none"
