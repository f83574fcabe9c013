"""Vision models of the TDPFed and pFedSOP experiments (MNIST, CIFAR, Tiny ImageNet).

* :func:`dnn`: TDPFed §VII-A's MNIST network, two fully connected layers (784x100, 100x10).
* :func:`vgg8`: TDPFed §VII-A / Table I's CIFAR-10 VGG8, five 3x3 convolutions and three
  fully connected layers.
* :func:`resnet18`: the CIFAR ResNet-18 (He et al., 2016) of pFedSOP §V-B1 (CIFAR-10), built
  with :class:`monai.networks.nets.ResNet`.
* :func:`resnet9`: the ResNet-9 of pFedSOP §V-B1 (CIFAR-100, Tiny ImageNet).

Builders take ``input_shape`` (one sample's shape) and ``num_classes`` like the tabular and
imaging ones, and give ``num_classes`` logits. Each model's last fully connected layer is the
personal head of the split methods (FedPer, FedRep: ``personal`` in ``conf/model/*.yaml``).
BatchNorm (ResNets; VGG8 with ``norm=batch``) keeps running statistics, which are part of the
flat vector (:mod:`fedexp.models.flat`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from monai.networks.nets import ResNet
from torch import nn

from fedexp.config.ranges import PositiveInt
from fedexp.errors import ConfigError
from fedexp.models.grouped import grouped_params
from fedexp.models.grouped import grouped_vgg8
from fedexp.models.grouped import stacks_vgg8


def _image_shape(input_shape: Sequence[int], model: str) -> tuple[int, int, int]:
    """(channels, height, width) of an image input; a ConfigError for anything else."""
    if len(input_shape) != 3:
        raise ConfigError(
            f"model={model} needs image inputs (channels, height, width); the dataset gives "
            f"inputs of shape {list(input_shape)} (use an image data set, e.g. dataset=digits, "
            f"mnist, cifar10, cifar100, tiny_imagenet, luna16)"
        )
    c, h, w = (int(s) for s in input_shape)
    return c, h, w


def _pool_plan(height: int, width: int, count: int) -> tuple[bool, ...]:
    """Which of ``count`` 2x2 max-pools to apply: each one while the map is still >= 2x2."""
    plan = []
    for _ in range(count):
        pool = min(height, width) >= 2
        plan.append(pool)
        if pool:
            height, width = height // 2, width // 2
    return tuple(plan)


# ----------------------------------------------------------------------------- DNN
def dnn(
    input_shape: Sequence[int], num_classes: PositiveInt, hidden: PositiveInt = 100
) -> nn.Module:
    """TDPFed §VII-A's MNIST DNN: flatten, ``fc1`` (784x100), ReLU, ``fc2`` (100x10).

    The paper's softmax output is the cross-entropy of the classification task. Any input is
    flattened (``fc1`` takes ``prod(input_shape)`` features), so it also runs on tabular data.

    Parameter names: ``fc1.weight`` (hidden x in), ``fc1.bias``, ``fc2.weight``
    (num_classes x hidden), ``fc2.bias``; ``fc2`` is the personal head.

    Args:
        input_shape: shape of one input, e.g. (1, 28, 28).
        num_classes: number of classes C (C logits).
        hidden: width of the hidden layer, ≥ 1 (the paper: 100).
    """
    return DNN(math.prod(input_shape), hidden, num_classes)


class DNN(nn.Module):
    """``fc2(relu(fc1(flatten(x))))``."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the flattened input."""
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


