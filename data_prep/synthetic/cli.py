"""The command line ``python -m data_prep.synthetic``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from data_prep.synthetic.brats import BRATS_RELEASES
from data_prep.synthetic.brats import write_brats
from data_prep.synthetic.luna16 import write_luna16
from data_prep.synthetic.mri import MRI_SHAPE
from data_prep.synthetic.mri import make_mri_studies


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
