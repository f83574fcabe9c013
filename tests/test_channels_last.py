"""Channels-last convolutions on the CPU (issue 14): FlatModel hands 2-D (and 3-D)
convolution weights over in NHWC (NDHWC) strides, with the same outputs and gradients as NCHW;
stacked training then computes gradients client by client, equal to the vmapped computation."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import grad_and_value
from torch.func import vmap

from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.steps import _rowwise
from fedexp.models.flat import FlatModel
from fedexp.models.flat import _nhwc
from fedexp.models.vision import vgg8

CPU = torch.device("cpu")


def _net() -> nn.Module:
    torch.manual_seed(0)
    # one input channel first (NCHW and NHWC share the data order: only the strides differ)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 3),
    )


def test_the_rule_cpu_and_a_conv2d():
    assert FlatModel(_net(), CPU).channels_last
    assert not FlatModel(_net(), CPU, channels_last=False).channels_last
    assert not FlatModel(nn.Linear(4, 2), CPU).channels_last
    assert not FlatModel(nn.Linear(4, 2), CPU, channels_last=True).channels_last  # no conv


def test_nhwc_strides_and_values():
    for shape in ((4, 1, 3, 3), (6, 4, 3, 3), (2, 3, 1, 5)):
        w = torch.randn(shape)
        v = _nhwc(w)
        assert torch.equal(v, w)
        assert v.stride()[1] == 1 and v.stride() == (w[0].numel(), 1, shape[3] * shape[1], shape[1])
        assert v.is_contiguous(memory_format=torch.channels_last)


def test_the_module_sees_channels_last_weights_and_gives_the_nchw_results():
    net = _net()
    seen = []
    for conv in (net[0], net[3]):
        conv.register_forward_pre_hook(
            lambda m, _: seen.append(m.weight.is_contiguous(memory_format=torch.channels_last))
        )
    nhwc, nchw = FlatModel(net, CPU), FlatModel(net, CPU, channels_last=False)
    flat = nhwc.initial().requires_grad_(True)
    x = torch.randn(5, 1, 8, 8)
    out = nhwc(flat, x)
    assert seen == [True, True]
    (g_cl,) = torch.autograd.grad(out.square().sum(), flat)
    seen.clear()
    ref = nchw(flat, x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), flat)
    assert seen[0] is True and seen[1] is False  # NCHW: only the 1-channel weight is ambiguous
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_cl, g_ref, rtol=1e-4, atol=1e-6)
    assert not torch.equal(g_cl, torch.zeros_like(g_cl))


def test_rowwise_gradients_equal_vmapped_ones():
    model = FlatModel(vgg8([1, 8, 8], 3, channels=(4, 4, 4, 4, 4), hidden=8), CPU)

    def loss(p, x, y, aux, u):
        logits = model(p, x)
        prox = aux["mu"] * (p - aux["anchor"]).square().sum()
        value = nn.functional.cross_entropy(logits, y) + prox
        return value, p.detach() * 2

    m, d = 3, model.layout.numel
    params = model.initial().expand(m, d) + 0.01 * torch.randn(m, d)
    x, y = torch.randn(m, 6, 1, 8, 8), torch.randint(0, 3, (m, 6))
    aux = {"mu": torch.tensor([0.0, 0.1, 0.5]), "anchor": torch.randn(m, d)}
    u = torch.zeros(m, 0)
    ctx = Context(
        model, None, num_clients=m, lr=0.1, local_steps=1, local_epochs=None, batch_size=6
    )
    g_row, (v_row, post_row) = _rowwise(ctx, Objective(loss), posts=True)(params, x, y, aux, u)
    g_vm, (v_vm, post_vm) = vmap(grad_and_value(loss, has_aux=True))(params, x, y, aux, u)
    torch.testing.assert_close(g_row, g_vm, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(v_row, v_vm)
    torch.testing.assert_close(post_row, post_vm)
    assert _rowwise(ctx, Objective(loss), posts=False)(params, x, y, aux, u)[1][1] is None


def test_3d_convolutions_get_channels_last_3d_weights_and_the_ncdhw_results():
    """The same for Conv3d (cubes, ``dataset.dims=3``): weights in channels-last-3d strides,
    outputs and gradients those of NCDHW; such a model then also goes row by row."""
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Conv3d(2, 4, 3), nn.ReLU(), nn.Conv3d(4, 3, 2), nn.Flatten(), nn.Linear(3 * 27, 2)
    )
    for shape in ((4, 2, 3, 3, 3), (3, 1, 2, 3, 4)):
        w = torch.randn(shape)
        v = _nhwc(w)
        assert torch.equal(v, w) and v.is_contiguous(memory_format=torch.channels_last_3d)
    seen = []
    net[0].register_forward_pre_hook(
        lambda m, _: seen.append(m.weight.is_contiguous(memory_format=torch.channels_last_3d))
    )
    last, plain = FlatModel(net, CPU), FlatModel(net, CPU, channels_last=False)
    assert last.channels_last and not plain.channels_last
    flat = last.initial().requires_grad_(True)
    x = torch.randn(3, 2, 6, 6, 6)
    out = last(flat, x)
    (g_last,) = torch.autograd.grad(out.square().sum(), flat)
    ref = plain(flat, x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), flat)
    assert seen == [True, False]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_last, g_ref, rtol=1e-4, atol=1e-6)
