"""Convert the official LUNA16 release into 32x32 axial candidate patches (or 3-D cubes).

pFedNet (§VI-A, "Luna16") classifies lung-nodule candidates from 32x32 patches and varies
the dataset-level negative:positive ratio δ ∈ {1, 2, 4, 7} (§VI-B1). This module turns the raw
release into arrays that the training code can load without SimpleITK:

* ``images.npy``   float32 ``(N, 1, 32, 32)``, HU clipped to a window and scaled to [0, 1]
  (``--dims 3``: ``(N, 1, P, P, P)`` cubes, axes z, y, x; ``--patch P`` sets the side);
* ``labels.npy``   int64 ``(N,)``, the candidate's ``class`` column;
* ``manifest.csv`` one row per patch (series UID, world mm, voxel index, label, and the
  ``subset0``-``subset9`` folder of the volume: the release's ten folds, which
  ``partition=natural`` uses as sites);
* ``summary.json`` counts, skipped files with reasons, window and δ;
* ``skipped.csv``  what was skipped and why (only when something was).

Bad inputs (an unreadable or truncated volume, a header that disagrees with its data, a
malformed candidate row, a series UID without a volume or one that looks like a path, a header
whose ``ElementDataFile`` really lies outside ``--root``) are skipped with one line naming the
file, row and column; the run stops with one ``error:`` line and exit status 1 only when
nothing usable remains. Headers are parsed here, strictly, before ITK sees them
(:func:`data_prep.mhd.mhd_problem`).

Usage::

    python -m data_prep.luna16 --root RAW --out OUT [--candidates candidates_V2.csv]
        [--delta 1] [--seed 0] [--hu-window -1000 400] [--dims 2|3] [--patch 32]

It never partitions the data into clients: that is the job of ``fedexp.data``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import SimpleITK as sitk
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
from data_prep.mhd import mhd_problem
from data_prep.sizes import check_luna
from fedexp.errors import DataError

PATCH = 32
"""Default patch side length in voxels (paper §VI-A), for 2-D patches and 3-D cubes."""
HU_WINDOW = (-1000.0, 400.0)
"""Default HU window: air (-1000) to just above soft tissue/nodule density."""
ORIENTATION = "LPS"
"""Volumes are re-oriented to DICOM LPS (axis flips/permutations only, never resampled)."""
CANDIDATE_COLUMNS = ("seriesuid", "coordX", "coordY", "coordZ", "class")
CANDIDATE_FILES = ("candidates_V2.csv", "candidates.csv")
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


@dataclass(frozen=True)
class LunaOptions:
    """Conversion options.

    Attributes:
        candidates: Candidate CSV; ``None`` looks for ``candidates_V2.csv`` then
            ``candidates.csv`` under the raw folder.
        delta: Dataset-level negative:positive ratio; ``None`` keeps every candidate.
        seed: Seed of the negative subsampling.
        window: HU window ``(low, high)`` mapped to [0, 1].
        quiet: Suppress the progress bar and messages.
        dims: 2 for axial patches, 3 for cubes centred on the candidate voxel.
        patch: Side length in voxels (even, >= 8); ``None`` means :data:`PATCH`.
    """

    candidates: Path | None = None
    delta: float | None = None
    seed: int = 0
    window: tuple[float, float] = HU_WINDOW
    quiet: bool = True
    dims: int = 2
    patch: int | None = None


# --------------------------------------------------------------------------- discovery


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


def find_candidates_csv(root: Path, given: Path | None) -> Path:
    """Locate the candidate list.

    Args:
        root: Raw LUNA16 folder.
        given: Path from ``--candidates`` (absolute, relative to the cwd, or relative to
            ``root``), or ``None`` to search ``root`` for the official file names.

    Returns:
        Path of the CSV.

    Raises:
        SystemExit: If no candidate file can be found.
    """
    if given is not None:
        for path in (given, root / given):
            if path.is_file():
                return path
        raise SystemExit(f"error: candidate file {given} not found (also tried {root / given})")
    for name in CANDIDATE_FILES:
        hits = sorted(root.rglob(name))
        if hits:
            return hits[0]
    raise SystemExit(f"error: no {' or '.join(CANDIDATE_FILES)} found under {root}")


def _row_problem(line: int, uid: str | None, values: dict[str, str], bad: list[str]) -> str:
    """One-line reason for a malformed candidate row (its kind before the first colon)."""
    if uid is not None:
        return f"bad seriesuid: line {line}, column seriesuid: {uid} (expected a series UID)"
    column = bad[0]
    if column == "class":
        return f"bad class: line {line}, column class: {values[column]!r} (expected 0 or 1)"
    return (
        f"bad coordinate: line {line}, column {column}: {values[column]!r} "
        "(expected a finite number of mm)"
    )


def read_candidates(
    path: Path, log: RunLog | None = None, console: Console | None = None
) -> pd.DataFrame:
    """Read ``candidates(_V2).csv`` and keep its row number as ``candidate_index``.

    Malformed rows (a series UID that is empty or looks like a path, a coordinate that is not
    a finite number, a class other than 0/1) are left out and recorded in ``log`` with their
    line and column; the number of rows in the file is kept in ``frame.attrs["rows_in_file"]``.

    Args:
        path: The CSV.
        log: Receives the malformed rows (they are dropped silently when ``None``).
        console: Where skip messages are echoed.

    Returns:
        The usable rows: ``seriesuid`` (str), ``coordX/Y/Z`` (float64), ``class`` and
        ``candidate_index`` (int64, 0-based data row of the file).

    Raises:
        SystemExit: If the file cannot be parsed or a required column is missing.
    """
    expected = ",".join(CANDIDATE_COLUMNS)
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # pandas errors are ValueErrors
        raise SystemExit(
            f"error: cannot read candidate file {path}: {one_line(exc)} "
            f"(expected a CSV with columns {expected})"
        ) from exc
    frame.columns = [str(c).strip() for c in frame.columns]
    missing = [c for c in CANDIDATE_COLUMNS if c not in frame.columns]
    if missing:
        hint = "; annotations.csv is not a candidate list" if "annotation" in path.name else ""
        raise SystemExit(
            f"error: candidate file {path} lacks column(s) {', '.join(missing)} "
            f"(expected {expected}{hint})"
        )
    text = frame.loc[:, list(CANDIDATE_COLUMNS)].astype(str)
    uids = text["seriesuid"].str.strip()
    numbers = {
        c: pd.to_numeric(text[c].str.strip(), errors="coerce") for c in CANDIDATE_COLUMNS[1:]
    }
    bad_uid = {u: id_problem(u) for u in uids.unique()}
    bad = pd.DataFrame({c: ~np.isfinite(numbers[c].to_numpy(np.float64)) for c in numbers})
    bad["class"] |= ~numbers["class"].isin([0, 1]).to_numpy()
    bad["seriesuid"] = uids.map(bad_uid).notna().to_numpy()
    ok = ~bad.any(axis=1).to_numpy()
    for i in np.flatnonzero(~ok):
        columns = [c for c in CANDIDATE_COLUMNS if bad.at[i, c]]
        uid_problem = bad_uid[uids.iat[i]]
        reason = _row_problem(int(i) + 2, uid_problem, text.iloc[i].to_dict(), columns)
        if log is not None:
            log.skip(path, reason, console)
    clean = pd.DataFrame(
        {
            "seriesuid": uids[ok].to_numpy(),
            **{c: numbers[c][ok].to_numpy(np.float64) for c in CANDIDATE_COLUMNS[1:4]},
            "class": numbers["class"][ok].to_numpy().astype(np.int64),
            "candidate_index": np.flatnonzero(ok).astype(np.int64),
        }
    )
    clean.attrs["rows_in_file"] = len(frame)
    return clean


def subsample_negatives(frame: pd.DataFrame, delta: float | None, seed: int) -> pd.DataFrame:
    """Keep all positives and at most ``round(delta * n_positive)`` random negatives.

    This is the dataset-level imbalance δ = n_negative / n_positive of the paper (§VI-B1,
    δ ∈ {1, 2, 4, 7}). The draw depends only on ``seed`` and the rows given, and applying the
    function twice with the same arguments is a no-op.

    Args:
        frame: Candidates with a ``class`` column (1 nodule, 0 not).
        delta: Target ratio, or ``None`` to keep everything.
        seed: Random seed.

    Returns:
        The kept rows, in their original order.
    """
    if delta is None:
        return frame
    negatives = np.flatnonzero(frame["class"].to_numpy() == 0)
    n_keep = min(len(negatives), int(round(delta * int((frame["class"] == 1).sum()))))
    if n_keep == len(negatives):
        return frame
    chosen = np.random.default_rng(seed).choice(negatives, size=n_keep, replace=False)
    keep = np.ones(len(frame), dtype=bool)
    keep[negatives] = False
    keep[chosen] = True
    return frame.loc[keep]


# --------------------------------------------------------------------------- one volume


def load_volume(path: Path) -> sitk.Image:
    """Read a CT volume and re-orient it to LPS (flips/permutations of the voxel grid only).

    Always with ITK's MetaImage reader, the format :func:`mhd_problem` checked.
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


