"""Cutting one study's candidate patches.

An axial patch (or a 3-D cube) around each candidate's voxel, HU clipped to a window and
scaled to [0, 1].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import SimpleITK as sitk

from data_prep.geometry import extract_patch
from data_prep.geometry import extract_window
from data_prep.luna16.volumes import load_volume
from data_prep.luna16.volumes import world_to_voxel
from data_prep.mhd import mhd_problem

PATCH = 32
"""Default patch side length in voxels (paper §VI-A), for 2-D patches and 3-D cubes."""
HU_WINDOW = (-1000.0, 400.0)
"""Default HU window: air (-1000) to just above soft tissue/nodule density."""


def scale_hu(values: np.ndarray, window: tuple[float, float]) -> np.ndarray:
    """Clip HU to ``window`` and scale linearly so that ``window`` maps to [0, 1]."""
    low, high = window
    return ((np.clip(values.astype(np.float32), low, high) - low) / (high - low)).astype(np.float32)


def extract_candidates(
    image: sitk.Image,
    points_mm: np.ndarray,
    window: tuple[float, float],
    patch: int = PATCH,
    dims: int = 2,
) -> dict[str, np.ndarray]:
    """Cut one axial patch (or cube) per candidate, centred on its nearest voxel.

    2-D: the ``patch``x``patch`` patch is taken from axial slice ``voxel_z``; rows run along y,
    columns along x, and the candidate's voxel sits at pixel (patch/2, patch/2), e.g. (16, 16).
    3-D: the ``patch``³ cube of the (z, y, x) array starting at ``voxel - patch/2`` on every
    axis, so the candidate's voxel sits at (patch/2, patch/2, patch/2). Parts outside the
    volume are padded with the window minimum (0 after scaling).

    Args:
        image: LPS-oriented volume in HU.
        points_mm: Candidate world coordinates, shape ``(n, 3)``.
        window: HU window.
        patch: Side length in voxels (even).
        dims: 2 (axial patches) or 3 (cubes).

    Returns:
        ``patches`` float32 ``(n, patch, patch)`` (3-D: ``(n, patch, patch, patch)``, axes z, y,
        x), ``voxels`` int64 ``(n, 3)`` (x, y, z) and ``inside`` bool ``(n,)`` (False: the
        centre voxel is outside the volume; its patch is all zeros and is dropped later).
    """
    volume = sitk.GetArrayViewFromImage(image)  # (z, y, x)
    voxels = np.floor(world_to_voxel(image, points_mm) + 0.5).astype(np.int64)
    size_xyz = np.asarray(image.GetSize())
    inside = np.all((voxels >= 0) & (voxels < size_xyz), axis=1)
    patches = np.zeros((len(voxels), *([patch] * dims)), dtype=np.float32)
    half = patch // 2
    for i, (vx, vy, vz) in enumerate(voxels):
        if not inside[i]:
            continue
        if dims == 3:
            raw = extract_window(volume, (vz - half, vy - half, vx - half), patch, window[0])
        else:
            raw = extract_patch(volume[vz], vy - half, vx - half, patch, window[0])
        patches[i] = scale_hu(raw, window)
    return {"patches": patches, "voxels": voxels, "inside": inside}


def convert_study(
    path: Path,
    rows: pd.DataFrame,
    window: tuple[float, float],
    root: Path | None = None,
    patch: int = PATCH,
    dims: int = 2,
) -> dict[str, np.ndarray]:
    """Read one volume and extract the patches (or cubes) of its candidate rows.

    Args:
        path: ``.mhd`` header.
        rows: The study's candidate rows.
        window: HU window.
        root: The raw folder its files must lie under (``None``: the header's folder).
        patch: Side length in voxels.
        dims: 2 (axial patches) or 3 (cubes).

    Raises:
        StudyError: If the header/data check fails (see :func:`mhd_problem`).
        RuntimeError: If ITK cannot read the volume.
    """
    problem = mhd_problem(path, root)
    if problem is not None:
        raise problem
    image = load_volume(path)
    points = rows[["coordX", "coordY", "coordZ"]].to_numpy()
    return extract_candidates(image, points, window, patch, dims)
