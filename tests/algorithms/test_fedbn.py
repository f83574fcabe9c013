"""FedBN's evaluation: the current body with each client's own BatchNorm layers."""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.runner import build_engine

pytestmark = pytest.mark.usefixtures("one_thread")


def test_eval_stack_is_eval_params_with_local_batchnorm(small_cfg):
    """``eval_stack`` (FedPer's, over FedBN's scattered BatchNorm coordinates) of clients in
    any order is ``eval_params`` row by row, bit for bit; rows differ only there."""
    e = build_engine(
        small_cfg("algorithm=fedbn", "model=mlp", "model.hidden=8", "model.norm=batch")
    )
    for _ in range(2):
        e.run_round()
    alg, ctx, server, states = e.algorithm, e.ctx, e.server, e.client_states
    clients = [3, 0, 4, 1]
    stack = alg.eval_stack(ctx, server, states.rows(clients), clients)
    for row, n in zip(stack, clients, strict=True):
        assert torch.equal(row, alg.eval_params(ctx, server, states[n], n))
    bn = alg.personal_idx(ctx)
    body = alg.body_idx(ctx)
    assert not torch.equal(stack[0, bn], stack[1, bn])  # each client's own BatchNorm
    assert torch.equal(stack[:, body], server["x"][body].expand(len(clients), -1))
