"""Models for tabular data: logistic regression and a small MLP.

Builders take ``input_shape`` and ``num_classes`` from the dataset; binary logistic regression
has one output logit (the paper's model), multi-class has one per class (softmax regression).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated

import torch
from torch import nn
from torch.nn import functional as F

from fedexp.config.ranges import OpenFraction
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range

#: Hidden layers of :func:`mlp`: none would be logistic regression under other names.
HiddenLayers = Annotated[
    int, Range(ge=1, note="0 hidden layers is logistic regression: use model=logreg")
]


def logistic_regression(
    input_shape: Sequence[int], num_classes: PositiveInt, bias: bool = True
) -> nn.Module:
    """Logistic regression: one logit for two classes, ``num_classes`` logits otherwise.

    Args:
        input_shape: shape of one input (flattened).
        num_classes: number of classes C.
        bias: learn an intercept.
    """
    return LogisticRegression(math.prod(input_shape), 1 if num_classes == 2 else num_classes, bias)


#: layers with fewer outputs than this compute ``(W xᵀ)ᵀ`` (:func:`linear`)
NARROW = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x Wᵀ + b`` of one model or of m stacked ones.

    One model: ``x [B, in]``, ``weight [out, in]``; m stacked: ``x [m, B, in]``,
    ``weight [m, out, in]``, ``bias [m, out]``.

    A layer of fewer than :data:`NARROW` outputs (a logistic regression's logit, a few
    classes' scores) is computed as ``(W xᵀ)ᵀ``: its products are then a row (or a few) times
    a matrix, whose batched kernels are 1.4-5.6× faster on the CPU, forward and backward
    together, than the matrix times a column or a few that ``x Wᵀ`` makes (``torch.bmm`` of
    100 and 1,000 clients, 16 and 64 samples, 30 and 784 inputs; from 16 outputs on the two
    are within 10 %). The one-model form is the same expression, so :func:`torch.func.vmap`
    of a module (an algorithm's own objective) makes the same batched product as
    :func:`stacked_linear`, and their figures agree bit for bit. Stacked, the product is
    ``torch.bmm`` and a view of its result in its own shape: what ``@`` runs for two 3-D
    operands, without its four expansions and reshapes (a step of a logistic regression's
    cohort of 100 clients 5 % shorter); the view is kept because its backward hands bmm's
    the gradient in the strides ``@``'s does, so the same GEMM kernel runs (a gradient
    without it differs from vmap's in the last bits). Wider layers are
    ``F.linear``, of which vmap makes ``x Wᵀ`` then the bias: what :func:`stacked_linear`
    computes for them.
    """
    stacked = weight.dim() == 3
    if weight.shape[-2] < NARROW:
        if stacked:  # what ``@`` runs, without its expansions: bmm, then a view of its shape
            wx = torch.bmm(weight, x.transpose(1, 2))
            wx = wx.view(wx.shape)  # backward: bmm's gradient in the strides ``@`` gives it
        else:
            wx = weight @ x.transpose(-1, -2)
        out = wx.transpose(-1, -2)
    elif stacked:
        out = torch.bmm(x, weight.transpose(1, 2))
    else:
        return F.linear(x, weight, bias)
    if bias is None:
        return out
    return out + (bias.unsqueeze(1) if stacked else bias)


def stacked_linear(params: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` ``name`` of m stacked models on their inputs ``x`` ``[m, B, in]``.

    :func:`linear` of the stacked weights.
    """
    return linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))


class Linear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear` (a narrow layer as ``(W xᵀ)ᵀ``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b``."""
        return linear(x, self.weight, self.bias)


class LogisticRegression(nn.Module):
    """``linear(flatten(x))``: parameters ``linear.weight`` and ``linear.bias``."""

    #: :meth:`stacked_forward` holds (:attr:`fedexp.models.flat.FlatModel.stacks`)
    stacks = True

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.linear = Linear(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the flattened input."""
        return self.linear(x.flatten(1))

    def stacked_forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits of m stacked models (``params``: ``[m, *shape]``) on ``x`` ``[m, B, ...]``."""
        return stacked_linear(params, "linear", x.flatten(2))


def mlp(
    input_shape: Sequence[int],
    num_classes: PositiveInt,
    hidden: PositiveInt = 64,
    layers: HiddenLayers = 1,
    dropout: OpenFraction = 0.0,
    norm: str = "none",
) -> nn.Module:
    """A small ReLU MLP; its last layer is named ``head`` (the natural personal part).

    Args:
        input_shape: shape of one input (flattened).
        num_classes: number of classes C.
        hidden: width of the hidden layers, ≥ 1.
        layers: number of hidden layers, ≥ 1 (none is ``model=logreg``).
        dropout: dropout rate after each hidden layer, in [0, 1).
        norm: "none" or "batch" (BatchNorm1d after each hidden linear layer, running
            statistics kept per client: the tabular test bed of FedBN).
    """
    if norm not in ("none", "batch"):
        raise ValueError(f"norm={norm!r}: expected 'none' or 'batch'")
    blocks: list[nn.Module] = []
    width = math.prod(input_shape)
    # fedexp's layers where the model stacks (linear layers and ReLUs: BodyHead.stacks), else
    # torch's own: a BatchNorm model's figures hang on the float order of its layers (golden)
    layer = Linear if norm == "none" and dropout == 0 else nn.Linear
    for _ in range(layers):
        blocks.append(layer(width, hidden))
        if norm == "batch":
            blocks.append(nn.BatchNorm1d(hidden))
        blocks.append(nn.ReLU())
        if dropout > 0:
            blocks.append(nn.Dropout(dropout))
        width = hidden
    body = nn.Sequential(*blocks)
    out = 1 if num_classes == 2 else num_classes
    return BodyHead(body, layer(width, out))


class BodyHead(nn.Module):
    """``body`` then ``head``: names that shared/personal patterns can match."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head
        #: fedexp's linear layers (:class:`Linear`) and ReLUs only, no dropout nor BatchNorm:
        #: :meth:`stacked_forward` then computes what the modules do, bit for bit (torch's
        #: ``nn.Linear`` computes a narrow layer in the other orientation: :func:`linear`)
        self.stacks = isinstance(head, Linear) and all(
            isinstance(m, Linear | nn.ReLU) for m in body.children()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Flatten the input, then body and head."""
        return self.head(self.body(x.flatten(1)))

    def stacked_forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Logits of m stacked models (``params``: ``[m, *shape]``) on ``x`` ``[m, B, ...]``.

        Where :attr:`stacks` (linear layers and ReLUs).
        """
        h = x.flatten(2)
        for name, layer in self.body.named_children():
            linear = isinstance(layer, nn.Linear)
            h = stacked_linear(params, f"body.{name}", h) if linear else h.relu()
        return stacked_linear(params, "head", h)