def _study_tag(path: Path, rows: pd.DataFrame) -> str:
    """Identify a study's inputs: its files and the candidate rows asked for."""
    coords = rows[["candidate_index", "coordX", "coordY", "coordZ"]].to_numpy(np.float64)
    stamp = file_stamp([path, path.with_suffix(".raw")])
    return hashlib.sha1(coords.tobytes()).hexdigest() + stamp


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


# --------------------------------------------------------------------------- whole dataset


def _process_studies(
    groups: dict[str, pd.DataFrame],
    volumes: dict[str, Path],
    cache: StudyCache,
    options: LunaOptions,
    log: RunLog,
    console: Console,
    root: Path,
    geometry: tuple[int, int] = (2, PATCH),
) -> pd.DataFrame:
    """Convert (or reuse) each study; return the manifest rows of all usable candidates.

    Every study's files are checked first (:func:`data_prep.mhd.mhd_problem`), also those in the
    resume cache: a header that now points outside ``root`` is skipped, not served from the cache.
    ``geometry`` is ``(dims, patch side)``.
    """
    dims, patch = geometry
    kept: list[pd.DataFrame] = []
    with progress_bar(console) as progress:
        task = progress.add_task("LUNA16 volumes", total=len(groups))
        for uid, rows in groups.items():
            problem = mhd_problem(volumes[uid], root)
            if problem is not None:
                log.skip(problem.path, problem.reason, console)
                progress.advance(task)
                continue
            tag = _study_tag(volumes[uid], rows)
            result = cache.load(uid, tag)
            if result is None:
                try:
                    result = convert_study(volumes[uid], rows, options.window, root, patch, dims)
                except StudyError as exc:
                    log.skip(exc.path, exc.reason, console)
                except Exception as exc:  # one unreadable study must not stop the run
                    log.skip(volumes[uid], one_line(exc), console)
                if result is None:
                    progress.advance(task)
                    continue
                cache.save(uid, result, tag)
                log.converted += 1
            else:
                log.reused += 1
            rows = rows.assign(
                voxel_x=result["voxels"][:, 0],
                voxel_y=result["voxels"][:, 1],
                voxel_z=result["voxels"][:, 2],
                _row=np.arange(len(rows)),
                _inside=result["inside"],
            )
            kept.append(rows)
            progress.advance(task)
    if not kept:
        return pd.DataFrame(columns=[*MANIFEST_COLUMNS, "_row", "_inside"])
    return pd.concat(kept, ignore_index=True)


