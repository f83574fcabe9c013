"""Where a BraTS release keeps its patients.

The layouts of BraTS 2017-2023, FeTS 2022 and MSD Task01, found in ``--root`` or up to two
levels below it, and each patient's modality and segmentation files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from data_prep.common import file_stamp
from data_prep.common import one_line

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
