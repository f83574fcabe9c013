"""Convert BraTS2017 or MSD Task01_BrainTumour releases into 64x64 axial tumour patches.

pFedNet (§VI-A, "BraTS2017") segments gliomas from 4-channel 64x64 MRI patches with a U-Net
(§VI-B2). This module reads either official layout,

* BraTS2017: ``{HGG,LGG}/<patient>/<patient>_{flair,t1,t1ce,t2,seg}.nii.gz``;
* MSD Task01: ``imagesTr/BRATS_XXX.nii.gz`` (4-D: FLAIR, T1w, t1gd, T2w) +
  ``labelsTr/BRATS_XXX.nii.gz``,

brings every volume to the closest canonical (RAS) orientation, z-scores each modality over
its non-zero (brain) voxels and cuts one patch per tumour-bearing axial slice plus a share of
tumour-free slices. Output in ``OUT``:

* ``images.npy``   float32 ``(N, 4, 64, 64)``, channels FLAIR, T1, T1ce, T2;
* ``masks.npy``    uint8 ``(N, 64, 64)`` whole tumour, or ``(N, 3, 64, 64)`` with
  ``--labels regions`` (whole tumour, tumour core, enhancing tumour);
* ``manifest.csv`` patient, slice, grade, row0, col0, has_tumour;
* ``summary.json`` counts, skipped files with reasons and the options used;
* ``skipped.csv``  what was skipped and why (only when something was).

A patient with a missing, unreadable or inconsistent file (modalities on different grids,
unknown label values) is skipped with one line naming the file and what was expected; the
run stops with one ``error:`` line and exit status 1 only when no patient is usable.

Usage::

    python -m data_prep.brats --root RAW --out OUT [--layout auto|brats2017|msd]
        [--labels whole|regions] [--negative-share 0.2] [--seed 0]
"""

from __future__ import annotations

import argparse
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
    cleanup_partials,
    console_for,
    extract_patch,
    file_stamp,
    id_problem,
    nothing_usable,
    one_line,
    prepare_out,
    progress_bar,
    require_dir,
    skip_line,
    write_csv,
    write_json,
    write_skipped,
    write_stacked,
)
from fedexp.errors import DataError

PATCH = 64
"""Patch side length in voxels (paper §VI-A)."""
MODALITIES = ("flair", "t1", "t1ce", "t2")
"""Output channel order."""
MSD_NAMES = ("flair", "t1w", "t1gd", "t2w")
"""MSD ``dataset.json`` modality names (lower-cased) in output channel order."""
LAYOUTS = ("brats2017", "msd")
REGIONS = ("whole_tumour", "tumour_core", "enhancing_tumour")
# Common label convention = BraTS: 0 background, 1 necrotic/non-enhancing core, 2 edema,
# 4 enhancing. Label 3 (non-enhancing core in BraTS 2012-2016) is folded into 1.
_BRATS_LABELS = {0: 0, 1: 1, 2: 2, 3: 1, 4: 4}
_MSD_LABELS = {0: 0, 1: 2, 2: 1, 3: 4}
MANIFEST_COLUMNS = ["patient", "slice", "grade", "row0", "col0", "has_tumour"]
OUTPUT_NAMES = ("images.npy", "masks.npy", "manifest.csv", "summary.json")
"""Fixed names of the files written in the output folder (besides ``studies/``)."""


@dataclass(frozen=True)
class Case:
    """One patient's files.

    Attributes:
        patient: Patient id (BraTS folder name or MSD file stem).
        grade: ``HGG``, ``LGG`` or ``unknown`` (MSD).
        layout: ``brats2017`` or ``msd``.
        images: Four single-modality files (BraTS2017) or one 4-D file (MSD).
        seg: Segmentation file.
    """

    patient: str
    grade: str
    layout: str
    images: tuple[Path, ...]
    seg: Path

    @property
    def location(self) -> Path:
        """Patient folder (BraTS2017) or image file (MSD), for messages."""
        return self.images[0].parent if self.layout == "brats2017" else self.images[0]

    @property
    def stamp(self) -> str:
        """Identity of the input files (resume cache)."""
        return file_stamp([*self.images, self.seg])


