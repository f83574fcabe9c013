"""Small synthetic studies written in the *official* LUNA16, BraTS2017 and MSD file layouts.

Nobody can download LUNA16 or BraTS on the development machines, so the converters of
pFedNet's §VI-A datasets are tested on these look-alikes. They are deterministic for a seed,
take well under a second for a handful of studies, and record where every nodule/tumour was
planted so tests can check that the converters find it.

Usage::

    python -m data_prep.synthetic luna16 --out DIR [--n-studies K] [--seed S]
        [--direction identity|flipped|permuted|oblique]
    python -m data_prep.synthetic brats --out DIR [--n-studies K] [--seed S]
        [--layout brats2017|msd|both]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import SimpleITK as sitk

# --------------------------------------------------------------------------- LUNA16

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
    root: Path, index: int, rng: np.random.Generator, direction: str, n_negatives: int
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
    folder = root / f"subset{index % 2}"
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
) -> list[LunaStudy]:
    """Write synthetic CT studies in the official LUNA16 layout.

    Creates ``out/subset0/``, ``out/subset1/`` with ``<seriesuid>.mhd`` + ``.raw`` (int16 HU,
    non-identity origin, anisotropic spacing, chosen direction matrix), ``candidates.csv``
    (nodule centres as class 1, random far-away points and one point near the volume corner as
    class 0, shuffled), ``candidates_V2.csv`` (same rows) and ``annotations.csv``.

    Args:
        out: Folder to create the release in.
        n_studies: Number of CT volumes.
        seed: Random seed; the output is identical for equal seeds.
        direction: Direction matrix kind, see :func:`direction_matrix`.
        n_negatives: Random negative candidates per volume (besides the corner one).

    Returns:
        The studies, with the world coordinates of what was planted.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    studies = [_luna_study(out, i, rng, direction, n_negatives) for i in range(n_studies)]
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


# --------------------------------------------------------------------------- BraTS / MSD

