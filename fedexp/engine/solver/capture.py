"""A round's client work captured: the local steps as one CUDA graph, replayed (issue 69).

A cohort's local steps dispatch a few hundred small kernels a step (a CNN's vmapped forward
and backward, the optimiser's arithmetic, the minibatch gathers), each launched from the host
at some µs: on a GPU the launches, not the arithmetic, set a small model's round. A CUDA
graph (:class:`torch.cuda.CUDAGraph`) records them once and replays them with one launch.

What makes the steps replayable is that nothing of them depends on the host:

* **static buffers** (:class:`StaticRound`): the cohort's parameters, optimiser state,
  objective tensors (``aux``, the linear term, the mask, the step-size factors) and every
  step's minibatch rows of the pool (``[steps, m, B]``, drawn ahead on the host by
  :meth:`fedexp.engine.solver.steps.Ahead.all_steps`) and their validity live in tensors
  made once; a round copies its inputs into them and reads its outputs out of them;
* **the step function** (:func:`replayable`): :func:`fedexp.engine.solver.steps.train_stacked`
  itself, its minibatches gathered from the static rows, every step's masks applied (a step
  whose batches are all whole has an all-true mask: the same sums, the same bits as the
  skipped masks), the optimiser's per-step constants made from the static state. It reads
  nothing back on the host;
* **the cache** (:class:`CapturedSolver`): one :class:`StaticRound` and graph per cohort size
  and step count (and what else the recorded kernels bake in: the objective's functions, the
  optimiser, the step size, the tensors' shapes), reused by every round.

On a GPU (``capture=auto``, the default, on a CUDA device) the function is captured at its
first round and replayed after; where capture fails (an op CUDA graphs refuse) the key runs
eagerly from then on, with one log line. Where the steps do not fit the static form (rows by
row, full batches, noise draws, augmentation, cohorts in slices, a round's draws beyond one
block) the solver's eager path runs, unchanged. On the CPU ``graphs=False`` runs the same
static-buffer function eagerly (what the tests compare against the eager path: within 1e-6
relative). ``capture=off`` keeps the eager solver on every device.

The replay follows NVIDIA's CUDA graphs and PyTorch's ``torch.cuda.graphs`` notes (warm-up on
a side stream, capture, replay on static tensors).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedexp.contract import Cohort
from fedexp.engine.solver import steps as solver
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.optim import Optimizer
from fedexp.engine.solver.optim import State as OptState
from fedexp.engine.solver.optim import stack_states
from fedexp.models.task import PADDING

if TYPE_CHECKING:
    from fedexp.engine.solver.context import Context

log = logging.getLogger("fedexp")

#: the ``capture`` setting's values
CHOICES = ("auto", "off")
#: recorded keys kept at most (each graph holds a memory pool of its own): the oldest goes
_MAX_KEYS = 8


@dataclass
class StaticRound:
    """The static tensors a captured round reads and writes (made once a key).

    Attributes:
        params: ``[m, d]`` starting points (input).
        state: the optimiser's stacked state (input).
        aux: the objective's stacked ``aux`` tensors (input).
        linear: ``[m, d]`` linear term, or None (input).
        keep: ``[m, d]`` coordinates that stay, or None (input).
        scale: ``[m, d]`` step-size factors, or None (input).
        rows: ``[steps, m, B]`` each step's rows of the pool (input).
        valid: ``[steps, m, B, 1, ...]`` which rows are samples, or None (input).
        out_params: ``[m, d]`` final parameters (output).
        out_state: the final optimiser state (output).
        loss: ``[m]`` each client's mean loss over the steps (output).
    """

    params: torch.Tensor
    state: OptState
    aux: dict[str, torch.Tensor]
    linear: torch.Tensor | None
    keep: torch.Tensor | None
    scale: torch.Tensor | None
    rows: torch.Tensor
    valid: torch.Tensor | None
    out_params: torch.Tensor
    out_state: OptState
    loss: torch.Tensor

    @classmethod
    def like(
        cls, params: torch.Tensor, state: OptState, inputs: dict[str, Any], steps: int
    ) -> StaticRound:
        """Buffers of the shapes of one round's inputs (its values not copied yet)."""

        def empty(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)

        return cls(
            params=torch.empty_like(params),
            state={k: torch.empty_like(v) for k, v in state.items()},
            aux={k: torch.empty_like(v) for k, v in inputs["aux"].items()},
            linear=empty(inputs["linear"]),
            keep=empty(inputs["keep"]),
            scale=empty(inputs["scale"]),
            rows=torch.empty_like(inputs["rows"]),
            valid=empty(inputs["valid"]),
            out_params=torch.empty_like(params),
            out_state={k: torch.empty_like(v) for k, v in state.items()},
            loss=torch.empty(params.shape[0], dtype=params.dtype, device=params.device),
        )

    def load(self, params: torch.Tensor, state: OptState, inputs: dict[str, Any]) -> None:
        """Copy a round's inputs into the buffers (host tensors without a wait)."""
        self.params.copy_(params)
        for k, v in state.items():
            self.state[k].copy_(v)
        for k, v in inputs["aux"].items():
            self.aux[k].copy_(v)
        for name in ("linear", "keep", "scale"):
            mine = getattr(self, name)
            if mine is not None:
                mine.copy_(inputs[name])
        self.rows.copy_(inputs["rows"], non_blocking=True)
        if self.valid is not None:
            self.valid.copy_(inputs["valid"], non_blocking=True)


