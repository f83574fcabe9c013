"""Image models of pFedNet §VI: thin builders around ``monai.networks.nets``.

* :func:`densenet`: the DenseNet-BC (Huang et al., 2017) of the lung-nodule task (pFedNet §VI,
  "D-Net"; the fully connected classifier is the personalised part).
* :func:`unet`: the U-Net (Ronneberger et al., 2015) of the brain-tumour task (pFedNet §VI;
  down-sampling path shared, up-sampling path personalised).

Normalisation: ``norm`` picks MONAI's layer. ``batch`` is the papers' (the DenseNet of pFedNet
§VI uses BatchNorm): its running mean and variance are part of the flat vector
(:mod:`fedexp.models.flat`), so they are kept per client, averaged like parameters, kept local
by FedBN (Li et al., 2021) and checkpointed. The default stays instance norm with a learnable
affine (parameters only), which needs no running statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from monai.networks.nets import DenseNet
from monai.networks.nets import UNet
from torch import nn

from fedexp.config.ranges import NonNegativeInt
from fedexp.config.ranges import OpenFraction
from fedexp.config.ranges import PositiveInt
from fedexp.errors import ConfigError

#: Instance norm with a learnable scale and shift: parameters, no running statistics.
INSTANCE_AFFINE: tuple[str, dict[str, Any]] = ("instance", {"affine": True})


def _norm(norm: str | Sequence[Any]) -> str | tuple[Any, ...]:
    """MONAI's ``(name, kwargs)`` form from a config value (YAML gives lists)."""
    return norm if isinstance(norm, str) else tuple(norm)


def _image_shape(input_shape: Sequence[int], model: str) -> tuple[int, tuple[int, ...]]:
    """(channels, spatial sizes) of 2-D ``(C, H, W)`` or 3-D ``(C, D, H, W)`` image inputs."""
    if len(input_shape) not in (3, 4):
        raise ConfigError(
            f"model={model} needs image inputs (channels, height, width) or (channels, depth, "
            f"height, width); the dataset gives inputs of shape {list(input_shape)} (use "
            "dataset=luna16 or dataset=brats)"
        )
    c, *spatial = (int(s) for s in input_shape)
    return c, tuple(spatial)


def densenet(
    input_shape: Sequence[int],
    num_classes: PositiveInt,
    growth_rate: PositiveInt = 6,
    block_config: Sequence[int] = (16, 16, 16),
    init_features: PositiveInt | None = None,
    bn_size: PositiveInt = 4,
    norm: str | Sequence[Any] = INSTANCE_AFFINE,
    dropout_prob: OpenFraction = 0.0,
) -> nn.Module:
    """DenseNet-BC for small patches (pFedNet §VI: LUNA16 32x32 candidates, "D-Net").

    The authors' network: DenseNet-BC with growth rate 6 and three dense blocks of 16
    bottleneck layers, compression 0.5 at the transitions (Huang et al., 2017, CIFAR variant).
    Built with :class:`monai.networks.nets.DenseNet` (``spatial_dims`` 2, or 3 for cubes:
    taken from the inputs); its ImageNet stem (7x7 stride-2 convolution and max pooling, a 4x
    reduction meant for 224x224 inputs) is replaced by the CIFAR stem, a 3x3 stride-1
    convolution, so a 32x32 patch is seen at 32x32, 16x16 and 8x8 by the three blocks.

    Parameter names: ``features.*`` (stem, dense blocks, transitions) and
    ``class_layers.out.*``, the fully connected classifier that ``conf/model/densenet.yaml``
    makes personal (pFedNet §VI).

    Normalisation: instance norm with affine parameters by default; ``norm=batch`` gives the
    paper's BatchNorm, whose running statistics are kept per client (see the module docstring).

    Args:
        input_shape: (channels, height, width) of one input, e.g. (1, 32, 32), or (channels,
            depth, height, width) of a cube, e.g. (1, 32, 32, 32).
        num_classes: number of classes C (C logits; 2 for nodule / not).
        growth_rate: k ≥ 1, channels added by each dense layer.
        block_config: dense layers per block.
        init_features: channels of the stem, ≥ 1 (default 2k, as DenseNet-BC).
        bn_size: bottleneck width factor ≥ 1 (bottleneck layers have ``bn_size * k`` channels).
        norm: MONAI norm name or ``[name, kwargs]`` (``batch``, ``instance``, ...).
        dropout_prob: dropout after each dense layer, in [0, 1).

    Raises:
        ConfigError: inputs are not images.
    """
    channels, spatial = _image_shape(input_shape, "densenet")
    init = 2 * growth_rate if init_features is None else init_features
    net = DenseNet(
        spatial_dims=len(spatial),
        in_channels=channels,
        out_channels=num_classes,
        init_features=init,
        growth_rate=growth_rate,
        block_config=tuple(block_config),
        bn_size=bn_size,
        norm=_norm(norm),
        dropout_prob=dropout_prob,
    )
    conv = nn.Conv2d if len(spatial) == 2 else nn.Conv3d
    stem = conv(channels, init, kernel_size=3, padding=1, bias=False)
    nn.init.kaiming_normal_(stem.weight)
    net.features.conv0 = stem
    net.features.pool0 = nn.Identity()
    return net


