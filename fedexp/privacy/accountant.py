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
Sampled Gaussian Mechanism" (Mironov, Talwar and Zhang 2019), over the dense order grid
:data:`ORDERS` (:class:`_RoundRdp`). PLD: "Connect the Dots: Tighter Discrete Approximations of
Privacy Loss Distributions" (Doroshenko et al. 2022).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting.pld import PLDAccountant
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as pld_mechanism
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon as compute_rdp_epsilon
from scipy import optimize

MODES = ("central", "local")
SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")
"""Accountants: ``pld`` (PLDAccountant: the tight epsilon) and ``rdp`` (RdpAccountant, an
upper bound). ``privacy.accountant=auto`` (the default, :func:`resolve_accountant`) is PLD
wherever the library's PLD accountant has the plan's event, RDP for central + ``fixed``.

RDP's conversion from Rényi to (epsilon, delta)-DP leaves it 4.5 % to 7x above PLD on q
0.01-0.5, z 0.6-3, T 1-1000 (tests/test_privacy_accountant.py), so PLD is the default. PLD's
epsilon after T rounds of central + poisson is the one-round loss distribution (built once a
plan, :func:`_round_pld`) composed T times: 6-180 ms at T = 1000 on 2 CPU cores (z = 3,
q = 0.01 to z = 0.6, q = 0.5); a run reports it each round at the points of a schedule
(:func:`pld_point`), so a 1,000-round run makes about 140 such calls, not 1,000. RDP's
epsilon takes < 1 ms once the plan's one-round curve is cached. Local DP's PLD epsilon is the
Gaussian mechanism's, in closed form (:func:`_gaussian_epsilon`). PLD cannot do central +
``fixed`` (its accountant has no ``SampledWithoutReplacementDpEvent``): that plan raises
ValueError.
"""

PLD_EVERY = 16
"""Rounds up to this have their own PLD epsilon in a run's reports; above, the points are
:data:`PLD_STEP` apart (:func:`pld_point`)."""

PLD_STEP = 1.03
"""Ratio between PLD's schedule points above :data:`PLD_EVERY`: a count between two points is
reported at the next one, at most 3 % more rounds (epsilon grows at most in proportion)."""

PLD_DISCRETIZATION = 1e-3
"""PLD ``value_discretization_interval``: at 1e-3 epsilon stays a pessimistic (valid) upper
bound and differs from 1e-4 by < 1e-3 (absolute, T = 1 to 1000 rounds) while it runs 8-10x
faster; 1e-2 drifts by ~0.02 at T = 1000."""

CALIBRATION_FLOOR = 0.1
"""Smallest z :func:`calibrate_noise` tries (epsilons in the hundreds; PLDs grow large below)."""


def _order_grid() -> np.ndarray:
    below_2 = [1 + k / 100 for k in range(1, 10)] + [1 + k / 20 for k in range(2, 20)]
    to_16 = np.arange(2.0, 16.0, 0.25)
    above = np.unique(np.round(np.geomspace(16, 10_000, 220)))
    return np.concatenate([below_2, to_16, above])


ORDERS = _order_grid()
"""The RDP orders: 1.01-1.09 by 0.01, 1.1-1.95 by 0.05, 2-15.75 by 0.25, then integers from
16 to 10,000 about 3 % apart (every integer to 33). dp-accounting's default grid jumps from 63
to 128 to 1024: at q = 0.01, z = 3, T = 1 the best order is 83, and epsilon 27 % lower there."""

_BLOCK = 16
"""Orders :class:`_RoundRdp` adds at a time from 2 up, until a whole block past the best one."""

_NeighborRel = dp_accounting.NeighboringRelation
_absl_logger = logging.getLogger("absl")
log = logging.getLogger("fedexp")


def _is_nonconvergence(record: logging.LogRecord) -> bool:
    return str(record.msg).startswith("_compute_log_a_frac failed to converge")


@contextlib.contextmanager
def _convergence_failures_unprinted() -> Iterator[None]:
    """Within: the library's "failed to converge" records are not printed, all others are.

    For :class:`_RoundRdp`, which drops the orders that failed itself.
    """

    def keep(record: logging.LogRecord) -> bool:
        return not _is_nonconvergence(record)

    _absl_logger.addFilter(keep)
    try:
        yield
    finally:
        _absl_logger.removeFilter(keep)


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


def resolve_accountant(name: str, mode: str, sampling: str) -> str:
    """The accountant ``privacy.accountant=name`` means for a plan of ``mode`` and ``sampling``.

    ``auto``: PLD (the tight epsilon) where the library's PLD accountant has the plan's event,
    RDP for central + ``fixed`` (sampling without replacement, RDP only); ``rdp`` and ``pld``
    as named.
    """
    if name != "auto":
        return name
    return "rdp" if mode == "central" and sampling == "fixed" else "pld"


