"""A cohort's draws: every client's minibatches and noise, as its own stream gives them.

The draws of :mod:`fedexp.engine.solver.steps`' local steps (split from it, issue 69): the
minibatch indices of every client and step come from one counter-based expression
(:func:`fedexp.engine.solver.passes.minibatch_indices`: the draws a client's
:class:`fedexp.engine.solver.passes.Stream` gives it alone), made ahead for a block of steps
(:class:`Ahead`, which a captured round takes whole: :mod:`fedexp.engine.solver.capture`),
gathered from the run's :class:`fedexp.engine.clients.pool.TrainPool`; the short batch that
ends an epoch padded with :data:`fedexp.models.task.PADDING` targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from fedexp.contract import Cohort
from fedexp.engine.solver.passes import Stream
from fedexp.engine.solver.passes import minibatch_indices
from fedexp.engine.solver.passes import pass_valid
from fedexp.models.task import PADDING
from fedexp.transfer import to_device

if TYPE_CHECKING:
    from fedexp.data.client import ClientData
    from fedexp.engine.solver.context import Context


def noise(cohort: Cohort, k: int, device: torch.device) -> torch.Tensor:
    """Each client's next ``k`` uniforms ``[m, k]`` from its round stream (none when k = 0)."""
    if k == 0:
        return torch.zeros(len(cohort), 0, device=device)
    if cohort.streams is None:
        cohort.streams = [Stream(key) for key in cohort.keys.tolist()]
    return torch.stack([torch.rand(k, generator=g) for g in cohort.streams]).to(device)


#: indices of draws made ahead at once (:class:`Ahead`) at most: 32 MiB of int64
_AHEAD_ENTRIES = 1 << 22


