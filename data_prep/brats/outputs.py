"""The files of the output folder.

``images.npy`` and ``masks.npy`` streamed from the resume cache, ``manifest.csv``, and the
summary written to ``summary.json``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from data_prep.brats.labels import LABEL_TABLES
from data_prep.brats.labels import REGIONS
from data_prep.brats.layouts import MODALITIES
from data_prep.brats.layouts import Case
from data_prep.brats.patches import PATCH
from data_prep.common import RunLog
from data_prep.common import StudyCache
from data_prep.common import write_csv
from data_prep.common import write_stacked

if TYPE_CHECKING:
    from data_prep.brats.options import BratsOptions

MANIFEST_COLUMNS = ["patient", "slice", "grade", "row0", "col0", "has_tumour"]
OUTPUT_NAMES = ("images.npy", "masks.npy", "manifest.csv", "summary.json")
"""Fixed names of the files written in the output folder (besides ``studies/``)."""


def _stream(
    done: list[tuple[Case, int]], cache: StudyCache, key: str, labels: str
) -> Iterator[np.ndarray]:
    for case, _ in done:
        stored = cache.load(case.patient, case.stamp, keys=(key,))
        assert stored is not None, case.patient
        array = stored[key]
        yield array[:, 0] if key == "regions" and labels == "whole" else array


def make_manifest(
    done: list[tuple[Case, int]], cache: StudyCache, sites: dict[str, str] | None = None
) -> pd.DataFrame:
    """The manifest rows of the usable patients, read from the cache (with ``site`` if given)."""
    columns = MANIFEST_COLUMNS + (["site"] if sites is not None else [])
    frames = []
    for case, _ in done:
        keys = ("slice", "row0", "col0", "has_tumour")
        stored = cache.load(case.patient, case.stamp, keys=keys)
        assert stored is not None, case.patient
        table = {k: stored[k] for k in keys}
        extra = {"site": sites[case.patient]} if sites is not None else {}
        frames.append(
            pd.DataFrame({"patient": case.patient, "grade": case.grade, **table, **extra})
        )
    if not frames:
        return pd.DataFrame(columns=columns)
    return pd.concat(frames, ignore_index=True).loc[:, columns]


def write_outputs(
    out: Path,
    done: list[tuple[Case, int]],
    cache: StudyCache,
    manifest: pd.DataFrame,
    labels: str,
    geometry: tuple[int, int] = (2, PATCH),
) -> None:
    """Write ``images.npy``, ``masks.npy`` (whole tumour or three regions) and the manifest."""
    n = len(manifest)
    dims, patch = geometry
    side = (patch,) * dims
    images = _stream(done, cache, "images", labels)
    write_stacked(out / "images.npy", images, (n, 4, *side), np.float32)
    mask_shape = (n, *side) if labels == "whole" else (n, 3, *side)
    write_stacked(out / "masks.npy", _stream(done, cache, "regions", labels), mask_shape, np.uint8)
    write_csv(out / "manifest.csv", manifest)


def run_summary(
    root: Path,
    base: Path,
    layout: str,
    options: BratsOptions,
    cases: list[Case],
    manifest: pd.DataFrame,
    log: RunLog,
    geometry: tuple[int, int] = (2, PATCH),
) -> dict[str, Any]:
    """The run's summary: inputs, conventions, options and counts (``summary.json``)."""
    n_tumour = int(manifest["has_tumour"].astype(int).sum())
    dims, patch = geometry
    orientation = "RAS (nibabel.as_closest_canonical); rows = R axis, cols = A axis"
    if dims == 3:
        orientation = (
            "RAS (nibabel.as_closest_canonical); crop axes R, A, S; "
            "row0/col0/slice = first R/A/S index"
        )
    return {
        "dataset": "brats",
        "root": str(root),
        "layout": layout,
        "layout_folder": str(base),
        "orientation": orientation,
        "channels": list(MODALITIES),
        "normalisation": "per patient and modality: z-score over non-zero voxels, 0 outside",
        "label_convention": "BraTS: 0 bg, 1 necrotic/non-enhancing, 2 edema, 4 enhancing",
        "release_labels": {str(k): v for k, v in LABEL_TABLES[layout].items()},
        "labels": options.labels,
        "mask_channels": ["whole_tumour"] if options.labels == "whole" else list(REGIONS),
        "dims": dims,
        "patch_size": patch,
        "negative_share": options.negative_share,
        "seed": options.seed,
        "n_patients_found": len(cases),
        "n_patients": int(manifest["patient"].nunique()),
        "n_samples": len(manifest),
        "n_tumour": n_tumour,
        "n_negative": len(manifest) - n_tumour,
        **log.as_dict(),
    }
