"""Execution backends: how the sampled clients' hooks of one round are run.

* ``sequential``: one client after another on the device.
* ``lockstep``: every sampled client's ``client_update`` runs as a greenlet (a coroutine of
  one OS thread); their calls of :meth:`fedexp.engine.context.Context.train` wait at a
  barrier and the calls with the same
  objective function, optimiser, step count and step size are executed together, as one
  computation over the stacked ``[m, d]`` parameters, ``aux`` tensors, masks and optimiser
  states with :func:`torch.func.vmap`. Algorithms are unchanged; each client draws its
  minibatch indices (then its noise) from its own (seed, round, client) stream in the same
  order as in ``sequential``, so both backends give the same models up to floating-point
  summation order. Full-batch calls (every step on all of ``data``, e.g. pFedMe's and TDPFed's
  steps on one drawn minibatch) are batched with the clients whose data have the same shape.
  Calls with an ``extra`` gradient closure run per client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from greenlet import greenlet
from torch.func import grad_and_value, vmap

from fedexp.data.federated import ClientData
from fedexp.engine.context import LocalResult
from fedexp.engine.objective import Objective
from fedexp.engine.optim import Optimizer
from fedexp.engine.optim import State as OptState
from fedexp.engine.rng import Stream, batch_indices
from fedexp.errors import DivergenceError

if TYPE_CHECKING:
    from fedexp.algorithms.base import ClientResult

log = logging.getLogger("fedexp")

#: client id -> its update, given its decoded downlink message.
ClientFn = Callable[[int], "ClientResult"]


def run_sequential(clients: Sequence[int], fn: ClientFn, ctx: object) -> dict[int, ClientResult]:
    """Run ``fn`` for each client in order."""
    out = {}
    for n in clients:
        try:
            out[n] = fn(n)
        except DivergenceError as exc:
            raise DivergenceError(f"client {n}: {exc}") from None
    return out


@dataclass
class _Request:
    params: torch.Tensor
    data: ClientData
    generator: torch.Generator
    steps: int
    lr: float
    objective: Objective
    optimizer: Optimizer
    opt_state: OptState
    mask: torch.Tensor | None
    full_batch: bool = False
    result: LocalResult | None = None
    error: Exception | None = None
    done: bool = False

    def key(self) -> Hashable:
        """Requests with equal keys run as one vmapped computation."""
        return (
            self.steps,
            self.lr,
            id(self.optimizer),
            tuple(sorted(self.opt_state)),
            self.mask is None,
            self.objective.batch_key(),
            tuple(self.data.x_train.shape) if self.full_batch else None,
        )


def _stack(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([v.detach() for v in values])


class LockstepBatcher:
    """The barrier of the lockstep backend: clients' hooks as greenlets, their calls batched.

    Each sampled client's hook runs in a greenlet (the ``greenlet`` package: stack-switching
    coroutines in one OS thread, as SQLAlchemy and gevent use). Its ``Context.train`` call
    queues the request and switches back to the scheduler (:func:`run_lockstep`), which
    runs every queued call of the cohort as batched computations (:meth:`run_pending`), then
    resumes the clients in order. A switch costs about a microsecond; a thread per client
    (this backend until issue 14) spent most of a 1,000-client round starting, joining and
    waiting on a condition.
    """

    def __init__(self, ctx) -> None:  # noqa: ANN001 - Context (import cycle)
        self.ctx = ctx
        self.pending: list[_Request] = []
        self.hub = greenlet.getcurrent()

    def train(
        self,
        params: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        steps: int,
        lr: float,
        objective: Objective,
        optimizer: Optimizer,
        opt_state: OptState,
        mask: torch.Tensor | None,
        full_batch: bool = False,
    ) -> LocalResult:
        """Queue one client's local training; yield to the scheduler until it has run.

        ``full_batch``: every step on all of ``data`` (no minibatch draws).
        """
        req = _Request(
            params.detach(),
            data,
            generator,
            steps,
            lr,
            objective,
            optimizer,
            opt_state,
            mask,
            full_batch,
        )
        self.pending.append(req)
        self.hub.switch()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def run_pending(self) -> None:
        """Run the queued calls: those with equal keys (:meth:`_Request.key`) as one batch."""
        batch, self.pending = self.pending, []
        groups: dict[Hashable, list[_Request]] = {}
        for r in batch:
            groups.setdefault(r.key(), []).append(r)
        for reqs in groups.values():
            self._run_group(reqs)
            for r in reqs:
                r.done = True

    def _run_group(self, reqs: list[_Request]) -> None:
        """Batched if the model and objective can be vmapped, else client by client."""
        # BatchNorm's in-place running-statistics update is lost under vmap(grad(...)) (the
        # statistics come back unchanged): models with buffers step client by client.
        if self.ctx.vmap_ok and len(reqs) > 1 and not self.ctx.model.has_buffers:
            states = [(r.generator.get_state(), getattr(r.generator, "draws", 0)) for r in reqs]
            try:
                self._execute(reqs)
                return
            except RuntimeError as exc:  # e.g. an in-place op of the loss that vmap refuses
                for r, (state, draws) in zip(reqs, states, strict=True):
                    r.generator.set_state(state)  # the same draws as if never batched
                    if isinstance(r.generator, Stream):
                        r.generator.draws = draws
                    r.error = None
                self.ctx.vmap_ok = False
                log.warning(
                    "lockstep: cannot vmap this model/loss (%s); clients run one by one",
                    str(exc).splitlines()[0][:160],
                )
        for r in reqs:
            try:
                r.result = self.ctx.local_train(
                    r.params,
                    r.data,
                    r.generator,
                    r.steps,
                    r.lr,
                    r.objective,
                    r.optimizer,
                    r.opt_state,
                    r.mask,
                    batch_size=0 if r.full_batch else None,
                )
            except Exception as exc:  # noqa: BLE001 - handed to the waiting client
                r.error = exc

    def _execute(self, reqs: list[_Request]) -> None:
        ctx = self.ctx
        first = reqs[0]
        obj = first.objective
        params = _stack([r.params for r in reqs])
        aux = {k: _stack([r.objective.aux[k] for r in reqs]) for k in obj.aux}
        state = {k: _stack([r.opt_state[k] for r in reqs]) for k in first.opt_state}
        frozen = None if obj.frozen is None else _stack([r.objective.frozen for r in reqs])
        keep = None if first.mask is None else _stack([r.mask for r in reqs]) == 0
        lr_scale = None
        if obj.lr_scale is not None:
            lr_scale = _stack([r.objective.lr_scale for r in reqs])
        draw = self._batches(reqs)
        params, state, means = train_stacked(
            ctx,
            obj,
            first.optimizer,
            first.steps,
            first.lr,
            params,
            aux,
            state,
            draw,
            frozen=frozen,
            keep=keep,
            lr_scale=lr_scale,
        )
        bad = diverged_rows(params, means)
        # one copy a client: a view would keep the whole cohort's tensor alive in its state
        rows, means_l = [p.clone() for p in params.unbind(0)], means.tolist()
        for i, r in enumerate(reqs):
            if i in bad:
                try:
                    ctx.check_finite(rows[i], means_l[i], first.lr)
                except DivergenceError as exc:
                    r.error = exc
                    continue
            r.result = LocalResult(rows[i], means_l[i], {k: v[i].clone() for k, v in state.items()})

    def _batches(self, reqs: list[_Request]) -> BatchFn:
        """Each step's (inputs, targets, noise) of the group, drawn as ``local_train`` draws."""
        ctx, first = self.ctx, reqs[0]
        dev = ctx.device
        noise = first.objective.noise
        gens = [r.generator for r in reqs]
        if first.full_batch:  # equal shapes (the request key): no draws, no padding
            xs = _stack([r.data.x_train for r in reqs])
            ys = _stack([r.data.y_train for r in reqs])
            return lambda: (xs, ys, stream_noise(gens, noise, dev))
        size = ctx.batch_size
        rows = None if ctx.pool is None else ctx.pool.rows([r.data for r in reqs])
        if rows is not None and all(isinstance(g, Stream) for g in gens):
            keys = torch.tensor([g.key for g in gens], dtype=torch.int64, device=dev)
            num = ctx.pool.size[rows]

            def pooled() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                draws = torch.tensor([g.draws for g in gens], dtype=torch.int64)
                for g in gens:
                    g.draws += 1
                idx = batch_indices(keys, draws, size, num)
                u = stream_noise(gens, noise, dev)  # after the indices, as ``local_train``
                return (*ctx.pool.gather(rows, idx), u)

            return pooled
        xs = torch.nn.utils.rnn.pad_sequence([r.data.x_train for r in reqs], batch_first=True)
        ys = torch.nn.utils.rnn.pad_sequence([r.data.y_train for r in reqs], batch_first=True)
        ar = torch.arange(len(reqs), device=dev)[:, None]

        def padded() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            idx, u = [], []
            for r in reqs:  # per client: indices, then noise (``local_train``'s order)
                if isinstance(r.generator, Stream):
                    idx.append(r.generator.indices(size, r.data.num_train, dev))
                else:
                    idx.append(torch.randint(r.data.num_train, (size,), generator=r.generator))
                u.append(torch.rand(noise, generator=r.generator))
            idx_t = torch.stack(idx).to(dev)
            return xs[ar, idx_t], ys[ar, idx_t], torch.stack(u).to(dev)

        return padded


