"""Client data sketches and the distances between them (pFedNet's similarity network).

pFedNet (Liu et al., §III-A) represents each client's local data by a *sketch*
computed once on the client; the server builds the similarity network from pairwise distances
between sketches. The sketch kinds here:

* :func:`label_sketch` -- normalised class histogram (the authors' tabular code);
* :func:`covariance_sketch` -- covariance of the local inputs ("feature space"); images offer
  channel or pixel covariance; compare with Frobenius or entrywise-L1 distance;
* :func:`kernel_sketch` -- kernel mean embedding with random Fourier features shared by all
  clients ("data space", Rahimi & Recht 2007); the Euclidean distance between two sketches is an
  unbiased-in-square estimate of the (biased, V-statistic) MMD of the two samples under the RBF
  kernel ``k(x, y) = exp(−‖x − y‖² / (2σ²))``;
* :func:`model_sketch` -- parameters after a few local epochs from the common initial model
  ("model space"); the caller does the training.

Every sketch is a flat float32 tensor, which is what leaves the client (uplink bytes). Details:
``docs/pfednet_math.md`` §1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = [
    "covariance_sketch",
    "kernel_sketch",
    "label_sketch",
    "make_rff",
    "median_bandwidth",
    "model_sketch",
    "sketch_distances",
]


def label_sketch(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Normalised class histogram of a client's labels.

    Args:
        y: ``(n,)`` integer labels in ``[0, num_classes)``.
        num_classes: number of classes ``C``.

    Returns:
        ``(C,)`` float32 tensor summing to 1 (all zeros if ``y`` is empty).

    Raises:
        ValueError: if a label is outside ``[0, num_classes)``.
    """
    y = torch.as_tensor(y).reshape(-1)
    if y.numel() == 0:
        return torch.zeros(num_classes, dtype=torch.float32, device=y.device)
    if y.dtype.is_floating_point:
        raise ValueError("labels must be integers")
    y = y.long()
    if bool((y < 0).any()) or bool((y >= num_classes).any()):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    counts = torch.bincount(y, minlength=num_classes).to(torch.float64)
    return (counts / counts.sum()).to(torch.float32)


def _covariance(samples: torch.Tensor) -> torch.Tensor:
    """Covariance (features × features) of ``(n, f)`` samples in float64, 1/(n−1) normalised."""
    n = samples.shape[0]
    x = samples.to(torch.float64)
    x = x - x.mean(dim=0, keepdim=True)
    return x.T @ x / max(n - 1, 1)


