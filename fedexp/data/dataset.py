"""In-memory datasets: what a dataset config builds before it is partitioned."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

import numpy as np

from fedexp.errors import DataError


@dataclass
class ArrayDataset:
    """A whole data set as arrays, before partitioning.

    Attributes:
        name: short name for logs.
        x: inputs, shape (n, ...) float32.
        y: integer class labels, shape (n,) (or segmentation masks, shape (n, H, W) or
            (n, D, H, W); all regions: (n, R, H, W) or (n, R, D, H, W)).
        num_classes: number of classes.
        groups: optional natural site / patient id per sample, for natural partitions.
        feature_names: optional names of the input features (tabular data).
        task: "classification", "segmentation" or "regions" (:data:`fedexp.models.task.TASKS`).

    Raises:
        DataError: ``x`` holds no sample (a loader must say which file was empty; this is the
            last guard, before a partition would blame a client).
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int
    groups: np.ndarray | None = None
    feature_names: list[str] = field(default_factory=list)
    task: str = "classification"

    def __post_init__(self) -> None:
        if len(self.x) == 0:
            raise DataError(
                f"dataset {self.name}: the data set is empty (0 samples); its files hold none"
            )
        if len(self.x) != len(self.y):
            raise ValueError(f"{self.name}: {len(self.x)} inputs but {len(self.y)} labels")

    @property
    def labels(self) -> np.ndarray:
        """One label per sample (the class for classification), used by partitions."""
        return self.y if self.y.ndim == 1 else self.y.reshape(len(self.y), -1).max(axis=1)

    @property
    def in_features(self) -> int:
        """Flattened input size (tabular: number of features)."""
        return int(np.prod(self.x.shape[1:]))

    @property
    def in_channels(self) -> int:
        """Channels of image inputs (1 for tabular)."""
        return int(self.x.shape[1]) if self.x.ndim >= 4 else 1
