"""Convert BraTS 2017-2023, FeTS 2022 or MSD Task01 releases into 64x64 axial tumour patches.

With ``--dims 3`` it cuts one 3-D crop per patient instead; ``--patch N`` sets the side.

pFedNet (§VI-A, "BraTS2017") segments gliomas from 4-channel 64x64 MRI patches with a U-Net
(§VI-B2). This module reads every BraTS training release as downloaded (``--layout auto``
finds which one ``--root`` holds):

* ``brats2017`` (BraTS 2017, 2018, 2019):
  ``{HGG,LGG}/<id>/<id>_{flair,t1,t1ce,t2,seg}.nii.gz``, labels 0, 1, 2, 4;
* ``brats2020``: ``BraTS20_Training_NNN/BraTS20_Training_NNN_{flair,t1,t1ce,t2,seg}.nii.gz``
  (``.nii`` in the Kaggle copy); the release names case 355's segmentation
  ``W39_1998.09.19_Segm.nii``, which is accepted for that case; ``name_mapping.csv`` and
  ``survival_info.csv`` next to the case folders are ignored;
* ``brats2021`` (BraTS 2021 and FeTS 2022): ``<id>/<id>_{flair,t1,t1ce,t2,seg}.nii.gz``
  (``BraTS2021_NNNNN``, ``FeTS2022_NNNNN``), labels 0, 1, 2, 4;
* ``brats2023`` (BraTS 2023 GLI): ``BraTS-GLI-NNNNN-NNN/BraTS-GLI-NNNNN-NNN-{t2f,t1n,t1c,t2w,seg}
  .nii.gz``, labels 0, 1, 2, 3 (3 = enhancing tumour);
* ``msd`` (MSD Task01): ``imagesTr/BRATS_XXX.nii.gz`` (4-D: FLAIR, T1w, t1gd, T2w) +
  ``labelsTr/BRATS_XXX.nii.gz``, labels 1 edema, 2 non-enhancing, 3 enhancing.

Every release gives the same channels (FLAIR, T1, T1ce, T2 = 2023's t2f, t1n, t1c, t2w) and
the same labels (BraTS 2017-2021's 0, 1, 2, 4), hence the same regions. It brings every volume
to the closest canonical (RAS) orientation, z-scores each modality over its non-zero (brain)
voxels and cuts one patch per tumour-bearing axial slice plus a share of tumour-free slices.
With ``--sites CSV`` (FeTS's ``partitioning_1.csv`` or ``partitioning_2.csv``:
``Subject_ID,Partition_ID``) each patient's site is recorded in the manifest, so that
``partition=natural`` makes one client per site. Output in ``OUT``:

* ``images.npy``   float32 ``(N, 4, 64, 64)``, channels FLAIR, T1, T1ce, T2;
* ``masks.npy``    uint8 ``(N, 64, 64)`` whole tumour, or ``(N, 3, 64, 64)`` with
  ``--labels regions`` (whole tumour, tumour core, enhancing tumour);
* ``manifest.csv`` patient, slice, grade, row0, col0, has_tumour (and site with ``--sites``);
* with ``--dims 3``: one ``P``³ crop per patient centred on the whole tumour's 3-D bounding
  box (the brain's when there is no tumour), ``images.npy`` ``(N, 4, P, P, P)``, masks
  ``(N, P, P, P)`` or ``(N, 3, P, P, P)``, axes X, Y, Z of the canonical arrays; the manifest's
  ``row0``, ``col0``, ``slice`` are then the crop's first index along X, Y, Z;
* ``summary.json`` counts, skipped files with reasons and the options used;
* ``skipped.csv``  what was skipped and why (only when something was).

A patient with a missing, unreadable or inconsistent file (modalities on different grids,
unknown label values) is skipped with one line naming the file and what was expected; the
run stops with one ``error:`` line and exit status 1 only when no patient is usable, or when
a patient has no row in the ``--sites`` file.

Usage::

    python -m data_prep.brats --root RAW --out OUT
        [--layout auto|brats2017|brats2018|brats2019|brats2020|brats2021|fets2022|brats2023|msd]
        [--sites partitioning_1.csv] [--labels whole|regions] [--negative-share 0.2] [--seed 0]
        [--dims 2|3] [--patch 64]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pandas as pd
from rich.console import Console

from data_prep.common import (
    RunLog,
    StudyCache,
    StudyError,
    add_geometry_options,
    cleanup_partials,
    console_for,
    extract_patch,
    extract_window,
    file_stamp,
    geometry_params,
    id_problem,
    nothing_usable,
    one_line,
    parse_patch,
    prepare_out,
    progress_bar,
    require_dir,
    resolve_geometry,
    skip_line,
    write_csv,
    write_json,
    write_skipped,
    write_stacked,
)
from data_prep.sizes import check_brats, check_room
from fedexp.errors import DataError

PATCH = 64
"""Default patch side length in voxels (paper §VI-A), for 2-D patches and 3-D crops."""
MODALITIES = ("flair", "t1", "t1ce", "t2")
"""Output channel order (the same for every release)."""
MSD_NAMES = ("flair", "t1w", "t1gd", "t2w")
"""MSD ``dataset.json`` modality names (lower-cased) in output channel order."""
LAYOUTS = ("brats2017", "brats2020", "brats2021", "brats2023", "msd")
"""Layouts this module reads (see :data:`LAYOUT_ALIASES` for the releases that share one)."""
LAYOUT_ALIASES = {"brats2018": "brats2017", "brats2019": "brats2017", "fets2022": "brats2021"}
"""Releases named on the command line that are read as another release's layout."""
RELEASE_FILES: dict[str, tuple[str, tuple[str, ...]]] = {
    "brats2017": ("_", (*MODALITIES, "seg")),
    "brats2020": ("_", (*MODALITIES, "seg")),
    "brats2021": ("_", (*MODALITIES, "seg")),
    "brats2023": ("-", ("t2f", "t1n", "t1c", "t2w", "seg")),
}
"""Per folder layout: separator between subject id and file kind, and the kinds in the order
FLAIR, T1, T1ce, T2, segmentation (file ``<id><sep><kind>.nii.gz``)."""
ODD_SEG_NAMES = {"BraTS20_Training_355": "W39_1998.09.19_Segm"}
"""Segmentation files a release ships under another name (BraTS 2020 training case 355)."""
REGIONS = ("whole_tumour", "tumour_core", "enhancing_tumour")
# Common label convention = BraTS 2017-2021: 0 background, 1 necrotic/non-enhancing core,
# 2 edema, 4 enhancing. Label 3 (non-enhancing core in BraTS 2012-2016) is folded into 1 in
# the HGG/LGG layout; BraTS 2023's 3 is the enhancing tumour (-> 4); MSD's order differs.
_BRATS_LABELS = {0: 0, 1: 1, 2: 2, 3: 1, 4: 4}
_BRATS2018_LABELS = {0: 0, 1: 1, 2: 2, 4: 4}
_BRATS2023_LABELS = {0: 0, 1: 1, 2: 2, 3: 4}
_MSD_LABELS = {0: 0, 1: 2, 2: 1, 3: 4}
LABEL_TABLES = {
    "brats2017": _BRATS_LABELS,
    "brats2020": _BRATS2018_LABELS,
    "brats2021": _BRATS2018_LABELS,
    "brats2023": _BRATS2023_LABELS,
    "msd": _MSD_LABELS,
}
"""Per layout: release label -> common label."""
SITE_COLUMNS = ("Subject_ID", "Partition_ID")
"""Header of a FeTS partitioning CSV (``partitioning_1.csv``, ``partitioning_2.csv``)."""
MANIFEST_COLUMNS = ["patient", "slice", "grade", "row0", "col0", "has_tumour"]
OUTPUT_NAMES = ("images.npy", "masks.npy", "manifest.csv", "summary.json")
"""Fixed names of the files written in the output folder (besides ``studies/``)."""


