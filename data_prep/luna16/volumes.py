"""The CT volumes of LUNA16.

The ``subset*/<seriesuid>.mhd`` headers found under ``--root``, a volume read and re-oriented to
LPS, and world coordinates (mm) mapped to its voxel indices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import SimpleITK as sitk

from data_prep.common import RunLog
from data_prep.common import id_problem

ORIENTATION = "LPS"
"""Volumes are re-oriented to DICOM LPS (axis flips/permutations only, never resampled)."""


def find_volumes(root: Path, log: RunLog) -> dict[str, Path]:
    """Map series UID to ``.mhd`` path for every CT volume in ``root/subset*/``.

    Only ``subset*`` folders (at any depth below them) are searched, so the lung masks of the
    official ``seg-lungs-LUNA16/`` folder, which reuse the series UIDs, are never mistaken for
    CT. Without any ``subset*`` folder, ``root/*.mhd`` is used.

    Args:
        root: Raw LUNA16 folder.
        log: Receives duplicate series UIDs as skips.

    Returns:
        Series UID -> header path, sorted by UID.
    """
    paths = sorted(root.glob("subset*/**/*.mhd")) or sorted(root.glob("*.mhd"))
    volumes: dict[str, Path] = {}
    for path in paths:
        if path.name.startswith("._"):
            continue
        problem = id_problem(path.stem)
        if problem is not None:
            log.skip(path, f"bad seriesuid: file name {problem}")
            continue
        if path.stem in volumes:
            log.skip(path, f"duplicate seriesuid: already found at {volumes[path.stem]}")
            continue
        volumes[path.stem] = path
    return dict(sorted(volumes.items()))


def subset_of(path: Path, root: Path) -> str:
    """The ``subset*`` folder (directly in ``root``) that holds ``path``, or ``""``.

    Args:
        path: A volume found by :func:`find_volumes`.
        root: The raw folder.

    Returns:
        E.g. ``subset3``; ``""`` for a volume directly in ``root``.
    """
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 and parts[0].startswith("subset") else ""


def load_volume(path: Path) -> sitk.Image:
    """Read a CT volume and re-orient it to LPS (flips/permutations of the voxel grid only).

    Always with ITK's MetaImage reader, the format :func:`data_prep.mhd.mhd_problem` checked.
    """
    image = sitk.ReadImage(str(path), imageIO="MetaImageIO")
    if image.GetDimension() != 3:
        raise ValueError(f"expected a 3-D volume, got {image.GetDimension()}-D")
    return sitk.DICOMOrient(image, ORIENTATION)


def world_to_voxel(image: sitk.Image, points_mm: np.ndarray) -> np.ndarray:
    """Map world points (mm) to continuous voxel indices (x, y, z) of ``image``.

    Uses origin, spacing *and* direction: ``index = (D · diag(spacing))⁻¹ (p - origin)``,
    the same as ``image.TransformPhysicalPointToContinuousIndex``, vectorised.

    Args:
        image: The volume.
        points_mm: World coordinates, shape ``(n, 3)``, columns x, y, z.

    Returns:
        Continuous indices, shape ``(n, 3)``, in SimpleITK order (x, y, z).
    """
    direction = np.asarray(image.GetDirection(), dtype=np.float64).reshape(3, 3)
    spacing = np.asarray(image.GetSpacing(), dtype=np.float64)
    origin = np.asarray(image.GetOrigin(), dtype=np.float64)
    to_world = direction @ np.diag(spacing)
    return np.linalg.solve(to_world, (np.asarray(points_mm, np.float64) - origin).T).T
