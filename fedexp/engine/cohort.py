"""The cohort path: a round's sampled clients trained as one computation (issue 14).

An algorithm whose client work is "local steps of one objective from a stacked starting
point" implements :meth:`fedexp.algorithms.base.Algorithm.cohort_update`: it receives the
cohort's decoded downlink messages stacked ``[m, d]`` and calls :meth:`Context.train_cohort`
once, instead of m ``client_update`` calls. The engine uses it with ``backend=lockstep`` (and
``auto``); the per-client hooks stay, give the same numbers up to floating-point summation
order (tests/test_cohort.py), and run everything else (other algorithms, models vmap cannot
run, BatchNorm statistics, per-client step counts).

What makes it cheap: the minibatch indices of every client and step come from one
counter-based expression (:func:`fedexp.engine.rng.batch_indices`, the draws a client's
:class:`fedexp.engine.rng.Stream` gives it alone), the data are gathered from the run's
:class:`fedexp.engine.pool.TrainPool` (concatenated once), and no Python runs per client
inside the steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from fedexp.data.federated import ClientData
from fedexp.engine.backends import (
    diverged_rows,
    stacked_gradients,
    stream_noise,
    train_stacked,
)
from fedexp.engine.objective import Objective
from fedexp.engine.optim import Optimizer
from fedexp.engine.optim import State as OptState
from fedexp.engine.rng import Stream, batch_indices
from fedexp.errors import DivergenceError

log = logging.getLogger("fedexp")

#: bytes of gathered minibatches (inputs and targets) a slice of the cohort takes per step:
#: 8 MiB is 2,048 tabular clients (batch 32 of 30 floats and a label) or 128 CNN clients
#: (batch 16 of 1x32x32). The round's transient memory then stays flat in N (issue 14's
#: 100,000-client run, docs/benchmarks.md), with no loss of speed in our trials.
_STEP_BYTES = 8 * 2**20
#: clients of a slice at most (the gathered index and per-client rows stay small too)
_CHUNK = 16384


def _slice_rows(pool, size: int) -> int:  # noqa: ANN001 - TrainPool
    """Clients per slice: ``_STEP_BYTES`` of a step's gathered minibatches, in [1, _CHUNK]."""
    row = pool.x[0].numel() * pool.x.element_size() + pool.y[0].numel() * pool.y.element_size()
    return max(1, min(_CHUNK, _STEP_BYTES // max(1, size * row)))


@dataclass
class Cohort:
    """The clients of one round, as the cohort path sees them.

    Attributes:
        clients: their ids, ascending.
        data: their data (views into ``pool``).
        rows: int64 [m] the clients' pool rows (= ids) on the device.
        keys: int64 [m] their round streams' keys (:func:`fedexp.engine.rng.stream_keys`).
        draws: int64 [m] minibatches each stream has drawn so far this round.
        pool: the run's training data (:class:`fedexp.engine.pool.TrainPool`).
        streams: the clients' round streams as generators (:class:`fedexp.engine.rng.Stream`,
            made on the first :meth:`noise` draw): the noise an objective asks for.
    """

    clients: list[int]
    data: Sequence[ClientData]
    rows: torch.Tensor
    keys: torch.Tensor
    draws: torch.Tensor
    pool: object
    streams: list[Stream] | None = None

    def __len__(self) -> int:
        return len(self.clients)

    def noise(self, k: int, device: torch.device) -> torch.Tensor:
        """Each client's next ``k`` uniforms [m, k], from its stream as ``local_train`` draws."""
        return stream_noise(self.generators(), k, device)

    def generators(self) -> list[Stream]:
        """The clients' round streams (made once, on the first call)."""
        if self.streams is None:
            self.streams = [Stream(key) for key in self.keys.tolist()]
        return self.streams

    def part(self, rows: slice) -> Cohort:
        """The clients ``rows`` of this cohort (their streams, if made, shared)."""
        return Cohort(
            self.clients[rows],
            self.data[rows],
            self.rows[rows],
            self.keys[rows],
            self.draws[rows],
            self.pool,
            None if self.streams is None else self.streams[rows],
        )


@dataclass
class CohortLocal:
    """What :func:`train_cohort` returns.

    Attributes:
        params: [m, d] final parameters.
        loss: [m] each client's mean training loss over the steps.
        opt_state: the optimiser's stacked state ``{name: [m, ...]}``.
    """

    params: torch.Tensor
    loss: torch.Tensor
    opt_state: OptState


@dataclass
class CohortResult:
    """What ``cohort_update`` returns: stacked uploads, per-client states and metrics.

    Attributes:
        updates: [m, ...] the clients' uploads (row i is client ``cohort.clients[i]``'s), a
            dict of such stacks for uploads with named parts, or None when the clients send
            nothing.
        states: each client's new state, in cohort order.
        metrics: name -> [m] per-client values (averaged over the round like
            ``ClientResult.metrics``).
    """

    updates: torch.Tensor | dict[str, torch.Tensor] | None
    states: list[dict[str, torch.Tensor]]
    metrics: dict[str, torch.Tensor]


def stack_opt_states(
    opt: Optimizer, params: torch.Tensor, states: Sequence[OptState | None]
) -> OptState | None:
    """The clients' optimiser states stacked per entry (fresh ones from ``opt.init``).

    Returns None when the clients' states do not have the same entries (the per-client path
    then runs).
    """
    if all(s is None for s in states):
        fresh = opt.init(params[0])
        return {k: torch.stack([opt.init(p)[k] for p in params]) for k in fresh}
    full = [opt.init(params[i]) if s is None else s for i, s in enumerate(states)]
    names = sorted(full[0])
    if any(sorted(s) != names for s in full):
        return None
    return {k: torch.stack([s[k].detach() for s in full]) for k in names}


def train_cohort(
    ctx,  # noqa: ANN001 - Context (import cycle)
    params: torch.Tensor,
    cohort: Cohort,
    objective: Objective,
    opt_state: OptState,
    steps: int,
    lr: float,
    keep: torch.Tensor | None = None,
    optimizer: Optimizer | None = None,
    batch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> CohortLocal:
    """``steps`` minibatch steps of every client of the cohort, as one computation.

    Client i's t-th minibatch is the one its stream would give it alone
    (:meth:`fedexp.engine.rng.Stream.indices` at draw ``cohort.draws[i]``), gathered from the
    pool; the objective's ``aux`` tensors are stacked ``[m, ...]`` (0-dim ones are shared),
    its ``lr_scale`` is one vector for all or ``[m, d]``; ``keep`` ([m, d] bool) marks the
    coordinates that do not move (a 0 of ``Context.train``'s mask). ``optimizer`` replaces the
    run's; with ``batch`` ([m, B, ...] inputs and targets, e.g. from :func:`draw_batch`) every
    step is on it and nothing is drawn.

    Raises:
        DivergenceError: a client's loss or parameters became NaN or infinite (the lowest
            client id is named, as the per-client path names it).
    """
    m = len(cohort)
    if objective.frozen is not None:
        raise ValueError("the cohort path takes objectives without frozen coordinates")
    aux = {k: v.expand(m) if v.dim() == 0 else v for k, v in objective.aux.items()}
    scale = objective.lr_scale
    if scale is not None:
        scale = scale.expand(m, params.shape[1])
    size = ctx.batch_size
    empty = torch.zeros(m, 0, device=params.device)
    opt = optimizer or ctx.optimizer

    def noise() -> torch.Tensor:  # after the indices, as ``local_train``
        return cohort.noise(objective.noise, params.device) if objective.noise else empty

    def draw() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xs, ys = draw_batch(ctx, cohort)
        return xs, ys, noise()

    fixed = batch is not None or size <= 0
    if fixed:  # every step on the same inputs: the given batch or the whole training sets
        xs, ys = batch if batch is not None else draw_batch(ctx, cohort)

        def draw() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: F811
            return xs, ys, noise()

    chunk = _slice_rows(cohort.pool, size)
    if m <= chunk or fixed:
        out, state, loss = train_stacked(
            ctx,
            objective,
            opt,
            steps,
            lr,
            params.detach(),
            aux,
            opt_state,
            draw,
            keep=keep,
            lr_scale=scale,
        )
        check_rows(ctx, cohort, out, loss, lr)
    else:  # large cohorts in slices: the per-step minibatch tensors stay small
        # (each slice is checked for divergence in order, so the lowest client is named)
        parts = []
        if objective.noise:
            cohort.generators()  # made once, then shared by the slices
        for a in range(0, m, chunk):
            part = slice(a, a + chunk)
            sub = cohort.part(part)
            parts.append(
                train_cohort(
                    ctx,
                    params[part],
                    sub,
                    replace(
                        objective,
                        aux={k: v[part] for k, v in aux.items()},
                        lr_scale=None if scale is None else scale[part],
                    ),
                    {k: v[part] for k, v in opt_state.items()},
                    steps,
                    lr,
                    None if keep is None else keep[part],
                    opt,
                )
            )
        cohort.draws = cohort.draws + steps
        out = torch.cat([p_.params for p_ in parts])
        loss = torch.cat([p_.loss for p_ in parts])
        state = {k: torch.cat([p_.opt_state[k] for p_ in parts]) for k in opt_state}
    return CohortLocal(out, loss, state)


def draw_batch(ctx, cohort: Cohort) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Each client's next minibatch, stacked ``[m, B, ...]``: what ``ClientData.batch`` gives it.

    The indices of every client's stream at its draw counter (advanced by one); with
    ``ctx.batch_size`` ≤ 0 every client's whole training set (equal sizes only), no draw.
    """
    size = ctx.batch_size
    if size <= 0:
        return (
            torch.stack([d.x_train for d in cohort.data]),
            torch.stack([d.y_train for d in cohort.data]),
        )
    idx = batch_indices(cohort.keys, cohort.draws, size, cohort.pool.size[cohort.rows])
    cohort.draws = cohort.draws + 1
    return cohort.pool.gather(cohort.rows, idx)


def loss_and_grad_cohort(
    ctx,  # noqa: ANN001 - Context (import cycle)
    params: torch.Tensor,
    cohort: Cohort,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Context.loss_and_grad`` of the whole cohort, each client on its next minibatch.

    Returns each client's task loss [m] and its gradient [m, d] at its row of ``params``, on
    the minibatch :func:`draw_batch` gives it (the module's train/eval mode left as it is, as
    ``Context.loss_and_grad`` leaves it).
    """
    objective = ctx.model_objective()
    if objective.frozen is not None:
        raise ValueError("the cohort path takes objectives without frozen coordinates")
    xs, ys = draw_batch(ctx, cohort)
    empty = torch.zeros(len(cohort), 0, device=params.device)
    grads, (values, _) = stacked_gradients(ctx, objective, posts=False)(
        params.detach(), xs, ys, {}, empty
    )
    return values.detach(), grads


@torch.no_grad()
def train_losses(
    ctx,  # noqa: ANN001 - Context (import cycle)
    candidates: Callable[[int, slice], torch.Tensor],
    count: int,
    data: Sequence[ClientData],
) -> torch.Tensor:
    """Each client's mean task loss on its training split under ``count`` candidate vectors.

    ``candidates(j, rows)`` gives candidate j's vectors ``[len(rows), d]`` of the clients
    ``rows`` (a slice of ``data``'s order); made chunk by chunk, so that m · count vectors
    never exist at once. The module in eval mode; the clients' training splits padded
    together once a chunk of about ``max(eval_batch_size, 8192)`` inputs, one vmapped
    forward pass a candidate and the task's per-client ``loss_batch`` (as
    ``Engine._evaluate_many`` evaluates). A task without ``loss_batch`` (segmentation) goes
    client by client, and so does a model vmap cannot run. Returns ``[m, count]`` float64 on
    the CPU.
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
                ctx.vmap_ok = False
                log.warning("batched losses: cannot vmap (%s)", str(exc).splitlines()[0][:160])
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


def check_rows(
    ctx,  # noqa: ANN001 - Context (import cycle)
    cohort: Cohort,
    params: torch.Tensor,
    loss: torch.Tensor,
    lr: float,
) -> None:
    """``Context.check_finite`` of every client at once ([m, d] parameters, [m] losses).

    Raises:
        DivergenceError: for the lowest client whose loss or parameters are not finite, named
            as the per-client path names it.
    """
    bad = diverged_rows(params, loss)
    if bad:
        i = min(bad)
        try:
            ctx.check_finite(params[i], float(loss[i]), lr)
        except DivergenceError as exc:
            raise DivergenceError(f"client {cohort.clients[i]}: {exc}") from None


def unstack_states(
    states: Sequence[dict[str, torch.Tensor]],
    opt: Optimizer,
    opt_state: OptState,
    prefix: str = "opt",
    **rows: torch.Tensor,
) -> list[dict[str, torch.Tensor]]:
    """Each client's new state, in cohort order.

    Its old state, updated with its row of each ``rows`` entry ([m, ...] tensors) and of the
    stacked optimiser state (``opt.save(..., prefix)``). Rows are copied: a view would keep
    the whole cohort's tensor alive in every client's state.
    """
    if not opt_state and not rows:
        return list(states)
    out = []
    for i, state in enumerate(states):
        row_opt = {k: v[i].clone() for k, v in opt_state.items()}
        new = {k: v[i].clone() for k, v in rows.items()}
        out.append({**state, **new, **opt.save(row_opt, prefix)})
    return out
