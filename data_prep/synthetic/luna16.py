"""Synthetic CT studies in the official LUNA16 layout.

Lung-like HU volumes with bright spherical nodules on a chosen voxel grid and direction
matrix, written as ``subset*/<seriesuid>.mhd`` + ``.raw`` with the candidate and annotation
CSVs of the release.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

import numpy as np
import pandas as pd
import SimpleITK as sitk

LUNA_SIZE_XYZ = (48, 48, 40)
"""Voxel grid of a synthetic CT, SimpleITK order (x, y, z); the numpy array is (40, 48, 48)."""
LUNA_SPACING = (0.72, 0.81, 2.5)
LUNA_ORIGIN = (-175.3, -160.6, -312.25)
NODULE_DIAMETER_MM = 7.0
NODULE_HU = 60.0
LUNG_HU = -850.0
UID_PREFIX = "1.3.6.1.4.1.14519.5.2.1.6279.6001."


def direction_matrix(kind: str) -> np.ndarray:
    """Return a 3x3 direction matrix (columns = world direction of the x, y, z index axes).

    Args:
        kind: ``identity``; ``flipped`` (x and z axes reversed); ``permuted`` (x and y index
            axes swapped, z reversed); ``oblique`` (rotated 20° about z and 10° about x).

    Returns:
        An orthonormal matrix.
    """
    if kind == "identity":
        return np.eye(3)
    if kind == "flipped":
        return np.diag([-1.0, 1.0, -1.0])
    if kind == "permuted":
        return np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, -1.0]])
    if kind == "oblique":
        a, b = np.deg2rad(20.0), np.deg2rad(10.0)
        rot_z = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
        rot_x = np.array([[1, 0, 0], [0, np.cos(b), -np.sin(b)], [0, np.sin(b), np.cos(b)]])
        return rot_z @ rot_x
    raise ValueError(f"unknown direction kind {kind!r}")


@dataclass(frozen=True)
class Geometry:
    """Voxel grid of a CT volume in SimpleITK conventions.

    Attributes:
        size: Number of voxels along x, y, z.
        spacing: Voxel size in mm along x, y, z.
        origin: World position (mm) of voxel (0, 0, 0).
        direction: 3x3 direction matrix.
    """

    size: tuple[int, int, int] = LUNA_SIZE_XYZ
    spacing: tuple[float, float, float] = LUNA_SPACING
    origin: tuple[float, float, float] = LUNA_ORIGIN
    direction: np.ndarray = field(default_factory=lambda: np.eye(3))

    def to_world(self, index_xyz: np.ndarray) -> np.ndarray:
        """Map (continuous) indices ``(n, 3)`` in (x, y, z) order to world mm ``(n, 3)``."""
        matrix = self.direction @ np.diag(self.spacing)
        return np.asarray(index_xyz, np.float64) @ matrix.T + np.asarray(self.origin)


@dataclass(frozen=True)
class LunaStudy:
    """One synthetic CT study.

    Attributes:
        seriesuid: Series UID (file stem).
        path: The written ``.mhd`` header.
        geometry: Its voxel grid.
        nodules: World centres (mm) of the planted nodules, shape ``(k, 3)``.
        negatives: World points of the negative candidates, shape ``(m, 3)``.
        edge: World point of a negative candidate 1 voxel from the volume's corner in-plane.
    """

    seriesuid: str
    path: Path
    geometry: Geometry
    nodules: np.ndarray
    negatives: np.ndarray
    edge: np.ndarray


def _random_indices(
    rng: np.random.Generator, size: Sequence[int], n: int, margin: int
) -> np.ndarray:
    """Draw ``n`` continuous voxel indices at least ``margin`` voxels in-plane from the edge."""
    lows = np.array([margin, margin, 3.0])
    highs = np.array(size, np.float64) - 1 - lows
    return rng.uniform(lows, highs, size=(n, 3))


def make_ct(geometry: Geometry, nodules_mm: np.ndarray, rng: np.random.Generator) -> sitk.Image:
    """Build a lung-like int16 HU volume with bright spherical nodules at world positions.

    Args:
        geometry: Voxel grid.
        nodules_mm: Nodule centres in world mm, shape ``(k, 3)``.
        rng: Random generator (noise).

    Returns:
        The volume with origin, spacing and direction set.
    """
    nx, ny, nz = geometry.size
    grid = np.stack(np.meshgrid(np.arange(nx), np.arange(ny), np.arange(nz), indexing="ij"), -1)
    world = geometry.to_world(grid.reshape(-1, 3)).reshape(nx, ny, nz, 3)
    hu = LUNG_HU + rng.normal(0.0, 15.0, size=(nx, ny, nz))
    for centre in nodules_mm:
        dist = np.linalg.norm(world - centre, axis=-1)
        hu = np.where(dist <= NODULE_DIAMETER_MM / 2, NODULE_HU - 20.0 * dist, hu)
    image = sitk.GetImageFromArray(np.round(hu).astype(np.int16).transpose(2, 1, 0))
    image.SetSpacing(geometry.spacing)
    image.SetOrigin(geometry.origin)
    image.SetDirection(tuple(geometry.direction.ravel()))
    return image


def _far_from(points: np.ndarray, centres: np.ndarray, min_mm: float) -> np.ndarray:
    dist = np.linalg.norm(points[:, None, :] - centres[None, :, :], axis=-1)
    return points[dist.min(axis=1) > min_mm]


def _luna_study(
    root: Path,
    index: int,
    rng: np.random.Generator,
    direction: str,
    n_negatives: int,
    subsets: int,
) -> LunaStudy:
    geometry = Geometry(
        origin=tuple(np.asarray(LUNA_ORIGIN) + rng.uniform(-5, 5, 3)),
        direction=direction_matrix(direction),
    )
    n_nodules = 1 + index % 2
    nodules = geometry.to_world(_random_indices(rng, geometry.size, n_nodules, 12))
    pool = geometry.to_world(_random_indices(rng, geometry.size, 8 * n_negatives, 4))
    negatives = _far_from(pool, nodules, 3 * NODULE_DIAMETER_MM)[:n_negatives]
    edge = geometry.to_world(np.array([[1.0, 2.0, geometry.size[2] // 2]]))[0]
    uid = f"{UID_PREFIX}{rng.integers(10**11, 10**12)}{index:03d}"
    folder = root / f"subset{index % subsets}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{uid}.mhd"
    sitk.WriteImage(make_ct(geometry, nodules, rng), str(path))
    return LunaStudy(uid, path, geometry, nodules, negatives, edge)


def _candidate_rows(study: LunaStudy) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    labelled = [(p, 1) for p in study.nodules] + [(p, 0) for p in study.negatives]
    for point, label in [*labelled, (study.edge, 0)]:
        x, y, z = (float(v) for v in point)
        rows.append(
            {"seriesuid": study.seriesuid, "coordX": x, "coordY": y, "coordZ": z, "class": label}
        )
    return rows


def write_luna16(
    out: Path,
    n_studies: int = 4,
    seed: int = 0,
    direction: str = "identity",
    n_negatives: int = 6,
    subsets: int = 2,
) -> list[LunaStudy]:
    """Write synthetic CT studies in the official LUNA16 layout.

    Creates ``out/subset0/`` to ``out/subset{subsets - 1}/`` (study ``i`` in ``i % subsets``)
    with ``<seriesuid>.mhd`` + ``.raw`` (int16 HU, non-identity origin, anisotropic spacing,
    chosen direction matrix), ``candidates.csv`` (nodule centres as class 1, random far-away
    points and one point near the volume corner as class 0, shuffled), ``candidates_V2.csv``
    (same rows) and ``annotations.csv``.

    Args:
        out: Folder to create the release in.
        n_studies: Number of CT volumes.
        seed: Random seed; the output is identical for equal seeds.
        direction: Direction matrix kind, see :func:`direction_matrix`.
        n_negatives: Random negative candidates per volume (besides the corner one).
        subsets: Number of subset folders, 1 to 10 (the release has ten: the natural sites of
            ``partition=natural``).

    Returns:
        The studies, with the world coordinates of what was planted.
    """
    if not 1 <= subsets <= 10:
        raise ValueError(f"subsets={subsets}: the release has subset0 to subset9 (1 to 10)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    studies = [_luna_study(out, i, rng, direction, n_negatives, subsets) for i in range(n_studies)]
    candidates = pd.DataFrame([row for s in studies for row in _candidate_rows(s)])
    candidates = candidates.sample(frac=1.0, random_state=seed).reset_index(drop=True)
    candidates.to_csv(out / "candidates.csv", index=False)
    candidates.to_csv(out / "candidates_V2.csv", index=False)
    annotations = pd.DataFrame(
        [
            {
                "seriesuid": s.seriesuid,
                "coordX": p[0],
                "coordY": p[1],
                "coordZ": p[2],
                "diameter_mm": NODULE_DIAMETER_MM,
            }
            for s in studies
            for p in s.nodules
        ]
    )
    annotations.to_csv(out / "annotations.csv", index=False)
    return studies
