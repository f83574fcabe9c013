"""When pFedNet's Z-step ADMM stops: residuals, a duality-gap certificate, residual balancing.

The pieces :class:`fedexp.graph.admm.ZStepSolver` stops by. Boyd et al.'s primal and dual
residuals (§3.3) are a cheap first filter; once they pass, the duality gap ``F(Z) − D(Ω)``
must be small relative to ``|F(Z)|``: the Z-step's dual has a closed form and ADMM's dual
variable ``Ω`` is dual feasible after every iteration, so the gap bounds the objective's
error in the objective's own units, whatever the scales of ``η``, ``λ`` and ``G``
(``docs/pfednet_math.md`` §5). Optional residual balancing of ``ρ`` follows Wohlberg,
"ADMM penalty parameter selection by residual balancing" (2017).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedexp.graph.incidence import RowOps


def _objective_offset(
    Z_t: torch.Tensor,  # noqa: N803
    G: torch.Tensor,  # noqa: N803
    eta: float,
    dtype: torch.dtype,
) -> float:
    """The constant ``c`` with ``h(Z) = ‖Z − B‖²_F/(2η) + c``, ``B = Z_t − (η/N)G``.

    Expanding the square gives ``c = (1/N)⟨G, Z_t⟩ − η‖G‖²_F/(2N²)``.
    """
    n = Z_t.shape[1]
    zt = Z_t.to(dtype)
    g = G.to(dtype)
    inner, square = torch.stack([(g * zt).sum(), (g * g).sum()]).tolist()  # one read
    return inner / n - eta * square / (2.0 * n * n)


def _duality_gap(
    z: torch.Tensor,
    omega: torch.Tensor,
    oqt: torch.Tensor,
    base: torch.Tensor,
    ops: RowOps,
    lam_w: float | torch.Tensor,
    eta: float,
    ordp: float,
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[float, float]:
    """Duality gap of the Z-step at the primal point ``Z`` and the dual point ``Ω``.

    In row layout (``z = Zᵀ``, ``omega = Ωᵀ``, ``oqt = (ΩQᵀ)ᵀ``, ``base = Bᵀ`` with
    ``B = Z_t − (η/N)G``). The dual function of the Z-step is
    ``D(Ω) = min_Z h(Z) + ⟨Ω, ZQ⟩`` for ``Ω`` with ``‖Ω[:, m]‖_q ≤ λ w_m`` (``q`` the dual
    exponent of ``p``), and

        F(Z) − D(Ω) = ‖Z − B + ηΩQᵀ‖²_F/(2η) + Σ_m (λ w_m ‖(ZQ)[:, m]‖_p − ⟨Ω[:, m], (ZQ)[:, m]⟩),

    a sum of two nonnegative terms (the second by Hölder's inequality), so it is computed with
    no cancellation between large numbers. ADMM's ``Ω`` is dual feasible after every iteration
    (the W-update makes ``Ω^{k+1}/ρ`` the residual of a prox, which lies in the dual ball).

    Args:
        z: ``(N, d2)`` primal iterate.
        omega: ``(M, d2)`` dual iterate.
        oqt: ``(N, d2)`` ``(Ω Qᵀ)ᵀ`` of that dual iterate.
        base: ``(N, d2)`` ``Bᵀ``.
        ops: the graph's ``Q`` products on the iterates' device and dtype.
        lam_w: ``λ`` or the ``(M,)`` tensor ``λ w_m``.
        eta: ``η``.
        ordp: ``1``, ``2`` or ``inf`` as a float.
        scratch: buffers of shapes ``(N, d2)``, ``(M, d2)``, ``(M, d2)`` (overwritten).

    Returns:
        ``(gap, F(Z) − c)``: the gap and the objective without its constant
        (:func:`_objective_offset`).
    """
    buf_n, zq, tmp = scratch
    torch.sub(z, base, out=buf_n)
    distance = torch.linalg.vector_norm(buf_n)
    buf_n.add_(oqt, alpha=eta)
    stationary = torch.linalg.vector_norm(buf_n)
    ops.qt(z, out=zq, tmp=tmp)
    norms = torch.linalg.vector_norm(zq, ord=ordp, dim=1)
    coupled = torch.mul(omega, zq, out=tmp).sum()
    values = torch.stack([distance, stationary, (norms * lam_w).sum(), coupled]).tolist()
    distance_f, stationary_f, penalty, coupling = values  # one read of the device
    quad = distance_f**2 / (2.0 * eta)
    stationarity = stationary_f**2 / (2.0 * eta)
    return stationarity + penalty - coupling, quad + penalty


@dataclass
class _GapCertificate:
    """The duality-gap stopping test: ``F(Z) − D(Ω) ≤ tol · |F(Z)|``.

    Attributes:
        tol: relative tolerance.
        offset: the constant of :func:`_objective_offset`.
        ordp: ``1``, ``2`` or ``inf`` as a float.
        lam_w: ``λ`` or the ``(M,)`` tensor ``λ w_m``.
        eta: ``η``.
    """

    tol: float
    offset: float
    ordp: float
    lam_w: float | torch.Tensor
    eta: float

    def check(
        self,
        z: torch.Tensor,
        omega: torch.Tensor,
        oqt: torch.Tensor,
        base: torch.Tensor,
        ops: RowOps,
        scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[bool, float]:
        """Return ``(passed, relative gap)`` (arguments as in :func:`_duality_gap`)."""
        gap, obj = _duality_gap(z, omega, oqt, base, ops, self.lam_w, self.eta, self.ordp, scratch)
        scale = abs(obj + self.offset)
        rel = gap / scale if scale > 0 else (0.0 if gap <= 0 else math.inf)
        return gap <= self.tol * scale, rel


# Residual balancing: at most one change of ρ per _RHO_PERIOD iterations and _RHO_MAX_UPDATES in
# all (a finite number of changes keeps ADMM's convergence guarantee); factor _RHO_TAU when one
# relative residual exceeds _RHO_MU times the other.
_RHO_PERIOD = 5
_RHO_MAX_UPDATES = 50
_RHO_MU = 10.0
_RHO_TAU = 2.0


@dataclass
class _Residuals:
    """Boyd et al.'s residuals and tolerances at the last check (all Frobenius norms).

    Attributes:
        r: primal residual ``‖ZQ − W‖``.
        s: dual residual ``‖ρ (W^{k+1} − W^k) Qᵀ‖``.
        eps_pri: primal tolerance.
        eps_dual: dual tolerance.
        r_scale: ``max(‖ZQ‖, ‖W‖)``, the scale of ``r``.
        s_scale: ``‖ΩQᵀ‖``, the scale of ``s``.
    """

    r: float = math.inf
    s: float = math.inf
    eps_pri: float = 0.0
    eps_dual: float = 0.0
    r_scale: float = 0.0
    s_scale: float = 0.0

    def small(self) -> bool:
        """Both residuals within their tolerances."""
        return self.r <= self.eps_pri and self.s <= self.eps_dual


def _balanced_rho(rho: float, res: _Residuals) -> float:
    """Residual balancing on the *relative* residuals ``r/max(‖ZQ‖, ‖W‖)`` and ``s/‖ΩQᵀ‖``.

    Boyd et al. (2011, §3.4.1) balance ``‖r‖`` against ``‖s‖``, which are in different units
    (``s`` carries a factor ``ρ``), so their ratio changes when the problem is rescaled;
    Wohlberg (2017) balances the residuals relative to their scales instead, which is
    invariant to such rescaling.

    Returns:
        ``ρ·τ`` if the relative primal residual is more than ``μ`` times the dual one,
        ``ρ/τ`` in the opposite case, else ``ρ`` (also when a scale is zero).
    """
    if res.r_scale <= 0 or res.s_scale <= 0:
        return rho
    r_rel = res.r / res.r_scale
    s_rel = res.s / res.s_scale
    if r_rel > _RHO_MU * s_rel:
        return rho * _RHO_TAU
    if s_rel > _RHO_MU * r_rel:
        return rho / _RHO_TAU
    return rho