# ----------------------------------------------------------------------------- VGG8
def vgg8(
    input_shape: Sequence[int],
    num_classes: PositiveInt,
    channels: Sequence[int] = (32, 64, 128, 256, 256),
    hidden: PositiveInt = 256,
    norm: str = "none",
) -> nn.Module:
    """TDPFed §VII-A / Table I's VGG8 for CIFAR-10: five convolutions, three linear layers.

    ``conv1`` ... ``conv5``: 3x3 convolutions (padding 1), 3->32->64->128->256->256, each
    followed by ReLU and a 2x2 max-pool; then ``fc1`` (256x256), ReLU, ``fc2`` (256x256), ReLU,
    ``fc3`` (256x10). Table I's shapes, written (in, out, kh, kw) there, are PyTorch's
    (out, in, kh, kw) here: ``conv1.weight`` is (32, 3, 3, 3), ``fc3.weight`` (10, 256).

    On 32x32 inputs the five pools leave 1x1x256. Smaller inputs (8x8 digits, 28x28 MNIST)
    are pooled only while the map is at least 2x2; an adaptive average pool to 1x1 then makes
    ``fc1`` always ``channels[-1]``-in. The flat names (``convK.weight`` 4-D, ``fcK.weight``
    2-D) are what a per-layer code such as TDPFed's CP decomposition matches.

    Args:
        input_shape: (channels, height, width) of one input, e.g. (3, 32, 32).
        num_classes: number of classes C (C logits).
        channels: output channels of the five convolutions.
        hidden: width of ``fc1`` and ``fc2``, ≥ 1.
        norm: "none" (the paper's) or "batch" (BatchNorm2d ``bn1`` ... ``bn5`` after each
            convolution; running statistics kept per client).

    Raises:
        ConfigError: inputs are not images, not five channel counts, or an unknown norm.
    """
    in_channels, height, width = _image_shape(input_shape, "vgg8")
    if len(channels) != 5:
        raise ConfigError(f"model.channels={list(channels)}: VGG8 has five convolutions")
    if norm not in ("none", "batch"):
        raise ConfigError(f"model.norm={norm!r}: expected 'none' or 'batch'")
    return VGG8(
        in_channels,
        num_classes,
        [int(c) for c in channels],
        hidden,
        norm == "batch",
        _pool_plan(height, width, 5),
    )


