"""The files of the output folder.

``images.npy`` streamed from the resume cache, ``labels.npy``, ``manifest.csv``, and the summary
written to ``summary.json``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from data_prep.common import RunLog
from data_prep.common import write_csv
from data_prep.common import write_stacked
from data_prep.luna16.patches import PATCH
from data_prep.luna16.volumes import ORIENTATION

if TYPE_CHECKING:
    from data_prep.luna16.options import LunaOptions

OUTPUT_NAMES = ("images.npy", "labels.npy", "manifest.csv", "summary.json")
"""Fixed names of the files written in the output folder (besides ``studies/``)."""
MANIFEST_COLUMNS = [
    "seriesuid",
    "coordX",
    "coordY",
    "coordZ",
    "voxel_x",
    "voxel_y",
    "voxel_z",
    "label",
    "candidate_index",
    "subset",
]
"""Manifest columns; ``subset`` is the ``subset*`` folder of the volume (empty for a volume
directly in ``--root``)."""


def write_outputs(
    out: Path, final: pd.DataFrame, patches: Iterator[np.ndarray], shape: tuple[int, ...]
) -> None:
    """Write ``images.npy`` (the streamed patches), ``labels.npy`` and the manifest."""
    write_stacked(out / "images.npy", patches, shape, np.float32)
    labels = final["class"].to_numpy(np.int64)
    write_stacked(out / "labels.npy", [labels], labels.shape, np.int64)
    manifest = final.rename(columns={"class": "label"}).loc[:, MANIFEST_COLUMNS]
    write_csv(out / "manifest.csv", manifest)


def run_summary(
    root: Path,
    csv_path: Path,
    options: LunaOptions,
    candidates: pd.DataFrame,
    on_disk: pd.Series,
    volumes: dict[str, Path],
    rows: pd.DataFrame,
    final: pd.DataFrame,
    log: RunLog,
    geometry: tuple[int, int] = (2, PATCH),
) -> dict[str, Any]:
    """The run's summary: inputs, scaling, geometry, δ and counts (``summary.json``)."""
    n_pos = int((final["class"] == 1).sum())
    n_neg = int((final["class"] == 0).sum())
    with_candidates = set(candidates.loc[on_disk, "seriesuid"])
    return {
        "dataset": "luna16",
        "root": str(root),
        "candidates_file": str(csv_path),
        "hu_window": list(options.window),
        "scaling": "clip(HU, low, high) then (HU - low) / (high - low); padding = 0",
        "orientation": ORIENTATION,
        **_geometry_summary(*geometry),
        "delta": options.delta,
        "seed": options.seed,
        "n_samples": len(final),
        "n_positive": n_pos,
        "n_negative": n_neg,
        "ratio_negative_positive": (n_neg / n_pos) if n_pos else None,
        "volumes_on_disk": len(volumes),
        "volumes_without_candidates": len(set(volumes) - with_candidates),
        "candidates_in_csv": int(candidates.attrs.get("rows_in_file", len(candidates))),
        "candidates_malformed": int(
            candidates.attrs.get("rows_in_file", len(candidates)) - len(candidates)
        ),
        "candidates_without_volume": int((~on_disk).sum()),
        "candidates_outside_volume": int((~rows["_inside"].astype(bool)).sum()),
        "patches_per_subset": {
            str(k): int(v) for k, v in final["subset"].value_counts().sort_index().items()
        },
        **log.as_dict(),
    }


def _geometry_summary(dims: int, patch: int) -> dict[str, Any]:
    """Summary fields of the patch geometry actually used."""
    return {"dims": dims, "patch_size": patch, "patch_axes": ["z", "y", "x"][3 - dims :]}