@dataclass(frozen=True)
class Case:
    """One patient's files.

    Attributes:
        patient: Patient id (BraTS folder name or MSD file stem).
        grade: ``HGG``, ``LGG`` or ``unknown`` (releases without grade folders, MSD).
        layout: One of :data:`LAYOUTS`.
        images: Four single-modality files (FLAIR, T1, T1ce, T2) or one 4-D file (MSD).
        seg: Segmentation file.
    """

    patient: str
    grade: str
    layout: str
    images: tuple[Path, ...]
    seg: Path

    @property
    def location(self) -> Path:
        """Patient folder (BraTS) or image file (MSD), for messages."""
        return self.images[0] if self.layout == "msd" else self.images[0].parent

    @property
    def stamp(self) -> str:
        """Identity of the input files (resume cache)."""
        return file_stamp([*self.images, self.seg])


@dataclass(frozen=True)
class BratsOptions:
    """Conversion options.

    Attributes:
        layout: ``auto``, one of :data:`LAYOUTS` or of :data:`LAYOUT_ALIASES`.
        labels: ``whole`` (binary whole-tumour mask) or ``regions`` (WT, TC, ET channels).
        sites: FeTS partitioning CSV (``Subject_ID,Partition_ID``) giving each patient's site;
            a relative path is tried against the current folder, ``--root`` and the layout
            folder. ``None`` records no site.
        negative_share: Target share of tumour-free patches among a patient's patches (2-D
            only: a 3-D run cuts one crop per patient).
        seed: Seed of the tumour-free slice draw (2-D only).
        quiet: Suppress the progress bar and messages.
        dims: 2 for axial slice patches, 3 for one crop per patient.
        patch: Side length in voxels (even, >= 8); ``None`` means :data:`PATCH`.
    """

    layout: str = "auto"
    labels: str = "whole"
    sites: Path | None = None
    negative_share: float = 0.2
    seed: int = 0
    quiet: bool = True
    dims: int = 2
    patch: int | None = None


# --------------------------------------------------------------------------- discovery


def _subfolders(folder: Path) -> Iterator[Path]:
    """Sub-folders in name order, without hidden ones and macOS ``__MACOSX`` archives."""
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return
    for child in children:
        if child.is_dir() and not child.name.startswith((".", "__MACOSX")):
            yield child


def _is_subject_folder(folder: Path, layout: str) -> bool:
    """Whether ``folder`` holds one of ``<folder name><sep><kind>.nii[.gz]`` of ``layout``."""
    if layout == "brats2020" and not folder.name.startswith("BraTS20_"):
        return False
    sep, kinds = RELEASE_FILES[layout]
    return any(
        (folder / f"{folder.name}{sep}{kind}{suffix}").is_file()
        for kind in kinds
        for suffix in (".nii.gz", ".nii")
    )


