"""Column proxes of pFedNet's Z-step penalty: ℓ1, ℓ2 and ℓ∞, column by column.

The W-update of the Z-step's ADMM (:mod:`fedexp.graph.admm`) is the prox of
``Σ_m τ_m ‖V[:, m]‖_p`` (``τ_m = λ w_m / ρ``), which separates over the columns of ``V``:
soft-thresholding for ``p = 1``, block soft-thresholding for ``p = 2`` and, by Moreau's
decomposition, the residual of the projection onto the ℓ1-ball for ``p = ∞``; every column at
once, no loop over columns.

References:
    Duchi, Shalev-Shwartz, Singer, Chandra (2008). Efficient projections onto the ℓ1-ball for
    learning in high dimensions. ICML (Figure 1, sort-based projection).

The proxes and their derivation: ``docs/pfednet_math.md`` §3.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "PNorm",
    "parse_p",
    "project_l1_ball_columns",
    "prox_columns",
    "prox_l1_columns",
    "prox_l2_columns",
    "prox_linf_columns",
]

PNorm = int | float | str


def parse_p(p: PNorm) -> str:
    """Normalise the norm index: ``1``, ``2`` or ``inf`` (also ``"inf"``, ``float('inf')``).

    Returns:
        ``"1"``, ``"2"`` or ``"inf"``.

    Raises:
        ValueError: for any other ``p``.
    """
    if isinstance(p, str):
        key = p.strip().lower()
        if key in ("1", "l1"):
            return "1"
        if key in ("2", "l2"):
            return "2"
        if key in ("inf", "infinity", "linf", "max"):
            return "inf"
    elif isinstance(p, (int, float)) and not isinstance(p, bool):
        if p == 1:
            return "1"
        if p == 2:
            return "2"
        if math.isinf(p) and p > 0:
            return "inf"
    raise ValueError(f"p must be 1, 2 or inf, got {p!r}")


def _column_tau(tau: float | torch.Tensor, V: torch.Tensor) -> torch.Tensor:  # noqa: N803
    """Thresholds as a ``(1, M)`` tensor (or a 0-d tensor) broadcasting over the rows of V."""
    if isinstance(tau, (int, float)):  # checked on the host: no read of the device
        if tau < 0:
            raise ValueError("tau must be nonnegative")
        return torch.full((), tau, dtype=V.dtype, device=V.device)
    t = torch.as_tensor(tau, dtype=V.dtype, device=V.device)
    if t.dim() == 0:
        if bool(t < 0):
            raise ValueError("tau must be nonnegative")
        return t
    if t.shape != (V.shape[1],):
        raise ValueError(f"tau must be a scalar or have shape ({V.shape[1]},)")
    if bool((t < 0).any()):
        raise ValueError("tau must be nonnegative")
    return t.unsqueeze(0)


def prox_l1_columns(V: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:  # noqa: N803
    """Prox of ``τ_m‖·‖₁`` on every column: soft-thresholding ``sign(v)·max(|v| − τ, 0)``.

    Args:
        V: ``(d, M)`` matrix.
        tau: scalar or ``(M,)`` nonnegative thresholds (one per column).

    Returns:
        ``(d, M)`` tensor.
    """
    t = _column_tau(tau, V)
    out = V.abs().sub_(t).clamp_(min=0)
    return out.mul_(torch.sign(V))


def prox_l2_columns(V: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:  # noqa: N803
    """Prox of ``τ_m‖·‖₂`` on every column: block soft-thresholding ``max(0, 1 − τ/‖v‖₂)·v``.

    Args:
        V: ``(d, M)`` matrix.
        tau: scalar or ``(M,)`` nonnegative thresholds.

    Returns:
        ``(d, M)`` tensor (a zero column stays zero).
    """
    t = _column_tau(tau, V)
    norms = torch.linalg.vector_norm(V, ord=2, dim=0, keepdim=True)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    scale = torch.clamp(norms - t, min=0) / safe
    return V * scale


def project_l1_ball_columns(V: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:  # noqa: N803
    """Euclidean projection of every column onto the ℓ1-ball of radius ``τ_m``.

    Duchi et al. (2008), Figure 1, batched over columns: sort ``|v|`` decreasingly into ``u``,
    ``ρ = max{j : u_j − (Σ_{r≤j} u_r − τ)/j > 0}``, ``θ = (Σ_{r≤ρ} u_r − τ)/ρ``, and
    ``Π(v) = sign(v)·max(|v| − θ, 0)``; columns already inside the ball are returned unchanged
    and ``τ = 0`` gives zero. Cost ``O(d log d)`` per column, no loop over columns.

    Args:
        V: ``(d, M)`` matrix.
        tau: scalar or ``(M,)`` nonnegative radii.

    Returns:
        ``(d, M)`` tensor.
    """
    d, m = V.shape
    t = _column_tau(tau, V)
    t_row = t.expand(1, m) if t.dim() == 0 else t
    if d == 0 or m == 0:
        return V.clone()
    absv = V.abs()
    inside = absv.sum(dim=0, keepdim=True) <= t_row
    u = torch.sort(absv, dim=0, descending=True).values
    css = torch.cumsum(u, dim=0)
    j = torch.arange(1, d + 1, dtype=V.dtype, device=V.device).unsqueeze(1)
    # cond holds on a prefix j = 1..ρ (Duchi et al. 2008, Lemma 2); ρ = number of hits there.
    cond = u * j > css - t_row
    rho = torch.amax(torch.where(cond, j, torch.zeros_like(j)), dim=0, keepdim=True)
    # τ = 0: no hit, θ = max|v| zeroes the column (the ball is {0}).
    idx = (rho.long() - 1).clamp(min=0)
    theta = (css.gather(0, idx) - t_row) / rho.clamp(min=1)
    theta = torch.clamp(theta, min=0)
    proj = torch.sign(V) * torch.clamp(absv - theta, min=0)
    return torch.where(inside, V, proj)


def prox_linf_columns(V: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:  # noqa: N803
    """Prox of ``τ_m‖·‖_∞`` on every column, by Moreau: ``v − Π_{‖·‖₁≤τ}(v)``.

    The dual norm of ℓ∞ is ℓ1, so ``prox_{τ‖·‖∞}(v) = v − Π_{τB₁}(v)`` (Moreau decomposition).

    Args:
        V: ``(d, M)`` matrix.
        tau: scalar or ``(M,)`` nonnegative thresholds.

    Returns:
        ``(d, M)`` tensor.
    """
    return V - project_l1_ball_columns(V, tau)


def prox_columns(V: torch.Tensor, tau: float | torch.Tensor, p: PNorm) -> torch.Tensor:  # noqa: N803
    """Prox of ``Σ_m τ_m‖V[:, m]‖_p``, i.e. the ``p``-norm prox on each column.

    Args:
        V: ``(d, M)`` matrix.
        tau: scalar or ``(M,)`` nonnegative thresholds.
        p: ``1``, ``2`` or ``inf``.

    Returns:
        ``(d, M)`` tensor.
    """
    key = parse_p(p)
    if key == "1":
        return prox_l1_columns(V, tau)
    if key == "2":
        return prox_l2_columns(V, tau)
    return prox_linf_columns(V, tau)
