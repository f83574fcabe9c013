"""A round's clients in sub-cohorts of alike work, and their results back in client order.

``Algorithm.client_update`` runs one cohort whose clients take the same number of local steps
(and, with full batches, have training sets of one shape): the engine groups a round's
clients by ``Context.work_key`` (:func:`sub_cohorts`), each group one
:class:`fedexp.contract.Cohort`, and puts the groups' results back in the round's client
order (:func:`merge_results`). Each client draws from its own (seed, purpose, round, client)
stream, so the grouping changes no figure; evaluation groups the clients it scores the same
way.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from fedexp import streams
from fedexp.contract import Cohort
from fedexp.contract import CohortResult
from fedexp.contract import CohortStates
from fedexp.contract import Stacked
from fedexp.contract import State
from fedexp.data.client import ClientData
from fedexp.data.client import client_ids

if TYPE_CHECKING:
    from fedexp.engine.clients.pool import TrainPool
    from fedexp.engine.solver.context import Context


def sub_cohorts(
    ctx: Context,
    clients: list[int],
    data: list[ClientData],
    seed: int,
    purpose: int,
    round_: int,
    pool: TrainPool | None,
) -> list[tuple[list[int], Cohort, Hashable]]:
    """``clients`` (with their ``data``) in sub-cohorts by ``Context.work_key``.

    Args:
        ctx: the run's context (its ``work_key``).
        clients: the clients, in the round's order.
        data: their data, in that order.
        seed: the run's seed.
        purpose: what the cohort draws for (``streams.CLIENT``, ``streams.EVAL``...).
        round_: the round.
        pool: every client's training data in one tensor, or None.

    Returns:
        (positions in ``clients``, the cohort, its work key) of each sub-cohort; its clients
        draw from their (seed, purpose, round, client) streams (``Cohort.keys``).
    """
    groups: dict[Hashable, list[int]] = {}
    for i, d in enumerate(data):
        groups.setdefault(ctx.work_key(d), []).append(i)
    out = []
    for key, rows in groups.items():
        members = [clients[i] for i in rows]
        ids = client_ids(members)  # on the host, as Cohort's docstring says
        cohort = Cohort(
            clients=members,
            data=[data[i] for i in rows],
            rows=ids,
            keys=streams.stream_keys(seed, purpose, round_, ids),
            draws=torch.zeros(len(members), dtype=torch.int64),
            pool=pool,
        )
        out.append((rows, cohort, key))
    return out


def merge_results(results: list[tuple[list[int], CohortResult]], m: int) -> CohortResult:
    """Sub-cohorts' results (each with its rows of the round's ``m`` clients) in client order."""
    order = torch.tensor([i for rows, _ in results for i in rows])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(m)

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts)[inverse.to(parts[0].device)]

    first = results[0][1]
    updates: Stacked | None = None
    if isinstance(first.updates, torch.Tensor):
        updates = cat([r.updates for _, r in results])  # type: ignore[misc]
    elif isinstance(first.updates, dict):
        names = first.updates
        updates = {k: cat([r.updates[k] for _, r in results]) for k in names}  # type: ignore[index]
    states: CohortStates | list[State]
    parts = [r.states for _, r in results]
    if (
        all(isinstance(p, CohortStates) for p in parts)
        and len({tuple(p.keys()) for p in parts}) == 1
    ):
        masks = {k for p in parts for k in p.present}  # type: ignore[union-attr]
        states = CohortStates(
            m,
            {k: cat([p.stack(k) for p in parts]) for k in first.states.keys()},  # type: ignore[union-attr]
            {
                k: cat(
                    [
                        p.present.get(
                            k, torch.ones(len(p), dtype=torch.bool, device=p.stack(k).device)
                        )
                        for p in parts
                    ]
                )  # type: ignore[union-attr]
                for k in masks
            },
        )
    else:
        states = [{}] * m
        for rows, r in results:
            for i, state in zip(rows, r.states, strict=True):
                states[i] = state
    metrics = {k: cat([r.metrics[k] for _, r in results]) for k in first.metrics}
    return CohortResult(updates, states, metrics)
