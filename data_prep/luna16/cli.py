"""The command line ``python -m data_prep.luna16``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from data_prep.command import run_conversion
from data_prep.geometry import add_geometry_options
from data_prep.geometry import parse_patch
from data_prep.luna16.conversion import convert
from data_prep.luna16.options import LunaOptions
from data_prep.luna16.patches import HU_WINDOW
from data_prep.luna16.patches import PATCH


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
    return run_conversion(lambda: convert(args.root, args.out, options))
