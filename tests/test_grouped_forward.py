"""A cohort's VGG8 on the grouped layout (``fedexp.models.grouped``, issue 69).

The vmapped path (a GPU's, and a CPU's with ``channels_last=False``) computes a VGG8 cohort's
logits by its own grouped forward pass instead of ``vmap(functional_call)``: the logits and a
step's gradients must be vmap's to rounding, for whole and short (padded) batches, a cohort
of one and of five, float64 and float32, several VGG8 shapes; FedAvg rounds equal vmap's,
eager and replayed through the captured solver's static buffers; a model it does not handle
(BatchNorm, ``conv_gemm``, channels-last, another kind of layer) stays vmap's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.func import vmap

from fedexp.engine.runner import build_engine
from fedexp.engine.solver import steps
from fedexp.engine.solver.capture import CapturedSolver
from fedexp.engine.solver.objective import Objective
from fedexp.models.flat import FlatModel
from fedexp.models.grouped import stacks_vgg8
from fedexp.models.task import PADDING
from fedexp.models.task import ClassificationTask
from fedexp.models.vision import vgg8

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
#: (input shape, channels, hidden): the census's small VGG on 8x8 digits (three pools, the
#: narrow linear layers), a wider one on 3x16x16 (four pools, wide layers), and one whose last
#: map is 1x4 (the adaptive average pool taken)
CONFIGS = {
    "census": ((1, 8, 8), [4, 4, 4, 4, 4], 8),
    "rgb16": ((3, 16, 16), [3, 5, 6, 4, 7], 20),
    "strip": ((2, 2, 8), [2, 3, 4, 5, 6], 16),
}
#: float64: 1e-10 relative; float32: 1e-5
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}
CLASSES = 10


def _model(config: str, dtype: torch.dtype) -> FlatModel:
    shape, channels, hidden = CONFIGS[config]
    torch.manual_seed(0)
    module = vgg8(shape, CLASSES, channels=channels, hidden=hidden).to(dtype)
    return FlatModel(module, CPU, channels_last=False)


def _cohort(model: FlatModel, config: str, m: int, dtype: torch.dtype, batch: int = 6):
    gen = torch.Generator().manual_seed(m)
    x0 = model.initial()
    params = x0 + 0.05 * torch.randn(m, x0.numel(), generator=gen, dtype=dtype)
    x = torch.randn(m, batch, *CONFIGS[config][0], generator=gen, dtype=dtype)
    y = torch.randint(0, CLASSES, (m, batch), generator=gen)
    return params, x, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_grouped_logits_are_vmaps(config, m, dtype):
    model = _model(config, dtype)
    assert model.stacks and isinstance(model.module, torch.fx.GraphModule)  # pool_first kept it
    params, x, _ = _cohort(model, config, m, dtype)
    got = model.forward_stacked(params, x)
    want = vmap(model)(params, x)
    assert got.shape == want.shape == (m, x.shape[1], CLASSES)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("full", [True, False], ids=["full", "masked"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_a_steps_gradients_are_vmaps(config, m, full, dtype):
    """The solver's vmapped path (``steps._vmapped``): the stacked objective's losses and
    gradients equal ``vmap`` of the one-client loss's."""
    model, task = _model(config, dtype), ClassificationTask(CLASSES)
    params, x, y = _cohort(model, config, m, dtype)
    if not full:
        y[0, 4:] = PADDING  # a short batch

    def loss(p, xb, yb, aux, u):  # noqa: ANN001, ANN202
        return task.loss(model(p, xb), yb), p.detach()

    def stacked(p, xb, yb, aux, u, whole=False):  # noqa: ANN001, ANN202
        return task.loss_stacked(model.forward_stacked(p, xb), yb, whole), p

    obj = Objective(loss, stacked=stacked)
    u = torch.zeros(m, 0, dtype=dtype)
    grads, (values, _) = steps._vmapped(obj)(params, x, y, {}, u, full)
    ref_g, (ref_v, _) = steps._vmapped(replace(obj, stacked=None))(params, x, y, {}, u, full)
    assert grads.abs().sum() > 0
    torch.testing.assert_close(values, ref_v, **TOL[dtype])
    torch.testing.assert_close(grads, ref_g, **TOL[dtype])


