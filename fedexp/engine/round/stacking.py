"""Stacked runs: the client work of several runs as one cohort (issue 41).

A sweep's small runs that share the algorithm, the model and the local solver, and differ in
their seed or their data split, each keep their own engine: server state, client states,
channels and ledger, DP accountant, checkpoints, files and MLflow run. Only the round's client
work, ``Algorithm.client_update``, runs once for all of them: each run's sub-cohorts of alike
work (``Context.work_key``) are concatenated along the client axis with those of the other runs
of the same round and key, trained in one call, and split back. The figures are those of the
runs alone because every client draws from its own (seed, purpose, round, client) stream
(``Cohort.keys``, made by its own run) and the solver's steps are row-wise: only the grouping
of rows changes, which the engine's sub-cohorts already vary (``tests/test_stacking.py``).

The runs are threads of one process (``hydra/launcher=stacked``,
``hydra_plugins.fedexp_stacked``); each calls :meth:`Member.work` where it would call
``client_update``, and once the last one of the group arrives the merged call runs on the
stack's own thread, with the process's intra-op threads (:meth:`Stack.use_threads`), while
each run's own steps take one (:func:`fedexp.engine.runner.run`). OpenMP gives every thread
that enters a parallel region a team of its own: twenty runs at two threads each kept twenty
teams waking and spinning on two cores, and an ``index_add_`` of pFedNet's ADMM took 120 µs
instead of 9 (a group of 20 pFedNet runs: 52 s at two threads a run, 24 s at one). A run that
finishes, fails or is not built leaves (:meth:`Member.leave`), and the others go on without
it. An algorithm whose ``client_update`` reads something of its run beyond its arguments (the
run's seed: FedALA's slices, L2GD's coins) says ``stacks = False`` and its runs' work is
called run by run (still in one process).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import threading
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedexp.contract import Cohort
from fedexp.contract import CohortResult
from fedexp.contract import CohortStates
from fedexp.contract import Stacked
from fedexp.contract import State

if TYPE_CHECKING:
    from fedexp.algorithms.base import Algorithm
    from fedexp.engine.solver.context import Context

#: The stack member of the run this thread runs (set by the stacked launcher), else None.
current: contextvars.ContextVar[Member | None] = contextvars.ContextVar("stack", default=None)


class Stopped(KeyboardInterrupt):
    """The stacked sweep was stopped (Ctrl-C, SIGTERM): every run of the group stops."""


@dataclass
class Work:
    """One sub-cohort's client work, as ``client_update`` takes it.

    Attributes:
        key: its ``Context.work_key`` (sub-cohorts of different keys never merge).
        inbox: the clients' decoded downlink, stacked (None: nothing received).
        states: their states.
        cohort: the clients.
    """

    key: Hashable
    inbox: Stacked | None
    states: CohortStates | list[State]
    cohort: Cohort


@dataclass
class _Request:
    ctx: Context
    algorithm: Algorithm
    works: list[Work]
    results: list[CohortResult] | None = None
    error: BaseException | None = None


class Stack:
    """A group of runs whose client work is merged; one :class:`Member` per run.

    Args:
        size: the number of runs (members).
    """

    def __init__(self, size: int) -> None:
        self.members = [Member(self, i) for i in range(size)]
        self._cond = threading.Condition()
        self._active = size
        self._pending: list[_Request] = []
        self._stopped = False
        self._pool: tuple[tuple[Any, ...], Any, list[int]] | None = None
        self._signatures: dict[tuple[int, int], Hashable] = {}
        self._turn = threading.Lock()  # held by the one run whose thread runs (Member.turns)
        self._threads = 0  # the merged work's intra-op threads (0: torch's as they are)
        self._worker: cf.ThreadPoolExecutor | None = None  # runs the merged work
        #: merged ``client_update`` calls made, and the clients they trained (the figures of
        #: the benchmark and of the tests)
        self.calls = 0
        self.clients = 0

    def use_threads(self, threads: int) -> None:
        """The intra-op threads of the merged client work (the run's choice; the same for all).

        The work runs on the stack's own thread, which takes them once: a thread's OpenMP and
        MKL settings are its own.
        """
        self._threads = int(threads)

    def _execute(self, batch: list[_Request]) -> None:
        """``batch``'s work on the stack's thread (started on first use); returns when done."""
        with self._cond:
            if self._worker is None:
                self._worker = cf.ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix="fedexp-stack",
                    initializer=_take_threads,
                    initargs=(self._threads,),
                )
            worker = self._worker
        context = contextvars.copy_context()  # (the arriving run's, as when it ran the work)
        worker.submit(context.run, self._run, batch).result()

    def stop(self) -> None:
        """Stop every run: members waiting, or arriving later, raise :class:`Stopped`."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _arrive(self, request: _Request) -> list[CohortResult]:
        with self._cond:
            if self._stopped:
                raise Stopped("the stacked sweep was stopped")
            self._pending.append(request)
            batch = self._take()
            if batch is None:
                while request.results is None and request.error is None and not self._stopped:
                    self._cond.wait()
                if request.results is None and request.error is None:
                    raise Stopped("the stacked sweep was stopped")
        if batch is not None:
            self._execute(batch)
        if request.error is not None:
            raise request.error
        assert request.results is not None
        return request.results

    def _leave(self) -> None:
        with self._cond:
            self._active -= 1
            batch = self._take()
            worker = self._worker if self._active == 0 else None
        if batch is not None:
            self._execute(batch)
        if worker is not None:  # the group's last run has left
            worker.shutdown(wait=False)

    def _take(self) -> list[_Request] | None:
        """Every pending request once every active member waits (under the lock), else None."""
        if not self._pending or len(self._pending) < self._active:
            return None
        batch, self._pending = self._pending, []
        return batch

    def _run(self, batch: list[_Request]) -> None:
        """The batch's work, merged where it may be; results (or errors) to each request."""
        try:
            self._work(batch)
        except BaseException as exc:  # noqa: BLE001 - to the members, each its own
            for r in batch:
                if r.results is None:
                    r.error = exc
        finally:
            with self._cond:
                self._cond.notify_all()

    def _work(self, batch: list[_Request]) -> None:
        for r in batch:
            if not r.algorithm.stacks:
                got = [_safely(r, w) for w in r.works]
                failed = next((g for g in got if isinstance(g, BaseException)), None)
                r.error, r.results = (failed, None) if failed else (None, got)  # type: ignore[assignment]
        together = [r for r in batch if r.algorithm.stacks]
        groups: dict[tuple[Hashable, ...], list[tuple[_Request, int]]] = {}
        for r in together:
            sign = self._signature(r)
            for i, w in enumerate(r.works):
                groups.setdefault((sign, r.ctx.round, w.key), []).append((r, i))
        out: dict[int, list[CohortResult | None]] = {id(r): [None] * len(r.works) for r in together}
        for members in groups.values():
            if len(members) == 1:
                r, i = members[0]
                out[id(r)][i] = _safely(r, r.works[i])  # type: ignore[assignment]
                continue
            try:
                results = self._merged([r.works[i] for r, i in members], members[0][0])
            except Exception:  # noqa: BLE001 - one run's failure (a divergence) is its own:
                results = [  # each run's work alone then raises in (only) that run
                    _safely(r, r.works[i]) for r, i in members
                ]
            for (r, i), result in zip(members, results, strict=True):
                out[id(r)][i] = result
        for r in together:
            got = out[id(r)]
            failed = next((g for g in got if isinstance(g, BaseException)), None)
            if failed is not None:
                r.error = failed
            else:
                r.results = got  # type: ignore[assignment]

    def _signature(self, r: _Request) -> Hashable:
        """What runs whose work merges share: the algorithm's and the solver's settings.

        The launcher stacks runs that differ in seed and data split only; this holds the
        merge to it whatever the caller (two runs of different ``lr`` train apart).
        """
        key = (id(r.ctx), id(r.algorithm))
        if key not in self._signatures:
            ctx = r.ctx
            self._signatures[key] = (
                type(r.algorithm),
                _settings(r.algorithm),
                _settings(ctx.optimizer),
                type(ctx.optimizer),
                type(ctx.task),
                _settings(ctx.task),
                repr(ctx.model.module),
                tuple(ctx.personal_idx.tolist()),
                tuple(ctx.shared_idx.tolist()),
                type(ctx.augment),
                _settings(ctx.augment),
                (ctx.lr, ctx.local_steps, ctx.local_epochs, ctx.batch_size, ctx.sampling),
                (ctx.num_clients, ctx.vmap_ok, ctx.solver),  # (a memory budget: the first's)
            )
        return self._signatures[key]

    def _merged(self, works: list[Work], first: _Request) -> list[CohortResult]:
        """One ``client_update`` over ``works`` (the first run's context and algorithm)."""
        pool, bases = self._merged_pool([w.cohort.pool for w in works])
        cohort = Cohort(
            clients=[n for w in works for n in w.cohort.clients],
            data=[d for w in works for d in w.cohort.data],
            rows=torch.cat([w.cohort.rows + b for w, b in zip(works, bases, strict=True)]),
            keys=torch.cat([w.cohort.keys for w in works]),
            draws=torch.cat([w.cohort.draws for w in works]),
            pool=pool,
        )
        sizes = [len(w.cohort) for w in works]
        inbox = concat_stacked([w.inbox for w in works])
        states = concat_states([w.states for w in works])
        result = first.algorithm.client_update(first.ctx, inbox, states, cohort)
        self.calls += 1
        self.clients += len(cohort)
        return split_result(result, sizes)

    def _merged_pool(self, pools: list[Any]) -> tuple[Any, list[int]]:
        """The pools concatenated (made once per set of pools), and each one's first row."""
        from fedexp.engine.clients.pool import TrainPool

        unique = list(dict.fromkeys(pools))
        key = tuple(id(p) for p in unique)
        if self._pool is None or tuple(id(p) for p in self._pool[0]) != key:
            merged = TrainPool.__new__(TrainPool)
            merged.x = torch.cat([p.x for p in unique])
            merged.y = torch.cat([p.y for p in unique])
            rows = [0]
            for p in unique:
                rows.append(rows[-1] + p.x.shape[0])
            merged.offset = torch.cat([p.offset + r for p, r in zip(unique, rows, strict=False)])
            merged.size = torch.cat([p.size for p in unique])
            merged.sizes = np.concatenate([p.sizes for p in unique])
            firsts = [0]
            for p in unique:
                firsts.append(firsts[-1] + len(p.size))
            self._pool = (tuple(unique), merged, firsts)  # (holds the pools: their ids stay)
        held, merged, firsts = self._pool
        first_of = {id(p): f for p, f in zip(held, firsts, strict=False)}
        return merged, [first_of[id(p)] for p in pools]


class Member:
    """One run's place in a :class:`Stack`."""

    def __init__(self, stack: Stack, index: int) -> None:
        self.stack, self.index = stack, index
        self._left = False
        self._holding = False

    @contextlib.contextmanager
    def turns(self) -> Iterator[None]:
        """Run the block (the run's thread) one run at a time.

        The stack's turn is held but while :meth:`work` waits for the others. The runs' own
        Python (rounds' bookkeeping, evaluation, files, figures) then never contends for the
        interpreter: many threads each taking many short torch calls would otherwise wait on
        one another at every call (the interpreter's switch interval).
        """
        self.stack._turn.acquire()
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            self.stack._turn.release()

    def work(self, ctx: Context, algorithm: Algorithm, works: list[Work]) -> list[CohortResult]:
        """The results of ``works`` (this run's sub-cohorts), with the group's others'."""
        with self.aside():
            return self.stack._arrive(_Request(ctx, algorithm, works))

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The block waits (on the group, on another thread or process): the turn is let go.

        The group's other runs take their turns meanwhile; the block's end takes it back.
        """
        holding = self._holding
        if holding:
            self._holding = False
            self.stack._turn.release()
        try:
            yield
        finally:
            if holding:
                self.stack._turn.acquire()
                self._holding = True

    def leave(self) -> None:
        """This run takes no further part (finished, failed, or never built); idempotent."""
        if not self._left:
            self._left = True
            self.stack._leave()


@contextlib.contextmanager
def aside() -> Iterator[None]:
    """:meth:`Member.aside` of this thread's run, if it is one of a stacked group's."""
    member = current.get()
    if member is None:
        yield
    else:
        with member.aside():
            yield


def _take_threads(threads: int) -> None:
    """The stack's thread takes ``threads`` intra-op threads (0: leaves torch's as they are)."""
    if threads > 0:
        torch.set_num_threads(threads)


def _settings(obj: object) -> tuple[tuple[str, Any], ...]:
    """An object's plain settings (numbers, strings, their tuples), by name."""
    plain = (int, float, str, bool, type(None))

    def ok(v: object) -> bool:
        return isinstance(v, plain) or (
            isinstance(v, (tuple, list)) and all(isinstance(x, plain) for x in v)
        )

    items = getattr(obj, "__dict__", {}).items()
    return tuple(sorted((k, repr(v)) for k, v in items if ok(v)))