def _has_layout(folder: Path, layout: str) -> bool:
    if layout == "brats2017":
        return (folder / "HGG").is_dir() or (folder / "LGG").is_dir()
    if layout == "msd":
        return (folder / "imagesTr").is_dir()
    return any(_is_subject_folder(sub, layout) for sub in _subfolders(folder))


_EXPECTED = {
    "brats2017": "HGG/ or LGG/ (BraTS 2017-2019)",
    "brats2020": "BraTS20_Training_NNN/BraTS20_Training_NNN_flair.nii.gz (BraTS 2020)",
    "brats2021": "<id>/<id>_flair.nii.gz (BraTS 2021, FeTS 2022)",
    "brats2023": "<id>/<id>-t2f.nii.gz (BraTS 2023)",
    "msd": "imagesTr/ + labelsTr/ (MSD Task01)",
}


def canonical_layout(layout: str) -> str:
    """The layout a ``--layout`` value reads (``brats2019`` -> ``brats2017``, ...).

    Raises:
        SystemExit: If the value names no layout.
    """
    if layout == "auto" or layout in LAYOUTS:
        return layout
    if layout in LAYOUT_ALIASES:
        return LAYOUT_ALIASES[layout]
    names = ", ".join(["auto", *LAYOUTS, *LAYOUT_ALIASES])
    raise SystemExit(f"error: --layout {layout!r}: expected one of {names}")


def _candidate_folders(root: Path) -> Iterator[Path]:
    """``root``, then its sub-folders, then theirs (breadth first, in name order)."""
    yield root
    children = list(_subfolders(root))
    yield from children
    for child in children:
        yield from _subfolders(child)


def detect_layout(root: Path, layout: str = "auto") -> tuple[str, Path]:
    """Find the release layout in ``root``, a sub-folder or a sub-sub-folder of it.

    Checked in each folder in the order of :data:`LAYOUTS`: grade folders ``HGG/``/``LGG/``
    (BraTS 2017-2019), ``imagesTr/`` (MSD), then sub-folders named like their files
    (BraTS 2023's ``<id>-t2f``, BraTS 2020's ``BraTS20_*``, BraTS 2021's ``<id>_flair``, ...).

    Args:
        root: Raw folder (e.g. ``MICCAI_BraTS2020_TrainingData``, ``Task01_BrainTumour``, or a
            folder above them, such as the Kaggle copy's ``BraTS2020_TrainingData``).
        layout: ``auto`` or the layout (or release, see :data:`LAYOUT_ALIASES`) to look for.

    Returns:
        The layout name and the folder that holds it.

    Raises:
        SystemExit: If no matching layout is found.
    """
    layout = canonical_layout(layout)
    wanted = LAYOUTS if layout == "auto" else (layout,)
    for folder in _candidate_folders(root):
        for name in wanted:
            if _has_layout(folder, name):
                return name, folder
    hint = " or ".join(_EXPECTED[name] for name in wanted)
    raise SystemExit(f"error: no BraTS layout ({hint}) found in {root} or two levels below")


def _nifti(folder: Path, stem: str) -> Path:
    for suffix in (".nii.gz", ".nii"):
        if (folder / f"{stem}{suffix}").is_file():
            return folder / f"{stem}{suffix}"
    return folder / f"{stem}.nii.gz"


def _folder_case(folder: Path, grade: str, layout: str) -> Case:
    """The files of the subject in ``folder`` (missing ones are caught on load)."""
    name = folder.name
    sep, kinds = RELEASE_FILES[layout]
    images = tuple(_nifti(folder, f"{name}{sep}{kind}") for kind in kinds[:4])
    seg = _nifti(folder, f"{name}{sep}{kinds[4]}")
    if not seg.is_file() and name in ODD_SEG_NAMES:
        odd = _nifti(folder, ODD_SEG_NAMES[name])
        seg = odd if odd.is_file() else seg
    return Case(name, grade, layout, images, seg)


def find_brats2017_cases(base: Path) -> list[Case]:
    """List ``HGG/*/`` and ``LGG/*/`` patient folders (BraTS 2017, 2018 and 2019)."""
    cases = []
    for grade in ("HGG", "LGG"):
        if (base / grade).is_dir():
            cases += [
                _folder_case(folder, grade, "brats2017") for folder in _subfolders(base / grade)
            ]
    return sorted(cases, key=lambda case: case.patient)


def find_folder_cases(base: Path, layout: str) -> list[Case]:
    """List the subject folders ``<id>/`` of BraTS 2020, 2021 (FeTS 2022) or 2023.

    Every sub-folder of ``base`` is a subject (files in ``base``, such as BraTS 2020's
    ``name_mapping.csv`` and ``survival_info.csv`` or FeTS's partitioning CSVs, are not looked
    at); a missing file is reported when the subject is loaded. BraTS 2020 case 355's
    segmentation, shipped as ``W39_1998.09.19_Segm.nii``, is taken when
    ``BraTS20_Training_355_seg.nii[.gz]`` is absent.

    Args:
        base: The folder holding the subject folders.
        layout: ``brats2020``, ``brats2021`` or ``brats2023``.

    Returns:
        The subjects, sorted by id, with grade ``unknown``.
    """
    return [_folder_case(folder, "unknown", layout) for folder in _subfolders(base)]


def find_cases(base: Path, layout: str) -> list[Case]:
    """The patients of a layout folder found by :func:`detect_layout`."""
    if layout == "brats2017":
        return find_brats2017_cases(base)
    if layout == "msd":
        return find_msd_cases(base)
    return find_folder_cases(base, layout)