def test_grouped_params_are_each_clients_entries():
    """Each entry in the grouped layout holds the clients' own coordinates, in client order,
    and the gradient of each comes back to its place in the flat vector."""
    model = _model("rgb16", torch.float64)
    m, d = 3, model.layout.numel
    flat = torch.arange(m * d, dtype=torch.float64).view(m, d).requires_grad_(True)
    params = model.module.stacked_params(model.layout, flat)
    rows = model.layout.unflatten_rows(flat.detach())
    assert list(params) == list(rows)
    for name, t in params.items():
        assert torch.equal(t.reshape(-1), rows[name].reshape(-1)), name
    assert params["conv2.weight"].shape == (m * 5, 3, 3, 3)
    assert params["fc1.bias"].shape == (m, 20, 1)
    total = sum((t * (k + 1)).sum() for k, t in enumerate(params.values()))
    (grad,) = torch.autograd.grad(total, flat)
    want = torch.cat([torch.full_like(rows[n].reshape(m, -1), k + 1) for k, n in
                      enumerate(params)], 1)  # fmt: skip
    assert torch.equal(grad, want)


def test_a_stack_in_other_strides_gives_the_same_logits():
    """Parameters in column-major order (a transposed copy's) and one vector expanded to
    every client give the contiguous stack's logits (to rounding: other product kernels)."""
    model = _model("census", torch.float64)
    params, x, _ = _cohort(model, "census", 5, torch.float64)
    want = model.forward_stacked(params, x)
    columns = params.t().contiguous().t()
    assert not columns.is_contiguous()
    torch.testing.assert_close(model.forward_stacked(columns, x), want, **TOL[torch.float64])
    one = params[2].expand(5, -1)
    torch.testing.assert_close(
        model.forward_stacked(one, x),
        model.forward_stacked(params[2:3].repeat(5, 1), x),
        **TOL[torch.float64],
    )


def test_models_it_does_not_handle_stay_vmapped():
    """BatchNorm, channels-last (the CPU's row by row), ``conv_gemm`` and a layer of another
    kind keep ``vmap(functional_call)``."""
    shape, channels, hidden = CONFIGS["census"]
    batch = vgg8(shape, CLASSES, channels=channels, hidden=hidden, norm="batch")
    assert not stacks_vgg8(batch) and not FlatModel(batch, CPU, channels_last=False).stacks
    plain = vgg8(shape, CLASSES, channels=channels, hidden=hidden)
    assert FlatModel(plain, CPU, channels_last=False).stacks
    assert not FlatModel(plain, CPU).stacks  # the CPU's default: channels-last, row by row
    assert not FlatModel(plain, CPU, channels_last=False, conv_gemm=True).stacks
    plain.conv2 = torch.nn.Conv2d(channels[0], channels[1], 3, padding=1, padding_mode="circular")
    assert not stacks_vgg8(plain)


#: the round census's FedAvg case of the small VGG (``tests/test_round_census.py``)
VGG = ["algorithm=fedavg", "dataset=digits", "partition=iid", "num_clients=4", "model=vgg8",
       "model.channels=[4,4,4,4,4]", "model.hidden=8", "tracker=none"]  # fmt: skip


@pytest.fixture
def vmapped(monkeypatch):
    """Every FlatModel's cohorts vmapped as on a GPU (``channels_last=False``)."""
    made = FlatModel.__init__

    def init(self, module, device, channels_last=None, conv_gemm=False):  # noqa: ANN001, ANN202
        made(self, module, device, channels_last=False, conv_gemm=conv_gemm)

    monkeypatch.setattr(FlatModel, "__init__", init)


@pytest.mark.usefixtures("vmapped")
def test_rounds_are_vmaps_and_replay_through_static_buffers(small_cfg):
    """FedAvg rounds of the small VGG on the grouped forward equal vmap's (1e-5 relative),
    and replayed through the captured solver's static buffers (on the CPU without graphs)
    they equal the eager ones (1e-6)."""

    def engine(solver=None, stacks=True):  # noqa: ANN001, ANN202
        out = build_engine(small_cfg(*VGG))
        if solver is not None:
            out.ctx.solver = solver
        out.ctx.model.module.stacks = stacks
        out.setup()
        return out

    captured = CapturedSolver(graphs=False)
    grouped, plain, replayed = engine(), engine(stacks=False), engine(captured)
    assert grouped.ctx.model.stacks and not plain.ctx.model.stacks
    assert grouped.ctx.model_objective().stacked is not None
    for _ in range(2):
        a, b, c = grouped.run_round(), plain.run_round(), replayed.run_round()
        losses = [k for k, v in a.items() if k.startswith("train") and isinstance(v, float)]
        assert losses and a.keys() == b.keys() == c.keys()
        for key in losses:
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
            assert c[key] == pytest.approx(a[key], rel=1e-6), key
    assert len(captured.cache) >= 1, "no call took the static path"
    assert grouped.ctx.vmap_ok and replayed.ctx.vmap_ok
    for key, value in grouped.server.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(plain.server[key], value, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(replayed.server[key], value, rtol=1e-6, atol=1e-7)
