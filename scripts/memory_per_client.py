"""Memory of one client's local step on 3-D cubes (or 2-D patches), as the engine estimates it.

    .venv/bin/python scripts/memory_per_client.py           # the table of docs/imaging.md
    .venv/bin/python scripts/memory_per_client.py --dataset brats --side 64 --batch 2 \
        -- model.channels=[32,64,128,256]

Writes random arrays of the prepared layout (``images.npy`` and labels or masks, any values:
the estimate depends on shapes only) to a temporary folder, builds the run with the given
overrides and prints :func:`fedexp.engine.memory.client_step_bytes`: the tensors autograd keeps
for one client's training step, doubled for the backward pass's transients, plus four copies of
the parameters (what ``memory_budget`` divides the device's memory by).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts" / "gpu")]

#: (dataset, side, batch, overrides) of the table in docs/imaging.md.
TABLE = (
    ("luna16", 32, 8, ()),
    ("luna16", 32, 8, ("model.block_config=[4,4,4]",)),
    ("luna16", 16, 8, ()),
    ("brats", 64, 2, ()),
    ("brats", 64, 2, ("model.channels=[32,64,128,256]",)),
    ("brats", 32, 8, ()),
)


def estimate(
    root: Path, dataset: str, side: int, batch: int, overrides: tuple[str, ...], dims: int = 3
) -> tuple[float, int]:
    """(MiB of one client's step, the model's parameters) of one setting."""
    from check import imaging_folder

    from fedexp.engine.memory import client_step_bytes
    from fedexp.engine.runner import build_engine
    from helpers import compose_config

    folder = imaging_folder(dataset, 40, 1, root, dims, side, regions=dataset == "brats")
    model = "model=densenet" if dataset == "luna16" else "model=unet"
    extra = ["dataset.region=all"] if dataset == "brats" else []
    cfg = compose_config(
        f"dataset={dataset}",
        f"dataset.path={folder}",
        f"dataset.dims={dims}",
        *extra,
        model,
        *overrides,
        "partition=iid",
        "num_clients=2",
        f"batch_size={batch}",
        output_dir=root / "out",
    )
    engine = build_engine(cfg)
    data = engine.clients[0]
    size = client_step_bytes(engine.ctx, data.x_train[:batch], data.y_train[:batch])
    return size / 2**20, engine.ctx.model.layout.num_params


def main(argv: list[str] | None = None) -> int:
    """Print the estimate of each setting (the table's, or the one given)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["luna16", "brats"], help="one setting, not the table")
    p.add_argument("--side", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dims", type=int, default=3, choices=[2, 3])
    p.add_argument("overrides", nargs="*", help="fedexp overrides (after --)")
    args = p.parse_args(argv)
    logging.getLogger("fedexp").setLevel(logging.WARNING)
    rows = (
        [(args.dataset, args.side, args.batch, tuple(args.overrides))]
        if args.dataset
        else list(TABLE)
    )
    print("| data | model | batch | parameters | one client's step |")
    print("|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for dataset, side, batch, overrides in rows:
            mib, params = estimate(Path(tmp), dataset, side, batch, overrides, args.dims)
            net = "DenseNet" if dataset == "luna16" else "U-Net, 3 regions"
            cube = "x".join([str(side)] * args.dims)
            setting = " ".join(overrides) or "defaults"
            row = f"| {dataset} {cube} | {net}, {setting} | {batch} | {params:,} | {mib:,.0f} MiB |"
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
