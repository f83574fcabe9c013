"""Each client's training loss under candidate models, every client of a cohort at once.

IFCA's cluster estimate (the loss of each cluster model on the client's training split) and
SuPerFed's mixing choice need a loss per client and candidate. The clients' training splits are
padded together a chunk at a time and each candidate is one vmapped forward pass, as in the
engine's batched evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from fedexp.engine.solver.steps import _refused

if TYPE_CHECKING:
    from fedexp.data.client import ClientData
    from fedexp.engine.solver.context import Context


@torch.no_grad()
def train_losses(
    ctx: Context,
    candidates: Callable[[int, slice], torch.Tensor],
    count: int,
    data: Sequence[ClientData],
) -> torch.Tensor:
    """Each client's mean task loss on its training split under ``count`` candidate vectors.

    ``candidates(j, rows)`` gives candidate j's vectors ``[len(rows), d]`` of the clients
    ``rows`` (a slice of ``data``'s order); made chunk by chunk, so that m · count vectors
    never exist at once. The module in eval mode; the clients' training splits padded
    together once a chunk of about ``max(eval_batch_size, 8192)`` inputs, one vmapped
    forward pass a candidate and the task's per-client ``loss_batch`` (as the engine's
    batched evaluation). A task without ``loss_batch`` (segmentation) goes client by client,
    and so does a model vmap cannot run. Returns ``[m, count]`` float64 on the CPU.
    """
    module = ctx.model.module
    was_training = module.training
    module.eval()
    out = []
    try:
        start = 0
        while start < len(data):
            stop, longest = start, 0
            while stop < len(data):  # clients while the padded chunk stays in the budget
                longest = max(longest, data[stop].num_train)
                if stop > start and longest * (stop + 1 - start) > max(ctx.eval_batch_size, 8192):
                    break
                stop += 1
            rows = slice(start, stop)
            try:
                out.append(_chunk_losses(ctx, candidates, count, data, rows))
            except RuntimeError as exc:  # an op vmap refuses: client by client from now on
                _refused(ctx, exc, "batched losses")
                out.append(_chunk_losses(ctx, candidates, count, data, rows))
            start = stop
    finally:
        module.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, count, dtype=torch.float64)


def _chunk_losses(ctx, candidates, count: int, data, rows: slice) -> torch.Tensor:  # noqa: ANN001
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
        return torch.tensor(table, dtype=torch.float64).T
    xs = torch.nn.utils.rnn.pad_sequence([d.x_train for d in part], batch_first=True)
    ys = torch.nn.utils.rnn.pad_sequence([d.y_train for d in part], batch_first=True)
    lengths = torch.tensor([d.num_train for d in part], dtype=torch.int64)
    forward = torch.func.vmap(ctx.model)
    losses = [
        ctx.task.loss_batch(forward(candidates(j, rows), xs), ys, lengths).double().cpu()
        for j in range(count)
    ]
    return torch.stack(losses, dim=1)
