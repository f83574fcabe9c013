"""The local solver (fedexp.engine.solver.steps, issue 22): how a cohort's steps execute is its
business. Row by row and vmapped give the same models; a loss vmap refuses is rerun row by row
with the same draws; BatchNorm statistics follow every step; clients whose step counts differ
run in sub-cohorts, each client its own count."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fedexp.engine.runner import build_engine
from helpers import solo

pytestmark = pytest.mark.usefixtures("one_thread")


def _rounds(engine, rounds=2):
    engine.setup()
    return [engine.run_round() for _ in range(rounds)]


def _assert_same_states(a, b, **tol):
    for key in a.server:
        torch.testing.assert_close(b.server[key], a.server[key], **tol)
    for sa, sb in zip(a.client_states, b.client_states, strict=True):
        assert sorted(sa) == sorted(sb)
        for key in sa:
            torch.testing.assert_close(sb[key], sa[key], **tol)


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm=fedavg", "optimizer=adam"),
        ("algorithm=ditto", "algorithm.lam=0.5", "model=mlp", "model.hidden=8"),
        ("algorithm=superfed", "algorithm.warmup_rounds=0"),  # noise from the streams
    ],
    ids=["fedavg-adam", "ditto-mlp", "superfed-noise"],
)
def test_row_by_row_equals_vmapped(small_cfg, overrides):
    vmapped = build_engine(small_cfg(*overrides))
    rows = build_engine(small_cfg(*overrides))
    rows.ctx.vmap_ok = False  # what a model vmap refuses runs
    _rounds(vmapped)
    _rounds(rows)
    assert vmapped.ctx.vmap_ok and not rows.ctx.vmap_ok
    _assert_same_states(vmapped, rows, rtol=1e-5, atol=1e-6)


def test_a_loss_vmap_refuses_is_rerun_row_by_row_with_the_same_draws(small_cfg):
    """An in-place op vmap refuses (MONAI's one_hot does this): the cohort's steps are rerun
    row by row from the same draws; the run then stays row by row."""

    def patch(engine):
        original = engine.ctx.task.loss

        def loss(logits, y):
            onehot = torch.zeros(y.shape[0], 2)
            onehot.scatter_(1, y[:, None].long(), 1.0)  # not vmappable: y batched, onehot not
            return original(logits, y) + 0.0 * onehot.sum()

        engine.ctx.task.loss = loss
        engine.ctx.model.module.stacks = False  # the loss through vmap, not the stacked forward
        return engine

    refused = patch(build_engine(small_cfg("optimizer=sgd", "optimizer.momentum=0.9")))
    rows = patch(build_engine(small_cfg("optimizer=sgd", "optimizer.momentum=0.9")))
    rows.ctx.vmap_ok = False
    plain = build_engine(small_cfg("optimizer=sgd", "optimizer.momentum=0.9"))
    for engine in (refused, rows, plain):
        _rounds(engine)
    assert refused.ctx.vmap_ok is False
    _assert_same_states(rows, refused, rtol=0, atol=0)  # the same draws, the same path
    _assert_same_states(plain, refused, rtol=1e-5, atol=1e-6)


def test_batchnorm_statistics_follow_each_step(small_cfg):
    """Running statistics are coordinates of the flat vector: the solver writes the forward
    pass's values after every step (row by row), and they differ between clients."""
    engine = build_engine(small_cfg("algorithm=local", "model=mlp", "model.hidden=8",
                                    "model.norm=batch"))  # fmt: skip
    x0 = engine.x0.clone()
    _rounds(engine, 1)
    buffers = engine.ctx.model.buffer_mask
    thetas = torch.stack([s["theta"] for s in engine.client_states])
    assert buffers.any()
    assert not torch.equal(thetas[:, buffers], x0[buffers].expand(len(thetas), -1))
    assert not torch.equal(thetas[0, buffers], thetas[1, buffers])


def test_clients_with_different_step_counts_run_in_sub_cohorts(small_cfg):
    """``local_epochs`` on unequal splits: each client takes its own ``steps_for`` steps, its
    sub-cohort of clients with the same count as one computation."""
    engine = build_engine(small_cfg("local_epochs=1", "algorithm=local"))
    seen = []
    hook = engine.algorithm.client_update

    def spy(ctx, model_in, states, cohort):
        seen.append((list(cohort.clients), ctx.cohort_steps(cohort)))
        result = hook(ctx, model_in, states, cohort)
        assert cohort.draws.tolist() == [ctx.cohort_steps(cohort)] * len(cohort)
        return result

    engine.algorithm.client_update = spy
    _rounds(engine, 1)
    steps = {n: engine.ctx.steps_for(c) for n, c in enumerate(engine.clients)}
    assert len(set(steps.values())) > 1 and len(seen) == len(set(steps.values()))
    assert sorted(n for clients, _ in seen for n in clients) == list(range(5))
    for clients, count in seen:
        assert all(steps[n] == count for n in clients)


def test_a_cohort_of_one_takes_the_steps_a_plain_loop_takes(small_cfg):
    """The solver's SGD on one client equals plain torch: minibatches drawn from the client's
    stream, loss.backward, p -= lr·grad."""
    from fedexp.engine.solver import passes

    engine = build_engine(small_cfg("model=mlp", "model.hidden=8"))
    ctx, data = engine.ctx, engine.clients[2]
    cohort = solo(data, key=12345)
    out = ctx.train(engine.x0[None], cohort, steps=4, lr=0.1)
    assert cohort.draws.tolist() == [4]
    p = engine.x0.clone()
    stream = passes.Stream(12345)
    for _ in range(4):
        idx = stream.indices(ctx.batch_size, data.num_train)
        q = p.detach().requires_grad_(True)
        loss = ctx.task.loss(ctx.model(q, data.x_train[idx]), data.y_train[idx])
        loss.backward()
        p = p - 0.1 * q.grad
    torch.testing.assert_close(out.params[0], p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("objective", ["model", "proximal"])
def test_one_backward_of_the_summed_losses_is_each_clients_gradient(small_cfg, objective):
    """The vmapped path's gradients (``steps._vmapped``): client i's loss depends on its row
    alone, so the gradient of the summed losses is, row by row, each client's gradient. Checked
    against each row's own autograd and functorch's ``vmap(grad_and_value)``, on a BatchNorm
    model (statistics of the valid rows returned as ``post``) with a short batch, and on an
    objective with stacked ``aux`` tensors."""
    from torch.func import grad_and_value
    from torch.func import vmap

    from fedexp.engine.solver import steps
    from fedexp.models.task import PADDING

    engine = build_engine(small_cfg("model=mlp", "model.hidden=8", "model.norm=batch"))
    ctx, m = engine.ctx, 4
    gen = torch.Generator().manual_seed(0)
    params = engine.x0 + 0.1 * torch.randn(m, engine.x0.numel(), generator=gen)
    obj = ctx.model_objective()
    aux = {}
    if objective == "proximal":
        obj = ctx.proximal_objective(engine.x0, 0.5)
        aux = {"anchor": params.flip(0), "mu": torch.full((m,), 0.5)}
    data = engine.clients[0]
    x = data.x_train[:32].expand(m, -1, -1) + 0.1 * torch.randn(m, 32, 30, generator=gen)
    y = data.y_train[:32].expand(m, -1).clone()
    y[1, 25:] = PADDING  # a short batch
    u = torch.zeros(m, 0)
    grads, (values, posts) = steps._vmapped(obj)(params, x, y, aux, u)
    ref_g, (ref_v, ref_p) = vmap(grad_and_value(obj.loss, has_aux=True))(params, x, y, aux, u)
    torch.testing.assert_close(grads, ref_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values, ref_v)
    torch.testing.assert_close(posts, ref_p)
    for i in range(m):
        row = replace(obj, aux={k: v[i] for k, v in aux.items()})
        keep = int((y[i] != PADDING).sum())
        v, g, post = ctx.loss_grad_post(row, params[i], x[i, :keep], y[i, :keep], None)
        torch.testing.assert_close(grads[i], g, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(values[i], v)
        torch.testing.assert_close(posts[i], post)
    assert not values.requires_grad and not grads.requires_grad


@pytest.mark.parametrize("objective", ["model", "proximal"])
@pytest.mark.parametrize(
    "model",
    [
        ("model=logreg",),
        ("model=logreg", "dataset=digits", "partition=dirichlet"),  # softmax regression
        ("model=mlp", "model.hidden=8", "model.layers=2"),
        ("model=mlp", "model.hidden=8", "dataset=digits", "partition=dirichlet"),
    ],
    ids=["logreg-binary", "logreg-10-classes", "mlp-2-layers", "mlp-10-classes"],
)
def test_a_linear_models_stacked_losses_are_what_vmap_gives(small_cfg, model, objective):
    """A cohort's losses from the model's own batched operations (``Objective.stacked``: a
    logistic regression's, a ReLU MLP's) are ``vmap`` of the one-client loss bit for bit, a
    short batch and the proximal term's stacked ``aux`` included, and so are their gradients:
    the same operations (the binary cross-entropy as vmap decomposes it). Other algorithms'
    objectives stay vmapped, and tests that equate them with FedAvg's hold exactly."""
    from torch.func import vmap

    from fedexp.engine.solver import steps
    from fedexp.models.task import PADDING

    engine = build_engine(small_cfg(*model))
    ctx, m = engine.ctx, 4
    assert ctx.model.stacks
    gen = torch.Generator().manual_seed(0)
    params = engine.x0 + 0.1 * torch.randn(m, engine.x0.numel(), generator=gen)
    obj, aux = ctx.model_objective(), {}
    if objective == "proximal":
        obj = ctx.proximal_objective(engine.x0, 0.5)
        aux = {"anchor": params.flip(0), "mu": torch.tensor([0.5, 0.1, 1.0, 2.0])}
    assert obj.stacked is not None
    data = engine.clients[0]
    x = data.x_train[:16].expand(m, *data.x_train[:16].shape).clone()
    x += 0.1 * torch.randn(x.shape, generator=gen)
    y = data.y_train[:16].expand(m, -1).clone()
    y[1, 9:] = PADDING  # a short batch
    u = torch.zeros(m, 0)
    values, posts = obj.stacked(params, x, y, aux, u)
    ref_v, ref_p = vmap(obj.loss)(params, x, y, aux, u)
    assert torch.equal(values, ref_v) and torch.equal(posts, ref_p)
    grads, (got_v, _) = steps._vmapped(obj)(params, x, y, aux, u)  # its backward too
    vmapped = replace(obj, stacked=None, stacked_grad=None)
    ref_g, (ref_v, _) = steps._vmapped(vmapped)(params, x, y, aux, u)
    assert torch.equal(grads, ref_g) and torch.equal(got_v, ref_v)
    # the binary logistic regression's own objective has its gradient in closed form
    closed = model == ("model=logreg",) and objective == "model"
    assert (obj.stacked_grad is not None) == closed


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_a_binary_logistic_regressions_closed_form_gradient_is_autograds(bias):
    """``fedexp.models.logistic.BinaryLogistic`` (``Objective.stacked_grad``): the losses and
    gradients of one backward pass of the stacked loss, bit for bit, with short batches
    (masked) and whole ones (``full``), at batch sizes with and without vector tails, inputs
    with more than one dimension, logits large enough to saturate the softplus, float
    targets in [0, 1], and float64."""
    from fedexp.engine.solver import steps
    from fedexp.engine.solver.objective import Objective
    from fedexp.models.flat import FlatModel
    from fedexp.models.logistic import closed_form
    from fedexp.models.tabular import logistic_regression
    from fedexp.models.task import PADDING
    from fedexp.models.task import ClassificationTask

    task = ClassificationTask(2)
    for case, (m, size, shape, dtype) in enumerate(
        [(7, 13, (30,), torch.float32), (3, 32, (2, 5), torch.float32),
         (40, 1, (9,), torch.float32), (5, 100, (17,), torch.float64)]
    ):  # fmt: skip
        model = FlatModel(logistic_regression(shape, 2, bias=bias), torch.device("cpu"))
        closed = closed_form(model, task)
        assert closed is not None
        gen = torch.Generator().manual_seed(case)
        d = model.layout.numel
        params = (8 * torch.randn(m, d, generator=gen)).to(dtype)
        x = torch.randn(m, size, *shape, generator=gen).to(dtype)
        y = torch.randint(0, 2, (m, size), generator=gen)
        short = y.clone()
        short[0, size // 2 + 1 :] = PADDING
        short[-1, 1:] = PADDING

        def stacked(p, xb, yb, aux, u, full=False, model=model):  # noqa: ANN001, ANN202
            logits = model.forward_stacked(p, xb)
            return task.loss_stacked(logits, yb, full), p

        autograd = steps._vmapped(Objective(stacked, stacked=stacked))
        soft = torch.rand(m, size, generator=gen).to(dtype)  # float targets in [0, 1]
        for labels, full in ((short, False), (y, False), (y, True), (soft, True)):
            want_g, (want_v, _) = autograd(params, x, labels, {}, torch.zeros(m, 0), full)
            got_g, got_v = closed(params, x, labels, {}, torch.zeros(m, 0), full)
            assert got_g.dtype == dtype and got_v.dtype == dtype
            assert torch.equal(got_g, want_g), (case, full, (got_g - want_g).abs().max())
            assert torch.equal(got_v, want_v), (case, full)


def test_only_a_binary_logistic_regression_has_a_closed_form():
    """Softmax regression, an MLP, another task: autograd (``closed_form`` gives None)."""
    from fedexp.models.flat import FlatModel
    from fedexp.models.logistic import closed_form
    from fedexp.models.tabular import logistic_regression
    from fedexp.models.tabular import mlp
    from fedexp.models.task import ClassificationTask

    cpu = torch.device("cpu")
    binary = FlatModel(logistic_regression([6], 2), cpu)
    assert closed_form(binary, ClassificationTask(2)) is not None
    assert closed_form(binary, object()) is None
    assert closed_form(FlatModel(logistic_regression([6], 3), cpu), ClassificationTask(3)) is None
    assert closed_form(FlatModel(mlp([6], 2), cpu), ClassificationTask(2)) is None


@pytest.mark.parametrize("outputs", [1, 3, 15, 16, 40])
def test_a_linear_layers_stacked_logits_are_x_w_plus_b_as_vmap_computes_them(outputs):
    """``tabular.linear``: m stacked models' ``x Wᵀ + b`` (within float order of the product
    in float64), and vmap of the one-model layer the same bits as the stacked one (the
    algorithms whose objectives stay vmapped), narrow (``(W xᵀ)ᵀ``) or not."""
    from torch.func import vmap

    from fedexp.models.tabular import NARROW
    from fedexp.models.tabular import linear

    gen = torch.Generator().manual_seed(outputs)
    m, b, d = 40, 32, 30
    x, w = torch.randn(m, b, d, generator=gen), torch.randn(m, outputs, d, generator=gen)
    bias = torch.randn(m, outputs, generator=gen)
    got = linear(x, w, bias)
    want = torch.einsum("mbi,moi->mbo", x.double(), w.double()) + bias.double()[:, None]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(vmap(linear)(x, w, bias), got)
    if outputs < NARROW:  # the orientation taken
        assert torch.equal(got, torch.bmm(w, x.transpose(1, 2)).transpose(1, 2) + bias[:, None])
    else:
        assert torch.equal(got, torch.bmm(x, w.transpose(1, 2)) + bias[:, None])


@pytest.mark.parametrize(
    "model",
    [("model=mlp", "model.norm=batch"), ("model=mlp", "model.dropout=0.2")],
    ids=["batchnorm", "dropout"],
)
def test_models_without_a_stacked_forward_go_through_vmap(small_cfg, model):
    """Running statistics and dropout's draws stay vmap's (or row by row)."""
    ctx = build_engine(small_cfg(*model)).ctx
    assert not ctx.model.stacks
    assert ctx.model_objective().stacked is None
    assert ctx.proximal_objective(torch.zeros(3), 0.5).stacked is None


def test_only_fedexps_linear_layers_stack_as_the_modules_compute():
    """``BodyHead.stacks`` holds for fedexp's ``Linear`` and ReLU layers only: torch's
    ``nn.Linear`` computes a narrow layer in the other orientation (other bits)."""
    from torch import nn

    from fedexp.models.tabular import BodyHead
    from fedexp.models.tabular import Linear
    from fedexp.models.tabular import mlp

    assert mlp([6], 2).stacks and not mlp([6], 2, dropout=0.1).stacks
    assert BodyHead(nn.Sequential(Linear(6, 4), nn.ReLU()), Linear(4, 1)).stacks
    assert not BodyHead(nn.Sequential(nn.Linear(6, 4), nn.ReLU()), nn.Linear(4, 1)).stacks
    assert not BodyHead(nn.Sequential(Linear(6, 4), nn.ReLU()), nn.Linear(4, 1)).stacks


def test_a_loss_that_does_not_reach_the_parameters_has_zero_gradients():
    from fedexp.engine.solver import steps
    from fedexp.engine.solver.objective import Objective

    def constant(p, x, y, aux, u):  # noqa: ANN001, ANN202
        return x.sum(), p.detach()

    grads, (values, _) = steps._vmapped(Objective(constant))(
        torch.ones(3, 5), torch.ones(3, 2), torch.zeros(3, 2), {}, torch.zeros(3, 0)
    )
    assert torch.equal(grads, torch.zeros(3, 5)) and values.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "opt",
    ["sgd", "momentum", "nesterov-decay", "adam", "adam-decay"],
)
@pytest.mark.parametrize("per_coordinate", [False, True], ids=["lr", "lr-per-coordinate"])
def test_a_stacks_optimiser_step_is_each_rows_step_bit_for_bit(opt, per_coordinate):
    """The solver steps a cohort's [m, d] stack with the one-client step itself (element-wise;
    Adam's step count [m] broadcast over each row): the same bits as vmap of the row's step."""
    from torch.func import vmap

    from fedexp.engine.solver.optim import SGD
    from fedexp.engine.solver.optim import Adam
    from fedexp.engine.solver.optim import stack_states

    make = {
        "sgd": lambda: SGD(),
        "momentum": lambda: SGD(momentum=0.9),
        "nesterov-decay": lambda: SGD(momentum=0.9, nesterov=True, weight_decay=0.01),
        "adam": lambda: Adam(),
        "adam-decay": lambda: Adam(weight_decay=0.01),
    }[opt]()
    gen = torch.Generator().manual_seed(1)
    m, d = 5, 7
    params = torch.randn(m, d, generator=gen)
    state = stack_states(make, params, [None] * m)
    if "step" in state:
        state["step"] = torch.arange(m, dtype=params.dtype)  # clients at different counts
    scale = 2 * torch.rand(m, d, generator=gen) if per_coordinate else None
    a, b = params, params
    sa, sb = dict(state), dict(state)
    for _ in range(3):
        grad = torch.randn(m, d, generator=gen)
        a, sa = make.step(a, grad, sa, 0.1, scale)
        dims = (0, 0, 0, None, 0 if per_coordinate else None)
        b, sb = vmap(make.step, in_dims=dims)(b, grad, sb, 0.1, scale)
        assert torch.equal(a, b)
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
