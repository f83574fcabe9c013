"""3-D patches (issue 42 item 4): cubes loaded, 3-D MONAI networks, flips of cubes, runs.

The prepared folders here are written by hand in the layout ``data_prep --dims 3`` writes
(``images.npy`` ``(N, C, D, H, W)``, labels or masks, ``manifest.csv``), so that these tests
check fedexp's side alone; ``tests/data_prep/test_3d.py`` checks the converters.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fedexp.data.augment import FlipRotate
from fedexp.data.imaging import brats
from fedexp.data.imaging import luna16
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.errors import DataError
from fedexp.models.imaging import densenet
from fedexp.models.imaging import unet
from fedexp.tracking.base import NullTracker
from helpers import vmapped_round_ops

SIDE = 8
DENSENET = ["model=densenet", "model.growth_rate=2", "model.block_config=[1,1]"]
UNET = ["model=unet", "model.channels=[4,8]", "model.strides=[2]"]


def _luna_cubes(folder: Path, n: int = 48, seed: int = 0) -> Path:
    """LUNA16-like cubes: a nodule is a bright ball at the centre."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(n) % 3 == 0).astype(np.int64)
    x = rng.uniform(0, 0.3, size=(n, 1, SIDE, SIDE, SIDE)).astype(np.float32)
    grid = np.indices((SIDE,) * 3) - SIDE / 2 + 0.5
    ball = (grid**2).sum(0) < 6
    x[labels == 1, 0] += 0.6 * ball
    folder.mkdir(parents=True)
    np.save(folder / "images.npy", x)
    np.save(folder / "labels.npy", labels)
    uids = [f"1.3.6.1.{i % 6}" for i in range(n)]
    pd.DataFrame(
        {"seriesuid": uids, "label": labels, "subset": [f"subset{i % 3}" for i in range(n)]}
    ).to_csv(folder / "manifest.csv", index=False)
    return folder


def _brats_crops(folder: Path, n: int = 24, seed: int = 0) -> Path:
    """BraTS-like crops: nested regions, the tumour brighter in every channel."""
    rng = np.random.default_rng(seed)
    regions = np.zeros((n, 3, SIDE, SIDE, SIDE), np.uint8)
    for i in range(n):
        c = rng.integers(2, SIDE - 2, size=3)
        grid = np.indices((SIDE,) * 3) - c[:, None, None, None]
        r2 = (grid**2).sum(0)
        regions[i, 0], regions[i, 1], regions[i, 2] = r2 <= 5, r2 <= 2, r2 <= 0
    x = rng.normal(0, 0.3, size=(n, 4, SIDE, SIDE, SIDE)).astype(np.float32)
    x += regions[:, :1].astype(np.float32) + regions[:, 1:2]
    folder.mkdir(parents=True)
    np.save(folder / "images.npy", x)
    np.save(folder / "masks.npy", regions)
    pd.DataFrame({"patient": [f"P{i:03d}" for i in range(n)]}).to_csv(
        folder / "manifest.csv", index=False
    )
    return folder


