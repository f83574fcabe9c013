"""Augmentation of the cohort's training batches, on the run's device (``augment`` group).

Image pFL baselines train on randomly flipped and rotated patches with jittered intensities
(MONAI's ``RandFlip``, ``RandRotate90``, ``RandScaleIntensity``, ``RandShiftIntensity``). Those
transforms take one image and a NumPy or torch generator of their own; fedexp draws a whole
cohort's minibatch of a step as one ``[m, B, C, H, W]`` tensor (``[m, B, C, D, H, W]`` for
cubes; the local solver,
:func:`fedexp.engine.solver.steps.draw_batch`), so the same transforms are written here as
batched tensor operations, with every random choice a counter-based hash of (the client's
stream key, its draw number, the sample's position in the batch). A client's augmented batch
is then the same drawn alone or in any cohort, on 1 or 2 processes and on any device, and a
rerun of the same seed gives the same batches.

Segmentation masks (targets with the image's spatial shape) move with their image under the
spatial transforms; intensity transforms touch the image alone. Evaluation is never augmented.
"""

from __future__ import annotations

import torch

from fedexp.config.ranges import Fraction
from fedexp.config.ranges import NonNegative
from fedexp.errors import ConfigError
from fedexp.streams import _GOLDEN
from fedexp.streams import _s64
from fedexp.streams import _srl
from fedexp.streams import mix64

#: tweak of augmentation's hashes (apart from the minibatch draws')
_AUGMENT = _s64(0x2545F4914F6CDD1D)


def uniforms(keys: torch.Tensor, draws: torch.Tensor, size: int, count: int) -> torch.Tensor:
    """Uniforms in [0, 1), float64 ``[m, size, count]``.

    ``count`` for each of the ``size`` samples of each client's draw: a SplitMix64 hash of
    (stream key, draw, position, index).
    """
    base = mix64(keys ^ mix64(draws.to(keys.device) ^ _AUGMENT))
    pos = torch.arange(size * count, dtype=torch.int64, device=keys.device) * _GOLDEN
    bits = _srl(mix64(base[:, None] + pos[None, :]), 11)
    return (bits.to(torch.float64) * 2.0**-53).view(-1, size, count)


class NoAugmentation:
    """The batches as drawn (``augment=none``, the default)."""

    active = False

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, keys: torch.Tensor, draws: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` and ``y`` unchanged."""
        return x, y

    def check(self, dataset: str, sample: tuple[int, ...]) -> None:
        """Any input: nothing to refuse."""


def _where(flag: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a`` where the per-sample ``flag`` [m, B] holds, else ``b``."""
    return torch.where(flag.view(*flag.shape, *[1] * (a.dim() - 2)), a, b)


class FlipRotate:
    """Random flips along each spatial axis and rotations by multiples of 90 degrees.

    As MONAI's ``RandFlip`` (each spatial axis, two of an image and three of a cube, flipped
    with probability ``flip``) followed by ``RandRotate90`` (with probability ``rotate``, a
    quarter, half or three-quarter turn, each as likely, in the plane of the last two axes:
    the axial plane of LUNA16's cubes; square planes only), per sample. A segmentation mask
    moves with its image.

    Args:
        flip: probability of flipping each spatial axis.
        rotate: probability of a rotation (0: none).
    """

    active = True

    def __init__(self, flip: Fraction = 0.5, rotate: Fraction = 0.5) -> None:
        self.flip = float(flip)
        self.rotate = float(rotate)

    def check(self, dataset: str, sample: tuple[int, ...]) -> None:
        """Refuse a data set whose samples are not images ``(C, H, W)`` or cubes ``(C, D, H, W)``.

        Raises:
            ConfigError: one line naming the data set and its sample shape.
        """
        if len(sample) not in (3, 4):
            raise ConfigError(
                f"augment=flip_rotate: dataset {dataset!r} has inputs of shape {sample}; "
                "expected images (C, H, W) or cubes (C, D, H, W)"
            )

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, keys: torch.Tensor, draws: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` [m, B, C, *spatial] and its targets, each sample transformed.

        Per sample, ``2 + len(spatial)`` uniforms: one a flip of each axis (from the first
        spatial axis), then whether to turn and by how much.
        """
        dims = x.dim() - 3
        if dims not in (2, 3):
            raise ValueError(
                f"augment=flip_rotate: expected images [clients, batch, C, H, W] or cubes "
                f"[clients, batch, C, D, H, W], got inputs of shape {tuple(x.shape)}"
            )
        u = uniforms(keys, draws, x.shape[1], dims + 2).to(x.device)
        spatial = tuple(x.shape[-dims:])
        masks = y.dim() >= 2 + dims and tuple(y.shape[-dims:]) == spatial  # [m, B, (R,) *spatial]
        for col, axis in enumerate(range(-dims, 0)):
            flag = u[..., col] < self.flip
            x = _where(flag, x.flip(axis), x)
            if masks:
                y = _where(flag, y.flip(axis), y)
        if self.rotate > 0 and x.shape[-1] == x.shape[-2]:
            turn = u[..., dims] < self.rotate
            quarter = 1 + (u[..., dims + 1] * 3).long().clamp(max=2)  # 1, 2 or 3 quarter turns
            x0, y0 = x, y
            for k in (1, 2, 3):
                flag = turn & (quarter == k)
                x = _where(flag, torch.rot90(x0, k, dims=(-2, -1)), x)
                if masks:
                    y = _where(flag, torch.rot90(y0, k, dims=(-2, -1)), y)
        return x, y


class Intensity:
    """Random intensity scaling and shifting of each sample.

    As MONAI's ``RandScaleIntensity`` (x · (1 + a), a uniform in [−scale, scale]) then
    ``RandShiftIntensity`` (+ b, b uniform in [−shift, shift]); targets untouched.

    Args:
        scale: the largest relative change of the intensities.
        shift: the largest offset added.
    """

    active = True

    def __init__(self, scale: NonNegative = 0.1, shift: NonNegative = 0.1) -> None:
        self.scale = float(scale)
        self.shift = float(shift)

    def check(self, dataset: str, sample: tuple[int, ...]) -> None:
        """Any input (a table's features are scaled and shifted alike): nothing to refuse."""

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, keys: torch.Tensor, draws: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs ``x`` [m, B, ...] rescaled and shifted per sample."""
        u = uniforms(keys, draws, x.shape[1], 2).to(device=x.device, dtype=x.dtype)
        a = self.scale * (2 * u[..., 0] - 1)
        b = self.shift * (2 * u[..., 1] - 1)
        shape = (*a.shape, *[1] * (x.dim() - 2))
        return x * (1 + a.view(shape)) + b.view(shape), y