@dataclass(frozen=True)
class BratsOptions:
    """Conversion options.

    Attributes:
        layout: ``auto``, ``brats2017`` or ``msd``.
        labels: ``whole`` (binary whole-tumour mask) or ``regions`` (WT, TC, ET channels).
        negative_share: Target share of tumour-free patches among a patient's patches.
        seed: Seed of the tumour-free slice draw.
        quiet: Suppress the progress bar and messages.
    """

    layout: str = "auto"
    labels: str = "whole"
    negative_share: float = 0.2
    seed: int = 0
    quiet: bool = True


# --------------------------------------------------------------------------- discovery


def _has_layout(folder: Path, layout: str) -> bool:
    if layout == "brats2017":
        return (folder / "HGG").is_dir() or (folder / "LGG").is_dir()
    return (folder / "imagesTr").is_dir()


def detect_layout(root: Path, layout: str = "auto") -> tuple[str, Path]:
    """Find the release layout in ``root`` or one of its direct sub-folders.

    Args:
        root: Raw folder (e.g. ``MICCAI_BraTS17_Data_Training`` or ``Task01_BrainTumour``, or
            their parent).
        layout: ``auto`` or the layout to look for.

    Returns:
        The layout name and the folder that holds it.

    Raises:
        SystemExit: If no matching layout is found.
    """
    wanted = LAYOUTS if layout == "auto" else (layout,)
    folders = [root, *sorted(p for p in root.iterdir() if p.is_dir())]
    for folder in folders:
        for name in wanted:
            if _has_layout(folder, name):
                return name, folder
    expected = {"brats2017": "HGG/ or LGG/", "msd": "imagesTr/ + labelsTr/"}
    hint = " or ".join(expected[name] for name in wanted)
    raise SystemExit(f"error: no BraTS layout ({hint}) found in {root}")


def _nifti(folder: Path, stem: str) -> Path:
    for suffix in (".nii.gz", ".nii"):
        if (folder / f"{stem}{suffix}").is_file():
            return folder / f"{stem}{suffix}"
    return folder / f"{stem}.nii.gz"


def find_brats2017_cases(base: Path) -> list[Case]:
    """List ``HGG/*/`` and ``LGG/*/`` patient folders (missing files are caught on load)."""
    cases = []
    for grade in ("HGG", "LGG"):
        for folder in sorted((base / grade).glob("*")):
            if not folder.is_dir() or folder.name.startswith("."):
                continue
            name = folder.name
            images = tuple(_nifti(folder, f"{name}_{m}") for m in MODALITIES)
            cases.append(Case(name, grade, "brats2017", images, _nifti(folder, f"{name}_seg")))
    return sorted(cases, key=lambda case: case.patient)


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
    """Map BraTS2017 or MSD labels to the common BraTS convention {0, 1, 2, 4}.

    BraTS2017: 1 necrotic/non-enhancing core, 2 edema, 4 enhancing (3 -> 1).
    MSD: 1 edema -> 2, 2 non-enhancing -> 1, 3 enhancing -> 4.

    Raises:
        StudyError: If the segmentation holds other values.
    """
    table = _BRATS_LABELS if layout == "brats2017" else _MSD_LABELS
    values = np.rint(seg).astype(np.int64)
    unknown = sorted(set(np.unique(values).tolist()) - set(table))
    if unknown or not np.allclose(values, seg):
        raise StudyError(path, f"unexpected label values {unknown or 'non-integer'}")
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
        case: The patient's files.
        msd_order: Channel permutation for MSD 4-D images (see :func:`msd_channel_order`).

    Returns:
        Images float32 ``(4, X, Y, Z)`` (FLAIR, T1, T1ce, T2) and labels uint8 ``(X, Y, Z)``.

    Raises:
        StudyError: On a missing, corrupt or inconsistent file.
    """
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


def n_negatives(n_tumour: int, share: float) -> int:
    """Number of tumour-free patches so that they are ``share`` of a patient's patches."""
    return int(round(n_tumour * share / (1.0 - share)))