@pytest.fixture(scope="module")
def cubes(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("cubes")
    return _luna_cubes(root / "luna3d"), _brats_crops(root / "brats3d")


def test_dims_3_loads_cubes_and_refuses_the_other_kind(cubes, prepared):
    luna, crops = cubes
    data = luna16(str(luna), dims=3)
    assert data.x.shape[1:] == (1, SIDE, SIDE, SIDE) and data.in_channels == 1
    regions = brats(str(crops), region="all", dims=3)
    assert regions.y.shape[1:] == (3, SIDE, SIDE, SIDE) and regions.task == "regions"
    whole = brats(str(crops), dims=3)
    assert whole.y.shape[1:] == (SIDE, SIDE, SIDE) and whole.task == "segmentation"
    with pytest.raises(DataError, match=r"dataset.dims=3: .*2-D patches.*--dims 3`"):
        luna16(str(prepared.luna), dims=3)
    with pytest.raises(DataError, match=r"dataset.dims=2: .*3-D cubes.*data_prep.brats"):
        brats(str(crops))
    with pytest.raises(DataError, match=r"dataset.dims=4: expected 2"):
        luna16(str(luna), dims=4)


def test_the_networks_are_monais_3d_ones_for_cubes():
    net = densenet([1, 16, 16, 16], 2, growth_rate=2, block_config=(1, 1))
    assert isinstance(net.features.conv0, nn.Conv3d)
    assert not any(isinstance(m, nn.Conv2d) for m in net.modules())
    assert net(torch.zeros(2, 1, 16, 16, 16)).shape == (2, 2)
    seg = unet([4, 16, 16, 16], 3, channels=(4, 8), strides=(2,))
    assert any(isinstance(m, nn.Conv3d) for m in seg.modules())
    assert seg(torch.zeros(1, 4, 16, 16, 16)).shape == (1, 3, 16, 16, 16)
    with pytest.raises(ConfigError, match=r"patch size 16x16x12 must be divisible"):
        unet([4, 16, 16, 12], 2, channels=(4, 8, 16), strides=(2, 4))


def test_a_cube_and_its_masks_flip_together_along_every_axis():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 2, 4, 4, 4, generator=gen)
    y = (x > 0.4).long()  # [m, B, R=2, D, H, W]: each region a function of its channel
    keys, draws = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    ax, ay = FlipRotate(flip=0.5, rotate=0.5)(x, y, keys, draws)
    assert torch.equal(ay, (ax > 0.4).long())
    seen_depth_flip = False
    for i in range(3):
        for j in range(5):
            candidates = {}
            for axes in ((), (-3,), (-2,), (-1,), (-3, -2), (-3, -1), (-2, -1), (-3, -2, -1)):
                flipped = x[i, j].flip(axes) if axes else x[i, j]
                for k in range(4):
                    candidates[(axes, k)] = torch.rot90(flipped, k, dims=(-2, -1))
            match = [key for key, c in candidates.items() if torch.equal(ax[i, j], c)]
            assert match, (i, j)
            seen_depth_flip |= any(-3 in axes for axes, _ in match)
    assert seen_depth_flip  # the depth axis is flipped too
    everything = FlipRotate(flip=1.0, rotate=0.0)(x, y, keys, draws)[0]
    assert torch.equal(everything, x.flip(-3).flip(-2).flip(-1))


def test_flip_rotate_refuses_tables(small_cfg):
    with pytest.raises(ConfigError, match=r"expected images \(C, H, W\) or cubes"):
        build_engine(small_cfg("augment=flip_rotate"))


@pytest.mark.parametrize("task", ["luna16", "brats"])
def test_a_3d_run_learns_past_its_start(cubes, small_cfg, task):
    luna, crops = cubes
    if task == "luna16":
        overrides = ["dataset=luna16", f"dataset.path={luna}", *DENSENET, "lr=0.1"]
        headline = "acc/mean"
    else:
        overrides = ["dataset=brats", f"dataset.path={crops}", "dataset.region=all", *UNET]
        overrides += ["lr=0.2"]
        headline = "dice/mean"
    cfg = small_cfg(
        *overrides,
        "dataset.dims=3",
        "augment=flip_rotate",
        "partition=iid",
        "num_clients=3",
        "rounds=6",
        "local_steps=4",
        "batch_size=4",
    )
    result = run(cfg, tracker=NullTracker())
    rounds = pd.read_csv(Path(result.output_dir) / "rounds.csv")
    first, last = rounds[headline].iloc[0], rounds[headline].iloc[-1]
    assert last > first, (first, last)


def test_a_vmapped_3d_round_is_constant_in_its_clients(cubes, small_cfg, monkeypatch):
    """Where 3-D convolutions are vmapped (on CUDA; forced here on the CPU, which runs them
    channels-last row by row), a round dispatches as many ops for 4 clients as for 2."""
    _, crops = cubes
    cfgs = [
        small_cfg(
            "dataset=brats",
            f"dataset.path={crops}",
            "dataset.dims=3",
            *UNET,
            f"num_clients={n}",
            "local_steps=2",
            "batch_size=2",
            "sampling=replacement",
            "partition=iid",
        )
        for n in (2, 4)
    ]
    ops = vmapped_round_ops(monkeypatch, cfgs)
    assert ops[0] == ops[1], ops[1] - ops[0]
