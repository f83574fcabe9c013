"""Max-pooling before ReLU (fedexp.models.pool_first): the same values and gradients, bit for bit.

The rewrite rests on ReLU commuting with a maximum, values and gradients alike, also where a
window has ties, exact zeros or no positive entry; it is checked there on crafted tensors, then
on the models it rewrites (the peers' 2-conv CNN, VGG8 with and without BatchNorm: outputs,
every gradient and BatchNorm's running statistics equal to the original's), and the modules it
must leave as written are left.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch import nn

from fedexp.models.flat import FlatModel
from fedexp.models.pool_first import pool_first
from fedexp.models.vision import resnet9
from fedexp.models.vision import vgg8

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "peers"))


def _cnn() -> nn.Module:
    import common

    return common.make_model("cnn", 0)


@pytest.mark.parametrize("pool", ["2d", "1d", "3d-ceil-padded"])
def test_relu_commutes_with_max_pooling_in_values_and_gradients(pool):
    """Ties, zeros, windows without a positive entry: both orders give the same bits."""
    torch.manual_seed(0)
    if pool == "1d":
        x, f = torch.randn(3, 4, 17), lambda t: F.max_pool1d(t, 3)
    elif pool == "2d":
        x, f = torch.randn(3, 4, 8, 8), lambda t: F.max_pool2d(t, 2)
    else:
        x, f = torch.randn(2, 3, 5, 5, 5), lambda t: F.max_pool3d(t, 2, padding=1, ceil_mode=True)
    flat = x.view(-1)
    flat[::7] = 0.0  # exact zeros
    flat[1::5] = flat[::5]  # ties
    x[0] = -x[0].abs() - 0.1  # a sample whose windows have no positive entry
    g = torch.randn_like(f(x))
    outs = []
    for order in (lambda t: f(F.relu(t)), lambda t: F.relu(f(t))):
        xi = x.clone().requires_grad_(True)
        y = order(xi)
        outs.append((y, torch.autograd.grad(y, xi, g)[0]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])


def _relus_after_pools(module: fx.GraphModule) -> int:
    modules = dict(module.named_modules())

    def pool(node: fx.Node) -> bool:
        if node.op == "call_module":
            return isinstance(modules[str(node.target)], nn.MaxPool2d)
        return node.target is F.max_pool2d

    return sum(
        1
        for n in module.graph.nodes
        if n.op == "call_function" and n.target is F.relu and pool(n.args[0])
    )


CASES = {
    "cnn": (_cnn, (1, 32, 32), 2),
    "vgg8": (lambda: vgg8((3, 32, 32), 10, channels=(4, 4, 8, 8, 8), hidden=8), (3, 32, 32), 5),
    "vgg8-batchnorm": (
        lambda: vgg8((3, 16, 16), 10, channels=(4, 4, 8, 8, 8), hidden=8, norm="batch"),
        (3, 16, 16),
        4,
    ),
    # pFedSOP's ResNet-9: ConvBN (BatchNorm, nn.ReLU) then nn.MaxPool2d modules, three times
    "resnet9": (lambda: resnet9((3, 16, 16), 10, width=4), (3, 16, 16), 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_rewritten_model_gives_the_originals_outputs_gradients_and_statistics(case):
    build, shape, swaps = CASES[case]
    torch.manual_seed(0)
    original = build()
    rewritten = pool_first(build())
    assert isinstance(rewritten, fx.GraphModule) and _relus_after_pools(rewritten) == swaps
    rewritten.load_state_dict(original.state_dict())
    assert [n for n, _ in rewritten.named_parameters()] == [
        n for n, _ in original.named_parameters()
    ]
    x = torch.randn(6, *shape)
    for module in (original, rewritten):
        module.train()
    ya, yb = original(x), rewritten(x)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ga = torch.autograd.grad(ya, list(original.parameters()), g)
    gb = torch.autograd.grad(yb, list(rewritten.parameters()), g)
    for a, b in zip(ga, gb, strict=True):
        assert torch.equal(a, b)
    for (name, a), (_, b) in zip(
        original.named_buffers(), rewritten.named_buffers(), strict=True
    ):  # BatchNorm's running statistics, updated by the training forward passes
        assert torch.equal(a, b), name
    original.eval(), rewritten.eval()
    assert torch.equal(original(x), rewritten(x))


class _ReadsTheMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return x * 2 if self.training else x


class _TwoUses(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = F.relu(x)
        return F.max_pool2d(r, 2).sum() + r.sum()


class _Indices(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(F.relu(x), 2, return_indices=True)[0]


LEFT = {
    "no pooling (an MLP)": lambda: nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)),
    "a ReLU in place": lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(True), nn.MaxPool2d(2)),
    "a ReLU with another use": _TwoUses,
    "a pooling that returns its indices": _Indices,
    "a forward that reads the mode": _ReadsTheMode,
}


@pytest.mark.parametrize("case", sorted(LEFT))
def test_modules_it_must_not_rewrite_are_left_as_written(case):
    module = LEFT[case]()
    assert pool_first(module) is module


def test_modules_of_relu_and_max_pool_layers_are_rewritten_too():
    module = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
    rewritten = pool_first(module)
    assert isinstance(rewritten, fx.GraphModule)
    x = torch.randn(2, 1, 9, 9)
    assert torch.equal(rewritten(x), module(x))


def test_the_flat_model_runs_the_rewrite_with_the_originals_layout():
    torch.manual_seed(0)
    model = FlatModel(_cnn(), torch.device("cpu"))
    assert isinstance(model.module, fx.GraphModule)
    assert model.layout.names == tuple(n for n, _ in _cnn().named_parameters())
    assert torch.equal(model.initial(), FlatModel(_cnn(), torch.device("cpu")).initial())


def test_a_module_without_max_pooling_is_not_traced(monkeypatch):
    """No ``MaxPoolNd`` layer and no ``max_poolNd`` in any ``forward``: no trace is paid for."""
    import fedexp.models.pool_first as pf

    monkeypatch.setattr(pf.fx, "symbolic_trace", lambda m: pytest.fail("traced"))
    mlp = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    assert pool_first(mlp) is mlp
    with pytest.raises(pytest.fail.Exception):  # one that pools is traced
        pool_first(_TwoUses())