def pld_point(count: int) -> int:
    """The first point of PLD's reporting schedule at or after ``count`` (>= 0).

    Every count up to :data:`PLD_EVERY`, then ``ceil(PLD_EVERY * PLD_STEP**k)``. Epsilon never
    falls as the count grows, so the epsilon of the next point is an upper bound for any count
    before it, and at most one :data:`PLD_STEP` of rounds above the count's own.
    """
    if count <= PLD_EVERY:
        return count
    k = max(0, int(math.log(count / PLD_EVERY) / math.log(PLD_STEP)) - 1)
    while (point := math.ceil(PLD_EVERY * PLD_STEP**k - 1e-9)) < count:
        k += 1
    return point


def make_accountant(
    plan: PrivacyPlan, orders: Sequence[float] | None = None
) -> dp_accounting.PrivacyAccountant:
    """A fresh ``RdpAccountant`` or ``PLDAccountant`` (:data:`PLD_DISCRETIZATION`) for ``plan``.

    Add/remove-one adjacency, but replace-one for central + fixed sampling (RDP only).

    Args:
        plan: the run's privacy plan.
        orders: the RDP orders (default :data:`ORDERS`, slow in full: :class:`_RoundRdp`).
    """
    if plan.accountant == "pld":
        return PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    orders = ORDERS if orders is None else orders
    if plan.mode == "central" and plan.sampling == "fixed":
        return RdpAccountant(orders, neighboring_relation=_NeighborRel.REPLACE_ONE)
    return RdpAccountant(orders)


class _RoundRdp:
    """One round's RDP curve of a plan on :data:`ORDERS`, computed as far as it is needed.

    Orders below 2 are tried from 1.95 down: the library's series for a fractional order fails
    to converge near 1 at large q and small z (it returns inf). The first order that fails and
    every order below it are dropped, explicitly (:attr:`dropped`), without being tried. From 2
    up the orders come in blocks of :data:`_BLOCK` (an order whose RDP is not finite is dropped
    too) until the best order for the epsilon asked for has a whole computed block above it:
    epsilon as a function of the order falls, then rises, in every case measured, and a stop
    too early could only make epsilon larger (every order gives a valid bound), never smaller.
    An order of 10,000 costs 0.15 s: the large orders are computed only for the small epsilons
    that need them.
    """

    def __init__(self, plan: PrivacyPlan) -> None:
        self.plan = plan
        self.orders: list[float] = []
        self.rdp: list[float] = []
        #: orders left out: their RDP failed to converge (or they lie below one that failed)
        self.dropped: list[float] = []
        low = ORDERS[ORDERS < 2]
        self._next = len(low)
        for i in range(len(low) - 1, -1, -1):
            value = float(self._compute(low[i : i + 1])[0])
            if not math.isfinite(value):
                self.dropped = [float(a) for a in low[: i + 1]]
                break
            self.orders.insert(0, float(low[i]))
            self.rdp.insert(0, value)
        if self.dropped:
            log.debug("RDP orders <= %g dropped for %s: no convergence", self.dropped[-1], plan)

    def _compute(self, orders: np.ndarray) -> np.ndarray:
        with _convergence_failures_unprinted():
            return make_accountant(self.plan, orders).compose(round_event(self.plan)).rdp

    def _extend(self) -> None:
        block = ORDERS[self._next : self._next + _BLOCK]
        self._next += len(block)
        for order, value in zip(block, self._compute(block), strict=True):
            if math.isfinite(value):
                self.orders.append(float(order))
                self.rdp.append(float(value))
            else:
                self.dropped.append(float(order))

    def epsilon(self, count: int) -> float:
        """Epsilon at the plan's delta after ``count`` rounds (the library's RDP conversion)."""
        while True:
            if self.orders:
                rdp = count * np.asarray(self.rdp)
                eps, best = compute_rdp_epsilon(self.orders, rdp, self.plan.delta)
                above = len(self.orders) - 1 - self.orders.index(best)
                if self._next >= len(ORDERS) or above >= _BLOCK:
                    return float(eps)
            elif self._next >= len(ORDERS):
                return math.inf
            self._extend()


@functools.lru_cache(maxsize=256)
def _round_rdp(plan: PrivacyPlan) -> _RoundRdp:
    return _RoundRdp(plan)


@functools.lru_cache(maxsize=16)
def _round_pld(plan: PrivacyPlan) -> pld_lib.PrivacyLossDistribution:
    """One round's privacy loss distribution of a central + poisson plan (z > 0).

    The very distribution PLDAccountant composes for ``PoissonSampledDpEvent(q,
    GaussianDpEvent(z))``, built once a plan (it is most of a call's time): epsilon after
    ``T`` rounds is its ``T``-fold self-composition's (tests/test_privacy_accountant.py: equal
    to the accountant's).
    """
    return pld_lib.from_gaussian_mechanism(
        standard_deviation=plan.noise_multiplier,
        value_discretization_interval=PLD_DISCRETIZATION,
        sampling_prob=plan.rate,
        neighboring_relation=_NeighborRel.ADD_OR_REMOVE_ONE,
    )


