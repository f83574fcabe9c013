"""The data set of a run, described for the tracker: name, source, content hash, shape.

:func:`describe_dataset` turns the loaded :class:`~fedexp.data.dataset.ArrayDataset` and its
``dataset`` config node into a :class:`DatasetRecord`; the MLflow tracker logs it as the run's
dataset input (MLflow's "Datasets used" panel), the null tracker keeps it in memory.

The content hash (:func:`content_hash`) is computed from the arrays as loaded, before they are
partitioned: two runs with the same digest trained and tested on the same numbers, whatever
files they came from; a file edited between two runs changes it.

:func:`mlflow_source` gives MLflow the record's source with its type stated (``local`` or
``code``): MLflow's own resolution of a bare path finds two ``local`` source classes (one per
``""`` and ``file`` scheme) and warns that the source "can be interpreted in multiple ways".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedexp.data.dataset import ArrayDataset

if TYPE_CHECKING:
    from mlflow.data.dataset_source import DatasetSource

#: MLflow stores at most 36 characters of a dataset digest: the first 32 hex digits (128 bits)
#: of the SHA-256 go there; the whole SHA-256 is in the profile (``sha256``).
DIGEST_CHARS = 32

#: Built-in data sets and the scikit-learn loader they come from (their source).
BUILTIN_LOADERS = {
    "fedexp.data.tabular.breast_cancer": "sklearn.datasets.load_breast_cancer",
    "fedexp.data.images.digits": "sklearn.datasets.load_digits",
}


@dataclass(frozen=True)
class DatasetRecord:
    """What the tracker records about a run's data.

    Attributes:
        name: the data set's name (``breast_cancer``, ``mnist``, ...).
        source: where it came from: the absolute file/folder path of ``dataset.path``, or the
            loader that made it (``sklearn.datasets.load_breast_cancer``, or a fedexp generator
            with its settings).
        source_type: ``local`` (a file or folder) or ``code`` (a loader).
        sha256: :func:`content_hash` of the loaded arrays (64 hex digits).
        profile: JSON-ready summary: sizes, shapes, dtypes, number of classes, task, the hash.
        features: ``(dtype, shape)`` of the inputs ``x``.
        targets: ``(dtype, shape)`` of the labels ``y``.
    """

    name: str
    source: str
    source_type: str
    sha256: str
    profile: dict[str, Any] = field(default_factory=dict)
    features: tuple[str, tuple[int, ...]] = ("float32", ())
    targets: tuple[str, tuple[int, ...]] = ("int64", ())

    @property
    def digest(self) -> str:
        """The digest MLflow stores: the first :data:`DIGEST_CHARS` hex digits of ``sha256``."""
        return self.sha256[:DIGEST_CHARS]


def content_hash(x: np.ndarray, y: np.ndarray) -> str:
    """SHA-256 of the inputs' bytes followed by the labels' bytes (hex).

    Covers exactly the values of ``x`` then ``y``, each as a C-ordered (row-major) buffer in the
    dtype it was loaded with (float32 inputs, int64 labels); shapes and dtypes are not hashed
    (the profile records them). Nothing is copied for arrays that are already C-contiguous.
    Equal to ``hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()``.
    """
    h = hashlib.sha256()
    for array in (x, y):
        h.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return h.hexdigest()


def _source(node: Mapping[str, Any]) -> tuple[str, str]:
    """``(source, source_type)`` of a ``dataset`` config node."""
    path = node.get("path")
    if path:
        return str(Path(str(path)).expanduser().resolve()), "local"
    target = str(node.get("_target_", ""))
    if target in BUILTIN_LOADERS:
        return BUILTIN_LOADERS[target], "code"
    args = ", ".join(f"{k}={v!r}" for k, v in node.items() if not str(k).startswith("_"))
    return f"{target}({args})", "code"


def describe_dataset(data: ArrayDataset, node: Mapping[str, Any]) -> DatasetRecord:
    """The record of ``data``, loaded from the (resolved) ``dataset`` config ``node``."""
    source, source_type = _source(node)
    sha = content_hash(data.x, data.y)
    profile = {
        "num_samples": len(data.x),
        "features_shape": list(data.x.shape),
        "features_dtype": str(data.x.dtype),
        "targets_shape": list(data.y.shape),
        "targets_dtype": str(data.y.dtype),
        "num_classes": int(data.num_classes),
        "task": data.task,
        "natural_groups": data.groups is not None,
        "sha256": sha,
    }
    return DatasetRecord(
        name=data.name,
        source=source,
        source_type=source_type,
        sha256=sha,
        profile=profile,
        features=(str(data.x.dtype), tuple(data.x.shape)),
        targets=(str(data.y.dtype), tuple(data.y.shape)),
    )


def mlflow_source(record: DatasetRecord) -> DatasetSource:
    """The record's source as an MLflow dataset source, of its type (no guessing, no warning).

    A ``local`` source (a file or folder) is MLflow's local-filesystem source built from its
    JSON form by type (``{"uri": path}``), not resolved from the bare path; a ``code`` source
    (a loader) is a ``CodeDatasetSource`` naming the loader. mlflow is imported here: the
    runner imports this module for every tracker.
    """
    if record.source_type == "local":
        from mlflow.data.dataset_source_registry import get_dataset_source_from_json

        return get_dataset_source_from_json(json.dumps({"uri": record.source}), "local")
    from mlflow.data.code_dataset_source import CodeDatasetSource

    return CodeDatasetSource({"loader": record.source})
