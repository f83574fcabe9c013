"""Client-level (user-level) differential privacy accounting of federated rounds.

Every formula comes from Google's ``dp-accounting``; this module describes a round as a
``DpEvent`` and picks the accountant. ``z`` (``noise_multiplier``) is the noise's standard
deviation over the L2 sensitivity under the plan's adjacency: ``sigma / C`` for central +
poisson (add/remove one upload clipped to ``C``), ``sigma / (2C)`` for fixed cohorts and local
DP (replace-one: two clipped uploads differ by up to ``2C``; :mod:`fedexp.privacy.uplink`
halves it).

* ``central`` + ``poisson``: each client joins a round with probability ``q``, the server
  noises the sum of the clipped uploads (DP-FedAvg of "Learning Differentially Private
  Recurrent Language Models", McMahan et al. 2018): ``PoissonSampledDpEvent(q,
  GaussianDpEvent(z))`` per round, add/remove-one adjacency (the library's default).
* ``central`` + ``fixed``: exactly ``m = max(1, round(qN))`` clients, uniformly without
  replacement: ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z))`` per round under
  replace-one adjacency (``N`` public), RDP only ("Subsampled Rényi Differential Privacy and
  Analytical Moments Accountant", Wang, Balle and Kasiviswanathan 2019). dp-accounting 0.6.0
  reads its multiplier per unit of replace-one sensitivity, like ``z``; a release that doubles
  the sensitivity itself (issue #378) is detected and compensated (:func:`_replace_one_scale`).
* ``local``: each client noises its own clipped upload. The server sees who uploads, so
  sampling amplifies nothing: ``GaussianDpEvent(z)`` composed over the rounds the client took
  part in (a client's worst case: the largest participation count).

RDP: "Rényi Differential Privacy" (Mironov 2017) and "Rényi Differential Privacy of the
Sampled Gaussian Mechanism" (Mironov, Talwar and Zhang 2019). PLD: "Connect the Dots: Tighter
Discrete Approximations of Privacy Loss Distributions" (Doroshenko et al. 2022).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon as compute_rdp_epsilon

MODES = ("central", "local")
SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")
"""Accountants: ``rdp`` (RdpAccountant, an upper bound) and ``pld`` (PLDAccountant, tighter).