#: One step's (inputs [m, B, ...], targets [m, B, ...], noise [m, k]) of a cohort.
BatchFn = Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def stream_noise(gens: list[torch.Generator], k: int, dev: torch.device) -> torch.Tensor:
    """Each generator's ``k`` uniforms (none drawn when k = 0), stacked ``[m, k]``.

    Shared by the greenlet barrier and the cohort path (``Cohort.noise``).
    """
    if k == 0:
        return torch.zeros(len(gens), 0, device=dev)
    return torch.stack([torch.rand(k, generator=g) for g in gens]).to(dev)


def diverged_rows(params: torch.Tensor, means: torch.Tensor) -> set[int]:
    """Rows whose parameters or mean loss are not finite (one reduction for the cohort).

    Shared by the greenlet barrier and the cohort path (``fedexp.engine.cohort``).
    """
    ok = torch.isfinite(params).all(dim=1) & torch.isfinite(means)
    if bool(ok.all()):
        return set()
    return set(torch.nonzero(~ok).reshape(-1).tolist())


def _rowwise(ctx, obj: Objective, posts: bool) -> Callable:  # noqa: ANN001 - Context
    """vmap(grad_and_value(loss, has_aux=True))'s contract, one row at a time.

    Each row's gradient by plain autograd, as ``Context.local_train`` takes it
    (``Context._loss_grad_post`` with the row's ``aux``: functorch's wrappers cost ~1 ms a
    step on issue 14's CNN); outputs stacked; the loss's ``post`` vectors only if ``posts``
    (else None).
    """

    def run(params, xb, yb, aux, u):  # noqa: ANN001, ANN202 - vmap's signature
        grads, values, kept = [], [], []
        for i in range(params.shape[0]):
            row = replace(obj, aux={k: t[i] for k, t in aux.items()})
            value, g, post = ctx._loss_grad_post(row, params[i], xb[i], yb[i], u[i])
            grads.append(g)
            values.append(value)
            if posts and post is not None:
                kept.append(post)
        post = torch.stack(kept) if kept else None
        return torch.stack(grads), (torch.stack(values), post)

    return run


