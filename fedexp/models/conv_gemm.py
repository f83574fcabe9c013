"""A cohort's 2-D convolutions as matrix products (im2col), for the GPU.

Under :func:`torch.func.vmap` a convolution of per-client weights becomes one grouped
convolution, a group a client. cuDNN runs such a convolution as a kernel a group: the device
check's profile of one CNN round of 100 clients on an H200 (2026-11-29) launched 200 forward
and 200 input-gradient kernels for 100 clients' two steps, and 802 layout transposes, 20
kernels a client in all. Written as ``unfold`` (im2col) and a matrix product, the same
convolution takes a few kernels whatever the cohort: each client's receptive fields, copied
once into a ``[B·L, C·kh·kw]`` matrix (L output positions), times its ``[C·kh·kw, O]``
weight matrix, one batched product for the cohort; autograd's backward is two batched
products and the unfold's backward. The price is memory: the fields hold kh·kw copies of
the input.

Only convolutions whose weight is batched (a cohort's, under vmap) take this path; a single
model's go to ``F.conv2d`` as before. :func:`install` sets it on a module's ``Conv2d``
layers (zero padding, one group); :func:`uninstall` takes it off. The run setting
``conv_gemm`` (off by default) installs it (:class:`fedexp.models.flat.FlatModel`).

Measured on an H200 (2026-11-29; docs/benchmarks.md; the device check's ``conv_gemm`` step): the
2-conv CNN's round 1.52× the grouped convolutions' client updates/s at 100 clients and 1.75×
at 1,000; MONAI's 2-D U-Net 0.90× and 1.01×. On the CPU a model with convolutions trains row
by row (channels-last, :mod:`fedexp.models.flat`), where weights are never batched, so the
setting changes nothing there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

try:  # functorch's own test of a vmapped tensor (what torch.func's Python code calls)
    from torch._C._functorch import is_batchedtensor as _is_batched
except ImportError:  # pragma: no cover - a torch without it: never the matrix-product path

    def _is_batched(tensor: torch.Tensor) -> bool:
        return False


def _forward(
    conv: nn.Conv2d, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``conv``'s convolution of ``x``: a matrix product where ``weight`` is a cohort's.

    The receptive fields are a view (``Tensor.unfold`` along height and width, no copy);
    ``einsum`` copies them once into the product's layout. ``F.unfold`` would copy them
    too, but ATen's CUDA ``im2col`` and ``col2im`` launch a kernel a sample: on the H200 a
    CNN round of 100 clients ran at 1,568 client updates/s that way, against 3,625 grouped.
    """
    if not _is_batched(weight) or x.dim() != 4:
        return nn.Conv2d._conv_forward(conv, x, weight, bias)
    _, _, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = conv.stride, conv.padding, conv.dilation
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    fields = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)
    if dh > 1 or dw > 1:
        fields = fields[..., ::dh, ::dw]
    out = torch.einsum("bchwij,ocij->bohw", fields, weight)  # [B, O, H', W']
    return out if bias is None else out + bias[:, None, None]


def eligible(conv: nn.Module) -> bool:
    """Whether ``conv`` is a ``Conv2d`` this path computes (zero padding as numbers, one group)."""
    return (
        type(conv) is nn.Conv2d
        and conv.groups == 1
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
    )


def install(module: nn.Module) -> int:
    """Send ``module``'s eligible ``Conv2d`` layers' cohort convolutions through im2col.

    Returns:
        How many layers now take the path.
    """
    count = 0
    for sub in module.modules():
        if eligible(sub):
            sub._conv_forward = partial(_forward, sub)  # an instance attribute: the layer's alone
            count += 1
    return count


@contextmanager
def counting_fields(module: nn.Module) -> Iterator[list[int]]:
    """Inside: the bytes of the field matrices the path saves, a convolution of ``module`` run.

    The receptive fields of a cohort's convolution are copied once and kept for the backward
    pass (what the memory budget's estimate of a client's step, measured on one unbatched
    model, would not see): kh·kw·C·L numbers a sample, L the output positions.
    """
    sizes: list[int] = []

    def hook(conv: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        x = inputs[0]
        if x.dim() == 4:
            _, channels, kh, kw = conv.weight.shape
            positions = output.shape[-2] * output.shape[-1]
            sizes.append(x.shape[0] * channels * kh * kw * positions * x.element_size())

    installed = [m for m in module.modules() if "_conv_forward" in m.__dict__]
    handles = [m.register_forward_hook(hook) for m in installed]
    try:
        yield sizes
    finally:
        for handle in handles:
            handle.remove()


def uninstall(module: nn.Module) -> None:
    """Every ``Conv2d`` of ``module`` back to ``F.conv2d``."""
    for sub in module.modules():
        if isinstance(sub, nn.Conv2d):
            sub.__dict__.pop("_conv_forward", None)