def replayable(
    ctx: Context, obj: Objective, opt: Optimizer, steps: int, lr: float, buf: StaticRound, pool
) -> Callable[[], None]:  # noqa: ANN001 - pool: TrainPool
    """The round's local steps on ``buf``: reads its inputs, writes its outputs; no host read.

    :func:`fedexp.engine.solver.steps.train_stacked` with each step's minibatch gathered from
    ``buf.rows`` (and masked by ``buf.valid`` where batches can be short): the eager path's
    arithmetic on the same draws.
    """
    sub = Objective(
        obj.loss, aux=buf.aux, frozen=obj.frozen, lr_scale=buf.scale, noise=0,
        project=obj.project, stacked=obj.stacked, linear=buf.linear,
        stacked_grad=obj.stacked_grad,
    )  # fmt: skip
    empty = torch.zeros(buf.params.shape[0], 0, device=buf.params.device)
    y = pool.y
    pad = torch.full((), PADDING, dtype=y.dtype if y.is_floating_point() else torch.int64,
                     device=y.device)  # fmt: skip
    masked = buf.valid is not None

    def run() -> None:
        rows = buf.rows.unbind(0)
        valid = buf.valid.unbind(0) if masked else None
        at = iter(range(steps))

        def draw() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
            i = next(at)
            xb, yb = pool.take(rows[i])
            if valid is not None:
                yb = torch.where(valid[i], yb if yb.is_floating_point() else yb.long(), pad)
            return xb, yb, empty, not masked

        out, state, loss = solver.train_stacked(
            ctx, sub, opt, steps, lr, buf.params, sub.aux, dict(buf.state), draw,
            keep=buf.keep, lr_scale=buf.scale, linear=buf.linear,
        )  # fmt: skip
        buf.out_params.copy_(out)
        for k, v in state.items():
            buf.out_state[k].copy_(v)
        buf.loss.copy_(loss)

    return run


class _Entry:
    """One key's buffers, step function and (on a GPU) graph."""

    def __init__(self, buf: StaticRound, fn: Callable[[], None]) -> None:
        self.buf, self.fn = buf, fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager = False  # capture failed: the function runs eagerly

    def capture(self) -> None:
        """Warm the function up on a side stream, then record it (PyTorch's recipe)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.fn()
        self.graph = graph

    def replay(self) -> None:
        """The round's steps: the graph's replay, or the function run eagerly."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def _describe(fn: object) -> Hashable:
    """What a function bakes into recorded kernels: itself, its bound object, its arguments."""
    if fn is None:
        return None
    if isinstance(fn, functools.partial):
        args = tuple(a if isinstance(a, Hashable) else id(a) for a in fn.args)
        kw = tuple(
            sorted((k, v if isinstance(v, Hashable) else id(v)) for k, v in fn.keywords.items())
        )
        return (_describe(fn.func), args, kw)
    owner = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    return (func, None if owner is None else id(owner))


