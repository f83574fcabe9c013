"""A cohort's convolutions as im2col products equal vmap's grouped ones (fedexp.models.conv_gemm).

The path exists for the GPU, where cuDNN runs a grouped convolution as a kernel a group; the
arithmetic is the same on any device, so its values and gradients are checked here, in double
precision, against the grouped convolution it replaces: the 2-conv CNN of the peers'
benchmark, MONAI's 2-D U-Net (strided convolutions, residual units) and a strided, dilated
layer with and without bias.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import vmap

from fedexp.models import conv_gemm
from fedexp.models.flat import FlatModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "peers"))


def _monai_unet() -> nn.Module:
    from monai.networks.nets import UNet

    return UNet(2, 4, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1)


def _odd() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        nn.ReLU(),
        nn.Conv2d(5, 4, 3, padding=1, bias=False),
    )


def _cnn() -> nn.Module:
    import common

    return common.make_model("cnn", 0)


CASES = {
    "cnn": (_cnn, (1, 32, 32)),
    "unet": (_monai_unet, (4, 16, 16)),
    "strided-dilated": (_odd, (3, 11, 9)),
}


def _grads(model: FlatModel, params: torch.Tensor, x: torch.Tensor) -> tuple:
    p = params.detach().requires_grad_(True)
    out = vmap(model)(p, x)
    loss = (out * torch.linspace(-1, 1, out[0].numel(), dtype=out.dtype).view(out[0].shape)).sum()
    return out.detach(), torch.autograd.grad(loss, p)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_cohorts_convolutions_as_products_equal_the_grouped_ones(case, monkeypatch):
    build, shape = CASES[case]
    einsum, calls = conv_gemm.torch.einsum, []
    monkeypatch.setattr(conv_gemm.torch, "einsum", lambda *a: calls.append(1) or einsum(*a))
    torch.manual_seed(0)
    module = build().double()
    model = FlatModel(module, torch.device("cpu"), channels_last=False)
    m, batch = 3, 2
    params = model.initial().double() + 0.01 * torch.randn(m, model.layout.numel).double()
    x = torch.randn(m, batch, *shape, dtype=torch.float64)
    grouped = _grads(model, params, x)
    assert not calls
    layers = conv_gemm.install(model.module)
    try:
        products = _grads(model, params, x)
    finally:
        conv_gemm.uninstall(model.module)
    assert layers > 0 and len(calls) == layers  # every eligible layer took the path, once
    again = _grads(model, params, x)
    for a, b, c in zip(grouped, products, again, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
        assert torch.equal(c, a)  # uninstalled: the grouped convolution again


def test_a_single_models_convolution_is_left_to_conv2d(monkeypatch):
    """Unbatched weights (one model, not a cohort) never take the im2col path."""
    conv = nn.Conv2d(2, 3, 3)
    conv_gemm.install(conv)
    monkeypatch.setattr(conv_gemm.torch, "einsum", lambda *a: pytest.fail("einsum called"))
    conv(torch.randn(1, 2, 5, 5))


def test_only_plain_zero_padded_convolutions_are_eligible():
    assert conv_gemm.eligible(nn.Conv2d(2, 3, 3))
    assert not conv_gemm.eligible(nn.Conv2d(2, 4, 3, groups=2))
    assert not conv_gemm.eligible(nn.Conv2d(2, 3, 3, padding="same"))
    assert not conv_gemm.eligible(nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"))
    assert not conv_gemm.eligible(nn.ConvTranspose2d(2, 3, 3))
    assert not conv_gemm.eligible(nn.Conv3d(2, 3, 3))


def test_the_memory_estimate_counts_the_receptive_fields_the_path_copies():
    """``client_step_bytes`` adds each layer's fields, kh·kw·C·L a sample, times its overhead."""
    from types import SimpleNamespace

    from fedexp.engine import memory
    from fedexp.models.task import ClassificationTask

    x, y = torch.randn(4, 1, 32, 32), torch.randint(0, 2, (4,))
    sizes = []
    for on in (False, True):
        model = FlatModel(_cnn(), torch.device("cpu"), channels_last=False, conv_gemm=on)
        assert model.conv_gemm is on
        ctx = SimpleNamespace(
            model=model, task=ClassificationTask(2), step_bytes={}, memory_budget=2**30
        )
        sizes.append(memory.client_step_bytes(ctx, x, y))
    # conv1: 1 channel, 5x5, 28x28 outputs; conv2: 16 channels, 5x5, 10x10 outputs; float32
    fields = 4 * (1 * 25 * 28 * 28 + 16 * 25 * 10 * 10) * 4
    assert abs(sizes[1] - sizes[0] - fields * memory.OVERHEAD) <= 1  # (int() of each sum)


def test_the_setting_does_nothing_where_cohorts_train_row_by_row():
    """On the CPU a convolutional model goes channels-last, one client at a time: no layer
    gets the path (and the memory estimate counts no fields)."""
    model = FlatModel(_cnn(), torch.device("cpu"), conv_gemm=True)
    assert model.channels_last and not model.conv_gemm
    assert not any("_conv_forward" in m.__dict__ for m in model.module.modules())