def _patches(
    manifest: pd.DataFrame,
    cache: StudyCache,
    groups: dict[str, pd.DataFrame],
    volumes: dict[str, Path],
) -> Iterator[np.ndarray]:
    """Stream the selected patches study by study from the resume cache."""
    for uid, rows in manifest.groupby("seriesuid", sort=False):
        stored = cache.load(uid, _study_tag(volumes[uid], groups[uid]))
        assert stored is not None, uid
        yield stored["patches"][rows["_row"].to_numpy()][:, None]


def convert(root: Path, out: Path, options: LunaOptions | None = None) -> dict[str, Any]:
    """Convert a LUNA16 release into ``images.npy``, ``labels.npy``, manifest and summary.

    Studies already converted with the same parameters (``OUT/studies/<uid>.npz``) are reused,
    so an interrupted run can simply be restarted.

    Args:
        root: Raw folder with ``subset*/<seriesuid>.mhd|.raw`` and the candidate CSV.
        out: Output folder (created; must not be inside ``root``).
        options: Conversion options.

    Returns:
        The summary written to ``OUT/summary.json``.

    Raises:
        SystemExit: If ``root`` is missing or holds no LUNA16 layout.
    """
    options = options or LunaOptions()
    dims, patch = resolve_geometry(options.dims, options.patch, PATCH)
    low, high = options.window
    if not high > low:
        raise SystemExit(f"error: HU window {options.window} must have low < high")
    root = require_dir(Path(root), "raw LUNA16 folder")
    console = console_for(options.quiet)
    log = RunLog()
    volumes = find_volumes(root, log)
    if not volumes:
        first = f"; {log.skipped[0].path}: {log.skipped[0].reason}" if log.skipped else ""
        raise SystemExit(f"error: no .mhd volumes in {root} (expected subset*/<uid>.mhd){first}")
    csv_path = find_candidates_csv(root, options.candidates)
    out = prepare_out(Path(out), root, OUTPUT_NAMES)
    cleanup_partials(out)
    candidates = read_candidates(csv_path, log, console)
    if candidates.empty:
        raise nothing_usable(out, log, f"no usable candidate row in {csv_path}")

    on_disk = candidates["seriesuid"].isin(volumes.keys())
    for uid, unknown in candidates.loc[~on_disk].groupby("seriesuid", sort=True):
        line = int(unknown["candidate_index"].min()) + 2
        reason = (
            f"unknown seriesuid: {uid} ({len(unknown)} rows, first at line {line}, column "
            f"seriesuid) has no {uid}.mhd under {root}"
        )
        log.skip(csv_path, reason, console)
    if not on_disk.any():
        what = f"no seriesuid of {csv_path} matches one of the {len(volumes)} volumes in {root}"
        raise nothing_usable(out, log, what)
    wanted = subsample_negatives(candidates.loc[on_disk], options.delta, options.seed)
    groups = {uid: rows for uid, rows in wanted.groupby("seriesuid", sort=True)}
    say = lambda line: console.print(line, highlight=False, soft_wrap=True)  # noqa: E731
    counts = {uid: len(rows) for uid, rows in groups.items()}
    check_luna(
        volumes, counts, dims, patch, options.patch is not None, out, say
    )  # headers only, before any patch
    params = {"dataset": "luna16", "window": list(options.window)}
    cache = StudyCache(out, {**params, **geometry_params(dims, patch, PATCH)})
    rows = _process_studies(groups, volumes, cache, options, log, console, root, (dims, patch))
    if rows.empty:
        raise nothing_usable(out, log, f"all {len(groups)} volumes with candidates were skipped")

    inside = rows[rows["_inside"].astype(bool)]
    if inside.empty:
        raise nothing_usable(out, log, "every candidate lies outside its volume")
    final = subsample_negatives(inside, options.delta, options.seed)
    final = final.sort_values(["seriesuid", "candidate_index"], kind="stable")
    final = final.assign(subset=final["seriesuid"].map(lambda uid: subset_of(volumes[uid], root)))
    shape = (len(final), 1, *([patch] * dims))
    _write_outputs(out, final, _patches(final, cache, groups, volumes), shape)
    summary = _summary(
        root, csv_path, options, candidates, on_disk, volumes, rows, final, log, (dims, patch)
    )
    summary["out"] = str(out)
    write_skipped(out, log)
    write_json(out / "summary.json", summary)
    what = "cubes" if dims == 3 else "patches"
    console.print(f"[green]wrote[/green] {len(final)} {what} to {out}", highlight=False)
    return summary


