"""Synthetic MRI studies written in the file layouts of BraTS 2017-2023, FeTS 2022 and MSD.

Each release's folders, file names, label values and side tables (BraTS 2020's
``name_mapping.csv``, FeTS's partitioning CSVs, MSD's ``dataset.json``), in any voxel
orientation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd

from data_prep.synthetic.mri import MRIStudy
from data_prep.synthetic.mri import make_mri_studies

BRATS_MODALITIES = ("flair", "t1", "t1ce", "t2")
MSD_MODALITY_NAMES = {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
BRATS_TO_MSD_LABEL = {0: 0, 1: 2, 2: 1, 4: 3}
"""BraTS labels (1 necrotic/non-enhancing, 2 edema, 4 enhancing) to MSD labels."""


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
