"""The one round loop every algorithm runs in.

The engine owns all state (server, clients, channel residuals and replicas, the byte ledger),
moves every message through its channel as bytes, and calls the algorithm's hooks. The
round's clients work as one cohort (``Algorithm.client_update`` over stacked tensors; the
local solver, ``fedexp.engine.solver``, runs their steps together), in sub-cohorts where their
step counts differ; each client draws from its own (seed, round, client) stream, so results
do not depend on the grouping or the order.
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import vmap

from fedexp.algorithms.base import Algorithm
from fedexp.comm.channel import Channel
from fedexp.comm.codec import DenseCodec
from fedexp.contract import Cohort, CohortResult, Message, Stacked, StackedUpdates, State
from fedexp.data.federated import ClientData
from fedexp.engine import rng
from fedexp.engine.context import Context
from fedexp.engine.ledger import ByteLedger
from fedexp.engine.pool import TrainPool
from fedexp.metrics import LOWER_IS_BETTER, aggregate

# Stream purposes of the channels and the set-up (beside rng.CLIENT etc.).
_UPLINK, _DOWNLINK, _SKETCH = 11, 12, 13

log = logging.getLogger("fedexp")

#: Prefix of the metrics on the clients' validation splits (``val_fraction > 0``).
_VAL = "val/"

#: (client, part name); the part of a bare-tensor message is named "".
PartKey = tuple[int, str]


def _per_direction() -> dict[str, dict[PartKey, torch.Tensor]]:
    return {"up": {}, "down": {}}


def _part_key(name: str) -> tuple[int, ...]:
    """Extra stream key of a named part (none for a bare tensor: the streams of v1)."""
    return (zlib.crc32(name.encode()),) if name else ()


def _exact(channel: Channel) -> bool:
    return channel.codec.lossless and not channel.transforms and not channel.error_feedback


def _state_key(key: PartKey) -> str:
    n, name = key
    return f"{n}:{name}" if name else str(n)


def _parse_key(text: str) -> PartKey:
    n, _, name = text.partition(":")
    return int(n), name


@dataclass
class Engine:
    """Federated simulation state and the round loop.

    Args:
        ctx: model, task and local-solver settings.
        algorithm: the algorithm's hooks.
        clients: every client's device-resident data.
        uplink: channel of client → server messages.
        downlink: channel of server → client messages.
        seed: root of all random streams.
        participation: fraction of clients sampled per round.
        x0: the common initial model.
    """

    ctx: Context
    algorithm: Algorithm
    clients: Sequence[ClientData]
    uplink: Channel
    downlink: Channel
    seed: int
    participation: float
    x0: torch.Tensor
    round: int = 0
    ledger: ByteLedger = field(default_factory=ByteLedger)
    server: State = field(default_factory=dict)
    client_states: list[State] = field(default_factory=list)
    #: per direction, (client, part) -> error-feedback residual / replica / last message
    residual: dict[str, dict[PartKey, torch.Tensor]] = field(default_factory=_per_direction)
    replica: dict[str, dict[PartKey, torch.Tensor]] = field(default_factory=_per_direction)
    reference: dict[str, dict[PartKey, torch.Tensor]] = field(default_factory=_per_direction)
    #: per client, the best value over evaluated rounds of each metric (pFedSOP's protocol)
    best: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the clients of the last round run
    last_sampled: list[int] = field(default_factory=list)
    #: every client's training data in one tensor (``fedexp.engine.pool``)
    pool: TrainPool | None = field(default=None, repr=False)
    #: the initial server state (derived, not checkpointed), built when a part needs it
    _server0: State | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.pool = TrainPool.of(self.clients) if self.clients else None
        self.server = self.algorithm.init_server(self.ctx, self.x0)
        self.client_states = [
            self.algorithm.init_client(self.ctx, self.x0, n) for n in range(len(self.clients))
        ]

    # ----------------------------------------------------------------- messages
    def _transmit(self, direction: str, n: int, name: str, kind: str, msg: torch.Tensor):
        """One message part between client n and the server; returns (received, metrics).

        ``kind`` says what the part is (:data:`fedexp.algorithms.base.PART_KINDS`):

        * ``exact``: dense float32 whatever the channel (a cluster id, a flag).
        * ``update``: coded as it is, through the channel's transforms and codec; with error
          feedback the sender keeps the residual (Sattler et al. 2019, STC).
        * ``model``: a lossless channel sends the model itself. A lossy one sends the change
          against a reference and the receiver adds what it decodes to the model it holds
          (every party starts from the common initial model, or zeros for other shapes). With
          error feedback the reference is what the receiver holds (the sender's replica of
          it), so the part not yet transmitted is sent later: that gap is the error-feedback
          memory, and no separate residual is kept. Without it the reference is the sender's
          previous message, so the compression error is dropped.
        """
        channel = self.uplink if direction == "up" else self.downlink
        purpose = _UPLINK if direction == "up" else _DOWNLINK
        key = (n, name)
        gen = None  # only a randomised codec (rand-k) draws: no seeding for the others
        if channel.codec.randomised:
            gen = rng.generator(self.seed, purpose, self.round, n, *_part_key(name))
        shape, flat = msg.shape, msg.detach().reshape(-1)
        numel, dev = flat.numel(), msg.device
        metrics: dict[str, float] = {}
        # CER's γ acts on the gradient scale whatever the algorithm sends (Algorithm.update_scale)
        scale = self.ctx.lr if self.algorithm.update_scale == "step" else 1.0
        if kind == "exact" or (kind == "model" and _exact(channel)):
            codec = DenseCodec() if kind == "exact" else channel.codec
            payload = codec.encode(flat.to(torch.float32))
            received = codec.decode(payload, numel).to(dev)
        elif kind == "update":
            store = self.residual[direction]
            payload, res, metrics = channel.send(flat, store.get(key), gen, scale)
            if res is not None:
                store[key] = res
            received = channel.receive(payload, numel, dev)
        else:
            held = self.replica[direction].get(key)
            if held is None:
                held = self._initial_part(direction, n, name, flat)
            ref = held
            if not channel.error_feedback:
                ref = self.reference[direction].get(key, held)
            payload, _, metrics = channel.send(flat - ref, None, gen, scale)
            received = held + channel.receive(payload, numel, dev)
            self.replica[direction][key] = received
            if not channel.error_feedback:
                self.reference[direction][key] = flat.clone()
        self.ledger.add(direction, payload, numel, part=name)
        return received.reshape(shape).to(msg.dtype), metrics

    def _initial_part(self, direction: str, n: int, name: str, like: torch.Tensor) -> torch.Tensor:
        """What the receiver holds of a "model" part before the first message.

        Every party can derive the initial state: downlink parts start as the algorithm's
        message from its initial server state (IFCA's k initial clusters), anything else as the
        common initial model when the shapes agree, else zeros.
        """
        if direction == "down":
            if self._server0 is None:
                self._server0 = self.algorithm.init_server(self.ctx, self.x0)
            msg0 = self.algorithm.downlink(self.ctx, self._server0, n)
            part = msg0 if name == "" or not isinstance(msg0, dict) else msg0.get(name)
            if isinstance(part, torch.Tensor) and part.numel() == like.numel():
                return part.detach().reshape(-1).to(like)
        return self.x0 if like.shape == self.x0.shape else torch.zeros_like(like)

    def _send(self, direction: str, n: int, msg: Message) -> tuple[Message, dict[str, float]]:
        """Every part of a message (a tensor, or a dict of named parts) through its channel."""
        kinds = self.algorithm.uplink_parts if direction == "up" else self.algorithm.downlink_parts
        default = "update" if direction == "up" else "model"
        if isinstance(msg, torch.Tensor):
            return self._transmit(direction, n, "", kinds.get("", default), msg)
        out, metrics = {}, {}
        for name in sorted(msg):
            out[name], m = self._transmit(direction, n, name, kinds.get(name, default), msg[name])
            metrics.update(m)
        return out, metrics

    # ------------------------------------------------------------------ set-up
    def setup(self) -> dict[str, float]:
        """The one-off exchange before round 0: client sketches up (dense), server set-up."""
        sketches: dict[int, torch.Tensor] = {}
        codec = DenseCodec()
        for n, data in enumerate(self.clients):
            sketch = self.algorithm.client_sketch(
                self.ctx, data, rng.generator(self.seed, _SKETCH, n)
            )
            if sketch is None:
                continue
            payload = codec.encode(sketch.reshape(-1))
            self.ledger.add("up", payload, sketch.numel())
            sketches[n] = codec.decode(payload, sketch.numel()).to(self.ctx.device)
        self.server = self.algorithm.server_setup(self.ctx, self.server, sketches)
        return {"bytes/setup_up": float(self.ledger.total["up"])}

    # ---------------------------------------------------------------- the round
    def run_round(self) -> dict[str, float]:
        """Run round ``self.round`` and advance it; returns the round's training metrics."""
        started = time.perf_counter()
        t = self.round
        self.ctx.round = t
        self.ledger.start_round()
        sampled = rng.sample_clients(self.seed, t, len(self.clients), self.participation)
        self.last_sampled = sampled
        msgs = self.algorithm.downlinks(self.ctx, self.server, sampled)
        inbox = self._downlink(sampled, [msgs[n] for n in sampled])
        result = self._client_work(sampled, inbox)
        for n, state in zip(sampled, result.states, strict=True):
            self.client_states[n] = state
        updates, sums = self._uplink(sampled, result)
        self.server = self.algorithm.server_update(
            self.ctx, self.server, updates, self._weights(updates)
        )
        self.round = t + 1
        out = {f"train/{k}": v / len(sampled) for k, v in sums.items()}
        out["clients/sampled"] = float(len(sampled))
        out.update(self.algorithm.server_metrics(self.ctx, self.server))
        out.update(self.ledger.metrics())
        out["time/round_s"] = time.perf_counter() - started
        return out

    def _downlink(self, sampled: list[int], msgs: list[Message | None]) -> Stacked | None:
        """The round's downlink messages through their channel; decoded, stacked ``[m, ...]``.

        In one pass when it can (:meth:`_send_cohort`), else message by message.
        """
        stacked = self._send_cohort("down", sampled, _stack_parts(msgs))
        if stacked is not None or all(m is None for m in msgs):
            return stacked
        if any(m is None for m in msgs):
            raise ValueError(f"{type(self.algorithm).__name__}: downlinks to some clients only")
        sent = [self._send("down", n, m)[0] for n, m in zip(sampled, msgs, strict=True)]
        decoded = _stack_parts(sent)
        if decoded is None:
            raise ValueError(f"{type(self.algorithm).__name__}: downlinks of different shapes")
        return decoded

    def _client_work(self, sampled: list[int], inbox: Stacked | None) -> CohortResult:
        """Every sampled client's ``client_update``, in sub-cohorts of alike work.

        Clients are grouped by ``Context.work_key`` (their step counts, and with full batches
        their training sets' shapes); each group is one cohort, and the groups' results are
        put back in client order. Each client draws from its own stream, so the grouping
        changes no figure.
        """
        ctx, algo = self.ctx, self.algorithm
        groups: dict[Hashable, list[int]] = {}
        for i, n in enumerate(sampled):
            groups.setdefault(ctx.work_key(self.clients[n]), []).append(i)
        results = []
        for rows in groups.values():
            clients = [sampled[i] for i in rows]
            ids = torch.tensor(clients, dtype=torch.int64, device=ctx.device)
            cohort = Cohort(
                clients=clients,
                data=[self.clients[n] for n in clients],
                rows=ids,
                keys=rng.stream_keys(self.seed, rng.CLIENT, self.round, ids),
                draws=torch.zeros(len(clients), dtype=torch.int64, device=ctx.device),
                pool=self.pool,
            )
            index = None if len(groups) == 1 else torch.tensor(rows, device=ctx.device)
            model_in = inbox if index is None else _take(inbox, index)
            states = [self.client_states[n] for n in clients]
            results.append((rows, algo.client_update(ctx, model_in, states, cohort)))
        return results[0][1] if len(results) == 1 else _merge(results, len(sampled))

    def _uplink(
        self, sampled: list[int], result: CohortResult
    ) -> tuple[Mapping[int, Message], dict[str, float]]:
        """The clients' uploads through their channel; (decoded uploads, summed metrics)."""
        sums = {k: float(v.sum()) for k, v in result.metrics.items()}
        updates: dict[int, Message] = {}
        if result.updates is None:
            return updates, sums
        received = self._send_cohort("up", sampled, result.updates)
        if isinstance(received, torch.Tensor):
            return StackedUpdates(sampled, received), sums
        if received is not None:  # named parts: each client's row of every part
            return {n: _row(received, i) for i, n in enumerate(sampled)}, sums
        for i, n in enumerate(sampled):  # message by message (transforms: CER)
            updates[n], metrics = self._send("up", n, _row(result.updates, i))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        return updates, sums

    def _send_cohort(
        self,
        direction: str,
        clients: list[int],
        stacked: torch.Tensor | dict[str, torch.Tensor] | None,
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Every client's message through its channel in one pass, part by part.

        ``stacked``: the clients' messages ``[m, ...]`` in client order, or for messages with
        named parts a dict of such stacks (:func:`_stack_parts`). Returns the decoded messages
        in the same form, or None, with nothing sent, when some part cannot go in one pass:
        the channel has transforms (they act message by message), a lossless codec other
        than dense float32 sends a model itself, or a part is empty (the per-client
        :meth:`_send` then runs). A part sent exactly as dense float32 is, on the CPU,
        encoded and decoded as one block (each client's message is its 4·numel bytes of it);
        on an accelerator its bytes are counted from the sizes (dense float32 has no header,
        MATH §8) and it stays on the device. Anything else goes through
        :meth:`_transmit_cohort`. Parts of different names are independent (their own
        residuals, replicas and streams), so part by part equals client by client.
        """
        if stacked is None or not clients:
            return None
        parts = {"": stacked} if isinstance(stacked, torch.Tensor) else stacked
        channel = self.uplink if direction == "up" else self.downlink
        kinds = self.algorithm.uplink_parts if direction == "up" else self.algorithm.downlink_parts
        default = "update" if direction == "up" else "model"
        plan = {}
        for name, stack in parts.items():
            kind = kinds.get(name, default)
            dense = kind == "exact" or (type(channel.codec) is DenseCodec and _exact(channel))
            if stack[0].numel() == 0 or (
                not dense and (channel.transforms or (kind == "model" and _exact(channel)))
            ):
                return None
            plan[name] = (kind, dense)
        out = {
            name: self._send_part_cohort(direction, clients, name, *plan[name], stack.detach())
            for name, stack in sorted(parts.items())
        }
        return out[""] if isinstance(stacked, torch.Tensor) else out

    def _send_part_cohort(
        self,
        direction: str,
        clients: list[int],
        name: str,
        kind: str,
        dense: bool,
        stack: torch.Tensor,
    ) -> torch.Tensor:
        """One part of every client's message in one pass (:meth:`_send_cohort`)."""
        m, shape = len(clients), stack.shape[1:]
        numel = stack[0].numel()
        if not dense:
            channel = self.uplink if direction == "up" else self.downlink
            flat = stack.reshape(m, numel)
            received = self._transmit_cohort(direction, clients, name, kind, channel, flat)
            return received.reshape(m, *shape).to(stack.dtype)
        if stack.device.type == "cpu":
            codec = DenseCodec()
            block = stack.reshape(-1).to(torch.float32)
            if stack.stride(0) == 0:  # the same message: encode it once, count it m times
                block = block[:numel]
            payloads = codec.encode_many(block.view(-1, numel))  # the bytes on the wire
            received = codec.decode_many(payloads, numel).reshape(-1, *shape)
            received = received.expand(m, *shape).to(stack.dtype)
        else:
            received = stack.to(torch.float32).to(stack.dtype)
        self.ledger.add_many(direction, m, 4 * numel, numel, part=name)
        return received

    def _transmit_cohort(
        self,
        direction: str,
        clients: list[int],
        name: str,
        kind: str,
        channel: Channel,
        flat: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`_transmit` of every client's part ``name`` through a lossy channel at once.

        The same messages, residuals, replicas and bytes as client by client (``update``:
        error-feedback residuals stacked; ``model``: the change against each receiver's
        reference), coded in one pass (``Channel.send_many``: one vectorised compression, one
        encoding of every payload, each counted at its own size; MATH §8). Returns the
        decoded messages ``[m, numel]``.
        """
        purpose = _UPLINK if direction == "up" else _DOWNLINK
        keys = [(n, name) for n in clients]
        gens = None
        if channel.codec.randomised:
            gens = [
                rng.generator(self.seed, purpose, self.round, n, *_part_key(name)) for n in clients
            ]
        numel, dev = flat.shape[1], flat.device
        if kind == "update":
            store = self.residual[direction]
            old = [store.get(k) for k in keys]
            res = None
            if channel.error_feedback and any(r is not None for r in old):
                res = torch.stack([torch.zeros_like(flat[0]) if r is None else r for r in old])
            payloads, new = channel.send_many(flat, res, gens)
            if new is not None:
                for k, row in zip(keys, new.unbind(0), strict=True):
                    store[k] = row.clone()  # a row of its own: no round's stack kept alive
            received = channel.receive_many(payloads, numel, dev)
        else:
            held = torch.stack(
                [
                    h
                    if (h := self.replica[direction].get(k)) is not None
                    else self._initial_part(direction, n, name, flat[i])
                    for i, (n, k) in enumerate(zip(clients, keys, strict=True))
                ]
            )
            ref = held
            if not channel.error_feedback:
                refs = self.reference[direction]
                ref = torch.stack([refs.get(k, held[i]) for i, k in enumerate(keys)])
            payloads, _ = channel.send_many(flat - ref, None, gens)
            received = held + channel.receive_many(payloads, numel, dev)
            for i, k in enumerate(keys):
                self.replica[direction][k] = received[i].clone()
                if not channel.error_feedback:
                    self.reference[direction][k] = flat[i].clone()
        self.ledger.add_sizes(direction, payloads.sizes, numel, part=name)
        return received

    def _weights(self, updates: dict[int, Message]) -> dict[int, float]:
        if not updates:
            return {}
        if self.algorithm.weighting == "uniform":
            return {n: 1.0 / len(updates) for n in updates}
        total = sum(self.clients[n].num_train for n in updates)
        return {n: self.clients[n].num_train / total for n in updates}

    # --------------------------------------------------------------- evaluation
    def evaluate(
        self, clients: Sequence[int] | None = None
    ) -> tuple[dict[str, float], list[dict[str, float]]]:
        """Clients on their own test split; returns (aggregates, per-client metrics).

        Args:
            clients: whom to evaluate (default: every client); the per-client list follows it.

        The aggregates are ``<m>/mean`` (the unweighted mean over clients, the papers'
        headline), ``/weighted`` (by test samples), ``/worst``, ``/std``, and ``<m>/best_mean``:
        the mean over every client evaluated so far of its best value over evaluated rounds
        (pFedSOP §VI's protocol). Clients with a validation split (``val_fraction > 0``) are
        also evaluated on it, with the same parameters: the same aggregates under ``val/``
        (``val/acc/mean``, ``val/acc/weighted`` by validation samples, ...), for tuning. The
        per-client metrics are the test split's.
        """
        who = list(range(len(self.clients)) if clients is None else clients)
        params = [
            self.algorithm.eval_params(self.ctx, self.server, self.client_states[n], n) for n in who
        ]
        per_client = self._evaluate_many(params, [self.clients[n] for n in who])
        for n, m in zip(who, per_client, strict=True):
            m["num_test"] = float(self.clients[n].num_test)
        val_who = [i for i, n in enumerate(who) if self.clients[n].num_val]
        val_rows = self._evaluate_many(
            [params[i] for i in val_who], [self.clients[who[i]].validation() for i in val_who]
        )
        val_weights = [float(self.clients[who[i]].num_val) for i in val_who]
        weights = [c["num_test"] for c in per_client]
        keys = [k for k in per_client[0] if k != "num_test"] if per_client else []
        out = aggregate(per_client, weights, keys) if per_client else {}
        out.update(self._update_best(who, per_client, keys))
        if val_rows:
            out.update({f"{_VAL}{k}": v for k, v in aggregate(val_rows, val_weights).items()})
            val_scored = [{f"{_VAL}{k}": v for k, v in row.items()} for row in val_rows]
            out.update(
                self._update_best([who[i] for i in val_who], val_scored, list(val_scored[0]))
            )
        return out, per_client

    def _forward(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.algorithm.predict(self.ctx, params, x)

    @torch.no_grad()
    def _evaluate_many(
        self, params: list[torch.Tensor], data: list[ClientData]
    ) -> list[dict[str, float]]:
        """Each client's metrics of ``params[i]`` on ``data[i]``'s test split.

        Clients are evaluated together (issue 14): their test inputs padded into one batch,
        one vmapped forward pass of the algorithm's ``predict`` over the stacked parameters
        (one plain pass when all share one vector) and the task's batched metrics
        (``evaluate_batch``), in chunks of about ``max(eval_batch_size, 8192)`` inputs.
        Equal to :meth:`Context.evaluate` client by client up to floating-point rounding
        (tested); segmentation tasks, and models vmap cannot run, go client by client.
        """
        ctx = self.ctx
        if not data:
            return []
        if not hasattr(ctx.task, "evaluate_batch") or not ctx.vmap_ok or len(data) == 1:
            return [ctx.evaluate(p, d, self._forward) for p, d in zip(params, data, strict=True)]
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
                out.extend(self._evaluate_chunk(params[start:stop], data[start:stop]))
            except RuntimeError as exc:  # an op vmap refuses: client by client from now on
                ctx.vmap_ok = False
                log.warning("batched evaluation: cannot vmap (%s)", str(exc).splitlines()[0][:160])
                return out + [
                    ctx.evaluate(p, d, self._forward)
                    for p, d in zip(params[start:], data[start:], strict=True)
                ]
            start = stop
        return out

    def _evaluate_chunk(
        self, params: list[torch.Tensor], data: list[ClientData]
    ) -> list[dict[str, float]]:
        xs = torch.nn.utils.rnn.pad_sequence([d.x_test for d in data], batch_first=True)
        ys = torch.nn.utils.rnn.pad_sequence([d.y_test for d in data], batch_first=True)
        lengths = torch.tensor([d.num_test for d in data], dtype=torch.int64)
        m, n = ys.shape[:2]
        if all(p is params[0] for p in params):  # one vector for all: one plain pass
            flat = xs.reshape(m * n, *xs.shape[2:])
            # small inputs (tabular rows) go through in passes of up to 8,192
            per_input = max(1, flat[0].numel()) if flat.numel() else 1
            size = max(1, self.ctx.eval_batch_size, min(8192, 2**20 // per_input))
            logits = torch.cat([self._forward(params[0], c) for c in torch.split(flat, size)])
            logits = logits.reshape(m, n, *logits.shape[1:])
        else:
            logits = vmap(self._forward)(torch.stack(params), xs)
        return self.ctx.task.evaluate_batch(logits, ys, lengths)

    def _update_best(
        self, who: list[int], scored: list[dict[str, float]], keys: list[str]
    ) -> dict[str, float]:
        out = {}
        for key in keys if scored else ():
            best = self.best.setdefault(
                key, torch.full((len(self.clients),), math.nan, dtype=torch.float64)
            )
            lower = key.removeprefix(_VAL) in LOWER_IS_BETTER
            better = torch.minimum if lower else torch.maximum
            new = torch.tensor([m[key] for m in scored], dtype=torch.float64)
            idx = torch.tensor(who, dtype=torch.long)
            old = best[idx]
            merged = torch.where(torch.isnan(new), old, better(old, new))
            best[idx] = torch.where(torch.isnan(old), new, merged)
            seen = best[~torch.isnan(best)]
            if seen.numel():
                out[f"{key}/best_mean"] = float(seen.mean())
        return out

    # ----------------------------------------------------------- checkpointing
    def state_tree(self) -> dict[str, Any]:
        """Every tensor of the run's state, as a nested dict for ``checkpoint.save``."""
        channel = {
            d: {
                kind: {_state_key(k): v for k, v in store[d].items()}
                for kind, store in (
                    ("residual", self.residual),
                    ("replica", self.replica),
                    ("reference", self.reference),
                )
            }
            for d in ("up", "down")
        }
        return {
            "server": self.server,
            "client": {str(n): s for n, s in enumerate(self.client_states)},
            "channel": channel,
            "best": dict(self.best),
        }

    def load_state_tree(self, tree: dict[str, Any], round_: int, ledger: ByteLedger) -> None:
        """Restore what :meth:`state_tree` saved."""
        dev = self.ctx.device
        self.server = {k: v.to(dev) for k, v in tree.get("server", {}).items()}
        clients = tree.get("client", {})
        self.client_states = [
            {k: v.to(dev) for k, v in clients.get(str(n), {}).items()}
            for n in range(len(self.clients))
        ]
        channel = tree.get("channel", {})
        for kind, store in (
            ("residual", self.residual),
            ("replica", self.replica),
            ("reference", self.reference),
        ):
            for d in ("up", "down"):
                saved = channel.get(d, {}).get(kind, {})
                store[d] = {_parse_key(k): v.to(dev) for k, v in saved.items()}
        self.best = {}
        for key, value in tree.get("best", {}).items():
            if isinstance(value, dict):  # the validation split's "val/<m>", saved nested
                for m, t in value.items():
                    self.best[f"{key}/{m}"] = t.to("cpu", torch.float64)
            else:
                self.best[key] = value.to("cpu", torch.float64)
        self.round = round_
        self.ledger = ledger


def _stack_alike(msgs: Sequence[Message | None]) -> torch.Tensor | None:
    """``msgs`` stacked ``[m, ...]`` (detached) if all are tensors of one shape, else None.

    One message for all (the global model) is expanded, not copied.
    """
    first = msgs[0]
    if not isinstance(first, torch.Tensor):
        return None
    if any(not isinstance(m, torch.Tensor) or m.shape != first.shape for m in msgs):
        return None
    if all(m is first for m in msgs):
        return first.detach().unsqueeze(0).expand(len(msgs), *first.shape)
    return torch.stack([m.detach() for m in msgs])


def _stack_parts(msgs: list) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """:func:`_stack_alike` of bare tensors, or of each named part of dict messages."""
    first = msgs[0]
    if not isinstance(first, dict):
        return _stack_alike(msgs)
    if any(not isinstance(m, dict) or m.keys() != first.keys() for m in msgs):
        return None
    parts = {name: _stack_alike([m[name] for m in msgs]) for name in first}
    return None if any(p is None for p in parts.values()) else parts  # type: ignore[return-value]


def _row(stacked: torch.Tensor | dict[str, torch.Tensor], i: int) -> Message:
    """Row ``i`` of a cohort's stacked message: of the tensor, or of each named part."""
    if isinstance(stacked, torch.Tensor):
        return stacked[i]
    return {name: part[i] for name, part in stacked.items()}


def _take(stacked: Stacked | None, index: torch.Tensor) -> Stacked | None:
    """Rows ``index`` of a cohort's stacked messages (of each named part)."""
    if stacked is None:
        return None
    if isinstance(stacked, torch.Tensor):
        return stacked[index]
    return {name: part[index] for name, part in stacked.items()}


def _merge(results: list[tuple[list[int], CohortResult]], m: int) -> CohortResult:
    """Sub-cohorts' results (each with its rows of the round's cohort) in client order."""
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
    states: list[State] = [{}] * m
    for rows, r in results:
        for i, state in zip(rows, r.states, strict=True):
            states[i] = state
    metrics = {k: cat([r.metrics[k] for _, r in results]) for k in first.metrics}
    return CohortResult(updates, states, metrics)


RoundCallback = Callable[[Engine, dict[str, float]], None]