def _safely(r: _Request, w: Work) -> CohortResult | BaseException:
    """``w`` alone with its run's context and algorithm; an error is returned, for that run."""
    try:
        return r.algorithm.client_update(r.ctx, w.inbox, w.states, w.cohort)
    except Exception as exc:  # noqa: BLE001 - handed to that run
        return exc


def concat_stacked(parts: Sequence[Stacked | None]) -> Stacked | None:
    """Stacked messages of several cohorts, one after the other (None: none has any)."""
    first = parts[0]
    if first is None:
        if any(p is not None for p in parts):
            raise ValueError("stacked runs: some runs' clients receive a message, some do not")
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)  # type: ignore[arg-type]
    return {k: torch.cat([p[k] for p in parts]) for k in first}  # type: ignore[index]


def concat_states(parts: Sequence[CohortStates | list[State]]) -> CohortStates:
    """Client states of several cohorts, one after the other."""
    regular = all(isinstance(p, CohortStates) and p._rows is None for p in parts)
    keys = {tuple(p.keys()) for p in parts} if regular else set()
    if not regular or len(keys) != 1:
        return CohortStates.of_rows([s for p in parts for s in p])
    stacks = {k: torch.cat([p.stack(k) for p in parts]) for k in parts[0].keys()}  # type: ignore[union-attr]
    masked = {k for p in parts for k in p.present}  # type: ignore[union-attr]
    present = {
        k: torch.cat(
            [
                p.present.get(k, torch.ones(len(p), dtype=torch.bool, device=stacks[k].device))  # type: ignore[union-attr]
                for p in parts
            ]
        )
        for k in masked
    }
    return CohortStates(sum(len(p) for p in parts), stacks, present)


def split_result(result: CohortResult, sizes: Sequence[int]) -> list[CohortResult]:
    """A merged cohort's result cut back into its parts' (of ``sizes`` rows each)."""
    out, start = [], 0
    for m in sizes:
        rows = slice(start, start + m)
        start += m
        updates: Stacked | None = None
        if isinstance(result.updates, torch.Tensor):
            updates = result.updates[rows]
        elif isinstance(result.updates, dict):
            updates = {k: v[rows] for k, v in result.updates.items()}
        states: CohortStates | list[State]
        s = result.states
        if isinstance(s, CohortStates) and s._rows is None:
            states = CohortStates(
                m,
                {k: v[rows] for k, v in s.stacks.items()},
                {k: v[rows] for k, v in s.present.items()},
            )
        else:
            states = list(s)[rows]
        out.append(CohortResult(updates, states, {k: v[rows] for k, v in result.metrics.items()}))
    return out
