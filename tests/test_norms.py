"""BatchNorm's training statistics as a function of the batch (``fedexp.models.norms``): the
same as PyTorch's BatchNorm, padded rows left out, and right under vmap (issue 39)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import grad_and_value
from torch.func import vmap

from fedexp.models.flat import FlatModel
from fedexp.models.norms import functional_norms
from fedexp.models.norms import tracked_norms
from fedexp.models.task import PADDING
from fedexp.models.task import valid_rows

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("norm", "shape"),
    [
        (nn.BatchNorm1d(3), (6, 3)),
        (nn.BatchNorm2d(3), (5, 3, 4, 4)),
        (nn.BatchNorm3d(3), (4, 3, 2, 3, 3)),
    ],
    ids=["1d", "2d", "3d"],
)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_the_training_forward_and_its_statistics_are_pytorchs(norm, shape, momentum):
    norm.momentum = momentum
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    net = nn.Sequential(norm)
    flat = FlatModel(net, CPU)
    assert flat.functional_stats
    p = flat.initial()
    x = torch.randn(shape) * 2 + 1
    out, buffers = flat.forward_train(p, x)
    reference = type(norm)(3, momentum=momentum)
    reference.load_state_dict(norm.state_dict())
    expected = reference.train()(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buffers, torch.cat([reference.running_mean, reference.running_var]))


def test_padded_rows_are_left_out_of_the_batch_statistics():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    flat = FlatModel(net, CPU)
    p = flat.initial()
    x = torch.randn(7, 4)
    y = torch.tensor([0, 1, 1, 0, 1, PADDING, PADDING])
    out, buffers = flat.forward_train(p, x, valid_rows(y))
    alone, alone_buffers = flat.forward_train(p, x[:5])
    torch.testing.assert_close(out[:5], alone)
    torch.testing.assert_close(buffers, alone_buffers)


def test_vmapped_gradients_and_statistics_equal_each_rows():
    """The in-place update of PyTorch's kernel is lost under vmap (the statistics came back
    unchanged); computed as a function of the batch they are each client's own."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    flat = FlatModel(net, CPU)

    def loss(p, x, y):  # noqa: ANN001, ANN202
        logits, buffers = flat.forward_train(p, x, valid_rows(y))
        keep = y != PADDING
        value = nn.functional.cross_entropy(logits, torch.where(keep, y, 0), reduction="none")
        return (value * keep).sum() / keep.sum(), buffers

    m = 3
    params = torch.stack([flat.initial() + 0.1 * i for i in range(m)])
    x = torch.randn(m, 8, 4)
    y = torch.randint(0, 2, (m, 8))
    y[1, 6:] = PADDING  # a short batch
    grads, (values, posts) = vmap(grad_and_value(loss, has_aux=True))(params, x, y)
    for i in range(m):
        rows = int((y[i] != PADDING).sum())
        g, (v, post) = grad_and_value(loss, has_aux=True)(params[i], x[i, :rows], y[i, :rows])
        torch.testing.assert_close(grads[i], g, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(values[i], v)
        torch.testing.assert_close(posts[i], post)
        assert not torch.equal(post, params[i][flat.layout.num_params :])  # they moved


def test_evaluation_reads_the_running_statistics_and_changes_none():
    net = nn.Sequential(nn.BatchNorm1d(3)).eval()
    flat = FlatModel(net, CPU)
    p = flat.initial()
    out, buffers = flat.forward_train(p, torch.randn(4, 3))
    torch.testing.assert_close(buffers, p[flat.layout.num_params :])
    with functional_norms(tracked_norms(net), None) as stats:
        net(torch.randn(4, 3))
    assert stats == {} and "forward" not in net[0].__dict__  # its own forward is back


def test_other_buffers_keep_the_row_by_row_path():
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    net.register_buffer("scale", torch.ones(3))
    assert not FlatModel(net, CPU).functional_stats
    assert not FlatModel(nn.Linear(3, 2), CPU).functional_stats


def test_fedrods_two_forward_passes_leave_the_padding_out(small_cfg):
    """FedRoD's joint loss runs the model twice (generic and personal head): a padded batch
    gives the loss, gradient and statistics of its samples alone in both."""
    import torch.nn.functional as F

    from fedexp.engine.runner import build_engine

    engine = build_engine(
        small_cfg("algorithm=fedrod", "model=mlp", "model.hidden=8", "model.norm=batch")
    )
    ctx = engine.ctx
    ctx.model.module.train()
    joint = engine.algorithm._joint(ctx)
    torch.manual_seed(0)
    w = torch.cat([engine.x0, 0.1 * torch.randn(len(joint.head))]).requires_grad_(True)
    data = engine.clients[0]
    x, y = data.x_train[:6], data.y_train[:6]
    padded_x = torch.cat([x, 5 * torch.randn_like(x[:2])])
    padded_y = torch.cat([y, torch.full_like(y[:2], PADDING)])
    aux = {"log_prior": F.log_softmax(torch.randn(2), 0)}
    u = torch.zeros(0)
    (value, post), (padded_value, padded_post) = (
        joint.loss(w, a, b, aux, u) for a, b in ((x, y), (padded_x, padded_y))
    )
    (grad,) = torch.autograd.grad(value, w)
    (padded_grad,) = torch.autograd.grad(padded_value, w)
    torch.testing.assert_close(padded_value, value)
    torch.testing.assert_close(padded_grad, grad)
    torch.testing.assert_close(padded_post, post)