def choose_slices(
    images: np.ndarray, regions: np.ndarray, share: float, seed: int
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

    Returns:
        ``(slice, row0, col0, has_tumour)`` tuples sorted by slice.
    """
    half = PATCH // 2
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
    images: np.ndarray, labels: np.ndarray, share: float, seed: int
) -> dict[str, np.ndarray]:
    """Cut the 64x64 patches of one patient (zero-padded where they leave the slice).

    Args:
        images: Canonical z-scored images ``(4, X, Y, Z)``.
        labels: Common-convention labels ``(X, Y, Z)``.
        share: Target share of tumour-free patches.
        seed: Random seed.

    Returns:
        ``images`` float32 ``(n, 4, 64, 64)``, ``regions`` uint8 ``(n, 3, 64, 64)`` and the
        int64 vectors ``slice``, ``row0``, ``col0``, ``has_tumour``.
    """
    regions = regions_from_labels(labels)
    picks = choose_slices(images, regions, share, seed)
    out_images = np.zeros((len(picks), 4, PATCH, PATCH), np.float32)
    out_regions = np.zeros((len(picks), 3, PATCH, PATCH), np.uint8)
    for n, (k, row0, col0, _) in enumerate(picks):
        out_images[n] = extract_patch(images[:, :, :, k], row0, col0, PATCH, 0.0)
        out_regions[n] = extract_patch(regions[:, :, :, k], row0, col0, PATCH, 0)
    table = np.array([p[:3] + (int(p[3]),) for p in picks], np.int64).reshape(-1, 4)
    return {
        "images": out_images,
        "regions": out_regions,
        "slice": table[:, 0],
        "row0": table[:, 1],
        "col0": table[:, 2],
        "has_tumour": table[:, 3],
    }


# --------------------------------------------------------------------------- whole dataset


def _process_cases(
    cases: list[Case],
    msd_order: Sequence[int],
    cache: StudyCache,
    options: BratsOptions,
    log: RunLog,
    console: Console,
) -> list[tuple[Case, int]]:
    """Convert (or reuse) every patient; return the usable ones with their patch counts."""
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
                    result = patient_patches(images, labels, options.negative_share, options.seed)
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


def _manifest(done: list[tuple[Case, int]], cache: StudyCache) -> pd.DataFrame:
    frames = []
    for case, _ in done:
        keys = ("slice", "row0", "col0", "has_tumour")
        stored = cache.load(case.patient, case.stamp, keys=keys)
        assert stored is not None, case.patient
        table = {k: stored[k] for k in keys}
        frames.append(pd.DataFrame({"patient": case.patient, "grade": case.grade, **table}))
    if not frames:
        return pd.DataFrame(columns=MANIFEST_COLUMNS)
    return pd.concat(frames, ignore_index=True).loc[:, MANIFEST_COLUMNS]


def convert(root: Path, out: Path, options: BratsOptions | None = None) -> dict[str, Any]:
    """Convert a BraTS2017 or MSD Task01 release into patches, masks, manifest and summary.

    Patients already converted with the same options (``OUT/studies/<patient>.npz``) are
    reused, so an interrupted run can simply be restarted. ``--labels`` does not enter the
    cache: each patient stores all three regions.

    Args:
        root: Raw release folder.
        out: Output folder (created; must not be inside ``root``).
        options: Conversion options.

    Returns:
        The summary written to ``OUT/summary.json``.

    Raises:
        SystemExit: If ``root`` is missing or holds no BraTS layout, or on bad options.
    """
    options = options or BratsOptions()
    if not 0.0 <= options.negative_share < 1.0:
        raise SystemExit(f"error: --negative-share {options.negative_share} not in [0, 1)")
    if options.labels not in ("whole", "regions"):
        raise SystemExit(f"error: --labels {options.labels!r} must be whole or regions")
    root = require_dir(Path(root), "raw BraTS folder")
    layout, base = detect_layout(root, options.layout)
    cases = find_brats2017_cases(base) if layout == "brats2017" else find_msd_cases(base)
    if not cases:
        raise SystemExit(f"error: no {layout} patients found in {base}")
    msd_order = msd_channel_order(base) if layout == "msd" else (0, 1, 2, 3)
    out = prepare_out(Path(out), root, OUTPUT_NAMES)
    cleanup_partials(out)
    console = console_for(options.quiet)
    log = RunLog()
    cache = StudyCache(
        out,
        {
            "dataset": "brats",
            "negative_share": options.negative_share,
            "seed": options.seed,
            "msd_order": list(msd_order),
        },
    )
    done = _process_cases(cases, msd_order, cache, options, log, console)
    if not done:
        raise nothing_usable(out, log, f"all {len(cases)} {layout} patients in {base} were skipped")
    manifest = _manifest(done, cache)
    if manifest.empty:
        what = f"the {len(done)} usable patients in {base} have no tumour slice, so no patch"
        raise nothing_usable(out, log, what)
    _write_outputs(out, done, cache, manifest, options.labels)
    summary = _summary(root, base, layout, options, cases, manifest, log)
    summary["out"] = str(out)
    write_skipped(out, log)
    write_json(out / "summary.json", summary)
    console.print(f"[green]wrote[/green] {len(manifest)} patches to {out}", highlight=False)
    return summary


def _write_outputs(
    out: Path, done: list[tuple[Case, int]], cache: StudyCache, manifest: pd.DataFrame, labels: str
) -> None:
    n = len(manifest)
    images = _stream(done, cache, "images", labels)
    write_stacked(out / "images.npy", images, (n, 4, PATCH, PATCH), np.float32)
    mask_shape = (n, PATCH, PATCH) if labels == "whole" else (n, 3, PATCH, PATCH)
    write_stacked(out / "masks.npy", _stream(done, cache, "regions", labels), mask_shape, np.uint8)
    write_csv(out / "manifest.csv", manifest)


def _summary(
    root: Path,
    base: Path,
    layout: str,
    options: BratsOptions,
    cases: list[Case],
    manifest: pd.DataFrame,
    log: RunLog,
) -> dict[str, Any]:
    n_tumour = int(manifest["has_tumour"].astype(int).sum())
    return {
        "dataset": "brats",
        "root": str(root),
        "layout": layout,
        "layout_folder": str(base),
        "orientation": "RAS (nibabel.as_closest_canonical); rows = R axis, cols = A axis",
        "channels": list(MODALITIES),
        "normalisation": "per patient and modality: z-score over non-zero voxels, 0 outside",
        "label_convention": "BraTS: 0 bg, 1 necrotic/non-enhancing, 2 edema, 4 enhancing",
        "labels": options.labels,
        "mask_channels": ["whole_tumour"] if options.labels == "whole" else list(REGIONS),
        "patch_size": PATCH,
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
        description="BraTS2017 / MSD Task01 release -> 64x64 tumour patches (pFedNet §VI-A).",
    )
    parser.add_argument("--root", type=Path, required=True, help="raw release folder")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--layout", choices=["auto", *LAYOUTS], default="auto")
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
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m data_prep.brats``."""
    args = build_parser().parse_args(argv)
    options = BratsOptions(
        layout=args.layout,
        labels=args.labels,
        negative_share=args.negative_share,
        seed=args.seed,
        quiet=args.quiet,
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
