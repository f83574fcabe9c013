"""The whole conversion of a LUNA16 release into the output folder.

Options, the candidates matched to their volumes, every study converted or reused from the
resume cache (``OUT/studies/``), then the output files written (:mod:`data_prep.luna16.outputs`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console

from data_prep.common import RunLog
from data_prep.common import StudyCache
from data_prep.common import StudyError
from data_prep.common import cleanup_partials
from data_prep.common import console_for
from data_prep.common import file_stamp
from data_prep.common import finish_run
from data_prep.common import nothing_usable
from data_prep.common import one_line
from data_prep.common import prepare_out
from data_prep.common import progress_bar
from data_prep.common import require_dir
from data_prep.geometry import geometry_params
from data_prep.geometry import resolve_geometry
from data_prep.luna16.candidates import find_candidates_csv
from data_prep.luna16.candidates import read_candidates
from data_prep.luna16.candidates import subsample_negatives
from data_prep.luna16.options import LunaOptions
from data_prep.luna16.outputs import MANIFEST_COLUMNS
from data_prep.luna16.outputs import OUTPUT_NAMES
from data_prep.luna16.outputs import run_summary
from data_prep.luna16.outputs import write_outputs
from data_prep.luna16.patches import PATCH
from data_prep.luna16.patches import convert_study
from data_prep.luna16.volumes import find_volumes
from data_prep.luna16.volumes import subset_of
from data_prep.mhd import mhd_problem
from data_prep.sizes import check_luna


def _study_tag(path: Path, rows: pd.DataFrame) -> str:
    """Identify a study's inputs: its files and the candidate rows asked for."""
    coords = rows[["candidate_index", "coordX", "coordY", "coordZ"]].to_numpy(np.float64)
    stamp = file_stamp([path, path.with_suffix(".raw")])
    return hashlib.sha1(coords.tobytes()).hexdigest() + stamp


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
    write_outputs(out, final, _patches(final, cache, groups, volumes), shape)
    summary = run_summary(
        root, csv_path, options, candidates, on_disk, volumes, rows, final, log, (dims, patch)
    )
    what = "cubes" if dims == 3 else "patches"
    return finish_run(out, log, summary, len(final), what, console)