def _gaussian_epsilon(sigma: float, delta: float) -> float:
    """Epsilon at ``delta`` of one Gaussian mechanism of std ``sigma`` (sensitivity 1), exactly.

    The library's privacy loss of the Gaussian (``GaussianPrivacyLoss``: delta(epsilon) in
    closed form, "Improving the Gaussian Mechanism for Differential Privacy", Balle and Wang
    2018) inverted by its own search (``inverse_monotone_function``, to 1e-9, on the safe
    side): the epsilon PLDAccountant's discretised distribution approaches from above (within
    1e-7 relative, tests/test_privacy_accountant.py), in about 5 ms at any count where the
    accountant took 12-800 ms. Local DP's k participations of std z are one of std z/sqrt(k).
    """
    loss = pld_mechanism.GaussianPrivacyLoss(sigma)
    search = pld_common.BinarySearchParameters(0.0, math.inf, initial_guess=1.0, tolerance=1e-9)
    found = pld_common.inverse_monotone_function(loss.get_delta_for_epsilon, delta, search)
    return math.inf if found is None else float(found)


@functools.lru_cache(maxsize=4096)
def _epsilon(plan: PrivacyPlan, count: int) -> float:
    if count == 0:
        return 0.0
    if plan.noise_multiplier == 0:
        return math.inf
    if plan.accountant == "rdp":  # what RdpAccountant does for count rounds, one round cached
        return _round_rdp(plan).epsilon(count)
    if plan.mode == "local":  # count Gaussians of std z: one of std z / sqrt(count)
        return _gaussian_epsilon(plan.noise_multiplier / math.sqrt(count), plan.delta)
    one = _round_pld(plan)  # (central + poisson: PLD has no plan of central + fixed)
    return float((one if count == 1 else one.self_compose(count)).get_epsilon_for_delta(plan.delta))


def epsilon(
    plan: PrivacyPlan,
    rounds: int,
    participations: int | None = None,
    planned: int | None = None,
) -> float:
    """Epsilon at ``plan.delta`` after ``rounds`` rounds (memoised).

    With PLD in central mode and ``planned`` (what a run reports each round), a count before
    the last round is reported as the epsilon of the next point of the schedule
    (:func:`pld_point`, capped at ``planned``): an upper bound within one :data:`PLD_STEP` of
    rounds, exact at the points and at the last round. Local mode's PLD epsilon is exact at
    every count (:func:`_gaussian_epsilon`, a few ms).

    Args:
        plan: the run's privacy plan.
        rounds: rounds run so far, >= 0.
        participations: local mode only (required there, ignored in central mode): the
            largest number of rounds any one client took part in, 0 <= participations <= rounds.
        planned: the run's planned rounds (None: every count exactly).

    Returns:
        Epsilon; 0.0 when nothing was released (``rounds`` or ``participations`` is 0),
        ``math.inf`` when ``noise_multiplier`` is 0.

    Raises:
        ValueError: a bad count; ``participations`` missing (local mode) or > ``rounds``.
    """
    rounds = _check_count("rounds", rounds)
    if plan.mode == "central":
        scheduled = plan.accountant == "pld" and planned is not None and 0 < rounds < planned
        return _epsilon(plan, min(pld_point(rounds), planned) if scheduled else rounds)
    if participations is None:
        raise ValueError("participations is required in local mode (rounds a client took part in)")
    participations = _check_count("participations", participations)
    if participations > rounds:
        raise ValueError(f"participations must be <= rounds ({rounds}), got {participations}")
    return _epsilon(plan, participations)


def calibrate_noise(plan: PrivacyPlan, rounds: int, target_epsilon: float) -> float:
    """Smallest noise multiplier whose epsilon after ``rounds`` rounds is <= ``target_epsilon``.

    Brent's method (as ``dp_accounting.calibrate_dp_mechanism``) on :func:`epsilon` with
    ``plan``'s accountant and order grid, whose ``noise_multiplier`` is ignored; local mode
    assumes a client in every round. The bracket starts at 1, halves down to
    :data:`CALIBRATION_FLOOR` (returned if that meets the target) and doubles up to 2**30.

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

    def gap(z: float) -> float:
        with_z = dataclasses.replace(plan, noise_multiplier=float(z))
        return _epsilon(with_z, rounds) - target_epsilon

    lower = 1.0
    while gap(lower) <= 0:
        if lower <= CALIBRATION_FLOOR:
            return CALIBRATION_FLOOR
        lower = max(lower / 2, CALIBRATION_FLOOR)
    upper = 2 * lower
    while gap(upper) > 0:
        if upper >= 2**30:
            raise ValueError(
                f"target_epsilon={target_epsilon} is not reachable at delta={plan.delta} "
                f"with accountant={plan.accountant!r}, even with noise_multiplier 2**30"
            )
        lower, upper = upper, 2 * upper
    z = float(optimize.brentq(gap, lower, upper, xtol=5e-5))
    while gap(z) > 0:  # to the root's safe side
        z += 5e-5
    return z
