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

if TYPE_CHECKING:
    from fedexp.data.client import ClientData

State = dict[str, torch.Tensor]
#: What crosses the network: one tensor, or named parts (IFCA: the k cluster models down).
Message = torch.Tensor | dict[str, torch.Tensor]
#: A cohort's messages: ``[m, ...]`` stacks, or a dict of such stacks part by part.
Stacked = torch.Tensor | dict[str, torch.Tensor]
#: How a message part is coded (``fedexp.engine.round.engine.Engine._transmit``).
PART_KINDS = ("model", "update", "exact")


@dataclass
class Cohort:
    """The clients whose work of a round runs as one computation.

    Every client of a cohort takes the same number of local steps (the engine groups a round's
    clients by :meth:`fedexp.engine.solver.context.Context.work_key` into sub-cohorts), so their
    steps stack.

    Attributes:
        clients: their ids, ascending.
        data: their data (rows of ``pool``).
        rows: int64 [m] the clients' pool rows on the device.
        keys: int64 [m] their round streams' keys (:func:`fedexp.engine.rng.stream_keys`).
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


@dataclass
class CohortResult:
    """What ``client_update`` returns: stacked uploads, per-client states and metrics.

    Attributes:
        updates: [m, ...] the clients' uploads (row i is client ``cohort.clients[i]``'s), a
            dict of such stacks for uploads with named parts, or None when the clients send
            nothing.
        states: each client's new state, in cohort order.
        metrics: name -> [m] per-client values (averaged over the round's clients).
    """

    updates: Stacked | None
    states: list[State]
    metrics: dict[str, torch.Tensor]


class StackedUpdates(Mapping):
    """A cohort's received updates as one ``[m, ...]`` tensor, read as ``{client: row}``.

    What the engine hands ``server_update`` instead of a dict of m row views (a view costs
    ~600 bytes: 60 MB a round at 100,000 clients); :func:`weighted_mean` reads the stack
    directly.

    Args:
        clients: the senders, ascending (row i is ``clients[i]``'s update).
        stack: ``[m, ...]`` the decoded updates.
    """

    def __init__(self, clients: list[int], stack: torch.Tensor) -> None:
        if len(clients) != stack.shape[0] or any(
            a >= b for a, b in zip(clients, clients[1:], strict=False)
        ):
            raise ValueError("StackedUpdates needs ascending clients, one per row")
        self.clients, self.stack = clients, stack

    def __getitem__(self, n: int) -> torch.Tensor:
        i = bisect.bisect_left(self.clients, n)
        if i == len(self.clients) or self.clients[i] != n:
            raise KeyError(n)
        return self.stack[i]

    def __iter__(self):  # noqa: ANN204 - Mapping's
        return iter(self.clients)

    def __len__(self) -> int:
        return len(self.clients)


def weighted_mean(updates: Mapping[int, torch.Tensor], weights: dict[int, float]) -> torch.Tensor:
    """Σ_n ω_n u_n over the received updates."""
    clients = sorted(updates)
    if isinstance(updates, StackedUpdates):  # rows in ascending client order: one product
        stack = updates.stack
        w = torch.tensor([weights[n] for n in clients], dtype=stack.dtype, device=stack.device)
        return (w @ stack.reshape(len(clients), -1)).reshape(stack.shape[1:])
    stacked = torch.stack([updates[n] for n in clients])
    w = torch.tensor([weights[n] for n in clients], dtype=stacked.dtype, device=stacked.device)
    return (w[:, None] * stacked).sum(dim=0)


def update_parts(updates: Mapping[int, Message], clients: list[int]) -> dict[str, torch.Tensor]:
    """Received updates as ``{part: [m, ...]}`` in ``clients`` order (a bare tensor's part: "")."""
    if isinstance(updates, StackedUpdates):
        return {"": updates.stack}
    first = updates[clients[0]]
    if isinstance(first, torch.Tensor):
        return {"": torch.stack([updates[n] for n in clients])}  # type: ignore[misc]
    return {name: torch.stack([updates[n][name] for n in clients]) for name in first}  # type: ignore[index]


def parts_updates(parts: dict[str, torch.Tensor], clients: list[int]) -> Mapping[int, Message]:
    """:func:`update_parts` undone.

    Bare tensors come back as a :class:`StackedUpdates`, named parts as a dict of each
    client's parts.
    """
    if set(parts) == {""}:
        return StackedUpdates(clients, parts[""])
    return {n: {name: p[i] for name, p in parts.items()} for i, n in enumerate(clients)}
