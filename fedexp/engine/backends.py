"""Execution backends: how the sampled clients' hooks of one round are run.

* ``sequential``: one client after another on the device.
* ``lockstep``: every sampled client's ``client_update`` runs in its own thread; their calls
  of :meth:`fedexp.engine.context.Context.sgd` wait at a barrier and are executed together,
  as one computation over the stacked ``[m, d]`` parameters with :func:`torch.func.vmap`.
  Algorithms are unchanged; each client draws its minibatch indices from its own
  (seed, round, client) stream in the same order as in ``sequential``, so both backends give
  the same models up to floating-point summation order. ``sgd`` calls with a proximal
  ``extra`` term or a ``mask``, and full-batch steps, run per client as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call, grad_and_value, vmap

from fedexp.algorithms.base import ClientResult
from fedexp.data.federated import ClientData
from fedexp.errors import DivergenceError

log = logging.getLogger("fedexp")

#: client id -> its update, given its decoded downlink message.
ClientFn = Callable[[int], ClientResult]


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
    result: tuple[torch.Tensor, float] | None = None
    error: Exception | None = None
    done: bool = False


class LockstepBatcher:
    """Barrier that runs the pending ``sgd`` calls of all live client threads as one batch."""

    def __init__(self, ctx, live: int) -> None:  # noqa: ANN001 - Context (import cycle)
        self.ctx = ctx
        self.live = live
        self.pending: list[_Request] = []
        self.cond = threading.Condition()

    def sgd(
        self,
        params: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        steps: int,
        lr: float,
    ) -> tuple[torch.Tensor, float]:
        """Queue one client's local SGD and wait until its batch has run."""
        req = _Request(params.detach(), data, generator, steps, lr)
        with self.cond:
            self.pending.append(req)
            self._maybe_run()
            self.cond.wait_for(lambda: req.done)
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def finished(self) -> None:
        """A client thread has returned: the others may all be waiting now."""
        with self.cond:
            self.live -= 1
            self._maybe_run()

    def _maybe_run(self) -> None:
        if self.pending and len(self.pending) >= self.live:
            batch, self.pending = self.pending, []
            groups: dict[tuple[int, float], list[_Request]] = {}
            for r in batch:
                groups.setdefault((r.steps, r.lr), []).append(r)
            for (steps, lr), reqs in groups.items():
                with self.ctx.model_lock:
                    self._run_group(reqs, steps, lr)
                for r in reqs:
                    r.done = True
            self.cond.notify_all()

    def _run_group(self, reqs: list[_Request], steps: int, lr: float) -> None:
        """Batched if the model and loss can be vmapped, else client by client."""
        if self.ctx.vmap_ok:
            states = [r.generator.get_state() for r in reqs]
            try:
                self._execute(reqs, steps, lr)
                return
            except RuntimeError as exc:  # e.g. an in-place op of the loss that vmap refuses
                for r, state in zip(reqs, states, strict=True):
                    r.generator.set_state(state)  # the same draws as if never batched
                    r.error = None
                self.ctx.vmap_ok = False
                log.warning(
                    "lockstep: cannot vmap this model/loss (%s); clients run one by one",
                    str(exc).splitlines()[0][:160],
                )
        for r in reqs:
            try:
                r.result = self.ctx.local_sgd(r.params, r.data, r.generator, steps, lr)
            except Exception as exc:  # noqa: BLE001 - handed to the waiting client
                r.error = exc

    def _execute(self, reqs: list[_Request], steps: int, lr: float) -> None:
        ctx = self.ctx
        model, task = ctx.model, ctx.task
        model.module.train()
        dev = ctx.device
        params = torch.stack([r.params for r in reqs])
        xs = torch.nn.utils.rnn.pad_sequence([r.data.x_train for r in reqs], batch_first=True)
        ys = torch.nn.utils.rnn.pad_sequence([r.data.y_train for r in reqs], batch_first=True)
        rows = torch.arange(len(reqs), device=dev)[:, None]
        buffers = model.buffers

        def loss(p: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = functional_call(model.module, {**model.layout.unflatten(p), **buffers}, (x,))
            return task.loss(out, y)

        step = vmap(grad_and_value(loss), randomness="different")
        total = torch.zeros(len(reqs), device=dev)
        for _ in range(steps):
            idx = torch.stack(
                [
                    torch.randint(r.data.num_train, (ctx.batch_size,), generator=r.generator)
                    for r in reqs
                ]
            ).to(dev)
            grads, values = step(params, xs[rows, idx], ys[rows, idx])
            params = params - lr * grads
            total = total + values
        means = (total / max(steps, 1)).tolist()
        for r, p, mean in zip(reqs, params, means, strict=True):
            try:
                ctx.check_finite(p, mean, lr)
                r.result = (p.clone(), mean)
            except DivergenceError as exc:
                r.error = exc


def run_lockstep(
    clients: Sequence[int], fn: ClientFn, ctx: object, chunk: int = 1024
) -> dict[int, ClientResult]:
    """Run ``fn`` for every client in threads whose ``ctx.sgd`` calls are batched."""
    out: dict[int, ClientResult] = {}
    errors: dict[int, Exception] = {}
    for start in range(0, len(clients), chunk):
        part = list(clients[start : start + chunk])
        batcher = LockstepBatcher(ctx, len(part))

        def work(n: int, batcher: LockstepBatcher = batcher) -> None:
            try:
                out[n] = fn(n)
            except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
                errors[n] = exc
            finally:
                batcher.finished()

        ctx.batcher = batcher
        threads = [threading.Thread(target=work, args=(n,), daemon=True) for n in part]
        try:
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        finally:
            ctx.batcher = None
        if errors:
            first = min(errors)
            error = errors[first]
            if isinstance(error, DivergenceError):
                raise DivergenceError(f"client {first}: {error}") from None
            raise error
    return out


BACKENDS = {"sequential": run_sequential, "lockstep": run_lockstep}
