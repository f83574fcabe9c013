"""Evaluation of the clients on their own splits: the engine's batched evaluation.

:class:`Evaluation` is the part of :class:`fedexp.engine.round.engine.Engine` that scores clients:
each on its test split (and validation split), with the algorithm's ``eval_params`` and
``predict``, many clients in one vmapped forward pass, the papers' aggregates and each client's
best value over the evaluated rounds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.func import vmap

from fedexp import streams
from fedexp.contract import Cohort
from fedexp.contract import State
from fedexp.data.client import ClientData
from fedexp.data.client import client_ids
from fedexp.engine.clients.pool import padded
from fedexp.engine.round.views import GLOBAL
from fedexp.engine.round.views import NEW
from fedexp.engine.round.views import NEWCOMER
from fedexp.engine.round.views import VIEWS
from fedexp.engine.round.views import with_gains
from fedexp.metrics import aggregate
from fedexp.metrics import lower_is_better
from fedexp.transfer import to_device

if TYPE_CHECKING:
    from fedexp.algorithms.base import Algorithm
    from fedexp.engine.clients.states import ClientStates
    from fedexp.engine.processes.ranks import Ranks
    from fedexp.engine.solver.context import Context

log = logging.getLogger("fedexp")

#: Prefix of the metrics on the clients' validation splits (``val_fraction > 0``).
_VAL = "val/"
#: Clients whose parameter vectors are made at once when every client is evaluated.
_BLOCK = 1 << 16


class Evaluation:
    """The engine's evaluation (a mixin of ``Engine``)."""

    ctx: Context
    algorithm: Algorithm
    clients: Sequence[ClientData]
    server: State
    client_states: ClientStates
    best: dict[str, torch.Tensor]
    ranks: Ranks | None
    x0: torch.Tensor
    #: score the global model on every client's test split too (``eval_global``)
    eval_global: bool
    #: the clients kept out of training (``holdout_clients``), ascending
    holdout: tuple[int, ...]
    #: a new client's local steps before its test (None: the run's local steps)
    holdout_steps: int | None
    _host_sizes: Callable[[], Any]
    _cohorts: Callable[[list[int], int], list[tuple[list[int], Cohort, Hashable]]]
    client_data: Callable[[Sequence[int]], list[ClientData]]

    def evaluate(
        self, clients: Sequence[int] | None = None
    ) -> tuple[dict[str, float], list[dict[str, float]]]:
        """Clients on their own test split; returns (aggregates, per-client metrics).

        Args:
            clients: whom to evaluate (default: every client); the per-client list follows it.
                Held-out clients (``holdout_clients``) are scored as new clients
                (:meth:`evaluate_newcomers`) when every client is evaluated: their rows hold
                ``new/<m>``, and they count in no other aggregate.

        The aggregates are ``<m>/mean`` (the unweighted mean over clients, the papers'
        headline), ``/weighted`` (by test samples), ``/worst``, ``/std``, and ``<m>/best_mean``:
        the mean over every client evaluated so far of its best value over evaluated rounds
        (pFedSOP §VI's protocol). Clients with a validation split (``val_fraction > 0``) are
        also evaluated on it, with the same parameters: the same aggregates under ``val/``
        (``val/acc/mean``, ``val/acc/weighted`` by validation samples, ...), for tuning. The
        per-client metrics are the test split's.

        With ``eval_global`` and a method that has a global model
        (``Algorithm.global_vector``), each row also holds ``global/<m>``, the global model's
        figure on the client's test split (scored with the clients' own in one pass), and
        ``gain/<m>`` (:func:`fedexp.engine.round.views.with_gains`); their aggregates are
        ``global/acc/mean``, ``gain/acc/worst``, ``gain/acc/hurt``...
        """
        everyone = clients is None
        who = self.training_clients() if everyone else list(clients)
        ranks = self.ranks
        local = who if ranks is None else ranks.mine(who)  # a rank scores its own clients
        per_client: list[dict[str, float]] = []
        val_rows: list[dict[str, float]] = []
        val_clients: list[int] = []
        glob = self.global_model()
        for start in range(0, len(local), _BLOCK):  # a block of clients' vectors at a time
            rows, val, scored = self._evaluate_block(local[start : start + _BLOCK], glob)
            per_client += rows
            val_rows += val
            val_clients += scored
        if ranks is not None:  # every rank's rows, in ``who`` order, on every rank
            per_client = _in_order(ranks.gather_json([local, per_client]), who)
            order = [n for n in who if self.clients[n].num_val]
            val_rows = _in_order(ranks.gather_json([val_clients, val_rows]), order)
            val_clients = order
        val_weights = [float(self.clients[n].num_val) for n in val_clients]
        if glob is not None:
            per_client = with_gains(per_client)
        weights = [c["num_test"] for c in per_client]
        keys = [k for k in per_client[0] if k != "num_test"] if per_client else []
        out = aggregate(per_client, weights, keys) if per_client else {}
        own = [k for k in keys if not k.startswith(VIEWS)]
        out.update(self._update_best(who, per_client, own))
        if val_rows:
            out.update({f"{_VAL}{k}": v for k, v in aggregate(val_rows, val_weights).items()})
            val_scored = [{f"{_VAL}{k}": v for k, v in row.items()} for row in val_rows]
            out.update(self._update_best(val_clients, val_scored, list(val_scored[0])))
        if everyone and self.holdout:
            new_rows = self.evaluate_newcomers(glob)
            new_keys = [k for k in new_rows[0] if k != "num_test"] if new_rows else []
            if new_keys:
                out.update(aggregate(new_rows, [r["num_test"] for r in new_rows], new_keys))
            by_client = dict(zip(who, per_client, strict=True))
            by_client.update(zip(self.holdout, new_rows, strict=True))
            per_client = [by_client[n] for n in range(len(self.clients))]
        return out, per_client

    def training_clients(self) -> list[int]:
        """Every client but the held-out ones (``holdout_clients``), ascending."""
        if not self.holdout:
            return list(range(len(self.clients)))
        out = set(self.holdout)
        return [n for n in range(len(self.clients)) if n not in out]

    def global_model(self) -> torch.Tensor | None:
        """The vector the global view scores (``Algorithm.global_vector``); None: no view.

        None with ``eval_global`` off, or for a method without a global model.
        """
        if not self.eval_global:
            return None
        got = self.algorithm.global_vector(self.ctx, self.server, self.client_average)
        return None if got is None else got.detach()

    def client_average(self, key: str) -> torch.Tensor:
        """The training clients' mean of their state ``key``, weighted by training samples.

        Block by block (a stack of :data:`_BLOCK` clients' rows at a time); over several
        processes each rank sums its own clients' and the ranks' sums are added.
        """
        train = self.training_clients()
        mine = train if self.ranks is None else self.ranks.mine(train)
        sizes = np.asarray(self._host_sizes(), dtype=np.float64)  # on the host: no read
        total: torch.Tensor | None = None
        for start in range(0, len(mine), _BLOCK):
            block = mine[start : start + _BLOCK]
            rows = self.client_states.rows(block).stack(key)
            w = torch.as_tensor(sizes[block]).to(rows.device, rows.dtype)
            part = w @ rows
            total = part if total is None else total + part
        if total is None:
            total = torch.zeros_like(self.x0)
        if self.ranks is not None:
            got = self.ranks.gather_tensors({"sum": total})
            total = sum((g["sum"].to(total.device) for g in got), torch.zeros_like(total))
        return total / float(sizes[train].sum())

    def evaluate_newcomers(self, glob: torch.Tensor | None) -> list[dict[str, float]]:
        """The held-out clients as new clients: ``new/<m>`` of each, in ``holdout`` order.

        Each starts from ``Algorithm.newcomer`` (the global model by default), takes
        ``holdout_steps`` local steps of the run's optimiser (fresh state, the task's loss) on
        its training split through the cohort solver (on the model's coordinates of a longer
        vector, FedRoD's [θ ; 0], whose rest is kept), drawing from its own streams (seed,
        :data:`~fedexp.engine.round.views.NEWCOMER`, round, client), and is scored on its
        test split. Nothing is kept. A method without a newcomer rule gives rows of
        ``num_test`` alone.
        """
        algo, ctx, ranks = self.algorithm, self.ctx, self.ranks
        who = list(self.holdout)
        local = who if ranks is None else ranks.mine(who)
        start = algo.newcomer(ctx, self.server, glob, self.x0)
        rows: list[dict[str, float]] = [{} for _ in local]
        if local and start is not None:
            data = self.client_data(local)
            groups = self._cohorts(local, NEWCOMER)
            parts = []
            d = ctx.model.layout.numel
            for _, cohort, _ in groups:
                x = start.detach().expand(len(cohort.clients), -1).clone()
                steps = self.holdout_steps
                steps = ctx.cohort_steps(cohort) if steps is None else steps
                if steps:  # the model's coordinates (FedRoD's [θ ; p]: θ), the rest kept
                    x[:, :d] = ctx.train(x[:, :d].contiguous(), cohort, steps=steps).params.detach()
                parts.append(x)
            order = torch.as_tensor([i for rows_, _, _ in groups for i in rows_])
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(len(local))
            params = torch.cat(parts)[inverse.to(parts[0].device)]
            scored = self._evaluate_many(params, data)
            rows = [{f"{NEW}{k}": v for k, v in r.items()} for r in scored]
        for n, r in zip(local, rows, strict=True):
            r["num_test"] = float(self.clients[n].num_test)
        if ranks is not None:
            rows = _in_order(ranks.gather_json([local, rows]), who)
        return rows

    def _evaluate_block(
        self, local: list[int], glob: torch.Tensor | None = None
    ) -> tuple[list[dict[str, float]], list[dict[str, float]], list[int]]:
        """Clients ``local`` on their test (and validation) splits.

        Returns (their test metrics with ``num_test``, and ``global/<m>`` of ``glob`` when
        given, the validation metrics of those with a validation split, who those are).
        """
        params = self.eval_vectors(local)
        data = self.client_data(local)
        rows = self._evaluate_many(params, data, glob)
        for d, m in zip(data, rows, strict=True):
            m["num_test"] = float(d.num_test)
        val_who = [i for i, d in enumerate(data) if d.num_val]
        if not val_who:
            return rows, [], []
        if params.stride(0) == 0:  # one vector for all
            val_params = params[:1].expand(len(val_who), *params.shape[1:])
        else:
            val_params = params[to_device(val_who, params.device, torch.int64)]
        val = self._evaluate_many(val_params, [data[i].validation() for i in val_who])
        return rows, val, [local[i] for i in val_who]

    def eval_vectors(self, who: list[int]) -> torch.Tensor:
        """``[m, d]`` the parameter vectors the clients ``who`` are evaluated with.

        The algorithm's ``eval_stack`` (one vector for all comes expanded: stride 0 along
        the clients), or with ``eval_with_data`` its ``eval_models`` over the clients in
        sub-cohorts drawing from their evaluation streams (``streams.EVAL``).
        """
        algo, ctx = self.algorithm, self.ctx
        if not algo.eval_with_data:
            states = self.client_states.rows(who)
            return algo.eval_stack(ctx, self.server, states, who)
        groups = self._cohorts(who, streams.EVAL)
        parts = []
        for _, cohort, _ in groups:
            states = self.client_states.rows(cohort.clients)
            parts.append(algo.eval_models(ctx, self.server, states, cohort).detach())
        if len(groups) == 1:
            return parts[0]
        order = torch.as_tensor([i for rows, _, _ in groups for i in rows])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(who))
        return torch.cat(parts)[inverse.to(parts[0].device)]

    def every_eval_vector(self) -> torch.Tensor:
        """``[N, d]``: every client's :meth:`eval_vectors` (the outputs' plot of the models).

        Over several processes each rank computes its own clients' (``eval_with_data``
        reads their training rows, which only that rank holds) and every rank gets them all.
        """
        who = list(range(len(self.clients)))
        ranks = self.ranks
        if ranks is None:
            return self.eval_vectors(who).contiguous()
        mine = ranks.mine(who)
        parts = {"v": self.eval_vectors(mine).contiguous()} if mine else {}
        return ranks.gather_rows(who, mine, parts)["v"]

    def _forward(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.algorithm.predict(self.ctx, params, x)

    @torch.no_grad()
    def _evaluate_many(
        self, params: torch.Tensor, data: list[ClientData], glob: torch.Tensor | None = None
    ) -> list[dict[str, float]]:
        """Each client's metrics of ``params[i]`` (``[m, d]``) on ``data[i]``'s test split.

        With ``glob`` (a ``[d]`` vector) each row also holds ``global/<m>``: the same test
        inputs through ``glob`` (one plain pass, stride 0 along the clients), its logits
        scored with the clients' in the same batched metrics (one transfer to the host, as
        without it). Where the clients are evaluated with ``glob`` itself (FedAvg: the global
        model expanded) its figures are theirs, not computed twice: the gain is exactly 0.

        Clients are evaluated together (issue 14): their test inputs padded into one batch
        (gathered from their pool at once), one vmapped forward pass of the algorithm's
        ``predict`` over the stacked parameters (one plain pass when all share one vector:
        ``params`` expanded, stride 0) and the task's batched metrics
        (``evaluate_batch``), in chunks of about ``max(eval_batch_size, 8192)`` inputs.
        Equal to :meth:`Context.evaluate` client by client up to floating-point rounding
        (tested); segmentation tasks, and models vmap cannot run, go client by client.
        """
        ctx = self.ctx
        if not data:
            return []
        if glob is not None and _is_expanded(params, glob):  # personal == global
            rows = self._evaluate_many(params, data)
            return [{**r, **{f"{GLOBAL}{k}": v for k, v in r.items()}} for r in rows]
        if not hasattr(ctx.task, "evaluate_batch") or not ctx.vmap_ok or len(data) == 1:
            return [
                _with_global(
                    ctx.evaluate(p, d, self._forward),
                    None if glob is None else ctx.evaluate(glob, d, self._forward),
                )
                for p, d in zip(params, data, strict=True)
            ]
        ctx.model.module.eval()
        budget = max(ctx.eval_batch_size, 8192)
        out: list[dict[str, float]] = []
        start = 0
        while start < len(data):
            longest, stop = 0, start
            while stop < len(data):  # clients while the padded chunk stays in the budget
                longest = max(longest, data[stop].num_test)
                if stop > start and longest * (stop + 1 - start) > budget:
                    break
                stop += 1
            try:
                out.extend(self._evaluate_chunk(params[start:stop], data[start:stop], glob))
            except RuntimeError as exc:  # an op vmap refuses: client by client from now on
                ctx.vmap_ok = False
                log.warning("batched evaluation: cannot vmap (%s)", str(exc).splitlines()[0][:160])
                return out + self._evaluate_many(params[start:], data[start:], glob)
            start = stop
        return out

    def _evaluate_chunk(
        self, params: torch.Tensor, data: list[ClientData], glob: torch.Tensor | None = None
    ) -> list[dict[str, float]]:
        xs, ys, lengths = _padded_tests(data)
        logits = self._chunk_logits(params, xs)
        if glob is None:
            return self.ctx.task.evaluate_batch(logits, ys, lengths)
        m = ys.shape[0]
        shared = self._chunk_logits(glob.expand(m, *glob.shape), xs)
        rows = self.ctx.task.evaluate_batch(
            torch.cat([logits, shared]), torch.cat([ys, ys]), torch.cat([lengths, lengths])
        )
        return [_with_global(r, g) for r, g in zip(rows[:m], rows[m:], strict=True)]

    def _chunk_logits(self, params: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """``[m, n, ...]`` logits of the clients' padded inputs under ``params[i]``."""
        m, n = xs.shape[:2]
        if params.stride(0) == 0:  # one vector for all: one plain pass
            flat = xs.reshape(m * n, *xs.shape[2:])
            # small inputs (tabular rows) go through in passes of up to 8,192
            per_input = max(1, flat[0].numel()) if flat.numel() else 1
            size = max(1, self.ctx.eval_batch_size, min(8192, 2**20 // per_input))
            logits = torch.cat([self._forward(params[0], c) for c in torch.split(flat, size)])
            logits = logits.reshape(m, n, *logits.shape[1:])
        elif self._stacked_forward():
            logits = self.ctx.model.forward_stacked(params, xs)  # vmap's values, without vmap
        else:
            logits = vmap(self._forward)(params, xs)
        return logits

    def _stacked_forward(self) -> bool:
        """Whether the clients' logits are the model's own batched forward pass.

        Where the algorithm predicts with the model itself and the model has one
        (:attr:`fedexp.models.flat.FlatModel.stacks`).
        """
        from fedexp.algorithms.base import Algorithm

        own = type(self.algorithm).predict is Algorithm.predict
        return own and self.ctx.model.stacks

    def _update_best(
        self, who: list[int], scored: list[dict[str, float]], keys: list[str]
    ) -> dict[str, float]:
        out = {}
        for key in keys if scored else ():
            best = self.best.setdefault(
                key, torch.full((len(self.clients),), math.nan, dtype=torch.float64)
            )
            lower = lower_is_better(key.removeprefix(_VAL))
            better = torch.minimum if lower else torch.maximum
            new = torch.tensor([m[key] for m in scored], dtype=torch.float64)
            idx = client_ids(who)
            old = best[idx]
            merged = torch.where(torch.isnan(new), old, better(old, new))
            best[idx] = torch.where(torch.isnan(old), new, merged)
            seen = best[~torch.isnan(best)]
            if seen.numel():
                out[f"{key}/best_mean"] = float(seen.mean())
        return out


def _padded_tests(data: list[ClientData]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clients' test inputs and targets padded to ``[m, n_max, ...]``, and their lengths.

    Clients whose test split is rows of one pool (a :class:`ClientTable`'s) are gathered from
    it with one index (rows past a client's length repeat its last row: padding, which the
    batched metrics leave out by ``lengths``); others are padded with zeros one by one.
    """
    gathered = padded([d._x_test for d in data])  # noqa: SLF001 - the pool rows, no views
    if gathered is not None:
        return gathered
    xs = torch.nn.utils.rnn.pad_sequence([d.x_test for d in data], batch_first=True)
    ys = torch.nn.utils.rnn.pad_sequence([d.y_test for d in data], batch_first=True)
    return xs, ys, torch.tensor([d.num_test for d in data], dtype=torch.int64)


def _is_expanded(params: torch.Tensor, vector: torch.Tensor) -> bool:
    """Whether ``params`` is ``vector`` expanded along the clients (the same storage)."""
    return (
        params.dim() == vector.dim() + 1
        and params.stride(0) == 0
        and params.data_ptr() == vector.data_ptr()
        and params.shape[1:] == vector.shape
        and params.stride()[1:] == vector.stride()
    )


def _with_global(row: dict[str, float], glob: dict[str, float] | None) -> dict[str, float]:
    """A client's row with the global model's figures as ``global/<m>`` (none: as it is)."""
    if glob is None:
        return row
    return {**row, **{f"{GLOBAL}{k}": v for k, v in glob.items()}}


def _in_order(gathered: list, who: list[int]) -> list[dict[str, float]]:
    """Rows gathered from the ranks (each ``[clients, rows]``) put in ``who``'s order."""
    by_client = {n: row for clients, rows in gathered for n, row in zip(clients, rows, strict=True)}
    return [by_client[n] for n in who]