class CapturedSolver:
    """The local solver with a round's steps as static buffers, replayed (the module's doc).

    A drop-in :attr:`fedexp.engine.solver.context.Context.solver`: a call it cannot take
    statically goes to :func:`fedexp.engine.solver.steps.train` unchanged.

    Args:
        graphs: record CUDA graphs (a CUDA device); False: the static-buffer function runs
            eagerly at every call (the CPU's form of the same path, for the tests).
    """

    def __init__(self, graphs: bool) -> None:
        self.graphs = graphs
        #: key (cohort size, steps, what the kernels bake in) -> its buffers and graph
        self.cache: dict[Hashable, _Entry] = {}
        self.evicted = False  # (said once)

    def __call__(self, ctx: Context, params: torch.Tensor, cohort: Cohort, **options: Any) -> Any:
        """:func:`fedexp.engine.solver.steps.train`'s contract; statically where it can."""
        if options.get("batch") is not None:
            return solver.train(ctx, params, cohort, **options)
        steps = options.get("steps")
        steps = ctx.cohort_steps(cohort) if steps is None else steps
        objective = options.get("objective") or ctx.model_objective()
        opt = options.get("optimizer") or ctx.optimizer
        lr = ctx.lr if options.get("lr") is None else options["lr"]
        m = len(cohort)
        if not self._static(ctx, objective, cohort, steps):
            return solver.train(ctx, params, cohort, **options)
        opt_states = options.get("opt_states")
        if isinstance(opt_states, dict):
            stacked = opt_states
        else:
            stacked = stack_states(opt, params, opt_states or [None] * m)
        mask = options.get("mask")
        restore = solver._snapshot(cohort)
        drawn = solver.Ahead(ctx, cohort, steps).all_steps()
        if drawn is None:  # more draws than one block (the cohort's counters untouched)
            return solver.train(ctx, params, cohort, **options)
        rows, valid = drawn
        d = params.shape[1]
        inputs = {
            "aux": {k: v.expand(m) if v.dim() == 0 else v for k, v in objective.aux.items()},
            "linear": None if objective.linear is None else objective.linear.expand(m, d),
            "keep": None if mask is None else (mask == 0).expand(m, d),
            "scale": None if objective.lr_scale is None else objective.lr_scale.expand(m, d),
            "rows": rows,
            "valid": valid,
        }
        key = self._key(m, steps, objective, opt, lr, params, stacked, inputs)
        entry = self.cache.get(key)
        if entry is None:
            if len(self.cache) >= _MAX_KEYS:  # keys that change every round: bounded memory
                self.cache.pop(next(iter(self.cache)))
                if not self.evicted:
                    log.warning(
                        "capture: more than %d kinds of local steps; the oldest recording "
                        "dropped (a key that changes every round?)",
                        _MAX_KEYS,
                    )
                self.evicted = True
            buf = StaticRound.like(params, stacked, inputs, steps)
            fn = replayable(ctx, objective, opt, steps, lr, buf, cohort.pool)
            entry = self.cache[key] = _Entry(buf, fn)
            entry.buf.load(params.detach(), stacked, inputs)
            if self.graphs:
                try:
                    entry.capture()
                except RuntimeError as exc:  # an op graphs refuse: this key stays eager
                    entry.graph, entry.eager = None, True
                    log.warning(
                        "capture: cannot record the local steps (%s); eager", str(exc)[:160]
                    )
        else:
            entry.buf.load(params.detach(), stacked, inputs)
        try:
            entry.replay()
        except RuntimeError as exc:  # an op vmap refuses: the same draws again, row by row
            if entry.graph is not None:
                raise
            del self.cache[key]
            solver._refused(ctx, exc, "captured solver")
            restore()
            return solver.train(ctx, params, cohort, **options)
        buf = entry.buf
        out = solver.CohortLocal(
            buf.out_params.clone(),
            buf.loss.clone(),
            {k: v.clone() for k, v in buf.out_state.items()},
        )
        solver.check_rows(ctx, cohort, out.params, out.loss, lr)
        return out

    @staticmethod
    def _static(ctx: Context, obj: Objective, cohort: Cohort, steps: int) -> bool:
        """Whether the call's steps fit the static form (else the eager solver takes it)."""
        return (
            steps >= 1
            and ctx.batch_size > 0
            and obj.noise == 0
            and not ctx.augment.active
            and not solver.rowwise(ctx, obj)
            and len(cohort) <= solver._slice_rows(ctx, cohort.pool, ctx.batch_size)
        )

    @staticmethod
    def _key(
        m: int, steps: int, obj: Objective, opt: Optimizer, lr: float, params: torch.Tensor,
        state: OptState, inputs: dict[str, Any],
    ) -> Hashable:  # fmt: skip
        """The cohort size and step count, and what else the recorded kernels bake in."""

        def shape(t: torch.Tensor | None) -> Hashable:
            return None if t is None else (tuple(t.shape), t.dtype)

        return (
            m,
            steps,
            _describe(obj.loss),
            _describe(obj.stacked),
            _describe(obj.stacked_grad),
            _describe(obj.project),
            None if obj.frozen is None else id(obj.frozen),
            id(opt),
            float(lr),
            shape(params),
            tuple(sorted((k, shape(v)) for k, v in state.items())),
            tuple(sorted((k, shape(v)) for k, v in inputs["aux"].items())),
            tuple(shape(inputs[k]) for k in ("linear", "keep", "scale", "rows", "valid")),
        )


def solver_for(setting: str, device: torch.device) -> Callable[..., Any]:
    """The run's local solver for the ``capture`` setting on ``device``.

    ``auto``: captured rounds on a CUDA device, the eager solver elsewhere; ``off``: eager.
    """
    if setting == "auto" and torch.device(device).type == "cuda":
        return CapturedSolver(graphs=True)
    return solver.train


__all__ = ["CHOICES", "CapturedSolver", "StaticRound", "replayable", "solver_for"]