def stacked_gradients(ctx, obj: Objective, posts: bool) -> Callable:  # noqa: ANN001 - Context
    """``(params, x, y, aux, u) -> (grads, (losses, posts))`` of m clients' stacked rows.

    One :func:`torch.func.vmap` of the objective's gradient, or client by client
    (:func:`_rowwise`) for a model whose convolutions run channels-last (see
    :func:`train_stacked`).
    """
    if getattr(ctx.model, "channels_last", False):
        return _rowwise(ctx, obj, posts=posts)
    return vmap(grad_and_value(obj.loss, has_aux=True), randomness="different")


def train_stacked(
    ctx,  # noqa: ANN001 - Context (import cycle)
    obj: Objective,
    opt: Optimizer,
    steps: int,
    lr: float,
    params: torch.Tensor,
    aux: dict[str, torch.Tensor],
    state: OptState,
    draw: BatchFn,
    *,
    frozen: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    lr_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, OptState, torch.Tensor]:
    """``steps`` optimiser steps of m clients at once, as ``Context.local_train`` takes one.

    One :func:`torch.func.vmap` of the objective's gradient over the stacked ``[m, d]``
    parameters, ``aux`` tensors and optimiser states per step. A model whose convolutions run
    channels-last (``FlatModel.channels_last``: on the CPU) has its gradients computed client
    by client instead (:func:`_rowwise`; the steps stay stacked): vmap would turn them into
    grouped convolutions, 1.3-1.9x slower a step on issue 14's CNN.

    Args:
        ctx: the run's context.
        obj: the objective (its ``aux`` entries given stacked in ``aux``).
        opt: the optimiser.
        steps: local steps.
        lr: step size (times ``lr_scale`` per client if given).
        params: ``[m, d]`` starting points.
        aux: the objective's stacked ``aux`` tensors.
        state: the optimiser's stacked state.
        draw: each step's minibatches and noise of the m clients.
        frozen: ``[m, d]`` coordinates written from the forward pass (running statistics).
        keep: ``[m, d]`` coordinates that do not move (a 0 of the mask).
        lr_scale: ``[m]`` per-client factors of the step size.

    Returns:
        (final parameters, final optimiser state, each client's mean loss over the steps).
    """
    ctx.model.module.train()
    step_lr: float | torch.Tensor = lr if lr_scale is None else lr * lr_scale
    grad_fn = stacked_gradients(ctx, obj, posts=frozen is not None)
    step_fn = vmap(opt.step, in_dims=(0, 0, 0, None if lr_scale is None else 0))
    project = None if obj.project is None else vmap(obj.project)
    total = torch.zeros(params.shape[0], device=params.device)
    for _ in range(steps):
        xb, yb, u = draw()
        grads, (values, post) = grad_fn(params, xb, yb, aux, u)
        if keep is not None:
            grads = grads.masked_fill(keep, 0.0)
        new, state = step_fn(params, grads, state, step_lr)
        if frozen is not None and post is not None:
            new = torch.where(frozen, post, new)
        if keep is not None:
            new = torch.where(keep, params, new)
        if project is not None:
            new = project(new, aux)
        params = new
        total = total + values.detach()
    return params.detach(), state, total / max(steps, 1)


