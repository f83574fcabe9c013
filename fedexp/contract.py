"""The algorithm contract's types: what crosses between the engine and an algorithm.

A bottom module: it imports nothing of fedexp's engine, so that the engine, the local solver
and the algorithms all build on it without import cycles (``tests/test_imports.py``).

One round, for the sampled clients as one cohort (:class:`Cohort`; one client alone is a
cohort of one)::

    msgs    = algorithm.downlinks(ctx, server, clients)         # {client: Message | None}
    result  = algorithm.client_update(ctx, stacked msgs, states, cohort)   # CohortResult
    server  = algorithm.server_update(ctx, server, received uploads, weights)

Messages cross as bytes (``fedexp.comm``); the hooks only see decoded tensors, stacked
``[m, ...]`` in cohort order.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedexp.transfer import to_device

if TYPE_CHECKING:
    from fedexp.data.client import ClientData

State = dict[str, torch.Tensor]
#: What crosses the network: one tensor, or named parts (IFCA: the k cluster models down).
Message = torch.Tensor | dict[str, torch.Tensor]
#: A cohort's messages: ``[m, ...]`` stacks, or a dict of such stacks part by part.
Stacked = torch.Tensor | dict[str, torch.Tensor]
#: How a message part is coded (``fedexp.engine.round.transport.Transport._transmit``).
PART_KINDS = ("model", "update", "exact")


@dataclass
class Cohort:
    """The clients whose work of a round runs as one computation.

    Every client of a cohort takes the same number of local steps (the engine groups a round's
    clients by :meth:`fedexp.engine.solver.context.Context.work_key` into sub-cohorts), so their
    steps stack.

    ``rows``, ``keys`` and ``draws`` live on the host whatever the run's device: the draws'
    bookkeeping (which minibatch each stream draws next, the noise streams' seeds) is then
    read without waiting for a GPU, and what a step needs on the device goes over in a copy
    the host does not wait for (:func:`fedexp.transfer.to_device`; :meth:`TrainPool.gather
    <fedexp.engine.clients.pool.TrainPool.gather>` takes host rows).

    Attributes:
        clients: their ids, ascending.
        data: their data (rows of ``pool``).
        rows: int64 [m] the clients' pool rows.
        keys: int64 [m] their round streams' keys (:func:`fedexp.streams.stream_keys`).
        draws: int64 [m] minibatches each stream has drawn so far this round.
        pool: the run's training data (:class:`fedexp.engine.clients.pool.TrainPool`).
        streams: the clients' round streams as generators (made by the solver on the first
            noise draw, :func:`fedexp.engine.solver.steps.noise`).
    """

    clients: list[int]
    data: Sequence[ClientData]
    rows: torch.Tensor
    keys: torch.Tensor
    draws: torch.Tensor
    pool: Any
    streams: list[torch.Generator] | None = None

    def __len__(self) -> int:
        return len(self.clients)

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


class CohortStates(Sequence[State]):
    """A cohort's client states, stacked by key: ``{key: [m, ...]}``, row i client i's.

    What ``client_update`` reads its clients' states as, and may return them as: one tensor
    per key for the whole cohort, so that reading, updating and writing back the states of
    m clients costs the same few tensor operations for any m (a GPU launches one kernel per
    op: an op per client would make a round's cost grow with the cohort).

    A row may lack a key (a client whose optimiser state is fresh, a key its algorithm writes
    some rounds only): :attr:`present` holds a bool ``[m]`` mask for each key some rows may
    lack (a key not in it is in every row), and a lacking row holds its algorithm's initial
    value of the key, or zeros (which is what a fresh optimiser state is).

    Read per client (``states[i]``, iteration) it is the list of dicts the contract had before:
    row views of the keys each row has (this reads the masks on the host once, and costs ops
    per client: for hooks not yet written over stacks).

    Args:
        size: m, the number of rows.
        stacks: key -> ``[m, ...]``.
        present: key -> bool ``[m]`` for the keys some rows may lack.
    """

    def __init__(
        self,
        size: int,
        stacks: Mapping[str, torch.Tensor] | None = None,
        present: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.size = size
        self.stacks: dict[str, torch.Tensor] = dict(stacks or {})
        self.present: dict[str, torch.Tensor] = dict(present or {})
        for key, value in self.stacks.items():
            if value.shape[:1] != (size,):
                raise ValueError(f"state {key!r}: {tuple(value.shape)} for {size} clients")
        self._rows: list[State] | None = None

    @classmethod
    def of_rows(cls, states: Sequence[State]) -> CohortStates:
        """Per-client states stacked (keys some rows lack get a mask and zeros there)."""
        if isinstance(states, CohortStates):
            return states
        m = len(states)
        keys = list(dict.fromkeys(k for s in states for k in s))
        stacks, present, irregular = {}, {}, False
        for key in keys:
            like = next(s[key] for s in states if key in s)
            rows = [s.get(key) for s in states]
            if any(r is not None and (r.shape, r.dtype) != (like.shape, like.dtype) for r in rows):
                irregular = True  # rows of different shapes: read per row only
                continue
            if any(r is None for r in rows):
                present[key] = to_device([r is not None for r in rows], like.device)
                zero = torch.zeros_like(like)
                rows = [zero if r is None else r for r in rows]
            stacks[key] = torch.stack([r.detach() for r in rows])
        out = cls(m, stacks, present)
        if irregular:
            out._rows = list(states)
        return out

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - Sequence's
        rows = self._per_row()
        return rows[i]

    def __iter__(self):  # noqa: ANN204 - Sequence's
        return iter(self._per_row())

    def _per_row(self) -> list[State]:
        """Each row's state as a dict of views (the masks read once; cached)."""
        if self._rows is None:
            has = {k: p.tolist() for k, p in self.present.items()}
            self._rows = [
                {k: v[i] for k, v in self.stacks.items() if k not in has or has[k][i]}
                for i in range(self.size)
            ]
        return self._rows

    def keys(self) -> list[str]:
        """The keys some row has."""
        return list(self.stacks)

    def __contains__(self, key: object) -> bool:
        return key in self.stacks

    def stack(self, key: str) -> torch.Tensor:
        """``[m, ...]`` every row's value of ``key`` (lacking rows: initial value or zeros).

        Raises:
            KeyError: no row has ``key``.
        """
        return self.stacks[key]

    def updated(
        self,
        opt_state: Mapping[str, torch.Tensor] | None = None,
        prefix: str = "opt",
        **rows: torch.Tensor,
    ) -> CohortStates:
        """These states with ``rows`` (``[m, ...]`` each) set and the optimiser state saved.

        ``opt_state``: the solver's stacked optimiser state (``CohortLocal.opt_state``), kept
        under ``<prefix>.<name>`` (pass it only for an optimiser with persistent state).
        """
        new = dict(rows)
        for name, value in (opt_state or {}).items():
            new[f"{prefix}.{name}"] = value
        if self._rows is not None and any(  # keys of several shapes: per row
            k not in self.stacks for row in self._rows for k in row
        ):
            return CohortStates.of_rows(
                [{**row, **{k: v[i] for k, v in new.items()}} for i, row in enumerate(self._rows)]
            )
        stacks, present = dict(self.stacks), dict(self.present)
        for key, value in new.items():
            stacks[key] = value.detach()
            present.pop(key, None)
        return CohortStates(self.size, stacks, present)


class Senders:
    """Who the round's server step hears from, whatever the slicing or the processes.

    A server that reads only the weighted mean of the uploads (``server_reads = "mean"``) is
    handed one pre-summed upload (:class:`MeanUpload`) when the round runs in memory slices or
    over several processes; these figures are the round's all the same (every process's,
    every slice's). SCAFFOLD's and FedDyn's server steps scale the mean by |S|/N with them.
    What the engine sets on ``ctx.senders`` before ``server_update``.

    Args:
        clients: the round's senders S_t, ascending, over every process.
        sizes: every client's training-set size (NumPy or a tensor, ``[N]``; read only when
            :attr:`samples` or :meth:`share` is asked for: no host read otherwise).
        population: N, every client of the run.
    """

    def __init__(self, clients: Sequence[int] = (), sizes: Any = None, population: int = 0) -> None:
        self.clients = list(clients)
        self.population = population
        self._sizes = sizes

    @property
    def count(self) -> int:
        """|S_t|."""
        return len(self.clients)

    @property
    def samples(self) -> int:
        """Σ_{n∈S_t} n_train, the senders' training samples (the "samples" weights' total)."""
        if self._sizes is None or not self.clients:
            return 0
        return int(self._sizes[list(self.clients)].sum())

    def share(self, weighting: str) -> float:
        """The senders' share of the population's aggregation weight, Σ_{n∈S_t} p_n.

        ``weighting="uniform"``: |S_t|/N (SCAFFOLD's and FedDyn's factor); "samples":
        Σ_{S_t} n_n / Σ_all n_n.
        """
        if not self.clients:
            return 0.0
        if weighting == "uniform" or self._sizes is None:
            return self.count / max(1, self.population)
        return self.samples / max(1, int(self._sizes.sum()))

    def __repr__(self) -> str:
        return f"Senders(count={self.count}, population={self.population})"


@dataclass
class CohortResult:
    """What ``client_update`` returns: stacked uploads, per-client states and metrics.

    Attributes:
        updates: [m, ...] the clients' uploads (row i is client ``cohort.clients[i]``'s), a
            dict of such stacks for uploads with named parts, or None when the clients send
            nothing.
        states: the clients' new states, in cohort order: a :class:`CohortStates` (one
            stack per key: what an algorithm written over stacks returns) or a list of dicts.
        metrics: name -> [m] per-client values (averaged over the round's clients).
    """

    updates: Stacked | None
    states: CohortStates | list[State]
    metrics: dict[str, torch.Tensor]


class StackedUpdates(Mapping):
    """A cohort's messages as ``[m, ...]`` stacks, read as ``{client: row}``.

    What the engine hands ``server_update`` instead of a dict of m row views (a view costs
    ~600 bytes, 60 MB a round at 100,000 clients, and an op each: a round whose work must not
    grow with the cohort reads the stack), and what ``Algorithm.downlinks`` may return for
    per-client messages made at once (FPFC's centres: one gather). :func:`weighted_mean`
    and :func:`update_parts` read the stack directly.

    Args:
        clients: the clients, ascending (row i is ``clients[i]``'s message).
        stack: ``[m, ...]`` the messages, or for messages with named parts a dict of such
            stacks (a row is then ``{part: its row}``).
    """

    def __init__(self, clients: list[int], stack: Stacked) -> None:
        first = stack if isinstance(stack, torch.Tensor) else next(iter(stack.values()), None)
        rows = len(clients) if first is None else first.shape[0]
        if len(clients) != rows or any(a >= b for a, b in zip(clients, clients[1:], strict=False)):
            raise ValueError("StackedUpdates needs ascending clients, one per row")
        self.clients, self.stack = clients, stack

    def __getitem__(self, n: int) -> Message:
        i = bisect.bisect_left(self.clients, n)
        if i == len(self.clients) or self.clients[i] != n:
            raise KeyError(n)
        if isinstance(self.stack, torch.Tensor):
            return self.stack[i]
        return {name: part[i] for name, part in self.stack.items()}

    def __iter__(self):  # noqa: ANN204 - Mapping's
        return iter(self.clients)

    def __len__(self) -> int:
        return len(self.clients)

    def parts(self) -> dict[str, torch.Tensor]:
        """The stacks by part (a bare tensor's part: "")."""
        return {"": self.stack} if isinstance(self.stack, torch.Tensor) else dict(self.stack)


class MeanUpload(StackedUpdates):
    """The round's weighted mean Σ_n ω_n u_n, handed to the server as its one upload.

    A server that reads the uploads only through their weighted mean (``server_reads =
    "mean"``) gets this in place of the senders' uploads when the round ran in memory slices
    or over several processes (which add their senders' weighted sums, not their rows). It
    reads as any :class:`StackedUpdates`: one row, keyed by the round's first sender, of
    weight 1 (:attr:`weights`), so that :func:`weighted_mean` gives the mean itself; who sent
    is ``ctx.senders`` (:class:`Senders`).

    Args:
        total: Σ_n ω_n u_n by part (a bare tensor's part: ""), each without the row axis.
        sampled: the round's senders, ascending.
    """

    def __init__(self, total: Mapping[str, torch.Tensor], sampled: list[int]) -> None:
        rows = {name: value.unsqueeze(0) for name, value in total.items()}
        super().__init__(sampled[:1], rows[""] if set(rows) == {""} else rows)

    @property
    def weights(self) -> dict[int, float]:
        """The aggregation weight of the one row: 1."""
        return {self.clients[0]: 1.0}


def part_scale(update_scale: str | Mapping[str, str], part: str) -> str:
    """The scale ("step" or "gradient") of message part ``part`` under ``update_scale``.

    An algorithm's ``update_scale`` is one scale for every part, or a mapping by part name
    (unlisted parts: "step").
    """
    if isinstance(update_scale, str):
        return update_scale
    return update_scale.get(part, "step")


def weighted_mean(updates: Mapping[int, torch.Tensor], weights: dict[int, float]) -> torch.Tensor:
    """Σ_n ω_n u_n over the received updates."""
    clients = sorted(updates)
    if isinstance(updates, StackedUpdates) and isinstance(updates.stack, torch.Tensor):
        stack = updates.stack
        w = to_device([weights[n] for n in clients], stack.device, stack.dtype)
        return (w @ stack.reshape(len(clients), -1)).reshape(stack.shape[1:])
    stacked = torch.stack([updates[n] for n in clients])
    w = to_device([weights[n] for n in clients], stacked.device, stacked.dtype)
    return (w[:, None] * stacked).sum(dim=0)


def update_parts(updates: Mapping[int, Message], clients: list[int]) -> dict[str, torch.Tensor]:
    """Received updates as ``{part: [m, ...]}`` in ``clients`` order (a bare tensor's part: "")."""
    if isinstance(updates, StackedUpdates) and list(updates) == list(clients):
        return updates.parts()
    first = updates[clients[0]]
    if isinstance(first, torch.Tensor):
        return {"": torch.stack([updates[n] for n in clients])}  # type: ignore[misc]
    return {name: torch.stack([updates[n][name] for n in clients]) for name in first}  # type: ignore[index]


def parts_updates(parts: dict[str, torch.Tensor], clients: list[int]) -> Mapping[int, Message]:
    """:func:`update_parts` undone: a :class:`StackedUpdates` (of named parts or a bare tensor)."""
    if set(parts) == {""}:
        return StackedUpdates(clients, parts[""])
    return StackedUpdates(clients, dict(parts))
