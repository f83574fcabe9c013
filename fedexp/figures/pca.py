"""The clients' models in two principal coordinates, for the client models' figure.

A data type the figures' drawing takes (:mod:`fedexp.figures.canvas`) and the run's plots
make (:mod:`fedexp.figures.plots`), on its own so that neither imports the other for it. No
torch at its top: the helper process that draws (:mod:`fedexp.figures.drawer`) unpickles
:class:`ModelPCA` from here without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Client models whose relative spread (their total variance about the mean model over their
#: mean squared norm) is below this are shown as equal, not as a PCA of rounding noise: a
#: relative RMS difference of 1e-5, some 100 float32 ulps (FedAvg's clients all evaluate one
#: global model; pFedNet at a small λ leaves differences of 1e-8).
MODEL_SPREAD_TOL = 1e-10


@dataclass
class ModelPCA:
    """The clients' models in PCA coordinates, as :func:`plot_client_models` draws them.

    Attributes:
        coords: ``(N, 2)`` float64, the first two principal coordinates (zeros when ``equal``).
        explained: the share of the total variance of PC1 and PC2 (zeros when ``equal``).
        spread: the relative spread: total variance about the mean model over the mean
            squared norm of the models (0 for all-zero models).
    """

    coords: np.ndarray
    explained: list[float]
    spread: float

    @property
    def equal(self) -> bool:
        """The models differ by less than :data:`MODEL_SPREAD_TOL`: nothing to project."""
        return self.spread < MODEL_SPREAD_TOL


def client_model_pca(models: torch.Tensor) -> ModelPCA:
    """PCA of ``(N, d)`` client models, or, below :data:`MODEL_SPREAD_TOL`, none."""
    import torch

    x = models.detach().double().cpu()
    n = x.shape[0]
    centred = x - x.mean(dim=0, keepdim=True)
    scale = float((x**2).sum(dim=1).mean())
    spread = float((centred**2).sum(dim=1).mean()) / scale if scale > 0 else 0.0
    coords = torch.zeros(n, 2, dtype=torch.float64)
    if spread < MODEL_SPREAD_TOL:
        return ModelPCA(coords.numpy(), [0.0, 0.0], spread)
    u, s, _ = torch.linalg.svd(centred, full_matrices=False)
    k = min(2, s.numel())
    coords[:, :k] = u[:, :k] * s[:k]
    var = (s**2) / (s**2).sum()
    return ModelPCA(coords.numpy(), [float(var[i]) if i < k else 0.0 for i in range(2)], spread)