def unet(
    input_shape: Sequence[int],
    num_classes: PositiveInt,
    channels: Sequence[int] = (16, 32, 64, 128),
    strides: Sequence[int] = (2, 2, 2),
    num_res_units: NonNegativeInt = 0,
    norm: str | Sequence[Any] = INSTANCE_AFFINE,
    act: str | Sequence[Any] = "PRELU",
    dropout: OpenFraction = 0.0,
) -> nn.Module:
    """U-Net (pFedNet §VI: BraTS2017 64x64 four-channel patches, tumour segmentation).

    Built with :class:`monai.networks.nets.UNet` (``spatial_dims`` 2, or 3 for cubes: taken
    from the inputs; ``in_channels`` from the data: 4 MRI channels, ``out_channels =
    num_classes``: 2 for background / whole tumour, 3 for all regions). The
    default widths (16 to 128) are smaller than the original U-Net's (64 to 1024) so that a
    federated round on a CPU takes seconds; set ``model.channels`` for the full size.

    Parameter names follow MONAI's nesting: ``model.0.*`` is the first down-sampling block,
    ``model.1.submodule.0.*`` the next, ..., the innermost ``...submodule.*`` the bottom block,
    and ``...submodule.2.*`` / ``model.2.*`` the up-sampling blocks (the decoder), which
    ``conf/model/unet.yaml`` makes personal (pFedNet §VI).

    Normalisation: instance norm with affine parameters by default; ``norm=batch`` gives
    BatchNorm, whose running statistics are kept per client (see the module docstring).

    Args:
        input_shape: (channels, height, width) of one input, e.g. (4, 64, 64), or (channels,
            depth, height, width) of a cube.
        num_classes: output channels (classes, background included).
        channels: feature channels of each level, from the top.
        strides: down-sampling stride between levels (``len(channels) - 1`` of them).
        num_res_units: residual units per block, ≥ 0 (0: plain convolutions).
        norm: MONAI norm name or ``[name, kwargs]`` (``batch``, ``instance``, ...).
        act: MONAI activation name or ``[name, kwargs]``.
        dropout: dropout rate, in [0, 1).

    Raises:
        ConfigError: inputs are not images, or the levels do not fit the patch size.
    """
    in_channels, spatial = _image_shape(input_shape, "unet")
    if len(strides) != len(channels) - 1:
        raise ConfigError(
            f"model.strides={list(strides)}: expected len(model.channels) - 1 = "
            f"{len(channels) - 1} strides"
        )
    scale = math.prod(strides)
    if any(side % scale for side in spatial):
        size = "x".join(str(side) for side in spatial)
        raise ConfigError(
            f"model.strides={list(strides)}: the patch size {size} must be divisible "
            f"by their product {scale}"
        )
    net = UNet(
        spatial_dims=len(spatial),
        in_channels=in_channels,
        out_channels=num_classes,
        channels=tuple(channels),
        strides=tuple(strides),
        num_res_units=num_res_units,
        norm=_norm(norm),
        act=_norm(act),
        dropout=dropout,
    )
    return net