class Ahead:
    """A cohort's next minibatches' rows of the pool, drawn for several steps in one call.

    :func:`fedexp.engine.solver.passes.minibatch_indices` is counter-based, so the indices of draws
    t..t+k-1 of every client come out of one call on ``[m·k]`` rows, equal to k calls of one
    draw each: one pass permutation (and, on a GPU, its few host synchronisations) a block
    of steps instead of one a step. Blocks keep at most ``_AHEAD_ENTRIES`` indices, held as
    the pool's rows (each client's first row added), step-major so that a step's ``[m, B]``
    is contiguous, and split into the steps' tensors once a block (one op, not one a step).

    The cohort's draw counters are the Ahead's while it draws: it counts its draws itself and
    writes ``cohort.draws`` once, advanced by every draw it was made for, when it hands the
    last one out (one op a round, not one a step; issue 69).

    Args:
        ctx: the run's context (batch size, sampling).
        cohort: the cohort whose draws are made ahead (its ``draws`` counters as they are
            now: they advance by ``steps`` when the last draw is handed out).
        steps: the draws still to come.
    """

    def __init__(self, ctx: Context, cohort: Cohort, steps: int) -> None:
        self.ctx, self.cohort, self.left = ctx, cohort, steps
        self.start, self.total, self.drawn = cohort.draws, steps, 0
        self.rows: Sequence[torch.Tensor] = ()
        self.block: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the last, whole
        self.valid: Sequence[torch.Tensor] | None = None
        self.draws: Sequence[torch.Tensor] = ()  # each step's counters (augmentation only)
        self.short: list[bool] = []  # per step of the block: whether some batch is short
        self.pad: torch.Tensor | int = PADDING
        self.at = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every client's next draw: its rows of the pool ``[m, B]``, and which are samples.

        Both made ahead when needed: the rows are the draw's indices plus each client's
        first row (:meth:`TrainPool.gather`'s, once a block instead of once a step); the
        second is :func:`fedexp.engine.solver.passes.pass_valid` of the draw (shaped to
        broadcast over the targets' trailing axes), None where every batch of the draw is full.
        """
        if self.at == len(self.rows):
            self._block()
        at = self.at
        self.at += 1
        self.left -= 1
        self.drawn += 1
        if self.left == 0:  # the last draw: the cohort's counters advanced once
            self.cohort.draws = self.start + self.total
        if self.valid is None or not self.short[at]:
            return self.rows[at], None
        return self.rows[at], self.valid[at]

    def all_steps(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Every draw still to come as one block, handed out at once (a captured round's).

        Returns:
            The rows ``[k, m, B]`` and their validity ``[k, m, B, 1, ...]`` (None where no
            batch can be short: the pool fills its batches, or draws with replacement); the
            cohort's counters advanced past them. None where they do not fit one block
            (``_AHEAD_ENTRIES``) or some were handed out already: nothing drawn then.
        """
        m, size = len(self.cohort), self.ctx.batch_size
        if self.at != len(self.rows) or self.left * m * size > _AHEAD_ENTRIES or self.left < 1:
            return None
        self._block()
        self.drawn, self.left, self.at = self.drawn + self.left, 0, len(self.rows)
        self.cohort.draws = self.start + self.total
        return self.block

    def step_draws(self) -> torch.Tensor:
        """The counters of the draw :meth:`next` handed out last ``[m]`` (on the host)."""
        return self.draws[self.at - 1]

    def _block(self) -> None:
        cohort, size = self.cohort, self.ctx.batch_size
        m = len(cohort)
        k = max(1, min(self.left, _AHEAD_ENTRIES // max(1, m * size)))
        dev = cohort.pool.offset.device
        # the counters, keys and sizes on the host (a GPU's indices drawn there, unwaited)
        draws = self.start + self.drawn
        ahead = (draws[:, None] + torch.arange(k, device=draws.device)).reshape(-1)
        num = cohort.pool.host_size(cohort.rows).repeat_interleave(k)
        keys = cohort.keys.repeat_interleave(k)
        idx = minibatch_indices(keys, ahead, size, num, self.ctx.sampling, dev).view(m, k, size)
        first = cohort.pool.offset[to_device(cohort.rows, dev)].view(m, 1, 1)
        block = (idx + first).transpose(0, 1).contiguous()  # [k, m, B]
        self.rows, self.at, self.block = block.unbind(0), 0, (block, None)
        if self.ctx.augment.active:
            self.draws = ahead.view(m, k).t().unbind(0)
        self.valid = None
        if self.ctx.sampling == "shuffle" and not cohort.pool.fills(size):
            valid = pass_valid(ahead, size, num).view(m, k, size)  # on the host
            self.short = self.short_steps(valid)
            trailing = [1] * (cohort.pool.y.dim() - 1)  # over the targets' trailing axes
            self.valid = to_device(valid, dev).transpose(0, 1).view(k, m, size, *trailing)
            self.block = (block, self.valid)
            self.valid = self.valid.unbind(0)
            y = cohort.pool.y  # the padding target as a tensor: no scalar made a step
            self.pad = torch.full((), PADDING, dtype=y.dtype if y.is_floating_point() else
                                  torch.int64, device=dev)  # fmt: skip

    @staticmethod
    def short_steps(valid: torch.Tensor) -> list[bool]:
        """Which of a block's steps hold a short batch, from its validity ``[m, k, B]``.

        A batch's padding is its suffix, so a batch is short where its last entry is not a
        sample. One read of k flags, of a tensor on the host (no wait on a device). The other
        steps' batches are all whole, and their losses skip the padding masks (``full``).
        """
        return [not whole for whole in valid[:, :, -1].all(0).tolist()]


def draw_batch(
    ctx: Context, cohort: Cohort, ahead: Ahead | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each client's next minibatch, stacked ``[m, B, ...]``: what ``ClientData.batch`` gives it.

    :func:`draw_step`'s inputs and targets.
    """
    x, y, _ = draw_step(ctx, cohort, ahead)
    return x, y


def draw_step(
    ctx: Context, cohort: Cohort, ahead: Ahead | None = None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Each client's next minibatch, stacked ``[m, B, ...]``, and whether every batch is whole.

    The indices of every client's stream at its draw counter (advanced by one), in shuffled
    epochs or with replacement (``ctx.sampling``,
    :func:`fedexp.engine.solver.passes.minibatch_indices`);
    with ``ctx.batch_size`` ≤ 0 every client's whole training set (equal sizes: the engine's
    sub-cohorts), no draw. The short batch that ends a client's epoch (n mod B samples) keeps
    the cohort's ``[m, B]`` shape: its padding rows have the target
    :data:`fedexp.models.task.PADDING`, which the task's loss gives no weight, and the row-by-row
    gradients of models with running statistics leave out (:func:`_rowwise`). ``ahead``:
    the rows come from it (made for several steps at once), else from one call. The
    batch is augmented by ``ctx.augment`` (:mod:`fedexp.data.augment`).

    Returns:
        (inputs, targets, full): ``full`` where no target is padding (no batch of the step
        short), which a loss may take to skip its masks.
    """
    size = ctx.batch_size
    if size <= 0:
        return (
            torch.stack([d.x_train for d in cohort.data]),
            torch.stack([d.y_train for d in cohort.data]),
            True,
        )
    valid = None
    dev = cohort.pool.offset.device
    if ahead is None:
        draws = cohort.draws
        short = ctx.sampling == "shuffle" and not cohort.pool.fills(size)  # some batches short
        num = cohort.pool.host_size(cohort.rows)
        idx = minibatch_indices(cohort.keys, draws, size, num, ctx.sampling, dev)
        x, y = cohort.pool.gather(cohort.rows, idx)
        if short:
            valid = to_device(pass_valid(draws, size, num), y.device)
            valid = valid.view(*valid.shape, *([1] * (y.dim() - 2)))
        cohort.draws = draws + 1
    else:  # its rows' validity made ahead too (shaped for the targets), where some of this
        # step's batches are short; the counters advanced by the Ahead once it is drawn out
        rows, valid = ahead.next()
        x, y = cohort.pool.take(rows)
    if ctx.augment.active:  # per (stream key, draw, position): as the client alone draws it
        drawn = draws if ahead is None else ahead.step_draws()
        x, y = ctx.augment(x, y, to_device(cohort.keys, dev), to_device(drawn, dev))
    if valid is None:
        return x, y, True  # every batch of every client full
    pad = PADDING if ahead is None else ahead.pad
    return x, torch.where(valid, y if y.is_floating_point() else y.long(), pad), False


def alone(data: ClientData, key: int) -> Cohort:
    """A cohort of the one client ``data``, drawing from the stream ``key``.

    Its data are its rows of the pool that holds them (no copy), else a pool of its own.
    """
    from fedexp.engine.clients.pool import TrainPool

    rows = data.pooled()
    pool, row = (rows.pool, rows.row) if rows is not None else (TrainPool.of([data]), 0)
    one = torch.full((1,), row, dtype=torch.int64)  # on the host, as every cohort's
    keys = torch.tensor([key], dtype=torch.int64)
    return Cohort([row], [data], one, keys, torch.zeros_like(one), pool)


def _snapshot(cohort: Cohort) -> Callable[[], None]:
    """A function that puts the cohort's draw counters and noise streams back as they are."""
    draws = cohort.draws.clone()
    streams = None if cohort.streams is None else [g.get_state() for g in cohort.streams]

    def restore() -> None:
        cohort.draws = draws
        if streams is None:
            cohort.streams = None
        else:
            for g, s in zip(cohort.streams, streams, strict=True):
                g.set_state(s)

    return restore