def run_lockstep(
    clients: Sequence[int], fn: ClientFn, ctx: object, chunk: int = 4096
) -> dict[int, ClientResult]:
    """Run ``fn`` for every client as greenlets whose ``ctx.train`` calls are batched.

    The clients run in order until each has queued a ``train`` call or returned; the queued
    calls run as batches; the clients resume in order; and so on until all have returned.
    Each client draws from its own generator in its own order, so the results equal
    ``sequential``'s up to floating-point summation order. An error of one client is raised
    after the cohort has finished (the lowest client id first), as in ``sequential``.
    """
    out: dict[int, ClientResult] = {}
    errors: dict[int, Exception] = {}
    for start in range(0, len(clients), chunk):
        part = list(clients[start : start + chunk])
        batcher = LockstepBatcher(ctx)
        lets = {n: greenlet(fn) for n in part}
        ctx.batcher = batcher
        try:
            waiting, first = part, True
            while waiting:
                for n in waiting:
                    try:
                        value = lets[n].switch(n) if first else lets[n].switch()
                    except Exception as exc:  # noqa: BLE001 - re-raised below
                        errors[n] = exc
                        continue
                    if lets[n].dead:
                        out[n] = value
                first = False
                if batcher.pending:
                    batcher.run_pending()
                waiting = [n for n in part if not lets[n].dead]
        finally:
            ctx.batcher = None
        if errors:
            first_bad = min(errors)
            error = errors[first_bad]
            if isinstance(error, DivergenceError):
                raise DivergenceError(f"client {first_bad}: {error}") from None
            raise error
    return out


def choose_backend(module: torch.nn.Module, device: torch.device) -> str:
    """``backend=auto``: lockstep unless it cannot batch the model.

    Models with BatchNorm statistics run ``sequential`` (lockstep would run them client by
    client anyway: vmap(grad) loses the in-place statistics update); every other model runs
    ``lockstep``. Measured with the greenlet barrier (docs/benchmarks.md): logistic
    regression 9x sequential's rounds/s at 100-1,000 clients; issue 14's 2-conv CNN (10
    clients, one CPU thread) 60 against 50 client updates/s (medians of 3). No GPU
    measurement yet: the same rule there.
    """
    del device  # one rule for CPU and GPU until a GPU measurement says otherwise
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
            return "sequential"
    return "lockstep"


BACKENDS = {"sequential": run_sequential, "lockstep": run_lockstep}
