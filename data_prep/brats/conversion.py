"""The whole conversion of a BraTS release into the output folder.

Options, every patient converted or reused from the resume cache (``OUT/studies/``), then the
output files written (:mod:`data_prep.brats.outputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from data_prep.brats.layouts import Case
from data_prep.brats.layouts import detect_layout
from data_prep.brats.layouts import find_cases
from data_prep.brats.layouts import msd_channel_order
from data_prep.brats.options import BratsOptions
from data_prep.brats.outputs import OUTPUT_NAMES
from data_prep.brats.outputs import make_manifest
from data_prep.brats.outputs import run_summary
from data_prep.brats.outputs import write_outputs
from data_prep.brats.patches import PATCH
from data_prep.brats.patches import patient_crop
from data_prep.brats.patches import patient_patches
from data_prep.brats.sites import check_sites
from data_prep.brats.sites import find_sites_file
from data_prep.brats.sites import read_sites
from data_prep.brats.sites import site_summary
from data_prep.brats.volumes import load_case
from data_prep.common import RunLog
from data_prep.common import StudyCache
from data_prep.common import StudyError
from data_prep.common import cleanup_partials
from data_prep.common import console_for
from data_prep.common import finish_run
from data_prep.common import id_problem
from data_prep.common import nothing_usable
from data_prep.common import one_line
from data_prep.common import prepare_out
from data_prep.common import progress_bar
from data_prep.common import require_dir
from data_prep.geometry import geometry_params
from data_prep.geometry import resolve_geometry
from data_prep.sizes import check_brats
from data_prep.sizes import check_room


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
    manifest = make_manifest(done, cache, sites)
    if manifest.empty:
        what = f"the {len(done)} usable patients in {base} have no tumour slice, so no patch"
        if dims == 3:
            what = f"the {len(done)} usable patients in {base} have no brain voxel, so no crop"
        raise nothing_usable(out, log, what)
    if dims == 2:  # the patches' count is known now: the output against the disk
        size = len(manifest) * (16 + (1 if options.labels == "whole" else 3)) * patch**2
        check_room(f"--patch {patch}", size, "images.npy and masks.npy", 0, "", out)
    write_outputs(out, done, cache, manifest, options.labels, (dims, patch))
    summary = run_summary(root, base, layout, options, cases, manifest, log, (dims, patch))
    summary.update(site_summary(sites_path, sites, manifest))
    what = "crops" if dims == 3 else "patches"
    return finish_run(out, log, summary, len(manifest), what, console)
