"""Group proxes of the concave fusion penalties SCAD and MCP, batched over rows.

FPFC (Yu, Liu, Wang, Sun, "Clustered Federated Learning based on Nonconvex Pairwise Fusion",
arXiv:2211.04218) penalises each pairwise difference through its norm, P(‖θ_i − θ_j‖), and its
ADMM needs, row by row, ``prox(δ) = argmin_z (ρ/2)‖z − δ‖² + P(‖z‖)``. The minimiser lies on the
ray of δ, ``z = s·δ/‖δ‖`` with ``s = argmin_{s≥0} (ρ/2)(s − t)² + P(s)``, ``t = ‖δ‖`` (Ma & Huang
2017, "A concave pairwise fusion approach to subgroup analysis", §2.2), so everything below is
a scalar map of the norm.

Penalties on s ≥ 0 (Fan & Li 2001; Zhang 2010):

* SCAD: ``P'(s) = λ`` (s ≤ λ), ``(aλ − s)/(a − 1)`` (λ < s ≤ aλ), ``0`` (s > aλ); a > 2.
* MCP: ``P'(s) = λ − s/a`` (s ≤ aλ), ``0`` after; a > 0.

Smoothing ξ ≥ 0 (the authors' code, ``xi``, default 1e-4): on [0, ξ] the penalty is replaced by
the quadratic with the same slope at ξ, ``P'(s) = P'(ξ)·s/ξ``, the rest shifted to stay
continuous; ξ = 0 is the plain penalty. The prox then reads, with ``c = P'(ξ)``:

* SCAD: t ≤ ξ + c/ρ: ``s = ξρt/(ξρ + c)`` (ξ = 0: s = 0); t ≤ λ + λ/ρ: ``s = t − λ/ρ``;
  t ≤ aλ: ``s = (t − aλ/((a−1)ρ)) / (1 − 1/((a−1)ρ))``; else ``s = t``.
  Unique (the scalar problem is strictly convex) when ``ρ(a − 1) > 1``.
* MCP: t ≤ ξ + c/ρ: ``s = ξρt/(ξρ + c)``; t ≤ aλ: ``s = (t − λ/ρ)/(1 − 1/(aρ))``; else
  ``s = t``. Needs ``aρ > 1``.

Pure functions on tensors; no state.
"""

from __future__ import annotations

import torch

__all__ = ["check_penalty", "penalty_derivative", "penalty_value", "prox_norm", "prox_rows"]

PENALTIES = ("scad", "mcp")


def check_penalty(penalty: str, lam: float, a: float, rho: float, xi: float = 0.0) -> None:
    """Refuse parameters for which the prox is not a well-defined single-valued map.

    Raises:
        ValueError: unknown penalty, λ < 0, ρ ≤ 0, ξ outside [0, λ) (λ > 0), or ``a`` too small
            (SCAD: a > 2 and ρ(a − 1) > 1; MCP: aρ > 1 and ξ < aλ).
    """
    if penalty not in PENALTIES:
        raise ValueError(f"penalty={penalty!r}: expected one of {PENALTIES}")
    if lam < 0 or rho <= 0 or xi < 0:
        raise ValueError(f"lam={lam}, rho={rho}, xi={xi}: expected λ ≥ 0, ρ > 0, ξ ≥ 0")
    if lam == 0:
        return  # the prox is the identity whatever a and ξ
    if xi >= lam:
        raise ValueError(f"xi={xi}: the smoothing must stay below λ={lam}")
    if penalty == "scad" and (a <= 2 or rho * (a - 1) <= 1):
        raise ValueError(f"a={a}, rho={rho}: SCAD needs a > 2 and ρ(a − 1) > 1")
    if penalty == "mcp" and (a * rho <= 1 or xi >= a * lam):
        raise ValueError(f"a={a}, rho={rho}, xi={xi}: MCP needs aρ > 1 and ξ < aλ")


def _slope_at_xi(penalty: str, lam: float, a: float, xi: float) -> float:
    return lam if penalty == "scad" else lam - xi / a


def penalty_derivative(
    s: torch.Tensor, penalty: str, lam: float, a: float, xi: float = 0.0
) -> torch.Tensor:
    """P'(s) for s ≥ 0 (the right derivative at 0: λ, or 0 when ξ > 0)."""
    if penalty == "scad":
        plain = torch.where(s <= lam, lam, torch.clamp(a * lam - s, min=0) / (a - 1))
    else:
        plain = torch.clamp(lam - s / a, min=0)
    if xi > 0:
        plain = torch.where(s <= xi, _slope_at_xi(penalty, lam, a, xi) * s / xi, plain)
    return plain.to(s.dtype)


def penalty_value(
    s: torch.Tensor, penalty: str, lam: float, a: float, xi: float = 0.0
) -> torch.Tensor:
    """P(s) for s ≥ 0 (the smoothed penalty when ξ > 0; P(0) = 0)."""
    if penalty == "scad":
        lin = lam * s
        mid = (2 * a * lam * s - s * s - lam * lam) / (2 * (a - 1))
        top = torch.full_like(s, lam * lam * (a + 1) / 2)
        plain = torch.where(s <= lam, lin, torch.where(s <= a * lam, mid, top))
    else:
        plain = torch.where(
            s <= a * lam, lam * s - s * s / (2 * a), torch.full_like(s, a * lam**2 / 2)
        )
    if xi > 0:
        c = _slope_at_xi(penalty, lam, a, xi)
        p_xi = float(penalty_value(torch.tensor(xi, dtype=torch.float64), penalty, lam, a))
        shift = p_xi - c * xi / 2  # the quadratic c s²/(2ξ) meets P at ξ
        plain = torch.where(s <= xi, c * s * s / (2 * xi), plain - shift)
    return plain


def prox_norm(
    t: torch.Tensor, penalty: str, lam: float, a: float, rho: float, xi: float = 0.0
) -> torch.Tensor:
    """s(t) = argmin_{s ≥ 0} (ρ/2)(s − t)² + P(s), elementwise on norms t ≥ 0."""
    if lam == 0:
        return t.clone()
    c = _slope_at_xi(penalty, lam, a, xi)
    small = t * (xi * rho / (xi * rho + c))
    if penalty == "scad":
        soft = t - lam / rho
        k = 1.0 / ((a - 1) * rho)
        concave = (t - a * lam * k) / (1 - k)
        s = torch.where(t <= lam + lam / rho, soft, torch.where(t <= a * lam, concave, t))
    else:
        s = torch.where(t <= a * lam, (t - lam / rho) / (1 - 1 / (a * rho)), t)
    return torch.where(t <= xi + c / rho, small, s)


def prox_rows(
    delta: torch.Tensor, penalty: str, lam: float, a: float, rho: float, xi: float = 0.0
) -> torch.Tensor:
    """Row-wise group prox: row m of the result is argmin_z (ρ/2)‖z − δ_m‖² + P(‖z‖).

    Args:
        delta: ``(M, d)`` rows δ_m.
        penalty: "scad" or "mcp".
        lam: λ ≥ 0 (0: the identity).
        a: concavity parameter (SCAD 3.7).
        rho: ADMM penalty ρ > 0.
        xi: smoothing ξ ∈ [0, λ).

    Returns:
        ``(M, d)``: each row a nonnegative multiple of its δ_m (zero rows stay zero).
    """
    t = torch.linalg.vector_norm(delta, dim=1, keepdim=True)
    s = prox_norm(t, penalty, lam, a, rho, xi)
    scale = torch.where(t > 0, s / torch.where(t > 0, t, torch.ones_like(t)), torch.zeros_like(t))
    return delta * scale