MRI_SHAPE = (80, 80, 24)
"""Canonical (RAS) voxel grid of a synthetic MRI."""
MRI_AFFINE = np.array(
    [[0.94, 0.0, 0.0, -37.5], [0.0, 1.06, 0.0, -42.0], [0.0, 0.0, 2.2, -25.0], [0, 0, 0, 1.0]]
)
"""Canonical RAS affine (anisotropic voxels, shifted origin)."""
BRATS_MODALITIES = ("flair", "t1", "t1ce", "t2")
MSD_MODALITY_NAMES = {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
BRATS_TO_MSD_LABEL = {0: 0, 1: 2, 2: 1, 4: 3}
"""BraTS labels (1 necrotic/non-enhancing, 2 edema, 4 enhancing) to MSD labels."""

_BRAIN_INTENSITY = (300.0, 500.0, 450.0, 400.0)
_LABEL_INTENSITY = {  # label -> intensity per modality (FLAIR, T1, T1ce, T2)
    2: (700.0, 420.0, 430.0, 800.0),
    4: (600.0, 450.0, 1000.0, 650.0),
    1: (500.0, 200.0, 250.0, 900.0),
}


@dataclass(frozen=True)
class MRIStudy:
    """One synthetic brain MRI in canonical (RAS) voxel order.

    Attributes:
        index: Study number (names the files).
        grade: ``HGG`` or ``LGG`` (BraTS2017 folder).
        images: int16 ``(X, Y, Z, 4)``, channels FLAIR, T1, T1ce, T2; zero outside the brain.
        seg: uint8 ``(X, Y, Z)`` in BraTS labels {0, 1, 2, 4}.
        affine: 4x4 RAS affine.
        centre: Voxel (i, j, k) of the tumour centre.
    """

    index: int
    grade: str
    images: np.ndarray
    seg: np.ndarray
    affine: np.ndarray
    centre: tuple[int, int, int]

    @property
    def brats_name(self) -> str:
        """Patient folder name in the BraTS2017 layout."""
        return f"Brats17_SYN_{self.index:03d}_1"

    @property
    def msd_name(self) -> str:
        """Case name in the MSD layout (file stem)."""
        return f"BRATS_{self.index + 1:03d}"


def _ellipsoid(shape: Sequence[int], centre: Sequence[float], radii: Sequence[float]) -> np.ndarray:
    axes = [(np.arange(n) - c) / r for n, c, r in zip(shape, centre, radii, strict=True)]
    grid = np.meshgrid(*axes, indexing="ij")
    return sum(g**2 for g in grid) <= 1.0


def make_mri(
    index: int,
    rng: np.random.Generator,
    shape: Sequence[int] = MRI_SHAPE,
    centre: Sequence[int] | None = None,
) -> MRIStudy:
    """Build a 4-modality brain MRI with a tumour (edema, enhancing rim, necrotic core).

    Args:
        index: Study number.
        rng: Random generator (tumour position, size and noise).
        shape: Canonical voxel grid.
        centre: Tumour centre voxel; random inside the brain when ``None``.

    Returns:
        The study.
    """
    shape = tuple(int(n) for n in shape)
    mid = [n / 2 - 0.5 for n in shape]
    brain = _ellipsoid(shape, mid, [0.42 * shape[0], 0.45 * shape[1], 0.45 * shape[2]])
    if centre is None:
        centre = [
            int(round(m + rng.uniform(-0.15, 0.15) * n)) for m, n in zip(mid, shape, strict=True)
        ]
    centre = tuple(int(c) for c in centre)
    scale = rng.uniform(0.8, 1.2)
    seg = np.zeros(shape, np.uint8)
    for label, radii in ((2, (10, 9, 4)), (4, (6, 6, 2.5)), (1, (3.5, 3.5, 1.5))):
        seg[_ellipsoid(shape, centre, [scale * r for r in radii]) & brain] = label
    images = np.zeros((*shape, 4), np.float64)
    for channel in range(4):
        values = np.full(shape, _BRAIN_INTENSITY[channel])
        for label, intensity in _LABEL_INTENSITY.items():
            values[seg == label] = intensity[channel]
        noisy = values + rng.normal(0.0, 20.0, size=shape)
        images[..., channel] = np.where(brain, np.maximum(noisy, 1.0), 0.0)
    grade = "HGG" if index % 2 == 0 else "LGG"
    return MRIStudy(index, grade, np.round(images).astype(np.int16), seg, MRI_AFFINE.copy(), centre)


def reorient(
    data: np.ndarray, affine: np.ndarray, axcodes: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Re-store canonical (RAS) data in another voxel orientation, same world geometry.

    Args:
        data: Array whose first three axes are RAS.
        affine: Its RAS affine.
        axcodes: Target orientation, e.g. ``("L", "P", "S")`` or ``("A", "R", "I")``.

    Returns:
        The re-ordered array and the affine that keeps every voxel at its world position.
    """
    transform = nib.orientations.ornt_transform(
        nib.orientations.axcodes2ornt(("R", "A", "S")),
        nib.orientations.axcodes2ornt(tuple(axcodes)),
    )
    image = nib.Nifti1Image(np.asarray(data), affine)
    moved = image.as_reoriented(transform)
    return np.asarray(moved.dataobj), moved.affine


def _save_nifti(path: Path, data: np.ndarray, affine: np.ndarray, axcodes: Sequence[str]) -> None:
    moved, moved_affine = reorient(data, affine, axcodes)
    image = nib.Nifti1Image(np.ascontiguousarray(moved), moved_affine)
    image.set_qform(moved_affine, code=1)
    image.set_sform(moved_affine, code=1)
    nib.save(image, str(path))


def write_brats2017_study(
    root: Path, study: MRIStudy, axcodes: Sequence[str] = ("L", "P", "S")
) -> Path:
    """Write a study as ``root/<grade>/<patient>/<patient>_{flair,t1,t1ce,t2,seg}.nii.gz``.

    Args:
        root: Release folder (holds ``HGG/`` and ``LGG/``).
        study: The study.
        axcodes: Voxel orientation of the files (BraTS files are usually ``LPS``).

    Returns:
        The patient folder.
    """
    folder = root / study.grade / study.brats_name
    folder.mkdir(parents=True, exist_ok=True)
    for channel, modality in enumerate(BRATS_MODALITIES):
        path = folder / f"{study.brats_name}_{modality}.nii.gz"
        _save_nifti(path, study.images[..., channel], study.affine, axcodes)
    _save_nifti(folder / f"{study.brats_name}_seg.nii.gz", study.seg, study.affine, axcodes)
    return folder


def to_msd_labels(seg: np.ndarray) -> np.ndarray:
    """Map BraTS labels {0, 1, 2, 4} to MSD labels {0 bg, 1 edema, 2 non-enh., 3 enh.}."""
    lut = np.zeros(256, np.uint8)
    for brats, msd in BRATS_TO_MSD_LABEL.items():
        lut[brats] = msd
    return lut[seg]


def write_msd_study(root: Path, study: MRIStudy, axcodes: Sequence[str] = ("R", "A", "S")) -> Path:
    """Write a study as MSD Task01 ``imagesTr/BRATS_XXX.nii.gz`` (4-D) + ``labelsTr/``.

    Args:
        root: Task folder (holds ``imagesTr/``, ``labelsTr/``, ``dataset.json``).
        study: The study.
        axcodes: Voxel orientation of the files.

    Returns:
        The image path.
    """
    (root / "imagesTr").mkdir(parents=True, exist_ok=True)
    (root / "labelsTr").mkdir(parents=True, exist_ok=True)
    image_path = root / "imagesTr" / f"{study.msd_name}.nii.gz"
    _save_nifti(image_path, study.images.astype(np.float32), study.affine, axcodes)
    label_path = root / "labelsTr" / f"{study.msd_name}.nii.gz"
    _save_nifti(label_path, to_msd_labels(study.seg), study.affine, axcodes)
    return image_path


def _write_msd_json(root: Path, studies: Sequence[MRIStudy]) -> None:
    meta = {
        "name": "BRATS",
        "tensorImageSize": "4D",
        "modality": MSD_MODALITY_NAMES,
        "labels": {
            "0": "background",
            "1": "edema",
            "2": "non-enhancing tumor",
            "3": "enhancing tumour",
        },
        "numTraining": len(studies),
        "training": [
            {"image": f"./imagesTr/{s.msd_name}.nii.gz", "label": f"./labelsTr/{s.msd_name}.nii.gz"}
            for s in studies
        ],
        "test": [],
    }
    (root / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")


def make_mri_studies(n_studies: int = 3, seed: int = 0) -> list[MRIStudy]:
    """Build ``n_studies`` deterministic MRI studies (alternating HGG/LGG)."""
    rng = np.random.default_rng(seed)
    return [make_mri(i, rng) for i in range(n_studies)]


def write_brats(
    out: Path,
    layout: str = "brats2017",
    n_studies: int = 3,
    seed: int = 0,
    axcodes: Sequence[str] | None = None,
    studies: Sequence[MRIStudy] | None = None,
) -> list[MRIStudy]:
    """Write synthetic MRI studies in the BraTS2017 or MSD Task01 layout.

    The same ``seed`` (or the same ``studies``) gives the same underlying studies in either
    layout, so converters can be checked to produce identical arrays.

    Args:
        out: Release folder.
        layout: ``brats2017`` or ``msd``.
        n_studies: Number of studies (ignored when ``studies`` is given).
        seed: Random seed.
        axcodes: File orientation; default ``LPS`` for BraTS2017 and ``RAS`` for MSD.
        studies: Pre-built studies to write instead of new ones.

    Returns:
        The studies written.
    """
    out = Path(out)
    studies = list(studies) if studies is not None else make_mri_studies(n_studies, seed)
    if layout == "brats2017":
        for study in studies:
            write_brats2017_study(out, study, axcodes or ("L", "P", "S"))
    elif layout == "msd":
        for study in studies:
            write_msd_study(out, study, axcodes or ("R", "A", "S"))
        _write_msd_json(out, studies)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return studies


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``python -m data_prep.synthetic``."""
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.synthetic",
        description="Write small synthetic studies in the official LUNA16/BraTS/MSD layouts.",
    )
    parser.add_argument("dataset", choices=["luna16", "brats"])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the release to")
    parser.add_argument("--n-studies", type=int, default=4, help="number of studies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--direction",
        choices=["identity", "flipped", "permuted", "oblique"],
        default="identity",
        help="LUNA16 only: direction matrix of the CT volumes",
    )
    parser.add_argument(
        "--layout",
        choices=["brats2017", "msd", "both"],
        default="brats2017",
        help="BraTS only; 'both' writes OUT/brats2017 and OUT/msd from the same studies",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m data_prep.synthetic``."""
    args = build_parser().parse_args(argv)
    if args.n_studies < 1:
        raise SystemExit("error: --n-studies must be at least 1")
    if args.dataset == "luna16":
        write_luna16(args.out, args.n_studies, args.seed, args.direction)
    elif args.layout == "both":
        studies = make_mri_studies(args.n_studies, args.seed)
        write_brats(args.out / "brats2017", "brats2017", studies=studies)
        write_brats(args.out / "msd", "msd", studies=studies)
    else:
        write_brats(args.out, args.layout, args.n_studies, args.seed)
    print(f"wrote {args.n_studies} synthetic {args.dataset} studies to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