def find_msd_cases(base: Path) -> list[Case]:
    """List ``imagesTr/*.nii.gz`` with their ``labelsTr/`` files (macOS ``._*`` ignored)."""
    cases = []
    for path in sorted((base / "imagesTr").glob("*.nii*")):
        if path.name.startswith("."):
            continue
        stem = path.name.split(".nii")[0]
        cases.append(Case(stem, "unknown", "msd", (path,), base / "labelsTr" / path.name))
    return cases


def msd_channel_order(base: Path) -> tuple[int, ...]:
    """Input channel index of FLAIR, T1, T1ce, T2 in MSD images.

    Read from ``dataset.json``'s ``modality`` entry when present, else the MSD default
    (0 FLAIR, 1 T1w, 2 t1gd, 3 T2w).

    Raises:
        SystemExit: If ``dataset.json`` exists but does not name the four modalities.
    """
    meta_path = base / "dataset.json"
    if not meta_path.is_file():
        return (0, 1, 2, 3)
    try:
        modality = json.loads(meta_path.read_text())["modality"]
        by_name = {str(v).lower(): int(k) for k, v in modality.items()}
        return tuple(by_name[name] for name in MSD_NAMES)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        expected = '{"modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}}'
        raise SystemExit(
            f"error: cannot read the modality list of {meta_path}: {one_line(exc)} "
            f"(expected {expected}, in any order)"
        ) from exc


# --------------------------------------------------------------------------- one patient


