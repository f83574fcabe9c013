"""The command line ``python -m data_prep.brats``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from data_prep.brats.conversion import convert
from data_prep.brats.layouts import LAYOUT_ALIASES
from data_prep.brats.layouts import LAYOUTS
from data_prep.brats.options import BratsOptions
from data_prep.brats.patches import PATCH
from data_prep.command import run_conversion
from data_prep.geometry import add_geometry_options
from data_prep.geometry import parse_patch


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
    return run_conversion(lambda: convert(args.root, args.out, options))
