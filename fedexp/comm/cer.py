"""CER, the communication-efficient regulariser of pFedNet, solved exactly in O(d).

pFedNet paper (Zhao et al., "Medical Federated Model with Mixture of Personalized and Sharing
Components"), Sec. IV-A and IV-B; solver and tests: ``docs/compression.md``, "CER".
A client turns its stochastic gradient ``g`` into the update

    v = argmin_y <g, y> + gamma ||Lambda (y - y_t)||_1 + ||y - y_t||^2 / (2 eta),
    grad = (y_t - v) / eta,

where ``Lambda`` has 1 on the diagonal and -1 on the super-diagonal (last row ``e_d``). With
``w = v - y_t``, ``u = -eta g`` and ``tau = eta gamma`` this is

    w = argmin_w 1/2 ||w - u||^2 + tau (sum_{i<d} |w_i - w_{i+1}| + |w_d|),   grad = -w / eta,

1-D total-variation denoising (the fused-lasso signal approximator) with the last entry tied
by one more TV edge to a fixed 0. The update is piecewise constant: few runs of equal values,
cheap to encode (``fedexp.comm.runs.RunLengthCodec``; STC also profits).

Note that the TV term is positively homogeneous, so ``grad = prox_{gamma TV}(g)`` whatever
``eta``: eta only rescales the problem (it is kept to follow the paper literally).

Solver: the dynamic programme of Johnson (2013), "A dynamic programming algorithm for the
fused lasso and L0-segmentation", JCGS 22(2), written here for the squared loss. The forward
pass keeps the derivative of the message ``F_i(b) = min over w_1..w_{i-1} of the cost with
w_i = b``: a continuous, increasing, piecewise-linear function stored as a deque of knots.
Step i clips ``F_i'`` to ``[-tau, tau]`` (the min-convolution with ``tau |.|``), which
gives the interval ``[lo_i, hi_i]`` the optimal ``w_i`` is clipped to given ``w_{i+1}``;
each step adds two knots and removes any number, so the whole pass is O(d). The extra edge to
0 makes the backward pass start from 0: ``w_d = clip(0, lo_d, hi_d)`` and
``w_i = clip(w_{i+1}, lo_i, hi_i)``. Condat (2013), "A direct algorithm for 1-D total
variation denoising", IEEE SPL 20(11), is the other classic O(d)-in-practice solver; the DP is
used because its O(d) bound holds in the worst case too.

A cohort's messages (:meth:`CERTransform.many`) are solved by one call of the same kernel: the
rows of ``[m, d]`` are consecutive segments of one vector (each tensor of each row its own
with ``scope="per_tensor"``), so every row's solution is the one it gets alone, bit for bit.
The dynamic programme is sequential along a message, so it runs on the host (numba): one copy
of the cohort's messages there and one back, whatever the cohort.

:func:`cer_admm_reference` is the paper's Algorithm 3 (ADMM with the eigendecomposition of
``Lambda^T Lambda``, O(d^2) memory) with the r-update threshold corrected to ``1 / rho``;
it is kept as a small-d reference for tests and benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import numpy as np
import torch
from numba import njit

from fedexp.config.ranges import Range
from fedexp.transfer import to_device

ArrayOrTensor = np.ndarray | torch.Tensor

#: CER's weight γ: 0 disables it, the message passes unchanged (``conf/experiment/cer_stc``'s
#: sweep starts there).
CerGamma = Annotated[float, Range(ge=0, note="0 disables CER")]
#: CER's step size η: the update does not depend on it (the TV term is positively homogeneous).
CerEta = Annotated[float, Range(gt=0, note="the update does not depend on it")]


@njit(cache=True)
def _tv_tail0_segments(u, tau, offsets, w):  # noqa: ANN001, ANN202 - numba kernel
    """Solve the tail-tied TV problem independently on each ``u[offsets[s]:offsets[s+1]]``.

    Writes the solution into ``w`` (float64, same size as ``u``). See the module docstring.
    """
    longest = 0
    for s in range(offsets.size - 1):
        longest = max(longest, offsets[s + 1] - offsets[s])
    knot_x = np.empty(2 * longest + 2)  # knot positions of F_i'
    knot_ds = np.empty(2 * longest + 2)  # slope increase of F_i' when crossing the knot
    lo = np.empty(longest)
    hi = np.empty(longest)
    for s in range(offsets.size - 1):
        start = offsets[s]
        n = offsets[s + 1] - start
        if n == 0:
            continue
        head = longest + 1  # the deque is knot_*[head .. tail]; empty when head > tail
        tail = longest
        for i in range(n):
            ui = u[start + i]
            off = tau if i > 0 else 0.0  # F_1' = b - u_1 has no clipped part yet
            # Leftmost piece of F_i' is b - u_i - off (slope 1); walk right to F_i' = -tau.
            slope = 1.0
            icpt = -ui - off
            while head <= tail:
                x = knot_x[head]
                if slope * x + icpt > -tau:
                    break
                slope += knot_ds[head]
                icpt -= knot_ds[head] * x
                head += 1
            b_lo = (-tau - icpt) / slope
            # Rightmost piece is b - u_i + off (slope 1); walk left to F_i' = +tau.
            slope_r = 1.0
            icpt_r = -ui + off
            while head <= tail:
                x = knot_x[tail]
                if slope_r * x + icpt_r < tau:
                    break
                slope_r -= knot_ds[tail]
                icpt_r += knot_ds[tail] * x
                tail -= 1
            b_hi = (tau - icpt_r) / slope_r
            lo[i] = b_lo
            hi[i] = b_hi
            # Clipping makes F' constant (-tau / +tau) outside [b_lo, b_hi]: two new knots.
            head -= 1
            knot_x[head] = b_lo
            knot_ds[head] = slope
            tail += 1
            knot_x[tail] = b_hi
            knot_ds[tail] = -slope_r
        v = 0.0  # the extra entry fixed at 0
        for i in range(n - 1, -1, -1):
            v = min(max(v, lo[i]), hi[i])
            w[start + i] = v
    return w


def prox_tv_tail0(
    u: np.ndarray, tau: float, segments: Sequence[int] | np.ndarray | None = None
) -> np.ndarray:
    """Exact ``argmin_w 1/2 ||w - u||^2 + tau (sum_i |w_i - w_{i+1}| + |w_d|)`` in O(d).

    Args:
        u: the vector to denoise (any float dtype; solved in float64).
        tau: TV weight, >= 0.
        segments: optional sizes of consecutive blocks solved independently (each block's
            last entry is tied to 0); they must sum to ``u.size``. None: one block.

    Returns:
        The solution ``w`` as float64.
    """
    u = np.ascontiguousarray(u, dtype=np.float64).reshape(-1)
    if not tau >= 0.0 or not math.isfinite(tau):
        raise ValueError(f"tau={tau} must be a finite number >= 0")
    sizes = [u.size] if segments is None else [int(s) for s in segments]
    if sum(sizes) != u.size or min(sizes, default=0) < 0:
        raise ValueError(f"segment sizes sum to {sum(sizes)}, expected {u.size}")
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
    w = np.empty_like(u)
    if u.size:
        _tv_tail0_segments(u, float(tau), offsets, w)
    return w


def difference(x: ArrayOrTensor, segments: Sequence[int] | None = None) -> ArrayOrTensor:
    """``Lambda x``: ``x_i - x_{i+1}``, and ``x_d`` for the last entry (of each segment)."""
    if isinstance(x, torch.Tensor):
        out = torch.empty_like(x)
        out[:-1] = x[:-1] - x[1:]
    else:
        out = np.empty_like(x)
        out[:-1] = x[:-1] - x[1:]
    ends = np.cumsum([x.shape[0]] if segments is None else list(segments)) - 1
    ends = ends[ends >= 0]
    out[ends] = x[ends]
    return out


def difference_rows(x: torch.Tensor, segments: Sequence[int] | None = None) -> torch.Tensor:
    """:func:`difference` of every row of ``x`` ``[m, d]`` (``Lambda`` applied row by row)."""
    out = torch.empty_like(x)
    out[:, :-1] = x[:, :-1] - x[:, 1:]
    ends = np.cumsum([x.shape[1]] if segments is None else list(segments)) - 1
    ends = to_device(ends[ends >= 0], x.device, torch.int64)
    out[:, ends] = x[:, ends]
    return out


def _to_numpy64(g: ArrayOrTensor) -> np.ndarray:
    if isinstance(g, torch.Tensor):
        return g.detach().reshape(-1).to("cpu", torch.float64).numpy()
    return np.asarray(g, dtype=np.float64).reshape(-1)


def _like(result: np.ndarray, g: ArrayOrTensor) -> ArrayOrTensor:
    """``result`` with the type, dtype, device and shape of ``g``."""
    if isinstance(g, torch.Tensor):
        return torch.from_numpy(result).to(device=g.device, dtype=g.dtype).reshape(g.shape)
    return result.astype(np.asarray(g).dtype, copy=False).reshape(np.shape(g))


def _check(gamma: float, eta: float) -> None:
    if not (gamma >= 0.0 and math.isfinite(gamma)):
        raise ValueError(f"gamma={gamma} must be a finite number >= 0")
    if not (eta > 0.0 and math.isfinite(eta)):
        raise ValueError(f"eta={eta} must be a finite number > 0")


def cer_update(
    g: ArrayOrTensor, gamma: float, eta: float, segments: Sequence[int] | None = None
) -> ArrayOrTensor:
    """The CER update ``grad = -w / eta`` with ``w = prox_tv_tail0(-eta g, eta gamma)``.

    pFedNet paper, Sec. IV-B. ``gamma = 0`` returns ``g`` itself (a copy) exactly.

    Args:
        g: the (stochastic or pseudo-) gradient, a tensor or array of any shape.
        gamma: CER weight, >= 0.
        eta: step size, > 0 (mathematically the result does not depend on it).
        segments: block sizes for a per-tensor CER (see :func:`prox_tv_tail0`).

    Returns:
        The update, of the same type, dtype, device and shape as ``g``.
    """
    _check(gamma, eta)
    if gamma == 0.0:
        return g.detach().clone() if isinstance(g, torch.Tensor) else np.array(g, copy=True)
    u = -eta * _to_numpy64(g)
    w = prox_tv_tail0(u, eta * gamma, segments)
    return _like(-w / eta, g)


def cer_admm_reference(
    g: ArrayOrTensor,
    gamma: float,
    eta: float,
    rho: float = 1.0,
    iters: int = 1000,
    callback: Callable[[int, np.ndarray], bool] | None = None,
) -> ArrayOrTensor:
    """The paper's ADMM for CER (Algorithm 3), corrected; O(d^2) memory, small d only.

    In ``w = y - y_t`` coordinates: minimise ``||r||_1 + ||w - u||^2 / (2 tau)`` subject to
    ``r = Lambda w``, with ``u = -eta g`` and ``tau = eta gamma``. One iteration:

        r     <- soft_threshold(Lambda w - omega / rho, 1 / rho)      (paper's "rho" is a typo)
        w     <- P (rho tau Sigma + I)^{-1} P^T (u + rho tau Lambda^T (r + omega / rho))
        omega <- omega + rho (r - Lambda w)

    where ``Lambda^T Lambda = P Sigma P^T`` is computed once (dense ``P``, O(d^2) memory;
    ``scipy.linalg.eigh_tridiagonal``, as ``Lambda^T Lambda`` is tridiagonal).

    Args:
        g: the gradient (tensor or array).
        gamma: CER weight, >= 0 (0 returns ``g``).
        eta: step size, > 0.
        rho: ADMM penalty, > 0.
        iters: number of iterations J.
        callback: called as ``callback(j, grad_j)`` after iteration j (1-based); returning
            True stops early.

    Returns:
        ``-w_J / eta`` with the type, dtype, device and shape of ``g``.
    """
    _check(gamma, eta)
    if not rho > 0.0:
        raise ValueError(f"rho={rho} must be > 0")
    if gamma == 0.0:
        return g.detach().clone() if isinstance(g, torch.Tensor) else np.array(g, copy=True)
    from scipy.linalg import eigh_tridiagonal  # a reference only: scipy loaded on demand

    u = -eta * _to_numpy64(g)
    tau = eta * gamma
    d = u.size
    # Lambda^T Lambda is tridiagonal: diagonal (1, 2, ..., 2), off-diagonals -1.
    diag = np.full(d, 2.0)
    diag[0] = 1.0
    sigma, p = eigh_tridiagonal(diag, -np.ones(d - 1))
    c = rho * tau
    scale = 1.0 / (c * sigma + 1.0)
    w = u.copy()
    omega = np.zeros(d)

    def lam_t(z: np.ndarray) -> np.ndarray:  # Lambda^T z: z_i - z_{i-1}
        out = z.copy()
        out[1:] -= z[:-1]
        return out

    for j in range(1, iters + 1):
        v = difference(w) - omega / rho
        r = np.sign(v) * np.maximum(np.abs(v) - 1.0 / rho, 0.0)
        w = p @ (scale * (p.T @ (u + c * lam_t(r + omega / rho))))
        omega = omega + rho * (r - difference(w))
        if callback is not None and callback(j, -w / eta):
            break
    return _like(-w / eta, g)


def _segment_sizes(layout: Any) -> list[int]:
    """Sizes of the flat segments of a layout.

    Accepted: a sequence whose items are ints (sizes), ``(name, shape)`` pairs, or objects
    with a ``numel`` attribute/method or a ``shape``; a mapping name -> shape; or an object
    with ``numels``/``sizes``/``shapes`` (an attribute or a method).
    """
    for attr in ("numels", "sizes", "shapes"):
        if hasattr(layout, attr) and not isinstance(layout, dict | list | tuple):
            value = getattr(layout, attr)
            return _segment_sizes(value() if callable(value) else value)
    items = list(layout.values()) if isinstance(layout, dict) else list(layout)
    sizes = []
    for item in items:
        if isinstance(item, int | np.integer):
            sizes.append(int(item))
        elif hasattr(item, "numel"):
            n = item.numel
            sizes.append(int(n() if callable(n) else n))
        elif hasattr(item, "shape"):
            sizes.append(math.prod(item.shape))
        elif isinstance(item, tuple | list) and len(item) == 2 and not isinstance(item[1], int):
            sizes.append(math.prod(item[1]))
        elif isinstance(item, tuple | list | torch.Size):
            sizes.append(math.prod(item))
        else:
            raise ValueError(f"cannot read a segment size from layout item {item!r}")
    return sizes


class CERTransform:
    """CER as an update transform (``fedexp.comm.channel.UpdateTransform``).

    pFedNet paper, Sec. IV. Applied to a flat message before the codec.

    Args:
        gamma: CER weight (0 disables it: the message passes unchanged).
        eta: the step size of the CER problem (the result does not depend on it).
        scope: ``"flat"``: one ``Lambda`` over the whole flat vector, as in the paper;
            ``"per_tensor"``: a block-diagonal ``Lambda``, one block per tensor of ``layout``
            (each tensor's last entry tied to 0; no difference across tensor boundaries).
        layout: the parameter layout (needed for ``"per_tensor"``); see
            :func:`_segment_sizes` for the forms accepted.

    Metrics returned with each message:
        ``cer/runs``: number of maximal runs of equal values of the flat output (what
        :class:`fedexp.comm.runs.RunLengthCodec` sends); ``cer/sparsity``: fraction of
        zeros of ``Lambda grad`` (block-diagonal ``Lambda`` for ``"per_tensor"``).
    """

    def __init__(
        self, gamma: CerGamma, eta: CerEta = 1.0, scope: str = "flat", layout: Any = None
    ) -> None:
        _check(float(gamma), float(eta))  # also for direct calls (a config is checked before)
        if scope not in ("flat", "per_tensor"):
            raise ValueError(f"scope={scope!r}: expected 'flat' or 'per_tensor'")
        if scope == "per_tensor" and layout is None:
            raise ValueError("scope='per_tensor' needs the parameter layout")
        self.gamma = float(gamma)
        self.eta = float(eta)
        self.scope = scope
        self.segments = None if layout is None or scope == "flat" else _segment_sizes(layout)

    def __call__(
        self, x: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return the CER update of the flat message ``x`` and its metrics.

        ``x`` is ``scale`` × a pseudo-gradient (``scale`` = lr for FedAvg's model change,
        1 for pFedNet's pseudo-gradient): the CER of ``x / scale``, times ``scale``, which is
        the CER of ``x`` with γ × scale (the TV penalty is positively homogeneous). So one
        γ regularises every algorithm's update equally.
        """
        flat = x.reshape(-1)
        if self.segments is not None and sum(self.segments) != flat.numel():
            raise ValueError(
                f"layout covers {sum(self.segments)} entries, the message has {flat.numel()}"
            )
        out = cer_update(flat, self.gamma * float(scale), self.eta, self.segments)
        d = max(flat.numel(), 1)
        runs = 0 if flat.numel() == 0 else 1 + int((out[1:] != out[:-1]).sum())
        zeros = int((difference(out, self.segments) == 0).sum()) if flat.numel() else 0
        return out.reshape(x.shape), {"cer/runs": float(runs), "cer/sparsity": zeros / d}

    def many(
        self, x: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The CER update of every row of ``x`` ``[m, d]`` and each row's metrics, at once.

        Row ``i`` is ``self(x[i], scale)``'s update bit for bit: the rows (and with
        ``"per_tensor"`` their tensors) are the segments of one call of the DP kernel, in
        float64 on the host, as a single message is (module docstring). The metrics are
        float64 ``[m]`` (``cer/runs``, ``cer/sparsity``), on ``x``'s device.
        """
        m, d = x.shape
        if self.segments is not None and sum(self.segments) != d:
            raise ValueError(f"layout covers {sum(self.segments)} entries, the message has {d}")
        gamma = self.gamma * float(scale)
        _check(gamma, self.eta)
        if gamma == 0.0 or x.numel() == 0:
            out = x.detach().clone()
        else:
            u = -self.eta * x.detach().to("cpu", torch.float64).numpy().reshape(-1)
            sizes = np.tile(np.asarray(self.segments or [d], dtype=np.int64), m)
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            w = np.empty_like(u)
            _tv_tail0_segments(np.ascontiguousarray(u), float(self.eta * gamma), offsets, w)
            w = (-w / self.eta).reshape(m, d)
            out = torch.from_numpy(w).to(device=x.device, dtype=x.dtype)
        if d == 0:
            zero = torch.zeros(m, dtype=torch.float64, device=x.device)
            return out, {"cer/runs": zero, "cer/sparsity": zero}
        runs = 1 + (out[:, 1:] != out[:, :-1]).sum(dim=1)
        zeros = (difference_rows(out, self.segments) == 0).sum(dim=1)
        return out, {
            "cer/runs": runs.to(torch.float64),
            "cer/sparsity": zeros.to(torch.float64) / d,
        }

    def __repr__(self) -> str:
        return f"CERTransform(gamma={self.gamma}, eta={self.eta}, scope={self.scope!r})"