def load_canonical(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Load a NIfTI file in the closest canonical (RAS) orientation.

    Args:
        path: ``.nii`` or ``.nii.gz`` file.

    Returns:
        The float32 data (axes R, A, S[, channel]) and its canonical affine.

    Raises:
        StudyError: If the file is missing or cannot be decoded.
    """
    if not path.is_file():
        raise StudyError(path, "missing file")
    try:
        image = nib.as_closest_canonical(nib.load(str(path)))
        return image.get_fdata(dtype=np.float32), image.affine
    except Exception as exc:  # nibabel raises many types for corrupt files
        raise StudyError(path, f"unreadable NIfTI: {one_line(exc)}") from exc


def to_common_labels(seg: np.ndarray, layout: str, path: Path) -> np.ndarray:
    """Map a release's labels to the common BraTS convention {0, 1, 2, 4}.

    * BraTS 2017-2019 (``brats2017``): 1 necrotic/non-enhancing core, 2 edema, 4 enhancing
      (3, the non-enhancing core of BraTS 2012-2016, -> 1);
    * BraTS 2020, 2021, FeTS 2022: 1, 2, 4 as they are;
    * BraTS 2023: 1 necrotic core (NETC), 2 edema (SNFH), 3 enhancing -> 4;
    * MSD: 1 edema -> 2, 2 non-enhancing -> 1, 3 enhancing -> 4.

    Raises:
        StudyError: If the segmentation holds other values.
    """
    table = LABEL_TABLES[layout]
    values = np.rint(seg).astype(np.int64)
    unknown = sorted(set(np.unique(values).tolist()) - set(table))
    if unknown or not np.allclose(values, seg):
        expected = ", ".join(str(v) for v in sorted(table))
        raise StudyError(
            path,
            f"unexpected label values {unknown or 'non-integer'} (expected {expected} "
            f"for the {layout} layout)",
        )
    lut = np.zeros(max(table) + 1, np.uint8)
    for source, target in table.items():
        lut[source] = target
    return lut[values]


def regions_from_labels(seg: np.ndarray) -> np.ndarray:
    """BraTS evaluation regions as uint8 channels: whole tumour, tumour core, enhancing."""
    whole = seg > 0
    core = (seg == 1) | (seg == 4)
    enhancing = seg == 4
    return np.stack([whole, core, enhancing]).astype(np.uint8)


def zscore_brain(volume: np.ndarray) -> np.ndarray:
    """Z-score one modality over its non-zero (brain) voxels; background stays 0.

    Args:
        volume: One modality, any shape.

    Returns:
        float32 array of the same shape.
    """
    brain = volume != 0
    out = np.zeros(volume.shape, np.float32)
    if not brain.any():
        return out
    values = volume[brain].astype(np.float64)
    std = values.std()
    out[brain] = (values - values.mean()) / (std if std > 0 else 1.0)
    return out


def _check_same_grid(path: Path, shape: Sequence[int], affine: np.ndarray, ref: tuple) -> None:
    ref_shape, ref_affine, ref_path = ref
    if tuple(shape[:3]) != tuple(ref_shape[:3]):
        raise StudyError(
            path,
            f"shape mismatch: {tuple(shape[:3])} but {ref_path.name} has {tuple(ref_shape[:3])} "
            "(expected every file of a patient on one voxel grid)",
        )
    if not np.allclose(affine, ref_affine, atol=1e-3):
        raise StudyError(
            path,
            f"affine mismatch: differs from {ref_path.name}'s "
            "(expected every file of a patient on one voxel grid)",
        )


def load_case(case: Case, msd_order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Load a patient as canonical, z-scored images and common-convention labels.

    Args:
        case: The patient's files (any layout; channels come out FLAIR, T1, T1ce, T2).
        msd_order: Channel permutation for MSD 4-D images (see :func:`msd_channel_order`).

    Returns:
        Images float32 ``(4, X, Y, Z)`` (FLAIR, T1, T1ce, T2) and labels uint8 ``(X, Y, Z)``.

    Raises:
        StudyError: On a missing, corrupt or inconsistent file.
    """
    odd = ODD_SEG_NAMES.get(case.patient)
    if odd and case.layout != "msd" and not case.seg.is_file():
        raise StudyError(
            case.seg, f"missing file (expected the segmentation {case.seg.name} or {odd}.nii[.gz])"
        )
    seg_raw, seg_affine = load_canonical(case.seg)
    if seg_raw.ndim != 3:
        raise StudyError(case.seg, f"expected a 3-D segmentation, got shape {seg_raw.shape}")
    ref = (seg_raw.shape, seg_affine, case.seg)
    if case.layout == "msd":
        data, affine = load_canonical(case.images[0])
        if data.ndim != 4 or data.shape[3] < 4:
            raise StudyError(case.images[0], f"expected 4-D data with 4 channels, got {data.shape}")
        _check_same_grid(case.images[0], data.shape, affine, ref)
        channels = [data[..., i] for i in msd_order]
    else:
        channels = []
        for path in case.images:
            data, affine = load_canonical(path)
            if data.ndim != 3:
                raise StudyError(path, f"expected a 3-D volume, got shape {data.shape}")
            _check_same_grid(path, data.shape, affine, ref)
            channels.append(data)
    images = np.stack([zscore_brain(c) for c in channels])
    return images, to_common_labels(seg_raw, case.layout, case.seg)


def _centre(mask2d: np.ndarray) -> tuple[int, int]:
    """Centre of the bounding box of a 2-D mask, as (row, col)."""
    rows = np.flatnonzero(mask2d.any(axis=1))
    cols = np.flatnonzero(mask2d.any(axis=0))
    return (rows[0] + rows[-1] + 1) // 2, (cols[0] + cols[-1] + 1) // 2


def bbox_centre(mask: np.ndarray) -> tuple[int, ...]:
    """Centre of the bounding box of a non-empty N-D mask, one index per axis.

    Per axis ``(first + last + 1) // 2`` of the indices holding a voxel of the mask, as
    :func:`_centre` does per slice.
    """
    centre = []
    for axis in range(mask.ndim):
        others = tuple(a for a in range(mask.ndim) if a != axis)
        hits = np.flatnonzero(mask.any(axis=others))
        centre.append(int(hits[0] + hits[-1] + 1) // 2)
    return tuple(centre)


def n_negatives(n_tumour: int, share: float) -> int:
    """Number of tumour-free patches so that they are ``share`` of a patient's patches."""
    return int(round(n_tumour * share / (1.0 - share)))


def choose_slices(
    images: np.ndarray, regions: np.ndarray, share: float, seed: int, patch: int = PATCH
) -> list[tuple[int, int, int, bool]]:
    """Pick the axial slices and patch corners of one patient.

    Every slice with tumour gives a patch centred on the bounding box of the whole tumour in
    that slice. ``n_negatives(n_tumour, share)`` tumour-free slices that contain brain are
    drawn at random, each centred on a random brain voxel. The draw depends only on ``seed``
    and the segmentation's content, so the same study gives the same patches in any layout
    or orientation.

    Args:
        images: ``(4, X, Y, Z)``.
        regions: ``(3, X, Y, Z)``; channel 0 is the whole tumour.
        share: Target share of tumour-free patches, in [0, 1).
        seed: Random seed.
        patch: Patch side length (the corner is the centre minus half of it).

    Returns:
        ``(slice, row0, col0, has_tumour)`` tuples sorted by slice.
    """
    half = patch // 2
    whole = regions[0]
    picks = []
    for k in np.flatnonzero(whole.any(axis=(0, 1))):
        row, col = _centre(whole[:, :, k])
        picks.append((int(k), row - half, col - half, True))
    brain = (images != 0).any(axis=0)
    free = np.flatnonzero(brain.any(axis=(0, 1)) & ~whole.any(axis=(0, 1)))
    rng = np.random.default_rng([seed, zlib.crc32(np.ascontiguousarray(whole).tobytes())])
    n_free = min(len(free), n_negatives(len(picks), share))
    for k in sorted(rng.choice(free, size=n_free, replace=False).tolist()):
        rows, cols = np.nonzero(brain[:, :, k])
        i = rng.integers(len(rows))
        picks.append((int(k), int(rows[i]) - half, int(cols[i]) - half, False))
    return sorted(picks)


def patient_patches(
    images: np.ndarray, labels: np.ndarray, share: float, seed: int, patch: int = PATCH
) -> dict[str, np.ndarray]:
    """Cut the 2-D slice patches of one patient (zero-padded where they leave the slice).

    Args:
        images: Canonical z-scored images ``(4, X, Y, Z)``.
        labels: Common-convention labels ``(X, Y, Z)``.
        share: Target share of tumour-free patches.
        seed: Random seed.
        patch: Patch side length (default 64).

    Returns:
        ``images`` float32 ``(n, 4, patch, patch)``, ``regions`` uint8 ``(n, 3, patch, patch)``
        and the int64 vectors ``slice``, ``row0``, ``col0``, ``has_tumour``.
    """
    regions = regions_from_labels(labels)
    picks = choose_slices(images, regions, share, seed, patch)
    out_images = np.zeros((len(picks), 4, patch, patch), np.float32)
    out_regions = np.zeros((len(picks), 3, patch, patch), np.uint8)
    for n, (k, row0, col0, _) in enumerate(picks):
        out_images[n] = extract_patch(images[:, :, :, k], row0, col0, patch, 0.0)
        out_regions[n] = extract_patch(regions[:, :, :, k], row0, col0, patch, 0)
    table = np.array([p[:3] + (int(p[3]),) for p in picks], np.int64).reshape(-1, 4)
    return _patient_record(out_images, out_regions, table)


def _patient_record(
    images: np.ndarray, regions: np.ndarray, table: np.ndarray
) -> dict[str, np.ndarray]:
    """A patient's cache entry: patches, regions and the manifest's int64 vectors.

    ``table`` rows are ``(slice, row0, col0, has_tumour)``, one per patch.
    """
    return {
        "images": images,
        "regions": regions,
        "slice": table[:, 0],
        "row0": table[:, 1],
        "col0": table[:, 2],
        "has_tumour": table[:, 3],
    }


def crop_start(images: np.ndarray, regions: np.ndarray, patch: int) -> tuple[tuple[int, ...], bool]:
    """First voxel (along X, Y, Z) of a patient's 3-D crop, and whether it is tumour-centred.

    The crop is centred on the centre of the 3-D bounding box of the whole tumour; a patient
    without tumour is centred on the bounding box of the brain (non-zero voxels of any
    channel).

    Args:
        images: ``(4, X, Y, Z)``.
        regions: ``(3, X, Y, Z)``; channel 0 is the whole tumour.
        patch: Crop side length.

    Returns:
        ``((x0, y0, z0), has_tumour)``; the corner is ``()`` when the patient has neither
        tumour nor brain (no crop).
    """
    whole = regions[0] != 0
    has_tumour = bool(whole.any())
    mask = whole if has_tumour else (images != 0).any(axis=0)
    if not mask.any():
        return (), False
    return tuple(c - patch // 2 for c in bbox_centre(mask)), has_tumour


def patient_crop(
    images: np.ndarray, labels: np.ndarray, patch: int = PATCH
) -> dict[str, np.ndarray]:
    """Cut the one 3-D crop of a patient (zero-padded where it leaves the volume).

    Args:
        images: Canonical z-scored images ``(4, X, Y, Z)``.
        labels: Common-convention labels ``(X, Y, Z)``.
        patch: Crop side length (default 64).

    Returns:
        ``images`` float32 ``(n, 4, patch, patch, patch)``, ``regions`` uint8
        ``(n, 3, patch, patch, patch)`` (axes X, Y, Z) and the int64 vectors ``slice`` (first
        Z index), ``row0`` (first X index), ``col0`` (first Y index) and ``has_tumour``, with
        ``n`` = 1, or 0 for a volume without tumour and brain.
    """
    regions = regions_from_labels(labels)
    start, has_tumour = crop_start(images, regions, patch)
    n = 1 if start else 0
    out_images = np.zeros((n, 4, patch, patch, patch), np.float32)
    out_regions = np.zeros((n, 3, patch, patch, patch), np.uint8)
    if n:
        out_images[0] = extract_window(images, start, patch, 0.0)
        out_regions[0] = extract_window(regions, start, patch, 0)
    x0, y0, z0 = start if n else (0, 0, 0)
    table = np.array([[z0, x0, y0, int(has_tumour)]][:n], np.int64).reshape(-1, 4)
    return _patient_record(out_images, out_regions, table)


# --------------------------------------------------------------------------- sites


def find_sites_file(given: Path, root: Path, base: Path) -> Path:
    """Locate ``--sites``: as given (absolute or relative to the cwd), then in ``root``, ``base``.

    Raises:
        SystemExit: If no such file exists.
    """
    tried = {path.absolute(): path for path in (base / given, root / given, given)}
    for path in reversed(tried.values()):
        if path.is_file():
            return path
    where = ", ".join(str(p) for p in reversed(tried))  # each place once (root may be base)
    raise SystemExit(
        f"error: --sites {given}: file not found (looked for {where}); expected a FeTS "
        "partitioning CSV such as partitioning_1.csv"
    )


def read_sites(path: Path) -> dict[str, str]:
    """Read a FeTS partitioning CSV: subject id -> site (partition id, as text).

    Both FeTS partitionings have the header ``Subject_ID,Partition_ID`` and one row per
    subject (``partitioning_1.csv``: the institution; ``partitioning_2.csv``: the largest
    institutions further split). A UTF-8 byte-order mark, surrounding blanks, blank lines and
    extra columns are tolerated.

    Args:
        path: The CSV.

    Returns:
        Subject id -> partition id.

    Raises:
        SystemExit: One line naming the file (and line) when it cannot be read, lacks a
            column, has an empty value or gives one subject two sites.
    """
    header = ",".join(SITE_COLUMNS)
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise SystemExit(
            f"error: --sites {path}: cannot be read as a CSV: {one_line(exc)} "
            f"(expected the header {header})"
        ) from None
    rows = [[cell.strip() for cell in row] for row in rows]
    numbered = [(n, row) for n, row in enumerate(rows, 1) if any(row)]
    if not numbered or not set(SITE_COLUMNS) <= set(numbered[0][1]):
        where = f"line {numbered[0][0]} is {','.join(numbered[0][1])!r}" if numbered else "empty"
        raise SystemExit(f"error: --sites {path}: {where}, expected the header {header}")
    columns = [numbered[0][1].index(name) for name in SITE_COLUMNS]
    sites: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, row in numbered[1:]:
        values = [row[i] if i < len(row) else "" for i in columns]
        for name, value in zip(SITE_COLUMNS, values, strict=True):
            if not value:
                raise SystemExit(
                    f"error: --sites {path}: line {number}, column {name} is empty "
                    "(expected a subject id and its partition id)"
                )
        subject, site = values
        if subject in sites and sites[subject] != site:
            raise SystemExit(
                f"error: --sites {path}: line {number}: subject {subject} has site {site} but "
                f"site {sites[subject]} on line {lines[subject]} (expected one site per subject)"
            )
        sites[subject], lines[subject] = site, number
    if not sites:
        raise SystemExit(f"error: --sites {path}: no subject rows below the header {header}")
    return sites


def check_sites(cases: Sequence[Case], sites: dict[str, str], path: Path) -> None:
    """Refuse a patient without a row in the sites file, naming it.

    Raises:
        SystemExit: One line naming the first missing patient, its folder and how many are
            missing.
    """
    missing = [case for case in cases if case.patient not in sites]
    if not missing:
        return
    first = missing[0]
    others = ", ".join(case.patient for case in missing[1:6])
    more = f"; also {others}{', ...' if len(missing) > 6 else ''}" if others else ""
    raise SystemExit(
        f"error: --sites {path}: subject {first.patient} ({first.location}) has no row "
        f"(expected a line '{first.patient},<Partition_ID>' under the header "
        f"{','.join(SITE_COLUMNS)}); {len(missing)} of {len(cases)} subjects missing{more}"
    )


# --------------------------------------------------------------------------- whole dataset


def _process_cases(
    cases: list[Case],
    msd_order: Sequence[int],
    cache: StudyCache,
    options: BratsOptions,
    log: RunLog,
    console: Console,
    geometry: tuple[int, int] = (2, PATCH),
) -> list[tuple[Case, int]]:
    """Convert (or reuse) every patient; return the usable ones with their patch counts.

    ``geometry`` is ``(dims, patch side)``: 2-D slice patches or one 3-D crop per patient.
    """
    dims, patch = geometry
    done: list[tuple[Case, int]] = []
    with progress_bar(console) as progress:
        task = progress.add_task("BraTS patients", total=len(cases))
        for case in cases:
            problem = id_problem(case.patient)
            if problem is not None:
                log.skip(case.location, f"bad patient id: {problem}", console)
                progress.advance(task)
                continue
            result = cache.load(case.patient, case.stamp, keys=("slice",))
            if result is None:
                try:
                    images, labels = load_case(case, msd_order)
                    if dims == 3:
                        result = patient_crop(images, labels, patch)
                    else:
                        share, seed = options.negative_share, options.seed
                        result = patient_patches(images, labels, share, seed, patch)
                except StudyError as exc:
                    log.skip(exc.path, exc.reason, console)
                except Exception as exc:  # one bad patient must not stop the run
                    log.skip(case.location, one_line(exc), console)
                if result is None:
                    progress.advance(task)
                    continue
                cache.save(case.patient, result, case.stamp)
                log.converted += 1
            else:
                log.reused += 1
            done.append((case, len(result["slice"])))
            progress.advance(task)
    return done


def _stream(
    done: list[tuple[Case, int]], cache: StudyCache, key: str, labels: str
) -> Iterator[np.ndarray]:
    for case, _ in done:
        stored = cache.load(case.patient, case.stamp, keys=(key,))
        assert stored is not None, case.patient
        array = stored[key]
        yield array[:, 0] if key == "regions" and labels == "whole" else array


def _manifest(
    done: list[tuple[Case, int]], cache: StudyCache, sites: dict[str, str] | None = None
) -> pd.DataFrame:
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


def convert(root: Path, out: Path, options: BratsOptions | None = None) -> dict[str, Any]:
    """Convert a BraTS 2017-2023, FeTS 2022 or MSD Task01 release into patches and masks.

    Patients already converted with the same options (``OUT/studies/<patient>.npz``) are
    reused, so an interrupted run can simply be restarted. ``--labels`` and ``--sites`` do not
    enter the cache: each patient stores all three regions, and sites only go to the
    manifest.

    Args:
        root: Raw release folder.
        out: Output folder (created; must not be inside ``root``).
        options: Conversion options.

    Returns:
        The summary written to ``OUT/summary.json``.

    Raises:
        SystemExit: If ``root`` is missing or holds no BraTS layout, on bad options, or when
            ``options.sites`` is unreadable or lacks one of the patients.
    """
    options = options or BratsOptions()
    if not 0.0 <= options.negative_share < 1.0:
        raise SystemExit(f"error: --negative-share {options.negative_share} not in [0, 1)")
    if options.labels not in ("whole", "regions"):
        raise SystemExit(f"error: --labels {options.labels!r} must be whole or regions")
    dims, patch = resolve_geometry(options.dims, options.patch, PATCH)
    root = require_dir(Path(root), "raw BraTS folder")
    layout, base = detect_layout(root, options.layout)
    cases = find_cases(base, layout)
    if not cases:
        raise SystemExit(f"error: no {layout} patients found in {base}")
    sites_path, sites = None, None
    if options.sites is not None:
        sites_path = find_sites_file(Path(options.sites), root, base)
        sites = read_sites(sites_path)
        check_sites(cases, sites, sites_path)
    msd_order = msd_channel_order(base) if layout == "msd" else (0, 1, 2, 3)
    console = console_for(options.quiet)
    # the patch against the volumes, the output against the disk and memory (headers only)
    say = lambda line: console.print(line, highlight=False, soft_wrap=True)  # noqa: E731
    given = options.patch is not None
    check_brats([c.seg for c in cases], dims, patch, given, options.labels, Path(out), say)
    out = prepare_out(Path(out), root, OUTPUT_NAMES)
    cleanup_partials(out)
    log = RunLog()
    cache = StudyCache(
        out,
        {
            "dataset": "brats",
            "negative_share": options.negative_share,
            "seed": options.seed,
            "msd_order": list(msd_order),
            **geometry_params(dims, patch, PATCH),
        },
    )
    done = _process_cases(cases, msd_order, cache, options, log, console, (dims, patch))
    if not done:
        raise nothing_usable(out, log, f"all {len(cases)} {layout} patients in {base} were skipped")
    manifest = _manifest(done, cache, sites)
    if manifest.empty:
        what = f"the {len(done)} usable patients in {base} have no tumour slice, so no patch"
        if dims == 3:
            what = f"the {len(done)} usable patients in {base} have no brain voxel, so no crop"
        raise nothing_usable(out, log, what)
    if dims == 2:  # the patches' count is known now: the output against the disk
        size = len(manifest) * (16 + (1 if options.labels == "whole" else 3)) * patch**2
        check_room(f"--patch {patch}", size, "images.npy and masks.npy", 0, "", out)
    _write_outputs(out, done, cache, manifest, options.labels, (dims, patch))
    summary = _summary(root, base, layout, options, cases, manifest, log, (dims, patch))
    summary.update(_site_summary(sites_path, sites, manifest))
    summary["out"] = str(out)
    write_skipped(out, log)
    write_json(out / "summary.json", summary)
    what = "crops" if dims == 3 else "patches"
    console.print(f"[green]wrote[/green] {len(manifest)} {what} to {out}", highlight=False)
    return summary


def _write_outputs(
    out: Path,
    done: list[tuple[Case, int]],
    cache: StudyCache,
    manifest: pd.DataFrame,
    labels: str,
    geometry: tuple[int, int] = (2, PATCH),
) -> None:
    n = len(manifest)
    dims, patch = geometry
    side = (patch,) * dims
    images = _stream(done, cache, "images", labels)
    write_stacked(out / "images.npy", images, (n, 4, *side), np.float32)
    mask_shape = (n, *side) if labels == "whole" else (n, 3, *side)
    write_stacked(out / "masks.npy", _stream(done, cache, "regions", labels), mask_shape, np.uint8)
    write_csv(out / "manifest.csv", manifest)


def _site_summary(
    path: Path | None, sites: dict[str, str] | None, manifest: pd.DataFrame
) -> dict[str, Any]:
    if path is None or sites is None:
        return {"sites_file": None, "n_sites": None}
    patients = manifest.drop_duplicates("patient")
    per_site = patients["site"].value_counts().sort_index()
    return {
        "sites_file": str(path),
        "n_sites": int(len(per_site)),
        "patients_per_site": {str(k): int(v) for k, v in per_site.items()},
        "sites_rows_without_patient": len(set(sites) - set(patients["patient"])),
    }


def _summary(
    root: Path,
    base: Path,
    layout: str,
    options: BratsOptions,
    cases: list[Case],
    manifest: pd.DataFrame,
    log: RunLog,
    geometry: tuple[int, int] = (2, PATCH),
) -> dict[str, Any]:
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


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``python -m data_prep.brats``."""
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.brats",
        description=(
            "BraTS 2017-2023 / FeTS 2022 / MSD Task01 release -> 64x64 tumour patches "
            "(pFedNet §VI-A), or one 3-D crop per patient."
        ),
    )
    parser.add_argument("--root", type=Path, required=True, help="raw release folder")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--layout",
        choices=["auto", *LAYOUTS, *LAYOUT_ALIASES],
        default="auto",
        help="release layout (default: detected); brats2018/2019 = brats2017, fets2022 = brats2021",
    )
    parser.add_argument(
        "--sites",
        type=Path,
        default=None,
        help="FeTS partitioning CSV (Subject_ID,Partition_ID) recording each patient's site",
    )
    parser.add_argument(
        "--labels",
        choices=["whole", "regions"],
        default="whole",
        help="whole: binary whole-tumour mask; regions: WT, TC, ET mask channels",
    )
    parser.add_argument(
        "--negative-share",
        type=float,
        default=0.2,
        help="share of tumour-free patches among each patient's patches, in [0, 1)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the tumour-free slice draw")
    add_geometry_options(parser, "one crop per patient centred on the tumour", PATCH)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m data_prep.brats``."""
    args = build_parser().parse_args(argv)
    patch = parse_patch(args.patch)
    options = BratsOptions(
        layout=args.layout,
        labels=args.labels,
        sites=args.sites,
        negative_share=args.negative_share,
        seed=args.seed,
        quiet=args.quiet,
        dims=args.dims,
        patch=patch,
    )
    try:
        summary = convert(args.root, args.out, options)
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from None
    except OSError as exc:  # e.g. a full disk or a folder without write permission
        raise SystemExit(f"error: {one_line(exc)}") from None
    line = skip_line(summary, Path(summary["out"]))
    if line is not None:
        print(line, file=sys.stderr)
    return 0 if summary["n_samples"] > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
