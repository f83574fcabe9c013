"""Small synthetic studies written in the *official* LUNA16, BraTS 2017-2023 and MSD file layouts.

Nobody can download LUNA16 or BraTS on the development machines, so the converters of
pFedNet's §VI-A datasets are tested on these look-alikes. They are deterministic for a seed,
take well under a second for a handful of studies, and record where every nodule/tumour was
planted so tests can check that the converters find it.

Usage::

    python -m data_prep.synthetic luna16 --out DIR [--n-studies K] [--seed S]
        [--direction identity|flipped|permuted|oblique]
    python -m data_prep.synthetic brats --out DIR [--n-studies K] [--seed S]
        [--layout brats2017|brats2018|brats2019|brats2020|brats2021|fets2022|brats2023|msd|both]
        [--shape X Y Z]
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

    def release_name(self, release: str) -> str:
        """Subject id of this study in a BraTS release, spelled as the release spells it.

        Args:
            release: One of :data:`BRATS_RELEASES` other than ``msd``.

        Returns:
            E.g. ``Brats18_TCIA01_101_1``, ``BraTS20_Training_001``, ``BraTS2021_00000``,
            ``FeTS2022_00000`` or ``BraTS-GLI-00000-000``.
        """
        names = {
            "brats2017": self.brats_name,
            "brats2018": f"Brats18_TCIA01_{101 + self.index}_1",
            "brats2019": f"BraTS19_TCIA01_{101 + self.index}_1",
            "brats2020": f"BraTS20_Training_{self.index + 1:03d}",
            "brats2021": f"BraTS2021_{self.index:05d}",
            "fets2022": f"FeTS2022_{self.index:05d}",
            "brats2023": f"BraTS-GLI-{self.index:05d}-000",
        }
        if release not in names:
            raise ValueError(f"unknown BraTS release {release!r}")
        return names[release]


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


def make_mri_studies(
    n_studies: int = 3, seed: int = 0, shape: Sequence[int] = MRI_SHAPE
) -> list[MRIStudy]:
    """Build ``n_studies`` deterministic MRI studies (alternating HGG/LGG) on a ``shape`` grid."""
    rng = np.random.default_rng(seed)
    return [make_mri(i, rng, shape) for i in range(n_studies)]


# --------------------------------------------------------------------------- BraTS 2018-2023

BRATS_RELEASES = (
    "brats2017",
    "brats2018",
    "brats2019",
    "brats2020",
    "brats2021",
    "fets2022",
    "brats2023",
    "msd",
)
"""Layouts :func:`write_brats` writes (``brats2018``/``brats2019`` = the 2017 HGG/LGG layout)."""
BRATS2023_MODALITIES = ("t2f", "t1n", "t1c", "t2w")
"""BraTS 2023 file suffixes of FLAIR, T1, T1ce, T2 (in :data:`BRATS_MODALITIES` order)."""
BRATS2020_ODD_SEG = {"BraTS20_Training_355": "W39_1998.09.19_Segm.nii"}
"""Segmentation files of the BraTS 2020 training data not named ``<id>_seg.nii``."""
BRATS_TO_2023_LABEL = {0: 0, 1: 1, 2: 2, 4: 3}
"""BraTS 2017-2021 labels to BraTS 2023 labels (1 NETC, 2 SNFH, 3 enhancing tumour)."""


def to_2023_labels(seg: np.ndarray) -> np.ndarray:
    """Map BraTS labels {0, 1, 2, 4} to BraTS 2023 labels {0, 1, 2, 3} (enhancing 4 -> 3)."""
    lut = np.zeros(256, np.uint8)
    for old, new in BRATS_TO_2023_LABEL.items():
        lut[old] = new
    return lut[seg]


def write_release_study(
    root: Path,
    study: MRIStudy,
    release: str,
    axcodes: Sequence[str] = ("L", "P", "S"),
    suffix: str = ".nii.gz",
) -> Path:
    """Write one study in the folder layout and file names of a BraTS release.

    * ``brats2017``/``brats2018``/``brats2019``:
      ``root/{HGG,LGG}/<id>/<id>_{flair,t1,t1ce,t2,seg}.nii.gz``;
    * ``brats2020``: ``root/BraTS20_Training_NNN/BraTS20_Training_NNN_{...}.nii.gz``, except
      case 355, whose segmentation is ``W39_1998.09.19_Segm.nii`` as in the release;
    * ``brats2021`` / ``fets2022``: ``root/<id>/<id>_{flair,t1,t1ce,t2,seg}.nii.gz`` with
      ``BraTS2021_NNNNN`` / ``FeTS2022_NNNNN`` ids;
    * ``brats2023``: ``root/BraTS-GLI-NNNNN-NNN/BraTS-GLI-NNNNN-NNN-{t2f,t1n,t1c,t2w,seg}.nii.gz``
      with labels 1, 2, 3 (3 = enhancing tumour, label 4 of the earlier releases).

    Args:
        root: Release folder.
        study: The study.
        release: One of :data:`BRATS_RELEASES` other than ``msd``.
        axcodes: Voxel orientation of the files.
        suffix: ``.nii.gz`` (the releases) or ``.nii`` (e.g. the widely used Kaggle copy of
            BraTS 2020, whose files are uncompressed).

    Returns:
        The subject folder.
    """
    name = study.release_name(release)
    if release in ("brats2017", "brats2018", "brats2019"):
        folder = root / study.grade / name
    else:
        folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    sep, modalities, seg = "_", BRATS_MODALITIES, study.seg
    if release == "brats2023":
        sep, modalities, seg = "-", BRATS2023_MODALITIES, to_2023_labels(study.seg)
    for channel, modality in enumerate(modalities):
        path = folder / f"{name}{sep}{modality}{suffix}"
        _save_nifti(path, study.images[..., channel], study.affine, axcodes)
    seg_name = BRATS2020_ODD_SEG.get(name, f"{name}{sep}seg{suffix}")
    _save_nifti(folder / seg_name, seg, study.affine, axcodes)
    return folder


def _write_brats2020_tables(root: Path, studies: Sequence[MRIStudy]) -> None:
    """``name_mapping.csv`` and ``survival_info.csv`` as they sit in the 2020 data folder."""
    names = [s.release_name("brats2020") for s in studies]
    pd.DataFrame(
        {
            "Grade": [s.grade for s in studies],
            "BraTS_2017_subject_ID": [s.brats_name for s in studies],
            "BraTS_2018_subject_ID": [s.release_name("brats2018") for s in studies],
            "TCGA_TCIA_subject_ID": [f"TCGA-02-{s.index:04d}" for s in studies],
            "BraTS_2019_subject_ID": [s.release_name("brats2019") for s in studies],
            "BraTS_2020_subject_ID": names,
        }
    ).to_csv(root / "name_mapping.csv", index=False)
    pd.DataFrame(
        {
            "Brats20ID": names,
            "Age": [60.5 + s.index for s in studies],
            "Survival_days": [str(300 + 10 * s.index) for s in studies],
            "Extent_of_Resection": ["GTR" for _ in studies],
        }
    ).to_csv(root / "survival_info.csv", index=False)


def write_fets_partitioning(path: Path, sites: dict[str, object]) -> Path:
    """Write a FeTS partitioning CSV (``Subject_ID,Partition_ID``, one row per subject).

    FeTS ships ``partitioning_1.csv`` (one partition per institution) and
    ``partitioning_2.csv`` (the largest institutions further split by tumour size); both
    have this shape.

    Args:
        path: The CSV to write.
        sites: Subject id -> partition id.

    Returns:
        ``path``.
    """
    rows = "".join(f"{subject},{site}\n" for subject, site in sites.items())
    Path(path).write_text("Subject_ID,Partition_ID\n" + rows)
    return Path(path)


def write_brats(
    out: Path,
    layout: str = "brats2017",
    n_studies: int = 3,
    seed: int = 0,
    axcodes: Sequence[str] | None = None,
    studies: Sequence[MRIStudy] | None = None,
    suffix: str = ".nii.gz",
) -> list[MRIStudy]:
    """Write synthetic MRI studies in a BraTS release's layout or MSD Task01's.

    The same ``seed`` (or the same ``studies``) gives the same underlying studies in every
    layout, so converters can be checked to produce identical arrays. ``brats2020`` also
    writes the release's ``name_mapping.csv`` and ``survival_info.csv``; ``fets2022`` writes
    FeTS's ``partitioning_1.csv`` (two sites) and ``partitioning_2.csv`` (three) next to the
    subject folders.

    Args:
        out: Release folder.
        layout: One of :data:`BRATS_RELEASES` (see :func:`write_release_study`).
        n_studies: Number of studies (ignored when ``studies`` is given).
        seed: Random seed.
        axcodes: File orientation; default ``LPS`` for BraTS and ``RAS`` for MSD.
        studies: Pre-built studies to write instead of new ones.
        suffix: File suffix of the BraTS 2018-2023 layouts, ``.nii.gz`` or ``.nii``.

    Returns:
        The studies written.
    """
    out = Path(out)
    if layout not in BRATS_RELEASES:
        raise ValueError(f"unknown layout {layout!r}")
    studies = list(studies) if studies is not None else make_mri_studies(n_studies, seed)
    if layout == "brats2017":
        for study in studies:
            write_brats2017_study(out, study, axcodes or ("L", "P", "S"))
    elif layout == "msd":
        for study in studies:
            write_msd_study(out, study, axcodes or ("R", "A", "S"))
        _write_msd_json(out, studies)
    else:
        for study in studies:
            write_release_study(out, study, layout, axcodes or ("L", "P", "S"), suffix)
    if layout == "brats2020":
        _write_brats2020_tables(out, studies)
    if layout == "fets2022":
        for number, n_sites in ((1, 2), (2, 3)):
            sites = {s.release_name(layout): 1 + k % n_sites for k, s in enumerate(studies)}
            write_fets_partitioning(out / f"partitioning_{number}.csv", sites)
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
        "--subsets",
        type=int,
        choices=range(1, 11),
        metavar="{1..10}",
        default=2,
        help="LUNA16 only: subset folders, 1 to 10 (the release's ten are the natural sites)",
    )
    parser.add_argument(
        "--layout",
        choices=[*BRATS_RELEASES, "both"],
        default="brats2017",
        help="BraTS only; 'both' writes OUT/brats2017 and OUT/msd from the same studies",
    )
    parser.add_argument(
        "--shape",
        type=int,
        nargs=3,
        default=list(MRI_SHAPE),
        metavar=("X", "Y", "Z"),
        help="BraTS only: voxel grid of each MRI (default 80 80 24)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m data_prep.synthetic``."""
    args = build_parser().parse_args(argv)
    if args.n_studies < 1:
        raise SystemExit("error: --n-studies must be at least 1")
    if args.dataset == "luna16":
        write_luna16(args.out, args.n_studies, args.seed, args.direction, subsets=args.subsets)
    elif min(args.shape) < 4:
        raise SystemExit(f"error: --shape {args.shape}: every side must be at least 4 voxels")
    elif args.layout == "both":
        studies = make_mri_studies(args.n_studies, args.seed, args.shape)
        write_brats(args.out / "brats2017", "brats2017", studies=studies)
        write_brats(args.out / "msd", "msd", studies=studies)
    else:
        studies = make_mri_studies(args.n_studies, args.seed, args.shape)
        write_brats(args.out, args.layout, studies=studies)
    print(f"wrote {args.n_studies} synthetic {args.dataset} studies to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