def _write_outputs(
    out: Path, final: pd.DataFrame, patches: Iterator[np.ndarray], shape: tuple[int, ...]
) -> None:
    write_stacked(out / "images.npy", patches, shape, np.float32)
    labels = final["class"].to_numpy(np.int64)
    write_stacked(out / "labels.npy", [labels], labels.shape, np.int64)
    manifest = final.rename(columns={"class": "label"}).loc[:, MANIFEST_COLUMNS]
    write_csv(out / "manifest.csv", manifest)


def _summary(
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


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of ``python -m data_prep.luna16``."""
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.luna16",
        description=(
            "LUNA16 raw release -> 32x32 candidate patches (pFedNet §VI-A), or 3-D cubes."
        ),
    )
    parser.add_argument("--root", type=Path, required=True, help="raw folder (subset*/ + CSVs)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--candidates", type=Path, default=None, help="candidate CSV (default: search root)"
    )
    parser.add_argument(
        "--delta",
        type=float,
        default=None,
        help="dataset-level negative:positive ratio (paper: 1, 2, 4, 7); default keeps all",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the negative subsampling")
    parser.add_argument(
        "--hu-window",
        type=float,
        nargs=2,
        default=list(HU_WINDOW),
        metavar=("LOW", "HIGH"),
        help="HU window mapped to [0, 1] (default -1000 400)",
    )
    add_geometry_options(parser, "cubes centred on the candidate voxel, axes z, y, x", PATCH)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m data_prep.luna16``."""
    args = build_parser().parse_args(argv)
    if args.delta is not None and not (math.isfinite(args.delta) and args.delta > 0):
        raise SystemExit(f"error: --delta {args.delta}: must be positive and finite (paper: 1-7)")
    if args.seed < 0:
        raise SystemExit(f"error: --seed {args.seed}: must be ≥ 0")
    if not all(math.isfinite(v) for v in args.hu_window):
        raise SystemExit(f"error: --hu-window {args.hu_window}: must be two finite HU values")
    patch = parse_patch(args.patch)
    options = LunaOptions(
        candidates=args.candidates,
        delta=args.delta,
        seed=args.seed,
        window=(args.hu_window[0], args.hu_window[1]),
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
