"""``Optimizer.schedule`` (issue 69): what a round's steps compute of the step count alone,
made once, equals what each step computes itself, to the bit; and the stacked Adam steps
still follow ``torch.optim.Adam`` client by client."""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.solver.optim import SGD
from fedexp.engine.solver.optim import Adam


def _stack(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params = torch.randn(3, 7, generator=gen)
    grads = [torch.randn(3, 7, generator=gen) for _ in range(4)]
    return params, grads


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adams_schedule_gives_the_steps_bits(weight_decay):
    """Four steps with the schedule's constants equal four steps without, bit for bit, from
    clients at different step counts."""
    opt = Adam(weight_decay=weight_decay)
    params, grads = _stack()
    state = {k: v.expand(3, *v.shape).clone() for k, v in opt.init(params[0]).items()}
    state["step"] = torch.tensor([0.0, 3.0, 10.0])
    consts = opt.schedule(state, len(grads), 0.01)
    assert consts is not None and len(consts) == len(grads)
    a, sa, b, sb = params, state, params, state
    for g, c in zip(grads, consts, strict=True):
        a, sa = opt.step(a, g, sa, 0.01)
        b, sb = opt.step(b, g, sb, 0.01, consts=c)
        assert torch.equal(a, b)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    assert sb["step"].tolist() == [4.0, 7.0, 14.0]


def test_adam_without_a_schedule_where_the_step_size_is_per_coordinate():
    """Per-coordinate step-size factors: no schedule (the steps compute their own)."""
    params, _ = _stack()
    state = Adam().init(params)
    assert Adam().schedule(state, 3, 0.1, scale=torch.ones_like(params)) is None
    assert SGD(momentum=0.9).schedule({}, 3, 0.1) is None


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (Adam(weight_decay=0.01), lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
        (SGD(momentum=0.9, nesterov=True, weight_decay=0.01),
         lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ],
    ids=["adam", "sgd-nesterov"],
)  # fmt: skip
def test_the_stacked_steps_follow_torch_optim_client_by_client(ours, theirs):
    """Each row of a scheduled stacked run equals ``torch.optim`` on that client alone."""
    params, grads = _stack(1)
    state = {k: v.expand(3, *v.shape).clone() for k, v in ours.init(params[0]).items()}
    consts = ours.schedule(state, len(grads), 0.01) or [None] * len(grads)
    x = params
    for g, c in zip(grads, consts, strict=True):
        x, state = ours.step(x, g, state, 0.01, consts=c)
    for i in range(3):
        p = torch.nn.Parameter(params[i].clone())
        opt = theirs([p])
        for g in grads:
            p.grad = g[i].clone()
            opt.step()
        # Adam's bias corrections are float32 tensors here (1 − 0.999ᵗ loses bits), PyTorch's
        # Python floats: a few ulps apart after four steps, as before issue 69
        torch.testing.assert_close(x[i], p.detach(), rtol=1e-5, atol=1e-6)
