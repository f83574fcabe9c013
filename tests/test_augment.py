"""Augmentation of the training batches (``augment`` group, issue 42 item 5)."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.data.augment import FlipRotate
from fedexp.data.augment import Intensity
from fedexp.data.augment import uniforms
from fedexp.engine.config_check import check_groups
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.tracking.base import NullTracker
from helpers import compose_config

KEYS = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int64)
DRAWS = torch.tensor([0, 3, 3, 7, 1], dtype=torch.int64)


def _images(m=5, b=6, h=8):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, b, 2, h, h, generator=gen)
    y = (x[:, :, 0] > 0.3).long()  # a mask that is a function of the image, pixel by pixel
    return x, y


def test_a_mask_moves_with_its_image():
    x, y = _images()
    ax, ay = FlipRotate(flip=0.5, rotate=0.5)(x, y, KEYS, DRAWS)
    assert torch.equal(ay, (ax[:, :, 0] > 0.3).long())
    assert not torch.equal(ax, x)  # something moved
    for i in range(5):  # each sample is its own image flipped and turned, nothing mixed
        for j in range(6):
            candidates = [
                torch.rot90(x[i, j].flip(a) if a else x[i, j], k, dims=(-2, -1))
                for a in ((), (-2,), (-1,), (-2, -1))
                for k in range(4)
            ]
            assert any(torch.equal(ax[i, j], c) for c in candidates)


def test_flip_and_rotate_are_what_their_probabilities_say():
    x, y = _images()
    assert torch.equal(FlipRotate(flip=1.0, rotate=0.0)(x, y, KEYS, DRAWS)[0], x.flip(-2).flip(-1))
    assert torch.equal(FlipRotate(flip=0.0, rotate=0.0)(x, y, KEYS, DRAWS)[0], x)
    u = uniforms(torch.arange(2000), torch.zeros(2000, dtype=torch.int64), 8, 4)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    n = u[..., 0].numel()
    assert abs(float((u[..., 0] < 0.3).float().mean()) - 0.3) < 4 * math.sqrt(0.21 / n)
    quarter = 1 + (u[..., 3] * 3).long().clamp(max=2)
    for k in (1, 2, 3):
        assert abs(float((quarter == k).float().mean()) - 1 / 3) < 4 * math.sqrt(2 / 9 / n)


def test_a_clients_augmentation_is_the_same_alone_or_in_a_cohort():
    x, y = _images()
    together = FlipRotate()(x, y, KEYS, DRAWS)
    scaled = Intensity(0.2, 0.1)(x, y, KEYS, DRAWS)[0]
    for i in range(5):
        one = slice(i, i + 1)
        alone = FlipRotate()(x[one], y[one], KEYS[one], DRAWS[one])
        assert torch.equal(alone[0][0], together[0][i]) and torch.equal(alone[1][0], together[1][i])
        assert torch.equal(Intensity(0.2, 0.1)(x[one], y[one], KEYS[one], DRAWS[one])[0][0],
                           scaled[i])  # fmt: skip
    later = FlipRotate()(x, y, KEYS, DRAWS + 1)[0]
    assert not torch.equal(later, together[0])  # the next draw: other choices


def test_intensity_scales_and_shifts_each_sample_within_its_bounds():
    x, y = _images()
    scaled, same = Intensity(scale=0.2, shift=0.0)(x, y, KEYS, DRAWS)
    assert torch.equal(same, y)
    ratio = scaled / x
    per_sample = ratio.flatten(2)
    torch.testing.assert_close(per_sample, per_sample[..., :1].expand_as(per_sample))
    assert float((ratio - 1).abs().max()) <= 0.2 + 1e-6
    shifted = Intensity(scale=0.0, shift=0.5)(x, y, KEYS, DRAWS)[0] - x
    assert float(shifted.abs().max()) <= 0.5 + 1e-6 and float(shifted.abs().max()) > 0


def test_an_augmented_imaging_run_trains_on_other_batches(prepared, small_cfg):
    """The run draws the same indices, augmented: round 1's training loss moves; none is
    the default and leaves the batches as drawn."""
    base = [
        "dataset=brats",
        f"dataset.path={prepared.brats}",
        "model=unet",
        "model.channels=[8,16]",
        "model.strides=[2]",
        "partition=iid",
        "num_clients=2",
        "local_steps=2",
        "batch_size=4",
        "rounds=1",
    ]
    plain = build_engine(small_cfg(*base))
    assert not plain.ctx.augment.active
    augmented = build_engine(small_cfg(*base, "augment=flip_rotate"))
    losses = [e.run_round()["train/train_loss"] for e in (plain, augmented)]
    assert losses[0] != losses[1]
    result = run(small_cfg(*base, "augment=intensity"), tracker=NullTracker())
    assert math.isfinite(result.metrics["iou/mean"])


def test_flip_rotate_on_a_table_is_refused_naming_the_shape(small_cfg):
    with pytest.raises(ConfigError, match=r"augment=flip_rotate: dataset .* expected images"):
        build_engine(small_cfg("augment=flip_rotate"))


def test_an_out_of_range_probability_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match=r"augment\.flip"):
        check_groups(compose_config("augment=flip_rotate", "augment.flip=1.5"))
