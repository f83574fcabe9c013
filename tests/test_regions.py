"""All BraTS regions in one run (issue 42 item 3): whole tumour, tumour core, enhancing tumour
as three sigmoid channels, Dice per region."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from monai.losses import DiceCELoss

from fedexp.data.augment import FlipRotate
from fedexp.data.imaging import brats
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.errors import DataError
from fedexp.models.task import PADDING
from fedexp.models.task import RegionsTask
from fedexp.tracking.base import NullTracker
from helpers import vmapped_round_ops

UNET = ["model=unet", "model.channels=[8,16]", "model.strides=[2]"]


def _batch(n=5, r=3, h=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, r, h, h, generator=gen)
    y = (torch.rand(n, r, h, h, generator=gen) < 0.3).long()
    return logits, y


def test_the_loss_is_monais_dice_ce_with_a_sigmoid_on_each_region():
    """Per region, MONAI's DiceCELoss(sigmoid=True) on that one channel (soft Dice + binary
    cross-entropy), averaged over the regions; padding rows weigh nothing."""
    logits, y = _batch()
    task = RegionsTask(3)
    monai = DiceCELoss(sigmoid=True)
    expected = torch.stack(
        [monai(logits[:, c : c + 1], y[:, c : c + 1].float()) for c in range(3)]
    ).mean()
    torch.testing.assert_close(task.loss(logits, y), expected)
    padded_y = torch.cat([y, torch.full_like(y[:2], PADDING)])
    padded_logits = torch.cat([logits, torch.randn_like(logits[:2])])
    torch.testing.assert_close(task.loss(padded_logits, padded_y), expected)


def _dice_by_hand(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Per region: 2|P∩T| / (|P| + |T|) per image, averaged over the images whose truth holds
    the region (NaN when none does)."""
    out = []
    for c in range(truth.shape[1]):
        scores = [
            2 * (p & t).sum() / (p.sum() + t.sum())
            for p, t in zip(pred[:, c], truth[:, c], strict=True)
            if t.any()
        ]
        out.append(np.mean(scores) if scores else math.nan)
    return np.array(out)


def test_dice_per_region_is_per_image_over_the_images_that_hold_it():
    logits, y = _batch(n=6)
    y[:, 2] = 0  # no enhancing tumour anywhere: its Dice is undefined, not 0
    y[0, 1] = 0  # one image without core: left out of the core's mean
    got = RegionsTask(3).evaluate(logits, y)
    want = _dice_by_hand((logits > 0).numpy(), y.numpy().astype(bool))
    assert list(got) == ["dice", "dice_wt", "dice_tc", "dice_et", "acc"]
    assert got["dice_wt"] == pytest.approx(want[0]) and got["dice_tc"] == pytest.approx(want[1])
    assert math.isnan(got["dice_et"]) and math.isnan(want[2])
    assert got["dice"] == pytest.approx(want[:2].mean())  # the mean of the defined regions
    assert got["acc"] == pytest.approx(float(((logits > 0).long() == y).float().mean()))


def test_a_perfect_prediction_scores_one_in_every_region():
    _, y = _batch()
    logits = torch.where(y.bool(), 5.0, -5.0)
    got = RegionsTask(3).evaluate(logits, y)
    assert got["dice"] == got["dice_wt"] == got["dice_et"] == 1.0 and got["acc"] == 1.0


def test_region_all_loads_the_three_channels(prepared):
    data = brats(str(prepared.brats_regions), region="all")
    masks = np.load(prepared.brats_regions / "masks.npy")
    assert data.task == "regions" and data.num_classes == 3
    assert data.y.shape == masks.shape and data.y.shape[1] == 3
    np.testing.assert_array_equal(data.y, masks > 0)
    # nested regions: enhancing ⊆ core ⊆ whole
    assert (data.y[:, 2] <= data.y[:, 1]).all() and (data.y[:, 1] <= data.y[:, 0]).all()
    # the one label per sample (partitions, the stratified split): tumour or not
    np.testing.assert_array_equal(data.labels, masks[:, 0].reshape(len(masks), -1).max(1) > 0)
    core = brats(str(prepared.brats_regions), region="core")
    np.testing.assert_array_equal(core.y, data.y[:, 1])  # one-region runs as before


def test_region_all_needs_the_regions_masks(prepared):
    with pytest.raises(DataError, match=r"region='all'.*--labels regions"):
        brats(str(prepared.brats), region="all")
    with pytest.raises(DataError, match=r"region='tumour'.*or all"):
        brats(str(prepared.brats_regions), region="tumour")


def test_a_mask_of_three_regions_moves_with_its_image():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, 3, 8, 8, generator=gen)
    y = (x > 0.2).long()  # each region a function of its image channel, pixel by pixel
    keys, draws = torch.arange(4), torch.zeros(4, dtype=torch.int64)
    ax, ay = FlipRotate(flip=0.5, rotate=0.5)(x, y, keys, draws)
    assert not torch.equal(ax, x)
    assert torch.equal(ay, (ax > 0.2).long())


def _cfg(small_cfg, prepared, *overrides, model=UNET):
    return small_cfg(
        "dataset=brats",
        f"dataset.path={prepared.brats_regions}",
        "dataset.region=all",
        *model,
        "num_clients=3",
        "local_steps=2",
        "batch_size=8",
        "lr=0.05",
        *overrides,
    )


def test_a_run_of_all_regions_logs_dice_per_region(prepared, small_cfg):
    cfg = _cfg(small_cfg, prepared, "rounds=2", "augment=flip_rotate")
    result = run(cfg, tracker=NullTracker())
    own = {k for k in result.per_client[0] if not k.startswith(("global/", "gain/"))}
    assert own == {
        "dice",
        "dice_wt",
        "dice_tc",
        "dice_et",
        "acc",
        "loss",
        "num_test",
    }
    for region in ("wt", "tc", "et"):
        assert f"dice_{region}/mean" in result.metrics
        assert f"global/dice_{region}/mean" in result.metrics  # FedAvg's global view too
    assert 0.0 <= result.metrics["dice/mean"] <= 1.0
    assert math.isfinite(result.metrics["loss/mean"])


def test_the_model_must_give_one_channel_a_region(prepared, small_cfg):
    densenet = ["model=densenet", "model.growth_rate=4", "model.block_config=[2,2]"]
    cfg = _cfg(small_cfg, prepared, model=densenet)
    with pytest.raises(ConfigError, match=r"output per sample is \[3\].*\[3, 64, 64\]"):
        build_engine(cfg)


def test_fedrod_refuses_overlapping_regions(prepared, small_cfg):
    with pytest.raises(ConfigError, match="fedrod.*dataset.region"):
        build_engine(_cfg(small_cfg, prepared, "algorithm=fedrod"))


def test_a_vmapped_round_of_all_regions_is_constant_in_its_clients(
    prepared, small_cfg, monkeypatch
):
    """The regions' loss runs under vmap (no in-place op): with the convolutions vmapped (as
    on CUDA; forced here), a round dispatches as many ops for 4 clients as for 2."""
    sizes = ("batch_size=4", "sampling=replacement", "partition=iid")
    cfgs = [_cfg(small_cfg, prepared, f"num_clients={n}", *sizes) for n in (2, 4)]
    ops = vmapped_round_ops(monkeypatch, cfgs)
    assert ops[0] == ops[1], ops[1] - ops[0]
