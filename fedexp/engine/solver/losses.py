"""Each client's training loss under candidate models, every client of a cohort at once.

IFCA's cluster estimate (the loss of each cluster model on the client's training split) and
SuPerFed's mixing choice need a loss per client and candidate. The clients' training splits are
gathered padded from their pool a run of clients at a time and each candidate is one vmapped
forward pass, as in the engine's batched evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from fedexp.engine.clients.pool import padded
from fedexp.engine.solver.steps import _refused
from fedexp.transfer import to_device

if TYPE_CHECKING:
    from fedexp.data.client import ClientData
    from fedexp.engine.solver.context import Context


#: padded training-input elements scored in one pass (256 MiB of float32 inputs)
_ELEMENTS = 2**26


@torch.no_grad()
def train_losses(
    ctx: Context,
    candidates: Callable[[int, slice], torch.Tensor],
    count: int,
    data: Sequence[ClientData],
) -> torch.Tensor:
    """Each client's mean task loss on its training split under ``count`` candidate vectors.

    ``candidates(j, rows)`` gives candidate j's vectors ``[len(rows), d]`` of the clients
    ``rows`` (a slice of ``data``'s order); made a run of clients at a time, so that
    m · count vectors never exist at once. The module in eval mode; the clients' training
    splits gathered padded from their pool with one index (``pool.padded``: a fixed number
    of ops for any cohort), in runs of at most ``_ELEMENTS`` padded input elements, one
    vmapped forward pass a candidate and the task's per-client ``loss_batch`` (as the
    engine's batched evaluation); nothing is read on the host. A task without
    ``loss_batch`` (segmentation), or a model vmap cannot run, goes client by client.

    Returns:
        ``[m, count]`` float64, on the data's device.
    """
    module = ctx.model.module
    was_training = module.training
    module.eval()
    per_input = max(1, math.prod(data[0].x_train.shape[1:])) if len(data) else 1
    out = []
    try:
        for rows in _runs([d.num_train for d in data], max(1, _ELEMENTS // per_input)):
            try:
                out.append(_run_losses(ctx, candidates, count, data, rows))
            except RuntimeError as exc:  # an op vmap refuses: client by client from now on
                _refused(ctx, exc, "batched losses")
                out.append(_run_losses(ctx, candidates, count, data, rows))
    finally:
        module.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, count, dtype=torch.float64)


def _runs(lengths: Sequence[int], budget: int) -> Iterator[slice]:
    """Runs of consecutive clients whose padded splits (longest × clients) fit ``budget``."""
    start = 0
    while start < len(lengths):
        longest, stop = 0, start
        while stop < len(lengths):
            longest = max(longest, lengths[stop])
            if stop > start and longest * (stop + 1 - start) > budget:
                break
            stop += 1
        yield slice(start, stop)
        start = stop


def _run_losses(ctx, candidates, count: int, data, rows: slice) -> torch.Tensor:  # noqa: ANN001
    """:func:`train_losses` of the clients ``rows``: [len, count]."""
    part = data[rows]
    if not hasattr(ctx.task, "loss_batch") or not ctx.vmap_ok:  # client by client
        size = max(1, ctx.eval_batch_size)
        table = []
        for j in range(count):
            vectors = candidates(j, rows)
            table.append(
                [
                    float(
                        ctx.task.loss(
                            torch.cat([ctx.model(p, x) for x in d.x_train.split(size)]), d.y_train
                        )
                    )
                    for p, d in zip(vectors, part, strict=True)
                ]
            )
        device = part[0].x_train.device if len(part) else None
        return to_device(table, device or "cpu", torch.float64).T
    gathered = padded([d.pooled() for d in part])
    if gathered is not None:
        xs, ys, lengths = gathered
    else:
        xs = torch.nn.utils.rnn.pad_sequence([d.x_train for d in part], batch_first=True)
        ys = torch.nn.utils.rnn.pad_sequence([d.y_train for d in part], batch_first=True)
        lengths = torch.tensor([d.num_train for d in part], dtype=torch.int64)
    model = ctx.model  # its own batched forward pass where it has one (vmap's bits)
    forward = model.forward_stacked if model.stacks else torch.func.vmap(model)
    losses = [
        ctx.task.loss_batch(forward(candidates(j, rows), xs), ys, lengths) for j in range(count)
    ]
    return torch.stack(losses, dim=1).double()