def covariance_sketch(
    X: torch.Tensor,  # noqa: N803
    mode: Literal["auto", "flat", "channel", "pixel"] = "auto",
    pool_to: int | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Covariance of a client's inputs, flattened (the "feature space" sketch).

    Modes:

    * ``"flat"``: every sample flattened to a vector of ``f = prod(X.shape[1:])`` features;
      the sketch is the ``f × f`` covariance (tabular data; small images only).
    * ``"channel"``: for ``(n, C, *spatial)`` inputs, every pixel/voxel of every sample is one
      observation of a ``C``-vector; the sketch is the ``C × C`` channel covariance.
    * ``"pixel"``: for ``(n, C, *spatial)`` inputs, every (sample, channel) image is one
      observation of a ``P``-vector of pixels (``P = prod(spatial)``); the sketch is the
      ``P × P`` pixel covariance. Use ``pool_to`` to average-pool the spatial size first.
    * ``"auto"``: ``"flat"`` for 2-D ``X``, ``"channel"`` otherwise.

    The sketch has ``f²`` entries, so the Frobenius (resp. entrywise L1) distance between two
    covariance matrices is the Euclidean (resp. L1) distance between their sketches.

    Args:
        X: ``(n, ...)`` float inputs.
        mode: see above.
        pool_to: spatial output size of an adaptive average pooling applied before the
            ``"pixel"`` (or ``"flat"``) covariance, for 2-D or 3-D spatial inputs.

    Returns:
        Flat float32 tensor (the row-major covariance matrix), computed in float64.
    """
    X = torch.as_tensor(X)  # noqa: N806
    if X.dim() < 2:
        raise ValueError(f"X must have shape (n, ...), got {tuple(X.shape)}")
    if mode == "auto":
        mode = "flat" if X.dim() == 2 else "channel"
    if pool_to is not None and X.dim() > 2:
        X = _pool(X, pool_to)  # noqa: N806
    n = X.shape[0]
    if mode == "flat":
        cov = _covariance(X.reshape(n, -1))
    elif mode == "channel":
        if X.dim() < 3:
            raise ValueError("channel covariance needs inputs of shape (n, C, *spatial)")
        c = X.shape[1]
        cov = _covariance(X.movedim(1, -1).reshape(-1, c))
    elif mode == "pixel":
        if X.dim() < 3:
            raise ValueError("pixel covariance needs inputs of shape (n, C, *spatial)")
        cov = _covariance(X.reshape(n * X.shape[1], -1))
    else:
        raise ValueError(f"unknown covariance mode {mode!r}")
    return cov.reshape(-1).to(torch.float32)


def _pool(X: torch.Tensor, size: int | tuple[int, ...]) -> torch.Tensor:  # noqa: N803
    spatial = X.dim() - 2
    xf = X.to(torch.float64) if X.dtype != torch.float64 else X
    if spatial == 1:
        return F.adaptive_avg_pool1d(xf, size)
    if spatial == 2:
        return F.adaptive_avg_pool2d(xf, size)
    if spatial == 3:
        return F.adaptive_avg_pool3d(xf, size)
    raise ValueError(f"pooling supports 1-3 spatial dims, got {spatial}")


def make_rff(
    dim_in: int,
    num_features: int,
    bandwidth: float,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random Fourier features for the RBF kernel ``exp(−‖x − y‖² / (2 σ²))``.

    Rahimi & Recht (2007): with ``W ~ N(0, σ⁻² I)`` (``dim_in × D``) and ``b ~ U[0, 2π)``,
    ``φ(x) = sqrt(2/D) cos(xW + b)`` satisfies ``E[φ(x)·φ(y)] = k(x, y)``. All clients must use
    the *same* ``(W, b)`` (draw them from a generator seeded identically everywhere).

    Args:
        dim_in: input dimension (flattened sample size).
        num_features: ``D``.
        bandwidth: ``σ > 0``.
        generator: random stream (CPU) for reproducibility.
        dtype: dtype of ``W`` and ``b``.

    Returns:
        ``(W, b)`` with shapes ``(dim_in, D)`` and ``(D,)``.
    """
    if bandwidth <= 0:
        raise ValueError("bandwidth must be positive")
    if num_features < 1 or dim_in < 1:
        raise ValueError("dim_in and num_features must be >= 1")
    w = torch.randn(dim_in, num_features, generator=generator, dtype=torch.float64) / bandwidth
    b = torch.rand(num_features, generator=generator, dtype=torch.float64) * (2.0 * math.pi)
    return w.to(dtype), b.to(dtype)


def kernel_sketch(
    X: torch.Tensor,  # noqa: N803
    features: tuple[torch.Tensor, torch.Tensor],
    chunk_size: int = 4096,
) -> torch.Tensor:
    """Kernel mean embedding of a client's inputs with shared random Fourier features.

    ``s = (1/n) Σ_i sqrt(2/D) cos(x_i W + b)``; ``‖s_P − s_Q‖₂`` estimates ``MMD(P, Q)``
    under the RBF kernel of :func:`make_rff`.

    Args:
        X: ``(n, ...)`` inputs; each sample is flattened to ``dim_in`` entries.
        features: ``(W, b)`` from :func:`make_rff`.
        chunk_size: samples processed at once (bounds memory at ``chunk_size × D``).

    Returns:
        ``(D,)`` float32 sketch (zeros if ``X`` is empty).
    """
    w, b = features
    X = torch.as_tensor(X)  # noqa: N806
    n = X.shape[0]
    d_feat = w.shape[1]
    x = X.reshape(n, -1)
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"samples have {x.shape[1]} entries but W expects {w.shape[0]}")
    w = w.to(device=x.device)
    b = b.to(device=x.device, dtype=w.dtype)
    total = torch.zeros(d_feat, dtype=w.dtype, device=x.device)
    if n == 0:
        return total.to(torch.float32)
    for start in range(0, n, chunk_size):
        xc = x[start : start + chunk_size].to(w.dtype)
        total += torch.cos(xc @ w + b).sum(dim=0)
    return (total * (math.sqrt(2.0 / d_feat) / n)).to(torch.float32)