class VGG8(nn.Module):
    """Five conv (+BN) / ReLU / pool stages, adaptive average pool, three linear layers."""

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        channels: list[int],
        hidden: int,
        batch_norm: bool,
        pools: tuple[bool, ...],
    ) -> None:
        super().__init__()
        self.pools = pools
        self.batch_norm = batch_norm
        prev = in_channels
        for k, out in enumerate(channels, start=1):
            setattr(self, f"conv{k}", nn.Conv2d(prev, out, kernel_size=3, padding=1))
            if batch_norm:
                setattr(self, f"bn{k}", nn.BatchNorm2d(out))
            prev = out
        self.fc1 = nn.Linear(prev, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)
        #: whether :meth:`stacked_forward` holds: no BatchNorm (:mod:`fedexp.models.grouped`)
        self.stacks = stacks_vgg8(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch of images."""
        for k, pool in enumerate(self.pools, start=1):
            x = getattr(self, f"conv{k}")(x)
            if self.batch_norm:
                x = getattr(self, f"bn{k}")(x)
            x = F.relu(x)
            if pool:
                x = F.max_pool2d(x, 2)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)

    def stacked_params(self, layout, flat: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: ANN001
        """The m clients' ``flat`` ``[m, d]`` (of ``layout``) as :meth:`stacked_forward` reads.

        :func:`fedexp.models.grouped.grouped_params`.
        """
        return grouped_params(layout, flat)

    def stacked_forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits of m stacked models (``params``: :meth:`stacked_params`'s) on ``x``.

        ``x`` ``[m, B, ...]``; on the grouped layout
        (:func:`fedexp.models.grouped.grouped_vgg8`), where :attr:`stacks`.
        """
        return grouped_vgg8(self, params, x)


# ----------------------------------------------------------------------------- ResNet-18
def resnet18(input_shape: Sequence[int], num_classes: PositiveInt) -> nn.Module:
    """The CIFAR ResNet-18 (He et al., 2016) of pFedSOP §V-B1 (CIFAR-10), MONAI's ResNet.

    :class:`monai.networks.nets.ResNet` with basic blocks [2, 2, 2, 2] of 64, 128, 256, 512
    planes (``spatial_dims=2``), the CIFAR stem (a 3x3 stride-1 convolution, no max-pool: the
    ImageNet stem's 7x7 stride-2 convolution and pooling would leave 8x8 of a 32x32 image),
    BatchNorm, global average pooling and ``fc``. The projection shortcuts (1x1 convolution
    and BatchNorm, He et al.'s option B) have no bias (``bias_downsample=False``): with 10
    classes the network has the usual 11,173,962 parameters of the CIFAR variant.

    Parameter names: ``conv1``/``bn1`` (stem), ``layer1`` ... ``layer4``, ``fc`` (the personal
    head). The BatchNorm running statistics are kept per client (flat vector buffers).

    Args:
        input_shape: (channels, height, width) of one input, e.g. (3, 32, 32).
        num_classes: number of classes C (C logits).

    Raises:
        ConfigError: inputs are not images.
    """
    in_channels, _, _ = _image_shape(input_shape, "resnet18")
    return ResNet(
        block="basic",
        layers=[2, 2, 2, 2],
        block_inplanes=[64, 128, 256, 512],
        spatial_dims=2,
        n_input_channels=in_channels,
        conv1_t_size=3,
        conv1_t_stride=1,
        no_max_pool=True,
        shortcut_type="B",
        bias_downsample=False,
        num_classes=num_classes,
    )


# ----------------------------------------------------------------------------- ResNet-9
def resnet9(
    input_shape: Sequence[int], num_classes: PositiveInt, width: PositiveInt = 64
) -> nn.Module:
    """The ResNet-9 of pFedSOP §V-B1 (CIFAR-100 and Tiny ImageNet).

    pFedSOP cites He et al. (2016) for it; the network is the Myrtle.ai ResNet-9 of the
    DAWNBench CIFAR-10 entry, the usual "ResNet9" of FL code. ``ConvBN`` is a 3x3
    convolution (padding 1, no bias: BatchNorm follows), BatchNorm and ReLU:

    * ``prep``: ConvBN(C -> w);
    * ``layer1``: ConvBN(w -> 2w), 2x2 max-pool, residual ``x + ConvBN(ConvBN(x))`` (2w);
    * ``layer2``: ConvBN(2w -> 4w), 2x2 max-pool;
    * ``layer3``: ConvBN(4w -> 8w), 2x2 max-pool, residual (8w);
    * adaptive max-pool to 1x1, flatten, ``fc`` (8w -> num_classes), the personal head.

    With w = 64 the widths are 64, 128, 256, 512. The adaptive pool (Myrtle's is a fixed 4x4
    max-pool, the same on 32x32 inputs) also takes 64x64 Tiny ImageNet images; like VGG8's,
    the 2x2 pools are skipped once the map is 1 pixel wide. MONAI has no ResNet-9 (its
    ResNet builds the [2, 2, 2, 2]-style stages of He et al.), so it is written here.

    Args:
        input_shape: (channels, height, width) of one input, e.g. (3, 32, 32).
        num_classes: number of classes C (C logits).
        width: w ≥ 1, channels of the stem (the stages have 2w, 4w, 8w).

    Raises:
        ConfigError: inputs are not images.
    """
    in_channels, height, width_px = _image_shape(input_shape, "resnet9")
    return ResNet9(in_channels, num_classes, width, _pool_plan(height, width_px, 3))


class ConvBN(nn.Module):
    """3x3 convolution (no bias), BatchNorm, ReLU: names ``conv.*``, ``bn.*``."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu(bn(conv(x)))``."""
        return F.relu(self.bn(self.conv(x)))


class Residual(nn.Module):
    """``x + res2(res1(x))`` with two width-preserving ConvBN (no activation after the sum)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.res1 = ConvBN(channels, channels)
        self.res2 = ConvBN(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The input plus its two-layer residual."""
        return x + self.res2(self.res1(x))


class ResNet9(nn.Module):
    """``prep``, ``layer1`` (with residual), ``layer2``, ``layer3`` (with residual), ``fc``."""

    def __init__(
        self, in_channels: int, num_classes: int, width: int, pools: tuple[bool, bool, bool]
    ) -> None:
        super().__init__()

        def pool(k: int) -> nn.Module:
            return nn.MaxPool2d(2) if pools[k] else nn.Identity()

        w = width
        self.prep = ConvBN(in_channels, w)
        self.layer1 = nn.Sequential(ConvBN(w, 2 * w), pool(0), Residual(2 * w))
        self.layer2 = nn.Sequential(ConvBN(2 * w, 4 * w), pool(1))
        self.layer3 = nn.Sequential(ConvBN(4 * w, 8 * w), pool(2), Residual(8 * w))
        self.fc = nn.Linear(8 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch of images."""
        x = self.layer3(self.layer2(self.layer1(self.prep(x))))
        return self.fc(F.adaptive_max_pool2d(x, 1).flatten(1))