One :func:`epsilon` call, central + poisson, q = 0.1, z = 1, delta = 1e-5, T = 10 to 1000
rounds: RDP < 1 ms once the plan's one-round RDP is cached (first call ~90 ms, mostly the
library's fractional-order series); PLD (``value_discretization_interval`` 1e-3) 55-85 ms,
~14 s over a 200-round run (~0.5 s a call at 1e-4). PLD cannot do central + ``fixed`` (its
accountant has no ``SampledWithoutReplacementDpEvent``): that plan raises ValueError.
"""

PLD_DISCRETIZATION = 1e-3
"""PLD ``value_discretization_interval``: at 1e-3 epsilon stays a pessimistic (valid) upper
bound and differs from 1e-4 by < 1e-3 (absolute, T = 1 to 1000 rounds) while it runs 8-10x
faster; 1e-2 drifts by ~0.02 at T = 1000."""

CALIBRATION_FLOOR = 0.1
"""Smallest z :func:`calibrate_noise` tries (epsilons in the hundreds; PLDs grow large below)."""

_NeighborRel = dp_accounting.NeighboringRelation


def _drop_convergence_warning(record: logging.LogRecord) -> bool:
    """Drop the RDP accountant's benign non-convergence warning, keep every other record.

    The library excludes such an order from the minimum over orders, so the epsilon stays a
    valid (possibly looser) upper bound; warnings such as "Negative Renyi divergence" still show.
    """
    return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


_absl_logger = logging.getLogger("absl")
if not any(getattr(f, "__name__", "") == "_drop_convergence_warning" for f in _absl_logger.filters):
    _absl_logger.addFilter(_drop_convergence_warning)


@dataclass(frozen=True)
class PrivacyPlan:
    """What the accountant needs to know about a run's DP mechanism.

    Attributes:
        mode: ``central`` (the server noises the sum of clipped uploads) or ``local`` (each
            client noises its own clipped upload).
        sampling: ``poisson`` (each client joins a round independently with probability
            ``rate``) or ``fixed`` (exactly ``max(1, round(rate * num_clients))`` clients,
            uniformly without replacement).
        num_clients: N, the number of clients, >= 1.
        rate: q in (0, 1].
        noise_multiplier: z >= 0, finite: noise std over the L2 sensitivity under the plan's
            adjacency (sigma / C for central + poisson, sigma / (2C) for fixed or local; see
            the module docstring). 0: no noise, epsilon = inf.
        delta: target delta in (0, 1).
        accountant: ``rdp`` or ``pld``.
    """

    mode: str
    sampling: str
    num_clients: int
    rate: float
    noise_multiplier: float
    delta: float
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        choices = {"mode": MODES, "sampling": SAMPLINGS, "accountant": ACCOUNTANTS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        z, n = self.noise_multiplier, self.num_clients
        for name, ok, expected in (
            ("num_clients", not _not_count(n) and n >= 1, "an integer >= 1"),
            ("rate", _finite(self.rate) and 0 < self.rate <= 1, "in (0, 1]"),
            ("noise_multiplier", _finite(z) and z >= 0, "finite and >= 0"),
            ("delta", _finite(self.delta) and 0 < self.delta < 1, "in (0, 1)"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")
        if self.mode == "central" and self.sampling == "fixed" and self.accountant == "pld":
            raise ValueError(
                "accountant='pld' does not support sampling='fixed' in central mode "
                "(dp_accounting's PLDAccountant has no SampledWithoutReplacementDpEvent); "
                "use accountant='rdp'"
            )


def _finite(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _not_count(x: object) -> bool:
    return isinstance(x, bool) or not isinstance(x, numbers.Integral)


def _check_count(name: str, value: int) -> int:
    if _not_count(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


def _sample_size(plan: PrivacyPlan) -> int:
    """Clients per round under fixed sampling: ``max(1, round(q N))``."""
    return max(1, round(plan.rate * plan.num_clients))


@functools.cache
def _replace_one_scale() -> float:
    """Factor from ``z`` to the multiplier of RdpAccountant's replace-one subsampled Gaussian.

    1.0 while a fully sampled ``SampledWithoutReplacementDpEvent`` of ``GaussianDpEvent(1)`` has
    the RDP of the plain Gaussian (dp-accounting 0.6.0); 2.0 if the library doubles the
    sensitivity (4x the RDP) itself, as proposed for google/differential-privacy issue #378.

    Raises:
        RuntimeError: the installed library follows neither convention.
    """
    gauss = dp_accounting.GaussianDpEvent(1.0)
    replace = RdpAccountant(neighboring_relation=_NeighborRel.REPLACE_ONE)
    replace.compose(dp_accounting.SampledWithoutReplacementDpEvent(2, 2, gauss))
    plain = RdpAccountant().compose(gauss).rdp
    for scale, factor in ((1.0, 1.0), (2.0, 4.0)):
        if np.allclose(replace.rdp, factor * plain):
            return scale
    raise RuntimeError("dp_accounting: unrecognised replace-one Gaussian RDP; check issue #378")


def _round_event(plan: PrivacyPlan, noise_multiplier: float) -> dp_accounting.DpEvent:
    if noise_multiplier == 0:
        return dp_accounting.NonPrivateDpEvent()
    gauss = dp_accounting.GaussianDpEvent(noise_multiplier)
    if plan.mode == "local":
        return gauss
    if plan.sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(plan.rate, gauss)
    return dp_accounting.SampledWithoutReplacementDpEvent(
        plan.num_clients,
        _sample_size(plan),
        dp_accounting.GaussianDpEvent(noise_multiplier * _replace_one_scale()),
    )


def round_event(plan: PrivacyPlan) -> dp_accounting.DpEvent:
    """One round's ``DpEvent`` for one client (module docstring), for :func:`make_accountant`'s.

    In local mode: a round the client took part in. ``z = 0``: ``NonPrivateDpEvent``.
    """
    return _round_event(plan, plan.noise_multiplier)


def make_accountant(plan: PrivacyPlan) -> dp_accounting.PrivacyAccountant:
    """A fresh ``RdpAccountant`` or ``PLDAccountant`` (:data:`PLD_DISCRETIZATION`) for ``plan``.

    Add/remove-one adjacency, but replace-one for central + fixed sampling (RDP only).
    """
    if plan.accountant == "pld":
        return PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    if plan.mode == "central" and plan.sampling == "fixed":
        return RdpAccountant(neighboring_relation=_NeighborRel.REPLACE_ONE)
    return RdpAccountant()


@functools.lru_cache(maxsize=256)
def _round_rdp(plan: PrivacyPlan) -> tuple[np.ndarray, np.ndarray]:
    accountant = make_accountant(plan).compose(round_event(plan))
    return accountant.orders, accountant.rdp


@functools.lru_cache(maxsize=4096)
def _epsilon(plan: PrivacyPlan, count: int) -> float:
    if count == 0:
        return 0.0
    if plan.noise_multiplier == 0:
        return math.inf
    if plan.accountant == "rdp":  # what RdpAccountant does for count rounds, one round cached
        orders, rdp = _round_rdp(plan)
        return float(compute_rdp_epsilon(orders, count * rdp, plan.delta)[0])
    event = dp_accounting.SelfComposedDpEvent(round_event(plan), count)
    return float(make_accountant(plan).compose(event).get_epsilon(plan.delta))


def epsilon(plan: PrivacyPlan, rounds: int, participations: int | None = None) -> float:
    """Epsilon at ``plan.delta`` after ``rounds`` rounds (memoised).

    Args:
        plan: the run's privacy plan.
        rounds: rounds run so far, >= 0.
        participations: local mode only (required there, ignored in central mode): the
            largest number of rounds any one client took part in, 0 <= participations <= rounds.

    Returns:
        Epsilon; 0.0 when nothing was released (``rounds`` or ``participations`` is 0),
        ``math.inf`` when ``noise_multiplier`` is 0.

    Raises:
        ValueError: a bad count; ``participations`` missing (local mode) or > ``rounds``.
    """
    rounds = _check_count("rounds", rounds)
    if plan.mode == "central":
        return _epsilon(plan, rounds)
    if participations is None:
        raise ValueError("participations is required in local mode (rounds a client took part in)")
    participations = _check_count("participations", participations)
    if participations > rounds:
        raise ValueError(f"participations must be <= rounds ({rounds}), got {participations}")
    return _epsilon(plan, participations)


def calibrate_noise(plan: PrivacyPlan, rounds: int, target_epsilon: float) -> float:
    """Smallest noise multiplier whose epsilon after ``rounds`` rounds is <= ``target_epsilon``.

    ``dp_accounting.calibrate_dp_mechanism`` (Brent's method) with ``plan``'s accountant, whose
    ``noise_multiplier`` is ignored; local mode assumes a client in every round. The bracket
    starts at 1, halves down to :data:`CALIBRATION_FLOOR` (returned if that meets the target)
    and the library doubles it up to 2**30 times.

    Args:
        plan: the run's privacy plan.
        rounds: number of rounds, >= 1.
        target_epsilon: epsilon budget at ``plan.delta``, finite and > 0.

    Returns:
        The noise multiplier z (within 1e-4 of the optimum, never below it).

    Raises:
        ValueError: bad arguments, or the target cannot be reached.
    """
    rounds = _check_count("rounds", rounds)
    if rounds < 1:
        raise ValueError("rounds must be >= 1 to calibrate noise")
    if not _finite(target_epsilon) or target_epsilon <= 0:
        raise ValueError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(_round_event(plan, z), rounds)

    def eps(z: float) -> float:
        return make_accountant(plan).compose(event(z)).get_epsilon(plan.delta)

    lower = 1.0
    while eps(lower) <= target_epsilon:
        if lower <= CALIBRATION_FLOOR:
            return CALIBRATION_FLOOR
        lower = max(lower / 2, CALIBRATION_FLOOR)
    try:
        z = dp_accounting.calibrate_dp_mechanism(
            lambda: make_accountant(plan),
            event,
            target_epsilon,
            plan.delta,
            dp_accounting.LowerEndpointAndGuess(lower, 2 * lower),
            tol=1e-4,
        )
    except dp_accounting.mechanism_calibration.NoBracketIntervalFoundError as err:
        raise ValueError(
            f"target_epsilon={target_epsilon} is not reachable at delta={plan.delta} "
            f"with accountant={plan.accountant!r}, even with noise_multiplier 2**30"
        ) from err
    return float(z)