def median_bandwidth(X: torch.Tensor, max_samples: int = 1000) -> float:  # noqa: N803
    """Median heuristic for the RBF bandwidth: median pairwise distance of (a subset of) ``X``.

    Args:
        X: ``(n, ...)`` inputs (flattened per sample); the first ``max_samples`` are used.
        max_samples: cap on the number of samples.

    Returns:
        ``σ`` (1.0 if every pairwise distance is zero or fewer than two samples).
    """
    x = torch.as_tensor(X).reshape(X.shape[0], -1)[:max_samples].to(torch.float64)
    if x.shape[0] < 2:
        return 1.0
    d = torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist")
    iu = torch.triu_indices(x.shape[0], x.shape[0], offset=1)
    med = float(d[iu[0], iu[1]].median())
    return med if med > 0 else 1.0


def model_sketch(
    params_after_local_epochs: torch.Tensor | Iterable[torch.Tensor] | Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """The "model space" sketch: the flat parameter vector after a few local epochs.

    The caller trains a copy of the common initial model on the client's data and passes the
    resulting parameters here (``model.parameters()``, a state dict, or a tensor).

    Args:
        params_after_local_epochs: a tensor, an iterable of tensors (concatenated in order, as
            ``torch.nn.utils.parameters_to_vector``), or a mapping (values in its order).

    Returns:
        Flat float32 detached tensor.
    """
    p = params_after_local_epochs
    if isinstance(p, torch.Tensor):
        return p.detach().reshape(-1).to(torch.float32).clone()
    if isinstance(p, Mapping):
        p = p.values()
    parts = [t.detach().reshape(-1).to(torch.float32) for t in p]
    if not parts:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(parts)


def sketch_distances(
    S: torch.Tensor,  # noqa: N803
    metric: Literal["euclidean", "l1", "frobenius"] = "euclidean",
) -> torch.Tensor:
    """Pairwise distances between client sketches.

    Args:
        S: ``(N, m)`` sketches, one row per client (or a list of flat sketches of equal size).
        metric: ``"euclidean"`` (kernel, model, label sketches), ``"frobenius"`` (covariance
            sketches; identical to Euclidean on the flattened matrices) or ``"l1"`` (entrywise).

    Returns:
        ``(N, N)`` float64 symmetric matrix with an exactly zero diagonal.
    """
    if isinstance(S, (list, tuple)):
        S = torch.stack([torch.as_tensor(s).reshape(-1) for s in S])  # noqa: N806
    if S.dim() != 2:
        raise ValueError(f"S must have shape (N, m), got {tuple(S.shape)}")
    x = S.detach().to(torch.float64)
    if metric in ("euclidean", "frobenius"):
        d = torch.cdist(x, x, p=2.0, compute_mode="donot_use_mm_for_euclid_dist")
    elif metric == "l1":
        d = torch.cdist(x, x, p=1.0)
    else:
        raise ValueError(f"unknown metric {metric!r}")
    d = 0.5 * (d + d.T)
    d.fill_diagonal_(0.0)
    return d
