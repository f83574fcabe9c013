"""A cohort's VGG forward pass on the grouped layout, without vmap (issue 69).

Under :func:`torch.func.vmap` a convolution of m clients' weights becomes one grouped
convolution (a group a client), but vmap's batching rule moves every layer's input and output
between the batched layout ``[m, B, C, H, W]`` and the grouped one ``[B, m·C, H, W]`` and back,
forward and backward: of the 323 operations a local step of the census's small VGG took
(``tests/test_round_census.py``, ``STEP_OPS``), about 110 were those permutes, copies and
views, and 35 the parameters' views. Here the activations stay in the grouped layout from the
first convolution to the last (:func:`grouped_vgg8`):

* the parameters: one ``split`` of the ``[m, d]`` stack and a view of each entry
  (:func:`grouped_params`): a convolution's weight ``[m·O, I, kh, kw]`` and bias ``[m·O]``
  (``F.conv2d`` with ``groups=m``; a copy of the entry's columns), a linear layer's weight
  ``[m, O, I]`` and bias ``[m, O, 1]`` (one ``torch.baddbmm`` a layer);
* ReLU (as ``threshold``, which keeps its input for the backward pass, not its output: no
  detached copy either way) and 2x2 max-pooling act on the grouped layout as they are;
* the features go to the linear layers once, transposed ``[m, F, B]``, and stay so through
  them (``W hᵀ + b``: no transposed weights); the logits come back as ``[m, B, K]``.

Autograd makes the backward pass. The same values as vmap's up to rounding (the convolutions
are the same grouped ones; the linear layers' products may sum in another order):
``tests/test_grouped_forward.py`` holds the logits and a step's gradients to vmap's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_params(layout, flat: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The m clients' parameters ``flat`` ``[m, d]`` (of ``layout``) as :func:`grouped_vgg8` reads.

    One ``split`` of the rows, then a view of each entry: a convolution's weight
    ``[m·O, I, kh, kw]`` and bias ``[m·O]`` (a group a client: a copy of the entry's columns,
    the clients one after the other), a linear layer's weight ``[m, O, I]`` and bias
    ``[m, O, 1]`` (views of the rows). The backward pass is a view of each gradient and one
    concatenation (the split's).
    """
    m = flat.shape[0]
    sizes = [int(torch.Size(shape).numel()) for shape in layout.shapes]
    parts = torch.split(flat, sizes, dim=1)
    out = {}
    for name, shape, part in zip(layout.names, layout.shapes, parts, strict=True):
        if name.startswith("fc"):
            out[name] = part.reshape(m, *shape) if len(shape) == 2 else part.reshape(m, shape[0], 1)
        else:  # a convolution's: its clients' groups one after the other
            out[name] = part.contiguous().view(m * shape[0], *shape[1:])
    return out


def stacks_vgg8(module: nn.Module) -> bool:
    """Whether :func:`grouped_vgg8` computes ``module``'s forward pass.

    A VGG8 without BatchNorm, its convolutions zero-padded in one group each (the clients'
    groups are the grouped layout's), its linear layers ``nn.Linear`` with biases, every
    parameter trained (each is an entry of the flat vector).
    """
    if getattr(module, "batch_norm", True) or not all(p.requires_grad for p in module.parameters()):
        return False
    convs = [getattr(module, f"conv{k}", None) for k in range(1, len(module.pools) + 1)]
    fcs = [getattr(module, f"fc{k}", None) for k in (1, 2, 3)]
    return all(
        type(c) is nn.Conv2d and c.padding_mode == "zeros" and c.groups == 1 for c in convs
    ) and all(type(f) is nn.Linear and f.bias is not None for f in fcs)


def _relu(h: torch.Tensor) -> torch.Tensor:
    """``relu(h)`` as ``threshold``, the same values and gradient (``threshold_backward`` at 0).

    ``threshold`` keeps its input for the backward pass; ``relu`` keeps its output, a detached
    copy dispatched in each pass.
    """
    return torch.threshold(h, 0.0, 0.0)


def grouped_vgg8(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor):
    """Logits ``[m, B, K]`` of m VGG8s (``params``: :func:`grouped_params`'s) on ``x``.

    ``x`` ``[m, B, C, H, W]``; ``module`` a :class:`fedexp.models.vision.VGG8` without
    BatchNorm (:func:`stacks_vgg8`), read for its layers' settings only. Each stage is its
    convolution, its 2x2 max-pooling where the map is pooled, then the ReLU (pooling first is
    exact: :mod:`fedexp.models.pool_first`); the adaptive average pool of a 1x1 map, the map
    itself, is left out.
    """
    m, b = x.shape[:2]
    h = x.transpose(0, 1).reshape(b, -1, *x.shape[3:])  # [B, m·C, H, W]
    for k, pool in enumerate(module.pools, start=1):
        conv = getattr(module, f"conv{k}")
        h = F.conv2d(
            h,
            params[f"conv{k}.weight"],
            params.get(f"conv{k}.bias"),
            conv.stride,
            conv.padding,
            conv.dilation,
            m,
        )
        if pool:
            h = F.max_pool2d(h, 2)
        h = _relu(h)
    if h.shape[-2:] != (1, 1):
        h = F.adaptive_avg_pool2d(h, 1)
    h = h.view(b, m, -1).permute(1, 2, 0)  # [m, F, B]
    for k in (1, 2):
        h = _relu(torch.baddbmm(params[f"fc{k}.bias"], params[f"fc{k}.weight"], h))
    return torch.baddbmm(params["fc3.bias"], params["fc3.weight"], h).transpose(1, 2)
