"""Server-side Z-step of pFedNet: ADMM with column proxes.

pFedNet (Liu et al., "pFedNet", §V-B, Algorithm 4) updates the personalised
components ``Z = [z⁽¹⁾ … z⁽ᴺ⁾] ∈ R^{d2×N}`` by

    Z_{t+1} = argmin_Z (1/N)⟨G, Z⟩ + λ Σ_m w_m ‖(ZQ)[:, m]‖_p + ‖Z − Z_t‖²_F / (2η),

with ``Q`` the edge-incidence matrix of the similarity network (``w_m = 1`` in the paper). It is
solved by ADMM (Boyd et al., 2011) on the split ``W = ZQ`` with the *unscaled* dual ``Ω``:

    Z^{k+1} = [Z_t − (η/N)G − η Ω^k Qᵀ + η ρ W^k Qᵀ] (I + ηρL)⁻¹      (anchored on Z_t)
    W^{k+1} = prox_{(λ w_m/ρ)‖·‖_p}(Z^{k+1}Q + Ω^k/ρ)                  column by column
    Ω^{k+1} = Ω^k + ρ (Z^{k+1}Q − W^{k+1})

The authors' released code anchored the Z-update on ``Z^k`` instead of ``Z_t``; that solves a
different problem. ``ZQ``/``WQᵀ`` are gather/scatter operations, or products with a dense
``Q`` on a small graph (:class:`fedexp.graph.incidence.RowOps`), and ``(I + ηρL)⁻¹`` comes
from one eigendecomposition of ``L`` per graph (or a sparse factorisation for large ``N``).
The column proxes of the W-update are :mod:`fedexp.graph.prox`'s. See ``docs/pfednet_math.md``
for the derivation.

Stopping is Boyd et al.'s residual test followed by a duality-gap certificate: the Z-step's
dual is explicit, ADMM's ``Ω`` is dual feasible after every iteration, so ``F(Z) − D(Ω)``
bounds the objective's error in the objective's own units, whatever the scales of ``η``, ``λ``
and ``G`` (:func:`fedexp.graph.admm_stopping._duality_gap`).

References:
    Boyd, Parikh, Chu, Peleato, Eckstein (2011). Distributed optimization and statistical
    learning via the alternating direction method of multipliers. §3.3 (stopping), §3.4.1
    (varying penalty).
    Wohlberg (2017). ADMM penalty parameter selection by residual balancing. arXiv:1704.06209
    (residuals relative to their scales).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedexp.graph.admm_stopping import _RHO_MAX_UPDATES
from fedexp.graph.admm_stopping import _RHO_PERIOD
from fedexp.graph.admm_stopping import _balanced_rho
from fedexp.graph.admm_stopping import _GapCertificate
from fedexp.graph.admm_stopping import _objective_offset
from fedexp.graph.admm_stopping import _Residuals
from fedexp.graph.incidence import RowOps
from fedexp.graph.incidence import apply_Q
from fedexp.graph.incidence import as_edge_tensor
from fedexp.graph.knn import Graph
from fedexp.graph.knn import laplacian
from fedexp.graph.prox import PNorm
from fedexp.graph.prox import parse_p
from fedexp.graph.prox import prox_columns
from fedexp.transfer import to_device

__all__ = ["ZStepSolver", "ZStepState", "zstep_objective"]


# --------------------------------------------------------------------------------------------
# Z-step objective
# --------------------------------------------------------------------------------------------


def zstep_objective(
    Z: torch.Tensor,  # noqa: N803
    Z_t: torch.Tensor,  # noqa: N803
    G: torch.Tensor,  # noqa: N803
    edges: torch.Tensor,
    lam: float,
    eta: float,
    p: PNorm,
    weights: torch.Tensor | None = None,
) -> float:
    """Z-step objective ``(1/N)⟨G, Z⟩ + λ Σ_m w_m ‖z_i − z_j‖_p + ‖Z − Z_t‖²_F / (2η)``.

    Args:
        Z: ``(d2, N)`` point to evaluate.
        Z_t: ``(d2, N)`` current personalised components.
        G: ``(d2, N)`` personalised gradients ``[Nᵀ∇⁽¹⁾ … Nᵀ∇⁽ᴺ⁾]``.
        edges: ``(M, 2)`` edge list.
        lam: ``λ ≥ 0``.
        eta: ``η > 0``.
        p: ``1``, ``2`` or ``inf``.
        weights: optional ``(M,)`` edge weights ``w_m`` (default ones).

    Returns:
        The objective value (computed in float64).
    """
    key = parse_p(p)
    z = Z.detach().to(torch.float64)
    zt = Z_t.detach().to(device=z.device, dtype=torch.float64)
    g = G.detach().to(device=z.device, dtype=torch.float64)
    n = z.shape[1]
    val = (g * z).sum() / n + ((z - zt) ** 2).sum() / (2.0 * eta)
    e = as_edge_tensor(edges, device=z.device)
    if e.shape[0] > 0 and lam != 0:
        diff = apply_Q(z, e)
        ordp = {"1": 1.0, "2": 2.0, "inf": float("inf")}[key]
        norms = torch.linalg.vector_norm(diff, ord=ordp, dim=0)
        if weights is not None:
            norms = norms * to_device(weights, z.device, torch.float64)
        val = val + lam * norms.sum()
    return float(val)


# --------------------------------------------------------------------------------------------
# ADMM solver
# --------------------------------------------------------------------------------------------


@dataclass
class ZStepState:
    """ADMM state carried between rounds for warm starts.

    Attributes:
        W: ``(d2, M)`` split variable (``≈ Z Q`` at convergence).
        Omega: ``(d2, M)`` unscaled dual variable.
        rho: penalty the state was produced with (informative; ``Ω`` is unscaled, so it stays
            valid under another ``ρ``).
    """

    W: torch.Tensor
    Omega: torch.Tensor
    rho: float


class ZStepSolver:
    """ADMM solver of the pFedNet Z-step on a fixed similarity network.

    Built once per graph. With the ``"eigh"`` method it eigendecomposes the Laplacian
    ``L = Q Qᵀ = U diag(μ) Uᵀ`` once (``torch.linalg.eigh``, float64) so that
    ``A = (I + ηρL)⁻¹ = U diag(1/(1 + ηρμ)) Uᵀ`` costs ``O(N³)`` per distinct ``ηρ`` with no
    new factorisation; ``A`` is cached as a dense ``N × N`` matrix. With the ``"sparse"``
    method it factorises the sparse SPD matrix ``I + ηρL`` per distinct ``ηρ`` (CHOLMOD via
    ``scikit-sparse`` when importable, else SciPy's SuperLU ``splu`` with a symmetric ordering)
    and solves ``(I + ηρL) Xᵀ = Rᵀ`` on the CPU in float64. ``"auto"`` picks ``"eigh"`` for
    ``N ≤ sparse_threshold``.

    Edge weights (optional) enter the penalty, ``λ Σ_m w_m ‖(ZQ)[:, m]‖_p``, as per-column prox
    thresholds ``λ w_m / ρ``; the split and the Laplacian stay unweighted.

    Args:
        edges: ``(M, 2)`` edge list; its row order is the column order of ``W`` and ``Ω``.
        num_nodes: ``N``.
        weights: optional ``(M,)`` nonnegative penalty weights.
        method: ``"auto"``, ``"eigh"`` or ``"sparse"``.
        sparse_threshold: ``N`` above which ``"auto"`` uses the sparse path.
        work_dtype: dtype of the iterations (default float64; float32 on devices without
            float64 such as MPS).
    """

    def __init__(
        self,
        edges: torch.Tensor,
        num_nodes: int,
        weights: torch.Tensor | None = None,
        *,
        method: str = "auto",
        sparse_threshold: int = 2000,
        work_dtype: torch.dtype | None = None,
    ) -> None:
        e = as_edge_tensor(edges).cpu()
        if e.shape[0] > 0:
            if bool((e[:, 0] == e[:, 1]).any()):
                raise ValueError("self loops are not allowed")
            if bool((e < 0).any()) or bool((e >= num_nodes).any()):
                raise ValueError(f"edge endpoints must lie in [0, {num_nodes})")
        self.edges = e
        self.num_nodes = int(num_nodes)
        self.num_edges = int(e.shape[0])
        if weights is not None:
            w = torch.as_tensor(weights, dtype=torch.float64).cpu().reshape(-1)
            if w.shape != (self.num_edges,):
                raise ValueError(f"weights must have shape ({self.num_edges},)")
            if bool((w < 0).any()):
                raise ValueError("weights must be nonnegative")
            self.weights: torch.Tensor | None = w
        else:
            self.weights = None
        if method == "auto":
            method = "eigh" if self.num_nodes <= sparse_threshold else "sparse"
        if method not in ("eigh", "sparse"):
            raise ValueError(f"method must be 'auto', 'eigh' or 'sparse', got {method!r}")
        self.method = method
        self.work_dtype = work_dtype
        self._edges_on: dict[torch.device, torch.Tensor] = {}
        self._ops_on: dict[tuple[torch.device, torch.dtype | None], RowOps] = {}
        self._a_cache: OrderedDict[tuple[float, str, torch.dtype], torch.Tensor] = OrderedDict()
        self._factor_cache: OrderedDict[float, Callable[[np.ndarray], np.ndarray]] = OrderedDict()
        self.backend = "eigh"
        if method == "eigh":
            lap = laplacian(self.edges, self.num_nodes, dtype=torch.float64)
            mu, u = torch.linalg.eigh(lap)
            self.eigvals = torch.clamp(mu, min=0.0)
            self.eigvecs = u
        else:
            import scipy.sparse as sp

            i = self.edges[:, 0].numpy()
            j = self.edges[:, 1].numpy()
            n = self.num_nodes
            adj = sp.coo_matrix((np.ones(len(i)), (i, j)), shape=(n, n))
            adj = (adj + adj.T).tocsc()
            deg = np.asarray(adj.sum(axis=1)).ravel()
            self._lap_sparse = (sp.diags(deg) - adj).tocsc()
            self.backend = "splu"

    @classmethod
    def from_graph(cls, graph: Graph, use_weights: bool = False, **kwargs: Any) -> ZStepSolver:
        """Build a solver on a :class:`~fedexp.graph.knn.Graph` (its canonical edge order).

        Args:
            graph: the similarity network.
            use_weights: put ``graph.weights`` into the penalty (default: ``w = 1``, the paper).
            **kwargs: passed to the constructor (``method``, ``sparse_threshold``, ...).
        """
        return cls(graph.edges, graph.num_nodes, graph.weights if use_weights else None, **kwargs)

    # ---------------------------------------------------------------- linear algebra helpers

    def _edges(self, device: torch.device) -> torch.Tensor:
        if device not in self._edges_on:
            self._edges_on[device] = self.edges.to(device)
        return self._edges_on[device]

    def _row_ops(self, edges: torch.Tensor, dtype: torch.dtype, width: int) -> RowOps:
        """``Q``'s row-layout products on ``edges``' device: dense for a small Z-step.

        A dense ``Q`` (:meth:`RowOps.fits`: ``N · M · d2`` small) with the ``"eigh"`` method,
        whose ``A`` is dense already; gathers and scatters otherwise. Made once per device,
        dtype and choice.
        """
        dense = self.method == "eigh" and RowOps.fits(self.num_nodes, self.num_edges, width)
        key = (edges.device, dtype if dense else None)
        ops = self._ops_on.get(key)
        if ops is None:
            ops = self._ops_on[key] = RowOps(edges, self.num_nodes, dtype if dense else None)
        return ops

    def _dense_a(self, c: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (c, str(device), dtype)
        a = self._a_cache.get(key)
        if a is None:
            f = 1.0 / (1.0 + c * self.eigvals)
            a = (self.eigvecs * f) @ self.eigvecs.T
            a = (0.5 * (a + a.T)).to(device=device, dtype=dtype)
            self._a_cache[key] = a
            while len(self._a_cache) > 8:
                self._a_cache.popitem(last=False)
        else:
            self._a_cache.move_to_end(key)
        return a

    def _sparse_solver(self, c: float) -> Callable[[np.ndarray], np.ndarray]:
        solve = self._factor_cache.get(c)
        if solve is not None:
            self._factor_cache.move_to_end(c)
            return solve
        import scipy.sparse as sp

        mat = (sp.identity(self.num_nodes, format="csc") + c * self._lap_sparse).tocsc()
        try:  # optional: CHOLMOD (scikit-sparse) is faster for SPD systems
            from sksparse.cholmod import cholesky  # type: ignore[import-not-found]

            factor = cholesky(mat)
            self.backend = "cholmod"

            def solve(rhs: np.ndarray) -> np.ndarray:
                return np.asarray(factor(rhs))

        except ImportError:
            from scipy.sparse.linalg import splu

            lu = splu(mat, permc_spec="MMD_AT_PLUS_A", diag_pivot_thresh=0.0)
            self.backend = "splu"

            def solve(rhs: np.ndarray) -> np.ndarray:
                return lu.solve(rhs)

        self._factor_cache[c] = solve
        while len(self._factor_cache) > 4:
            self._factor_cache.popitem(last=False)
        return solve

    def apply_A(self, X: torch.Tensor, eta_rho: float) -> torch.Tensor:  # noqa: N802, N803
        """Return ``X (I + ηρL)⁻¹`` for ``X`` of shape ``(d2, N)`` (same dtype and device)."""
        return self._apply_a_rows(X.T.contiguous(), eta_rho).T.contiguous()

    def _apply_a_rows(
        self,
        X: torch.Tensor,  # noqa: N803
        eta_rho: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return ``(I + ηρL)⁻¹ X`` for ``X`` of shape ``(N, d2)`` (``A`` is symmetric)."""
        if out is None:
            out = torch.empty_like(X)
        if eta_rho == 0 or self.num_edges == 0:
            return out.copy_(X)
        if self.method == "eigh":
            return torch.matmul(self._dense_a(float(eta_rho), X.device, X.dtype), X, out=out)
        solve = self._sparse_solver(float(eta_rho))
        res = solve(X.detach().to(device="cpu", dtype=torch.float64).contiguous().numpy())
        return out.copy_(torch.from_numpy(np.ascontiguousarray(res)))

    # ------------------------------------------------------------------------------- solve

    def _resolve_work_dtype(self, device: torch.device) -> torch.dtype:
        if self.work_dtype is not None:
            return self.work_dtype
        return torch.float32 if device.type == "mps" else torch.float64

    def solve(
        self,
        Z_t: torch.Tensor,  # noqa: N803
        G: torch.Tensor,  # noqa: N803
        lam: float,
        eta: float,
        p: PNorm = 2,
        rho: float | None = None,
        max_iter: int = 1000,
        eps_abs: float = 1e-6,
        eps_rel: float = 1e-4,
        warm: ZStepState | None = None,
        adaptive_rho: bool = False,
        check_every: int = 1,
        gap_tol: float | None = 1e-7,
    ) -> tuple[torch.Tensor, ZStepState, dict[str, Any]]:
        """Solve the Z-step by ADMM (``docs/pfednet_math.md`` §3).

        ``λ = 0`` or a graph without edges decouples the problem: the result is exactly
        ``Z_t − (η/N) * G`` computed in the input dtype (no iterations).

        Stopping: the residual test of Boyd et al. (2011, §3.3.1), with ``r = ZQ − W`` and
        ``s = ρ (W^{k+1} − W^k) Qᵀ``, ``‖r‖_F ≤ √(d2·M) ε_abs + ε_rel max(‖ZQ‖_F, ‖W‖_F)`` and
        ``‖s‖_F ≤ √(d2·N) ε_abs + ε_rel ‖ΩQᵀ‖_F``; once it passes, the duality gap
        ``F(Z) − D(Ω) ≥ F(Z) − F*`` (``fedexp.graph.admm_stopping``) must also be at most
        ``gap_tol · |F(Z)|``, which bounds the objective's relative error whatever the scales of
        ``η``, ``λ`` and ``G`` (the residual test alone does not: its tolerances are in units of
        ``ZQ`` and ``ΩQᵀ``, not of the objective). Or ``max_iter`` iterations.

        Args:
            Z_t: ``(d2, N)`` current personalised components (float32/float64, any device).
            G: ``(d2, N)`` personalised gradients.
            lam: ``λ ≥ 0``.
            eta: step ``η > 0``.
            p: ``1``, ``2`` or ``inf``.
            rho: ADMM penalty ``ρ > 0``; ``None`` uses ``1/η`` (balances the two quadratic
                terms of the Z-update).
            max_iter: iteration cap ``K``.
            eps_abs: absolute tolerance.
            eps_rel: relative tolerance.
            warm: state of a previous solve on the same graph and ``d2`` (``W``, ``Ω``);
                ignored if the shapes do not match. Cold start is ``W = Ω = 0``.
            adaptive_rho: residual balancing (Boyd et al. 2011, §3.4.1, ``μ = 10``, ``τ = 2``)
                on the relative residuals (Wohlberg 2017; :func:`_balanced_rho`), at most once
                every 5 iterations and 50 times in all; the unscaled dual needs no rescaling
                when ``ρ`` changes.
            check_every: evaluate the residuals every this many iterations.
            gap_tol: relative duality-gap tolerance (raised to ``10 ε`` of the working dtype
                where that is larger, about ``1.2e-6`` in float32); ``None`` stops on the
                residual test alone, the rule before the gap certificate was added (with
                ``adaptive_rho=False`` it reproduces that rule's iterates exactly). An objective
                of exactly zero at the solution cannot pass a relative test: such a solve ends at
                ``max_iter``.

        Returns:
            ``(Z_next, state, info)``: ``Z_next`` in the dtype/device of ``Z_t``; ``state`` for
            warm starts; ``info`` with ``iterations``, ``primal_residual``, ``dual_residual``,
            ``converged``, ``rho`` (final penalty), ``rho_updates`` (changes of ``ρ``) and
            ``gap`` (the last relative duality gap ``(F(Z) − D(Ω))/|F(Z)|`` evaluated, ``nan``
            if none was: it is evaluated only once the residual test passes).
        """
        if Z_t.dim() != 2 or Z_t.shape[1] != self.num_nodes:
            raise ValueError(f"Z_t must have shape (d2, {self.num_nodes}), got {tuple(Z_t.shape)}")
        if G.shape != Z_t.shape:
            raise ValueError(f"G must have shape {tuple(Z_t.shape)}, got {tuple(G.shape)}")
        if lam < 0:
            raise ValueError("lam must be nonnegative")
        if eta <= 0:
            raise ValueError("eta must be positive")
        if rho is None:
            rho = 1.0 / eta
        if rho <= 0:
            raise ValueError("rho must be positive")
        if max_iter < 1:
            raise ValueError("max_iter must be >= 1")
        if gap_tol is not None and gap_tol < 0:
            raise ValueError("gap_tol must be nonnegative or None")

        n = self.num_nodes
        d2 = Z_t.shape[0]
        m = self.num_edges
        device = Z_t.device
        wd = self._resolve_work_dtype(device)
        edges = self._edges(device)
        G = G.to(device=device, dtype=Z_t.dtype)  # noqa: N806

        if lam == 0 or m == 0:
            z_next = Z_t - (eta / n) * G
            state = ZStepState(
                W=apply_Q(z_next.to(wd), edges),
                Omega=torch.zeros((d2, m), dtype=wd, device=device),
                rho=float(rho),
            )
            info = {
                "iterations": 0,
                "primal_residual": 0.0,
                "dual_residual": 0.0,
                "converged": True,
                "rho": float(rho),
                "rho_updates": 0,
                "gap": 0.0,
            }
            return z_next, state, info

        # Row layout: Zᵀ (N, d2), Wᵀ and Ωᵀ (M, d2), so that the gathers and scatters over
        # edges move contiguous rows; buffers are allocated once and reused.
        base = (Z_t.to(wd) - (eta / n) * G.to(wd)).T.contiguous()
        w_pen = None if self.weights is None else self.weights.to(device=device, dtype=wd)

        if warm is not None and warm.W.shape == (d2, m) and warm.Omega.shape == (d2, m):
            w_var = warm.W.T.to(device=device, dtype=wd).contiguous().clone()
            omega = warm.Omega.T.to(device=device, dtype=wd).contiguous().clone()
        else:
            w_var = torch.zeros((m, d2), dtype=wd, device=device)
            omega = torch.zeros((m, d2), dtype=wd, device=device)
        ops = self._row_ops(edges, wd, d2)
        wqt = ops.q(w_var)  # (W Qᵀ)ᵀ
        oqt = ops.q(omega)  # (Ω Qᵀ)ᵀ
        wqt_new = torch.empty_like(wqt)
        rhs = torch.empty_like(base)
        z = torch.empty_like(base)
        zq = torch.empty((m, d2), dtype=wd, device=device)
        v = torch.empty_like(zq)

        sqrt_p = math.sqrt(d2 * m)
        sqrt_n = math.sqrt(d2 * n)
        res = _Residuals()
        cert = None
        if gap_tol is not None:
            cert = _GapCertificate(
                tol=max(gap_tol, 10.0 * torch.finfo(wd).eps),
                offset=_objective_offset(Z_t, G, eta, wd),
                ordp={"1": 1.0, "2": 2.0, "inf": math.inf}[parse_p(p)],
                lam_w=lam if w_pen is None else lam * w_pen,
                eta=eta,
            )
        rel_gap = math.nan
        converged = False
        last_update = rho_updates = it = 0
        for it in range(1, max_iter + 1):
            # Z-update, anchored on Z_t (not Z^k): Zᵀ = A [base + η(ρ WQᵀ − ΩQᵀ)]ᵀ.
            torch.mul(wqt, eta * rho, out=rhs)
            rhs.sub_(oqt, alpha=eta)
            rhs.add_(base)
            self._apply_a_rows(rhs, eta * rho, out=z)
            ops.qt(z, out=zq, tmp=v)  # (Z Q)ᵀ
            # W-update: column prox (rows here) with thresholds λ w_m / ρ.
            torch.add(zq, omega, alpha=1.0 / rho, out=v)
            tau = lam / rho if w_pen is None else (lam / rho) * w_pen
            w_new = prox_columns(v.T, tau, p).T.contiguous()
            check = (it % check_every == 0) or it == max_iter
            if check:  # ‖ZQ‖, ‖W‖ before zq becomes r
                scales = [torch.linalg.vector_norm(zq), torch.linalg.vector_norm(w_new)]
            # Ω-update with r = ZQ − W (zq becomes r in place).
            r = zq.sub_(w_new)
            omega.add_(r, alpha=rho)
            ops.q(w_new, out=wqt_new)
            ops.q(omega, out=oqt)
            if check:  # the five norms read from the device at once
                norms = torch.stack(
                    [
                        *scales,
                        torch.linalg.vector_norm(r),
                        torch.linalg.vector_norm(torch.sub(wqt_new, wqt, out=rhs)),
                        torch.linalg.vector_norm(oqt),
                    ]
                ).tolist()
                res.r_scale = max(norms[0], norms[1])
                res.r, res.s, res.s_scale = norms[2], rho * norms[3], norms[4]
                res.eps_pri = sqrt_p * eps_abs + eps_rel * res.r_scale
                res.eps_dual = sqrt_n * eps_abs + eps_rel * res.s_scale
            w_var = w_new
            wqt, wqt_new = wqt_new, wqt
            if not check:
                continue
            converged = res.small()
            if converged and cert is not None:
                converged, rel_gap = cert.check(z, omega, oqt, base, ops, (rhs, zq, v))
            if converged:
                break
            if adaptive_rho and it - last_update >= _RHO_PERIOD and rho_updates < _RHO_MAX_UPDATES:
                new_rho = _balanced_rho(rho, res)
                if new_rho != rho:
                    rho, last_update, rho_updates = new_rho, it, rho_updates + 1

        state = ZStepState(W=w_var.T, Omega=omega.T, rho=float(rho))
        info = {
            "iterations": it,
            "primal_residual": res.r,
            "dual_residual": res.s,
            "converged": converged,
            "rho": float(rho),
            "rho_updates": rho_updates,
            "gap": rel_gap,
        }
        return z.T.to(dtype=Z_t.dtype).contiguous(), state, info
