"""The one round loop every algorithm runs in.

The engine owns all state (server, clients, channel residuals and replicas, the byte ledger),
moves every message through its channel as bytes, and calls the algorithm's hooks. The
round's clients work as one cohort (``Algorithm.client_update`` over stacked tensors; the
local solver, ``fedexp.engine.solver.steps``, runs their steps together), in sub-cohorts where their
step counts differ; each client draws from its own (seed, round, client) stream, so results
do not depend on the grouping or the order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedexp import streams
from fedexp.algorithms.base import Algorithm
from fedexp.comm.channel import Channel
from fedexp.comm.codec import DenseCodec
from fedexp.contract import (
    Cohort,
    CohortResult,
    CohortStates,
    Message,
    Senders,
    Stacked,
    StackedUpdates,
    State,
    update_parts,
)
from fedexp.data.client import ClientData, client_ids
from fedexp.engine.clients.part_memory import PartMemory, merge_memories
from fedexp.engine.clients.pool import ClientTable, TrainPool
from fedexp.engine.clients.states import ClientStates, merge_exports
from fedexp.engine.files.checkpoint import flatten_state, unflatten_state
from fedexp.engine.memory import peak_mib, reset_peak
from fedexp.engine.processes.ranks import Ranks, weighted_sums
from fedexp.engine.round.evaluation import Evaluation
from fedexp.engine.round.exchange import Alone, RankExchange
from fedexp.engine.round.ledger import ByteLedger
from fedexp.engine.round.stacking import Member, Work
from fedexp.engine.round.stages import (
    Privatize,
    Sampler,
    Uplink,
    UplinkStage,
    Who,
    Wire,
    rows_of,
    take_rows,
    weakly,
)
from fedexp.engine.round.transport import (
    Transport,
    _exact,
    _parse_key,
    _row,
    _stack_parts,
)
from fedexp.engine.solver.context import Context
from fedexp.privacy.uplink import PrivateUplink
from fedexp.system.clock import Clock, local_steps
from fedexp.system.settings import SystemModel
from fedexp.transfer import to_device


def _sample(seed: int, num_clients: int, rate: float, round_: int) -> list[int]:
    """The round's fixed-size cohort (``streams.sample_clients``)."""
    return streams.sample_clients(seed, round_, num_clients, rate)


def _sample_among(members: tuple[int, ...], seed: int, rate: float, round_: int) -> list[int]:
    """The round's fixed-size cohort of ``members`` (the clients not held out), ascending."""
    return [members[i] for i in streams.sample_clients(seed, round_, len(members), rate)]


# Stream purpose of the set-up exchange (beside streams.CLIENT and the channels' purposes).
_SKETCH = 13

#: ``[m, d]`` stacks a round holds of each of its clients beyond the local steps' own memory
#: (the trained parameters, the update, its decoded copy, the channel's residual): the unit
#: in which a round is sliced to fit ``memory_budget`` (:meth:`Engine._round_slices`)
_ROUND_COPIES = 4

log = logging.getLogger("fedexp")


@dataclass
class Engine(Transport, Evaluation):
    """Federated simulation state and the round loop.

    Messages move through :class:`fedexp.engine.round.transport.Transport`'s methods, clients are
    scored by :class:`fedexp.engine.round.evaluation.Evaluation`'s.

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
    #: every client's state (``fedexp.engine.clients.states``), made in ``__post_init__``
    client_states: ClientStates = field(init=False)
    #: per direction, (client, part) -> error-feedback residual / replica / last message
    #: (``fedexp.engine.clients.part_memory``), made in ``__post_init__``
    residual: dict[str, PartMemory] = field(init=False)
    replica: dict[str, PartMemory] = field(init=False)
    reference: dict[str, PartMemory] = field(init=False)
    #: per client, the best value over evaluated rounds of each metric (pFedSOP's protocol)
    best: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the clients of the last round run
    last_sampled: list[int] = field(default_factory=list)
    #: every client's training data in one tensor (``fedexp.engine.clients.pool``)
    pool: TrainPool | None = field(default=None, repr=False)
    #: client-level DP on the uplink (``privacy`` group); None: none
    privacy: PrivateUplink | None = None
    #: the run's processes (torch.distributed); None: this process alone
    ranks: Ranks | None = None
    #: where the clients' states are memory-mapped (``store=disk``); None: in memory
    store: Path | None = None
    #: the run's place in a group of stacked runs whose client work is merged
    #: (``fedexp.engine.round.stacking``); None: its work is its own
    stack: Member | None = None
    #: the processes' exchange (``fedexp.engine.round.exchange``), from ``ranks``
    exchange: Alone | RankExchange = field(init=False, repr=False)
    #: whether the log has said that rounds go in slices (:meth:`_round_slices`)
    _slices_told: bool = field(default=False, init=False, repr=False)
    #: who takes part in a round (``fedexp.engine.round.stages.Sampler``)
    sampler: Sampler = field(init=False, repr=False)
    #: the uplink's stages after the algorithm's upload: DP (with ``privacy``), the channel
    stages: list[UplinkStage] = field(init=False, repr=False)
    #: the initial server state (derived, not checkpointed), built when a part needs it
    _server0: State | None = field(default=None, repr=False)
    #: score the global model on every client's test split too (``eval_global``,
    #: ``fedexp.engine.round.views``)
    eval_global: bool = True
    #: the clients kept out of training, scored as new clients (``holdout_clients``)
    holdout: tuple[int, ...] = ()
    #: a new client's local steps before its test (``holdout_steps``; None: the run's)
    holdout_steps: int | None = None
    #: every client's device, links and availability (``system`` group); None: no clock
    system: SystemModel | None = None
    #: the simulated clock (``fedexp.system.clock``), made from ``system``
    clock: Clock | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._choose_stages()
        self.pool = TrainPool.of(self.clients) if self.clients else None
        self.server = self.algorithm.init_server(self.ctx, self.x0)
        self.client_states = self._fresh_states()
        self._fresh_memories()
        if self.clients:  # states are made when read: one now, so that bad settings fail here
            self.algorithm.init_client(self.ctx, self.x0, 0)

    def _choose_stages(self) -> None:
        """The round's exchange, sampler and uplink chain, from the run's settings."""
        privacy, n = self.privacy, len(self.clients)
        if self.ranks is None:
            self.exchange = Alone()
        else:
            mean = privacy is None and self.algorithm.server_reads == "mean" and self._keeps_all
            self.exchange = RankExchange(self.ranks, mean, weakly(self._weight_tensor))
        seed, rate = self.seed, self.participation
        draw = privacy.sample if privacy is not None else partial(_sample, seed, n, rate)
        members = None
        if self.holdout:  # the held-out clients never take part (``holdout_clients``)
            members = tuple(self.training_clients())
            draw = partial(_sample_among, members, seed, rate)
        if self.system is not None:  # the simulated clock: available clients only, timed
            self.clock = self._clock(members)
            draw = self.clock.draw if privacy is None else draw
        self.sampler = Sampler(draw, n, self.algorithm.all_train, self.exchange.mine, members)
        wire = Wire(weakly(self._uplink))
        lossy = not _exact(self.uplink)
        if privacy is None:
            self.stages = [wire]
        else:
            self.stages = [Privatize(privacy, self.x0, lossy, weakly(self._received)), wire]
        if self.clock is not None:  # first on the server's side: it may drop late uploads
            self.stages.insert(0, self.clock)

    @property
    def _keeps_all(self) -> bool:
        """Whether the server keeps every sampled upload (no clock drops any)."""
        return self.system is None or self.system.keeps_all

    def _clock(self, members: tuple[int, ...] | None) -> Clock:
        """The simulated clock of :attr:`system` (the ledger then keeps each client's bytes)."""
        assert self.system is not None
        self.ledger.per_client = True
        n = len(self.clients)
        return Clock(
            self.system,
            self.seed,
            self.participation,
            np.arange(n) if members is None else np.asarray(members, dtype=np.int64),
            weakly(self._client_bytes),
            weakly(self._client_steps),
        )

    def _client_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """This round's bytes of every client, (up ``[N]``, down ``[N]``), every process's."""
        n = len(self.clients)
        return self.ledger.client_bytes("up", n), self.ledger.client_bytes("down", n)

    def _client_steps(self) -> np.ndarray:
        """Every client's local steps a round (``Context.steps_for`` of each, at once)."""
        ctx = self.ctx
        return local_steps(self._host_sizes(), ctx.local_steps, ctx.local_epochs, ctx.batch_size)

    def _received(self) -> Message | None:
        """What client 0 would receive now (the shape of an empty DP cohort's noise)."""
        return self.algorithm.downlinks(self.ctx, self.server, [0])[0]

    def _fresh_memories(self) -> None:
        """The channels' memories, empty.

        :class:`PartMemory`: in memory, or files beside the states' with ``store=disk``; a
        rank's own clients over several processes.
        """
        share = None if self.ranks is None else self.ranks.share
        for kind in ("residual", "replica", "reference"):
            memories = {}
            for d in ("up", "down"):
                folder = None if self.store is None else self.store / "channel" / f"{kind}-{d}"
                memories[d] = PartMemory(len(self.clients), self.ctx.device, folder, share)
            setattr(self, kind, memories)

    def _fresh_states(self) -> ClientStates:
        """Every client at its initial state (made when read: nothing is stored until then)."""
        algo, ctx, x0 = self.algorithm, self.ctx, self.x0
        return ClientStates(
            len(self.clients),
            lambda n: algo.init_client(ctx, x0, n),
            ctx.device,
            self.store,
            share=None if self.ranks is None else self.ranks.share,
            shared_init=not algo.init_per_client,
        )

    # ------------------------------------------------------------------ set-up
    def setup(self) -> dict[str, float]:
        """The one-off exchange before round 0: client sketches up (dense), server set-up."""
        sketches: dict[int, torch.Tensor] = {}
        codec = DenseCodec()
        ranks, ledger = self.ranks, self.ledger
        everyone = list(range(len(self.clients)))
        if ranks is not None:
            self.ledger = ByteLedger()
        for n in everyone if ranks is None else ranks.mine(everyone):
            sketch = self.algorithm.client_sketch(
                self.ctx, self.clients[n], streams.generator(self.seed, _SKETCH, n)
            )
            if sketch is None:
                continue
            payload = codec.encode(sketch.reshape(-1))
            self.ledger.add("up", payload, sketch.numel())
            sketches[n] = codec.decode(payload, sketch.numel()).to(self.ctx.device)
        if ranks is not None:  # every rank's sketches, in client order
            got = ranks.gather_tensors({str(n): s for n, s in sketches.items()})
            found = {int(k): v.to(self.ctx.device) for g in got for k, v in g.items()}
            sketches = dict(sorted(found.items()))
            ledger.merge(ranks.gather_json(self.ledger.round_record()))
            self.ledger = ledger
        self.server = self.algorithm.server_setup(self.ctx, self.server, sketches)
        return {"bytes/setup_up": float(self.ledger.total["up"])}

    # ---------------------------------------------------------------- the round
    def run_round(self) -> dict[str, float]:
        """Run round ``self.round`` and advance it; returns the round's training metrics.

        Algorithm 1 of every paper: sample, downlink, client work, uplink, aggregate, server
        step, record. Over several processes each runs its own clients and counts their
        messages; the exchange (:attr:`exchange`) gives every rank the decoded uploads, which
        then takes the same server step.
        """
        started = time.perf_counter()
        reset_peak(self.ctx.device)
        t = self.ctx.round = self.round
        self.ledger.start_round()
        run_ledger, self.ledger = self.ledger, self.exchange.round_ledger(self.ledger)
        who = self.sampler(t)
        self.last_sampled = who.sampled
        slices = self._round_slices(who)
        up = self._sending(t, who) if slices is None else self._sliced(t, who, slices)
        up = self.exchange.combine(who, up, self.ledger, run_ledger)
        self.ledger = run_ledger
        up.weights = self._weights(up.updates)
        for stage in self.stages:  # re-clip, server noise, the accountant
            up = stage.server(t, who, up)
        # the senders over every slice and process (a "mean" server may get one summed upload)
        heard = who.sampled if up.heard is None else up.heard  # (a deadline may drop some)
        self.ctx.senders = Senders(heard, self._host_sizes(), self.ctx.num_clients)
        self.server = self.algorithm.server_update(self.ctx, self.server, up.updates, up.weights)
        self.round = t + 1
        return self._record(who, up, started)

    def _sending(self, t: int, who: Who) -> Uplink:
        """The workers' downlink, client work and states, and the senders' side of the uplink."""
        inbox, result = self._train(who.workers)
        self.client_states.write(who.workers, result.states)
        sums = _sums(result.metrics)
        up = Uplink(rows_of(result.updates, who.workers, who.senders), inbox, sums)
        for stage in self.stages:  # clip, local noise, codec, wire and ledger, decode
            up = stage.client(t, who, up)
        return up

    def _round_slices(self, who: Who) -> list[Who] | None:
        """``who``'s workers in slices whose stacked vectors fit ``memory_budget``; None: whole.

        A round holds ``_ROUND_COPIES`` ``[m, d]`` stacks of its cohort (1,000 ResNet-18
        clients: 45 GB each). Where the server reads the uploads only through Σ_n ω_n u_n
        (``server_reads="mean"``), without DP, and the run is not stacked with others, the
        cohort can go through its client work and the senders' side of the uplink slice by
        slice, each slice's weighted sum added, so that no stack of the whole cohort is ever
        made. Over several processes each slices its own clients, and the processes add
        their sums as they add their uploads' (:class:`RankExchange`, whose ``mean`` holds
        exactly then).
        """
        budget = self.ctx.memory_budget
        if (
            budget <= 0
            or self.algorithm.server_reads != "mean"
            or self.privacy is not None
            or self.stack is not None
            or not self._keeps_all
        ):
            return None
        size = max(1, budget // (_ROUND_COPIES * self.x0.numel() * self.x0.element_size()))
        if len(who.workers) <= size:
            return None
        if not self._slices_told:
            log.info("rounds in slices of %d clients (memory_budget)", size)
            self._slices_told = True
        senders = set(who.senders)
        return [
            Who(who.sampled, who.trained, part, [n for n in part if n in senders])
            for part in (who.workers[a : a + size] for a in range(0, len(who.workers), size))
        ]

    def _sliced(self, t: int, who: Who, slices: list[Who]) -> Uplink:
        """:meth:`_sending` slice by slice: the uploads' Σ_n ω_n u_n as the round's one upload.

        Each slice's decoded uploads are weighted (ω_n among the round's senders) and summed,
        then freed; the sum (``Uplink.summed``) goes to the exchange, which gives the server
        the processes' sum as the upload of the round's first sender, which then weighs 1
        (``Alone.combine``, :func:`fedexp.engine.processes.ranks.reduce_uploads`). Metrics
        are the slices' sums; the ledger counts every message as it is sent.
        """
        total: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        uploaded = False
        for part in slices:
            up = self._sending(t, part)
            for k, v in up.metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v
            uploaded = uploaded or up.uploaded
            if up.updates and part.senders:
                weights = self._weight_tensor(part.senders, who.sampled)
                for k, v in weighted_sums(update_parts(up.updates, part.senders), weights).items():
                    total[k] = total[k] + v if k in total else v
            del up
        return Uplink(None, None, metrics, uploaded=uploaded, summed=total)

    def _train(self, workers: list[int]) -> tuple[Stacked | None, CohortResult]:
        """The workers' downlink and client work: (their decoded inbox, their results).

        A Poisson-sampled cohort, or a rank's share of one, may be empty.
        """
        if not workers:
            return None, CohortResult(None, [], {})
        msgs = self.algorithm.downlinks(self.ctx, self.server, workers)
        if isinstance(msgs, StackedUpdates) and msgs.clients == workers:  # made at once
            inbox = self._send_cohort("down", workers, msgs.stack)
            if inbox is not None:
                return inbox, self._client_work(workers, inbox)
        inbox = self._downlink(workers, [msgs[n] for n in workers])
        return inbox, self._client_work(workers, inbox)

    def _record(self, who: Who, up: Uplink, started: float) -> dict[str, float]:
        """The round's figures.

        The clients' metrics are the mean over who trained, the channel's over who uploaded;
        then the stages', the sampler's, the server's and the ledger's.
        """
        out = {k: v / len(who.trained) for k, v in up.metrics.items() if k.startswith("train/")}
        for k, v in up.metrics.items():
            if k.startswith("channel/"):
                name = f"train/{k.removeprefix('channel/')}"
                out[name] = out.get(name, 0.0) + v / len(who.sampled)
        out.update(up.report)
        out.update(who.metrics())
        out.update(self.algorithm.server_metrics(self.ctx, self.server))
        out.update(self.ledger.metrics())
        out["time/round_s"] = time.perf_counter() - started
        out["memory/peak_mib"] = peak_mib(self.ctx.device)
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
        changes no figure; nor does a stack (:attr:`stack`), which runs these cohorts with
        those of its other runs.
        """
        ctx, algo = self.ctx, self.algorithm
        groups = self._cohorts(sampled, streams.CLIENT)
        works = []
        for rows, cohort, key in groups:
            index = None if len(groups) == 1 else to_device(rows, ctx.device, torch.int64)
            model_in = inbox if index is None else take_rows(inbox, index)
            states = self.client_states.rows(cohort.clients)
            works.append(Work(key, model_in, states, cohort))
        if self.stack is not None:
            done = self.stack.work(ctx, algo, works)
        else:
            done = [algo.client_update(ctx, w.inbox, w.states, w.cohort) for w in works]
        results = [(rows, r) for (rows, _, _), r in zip(groups, done, strict=True)]
        return results[0][1] if len(results) == 1 else _merge(results, len(sampled))

    def _cohorts(
        self, clients: list[int], purpose: int
    ) -> list[tuple[list[int], Cohort, Hashable]]:
        """``clients`` in sub-cohorts by ``Context.work_key``.

        Returns:
            (positions in ``clients``, the cohort, its work key) of each sub-cohort.

        Each cohort's clients draw from their (seed, ``purpose``, round, client) streams.
        """
        ctx = self.ctx
        data = self.client_data(clients)
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
                keys=streams.stream_keys(self.seed, purpose, self.round, ids),
                draws=torch.zeros(len(members), dtype=torch.int64),
                pool=self.pool,
            )
            out.append((rows, cohort, key))
        return out

    def client_data(self, clients: Sequence[int]) -> list[ClientData]:
        """The data of ``clients`` (a table's made at once)."""
        if isinstance(self.clients, ClientTable):
            return self.clients.many(clients)
        return [self.clients[n] for n in clients]

    def _uplink(
        self, sampled: list[int], uploads: Stacked | None
    ) -> tuple[Mapping[int, Message], dict[str, float]]:
        """The clients' stacked uploads through their channel.

        Returns (decoded uploads, the channel's metrics summed over the messages: CER's).
        """
        sums: dict[str, float] = {}
        updates: dict[int, Message] = {}
        if uploads is None or not sampled:
            return updates, sums
        received = self._send_cohort("up", sampled, uploads, sums)
        if isinstance(received, torch.Tensor):
            return StackedUpdates(sampled, received), sums
        if received is not None:  # named parts: a stack of each
            return StackedUpdates(sampled, received), sums
        for i, n in enumerate(sampled):  # message by message (transforms: CER)
            updates[n], metrics = self._send("up", n, _row(uploads, i))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        if isinstance(uploads, torch.Tensor):  # the server reads a stack either way
            return StackedUpdates(sampled, torch.stack([updates[n] for n in sampled])), sums
        return updates, sums

    def _host_sizes(self) -> np.ndarray:
        """Every client's training-set size on the host (NumPy int64 [N]; no tensor op).

        A plain array, not a method of the engine: ``ctx.senders`` holds it, and a context
        that held the engine would keep it alive in a cycle (a disk store's scratch folder
        then outlived its run).
        """
        if self.pool is not None:
            return self.pool.sizes
        return np.asarray([c.num_train for c in self.clients], dtype=np.int64)

    def _weights(self, senders: Iterable[int]) -> dict[int, float]:
        """The aggregation weights ω_n of ``senders`` (ids, or the received uploads' keys)."""
        clients = list(senders)
        if not clients:
            return {}
        return dict(zip(clients, self._weight_tensor(clients, clients).tolist(), strict=True))

    def _weight_tensor(self, clients: list[int], among: list[int]) -> torch.Tensor:
        """The weights ω_n of ``clients`` (float64) in a round whose senders are ``among``.

        Uniform: 1/|among|; else n_train / Σ_among n_train.
        """
        if self.algorithm.weighting == "uniform":
            return torch.full((len(clients),), 1.0 / len(among), dtype=torch.float64)
        if self.pool is not None:  # the training-set sizes at once (a property call each: slow)
            total = self.pool.host_size(client_ids(among)).sum()  # no device read
            return self.pool.host_size(client_ids(clients)).double() / total.double()
        sizes = {n: self.clients[n].num_train for n in set(clients) | set(among)}
        total = sum(sizes[n] for n in among)
        return torch.tensor([sizes[n] / total for n in clients], dtype=torch.float64)

    # ----------------------------------------------------------- checkpointing
    def state_tree(self) -> dict[str, Any] | None:
        """Every tensor of the run's state, as a nested dict for ``checkpoint.save``.

        Over several processes a collective: every rank's clients' states and channel
        memories go to rank 0, which gets the whole tree; the other ranks get None.
        """
        clients = self.client_states.export()
        kinds = {"residual": self.residual, "replica": self.replica, "reference": self.reference}
        channel = {d: {k: m[d].export() for k, m in kinds.items()} for d in ("up", "down")}
        if self.ranks is not None:
            got = self.ranks.leader_gathers(flatten_state({"c": clients, "m": channel}))
            if got is None:
                return None
            trees = [unflatten_state(g) for g in got]
            clients = merge_exports([t.get("c", {}) for t in trees])
            channel = {
                d: {
                    k: merge_memories([t.get("m", {}).get(d, {}).get(k, {}) for t in trees])
                    for k in kinds
                }
                for d in ("up", "down")
            }
        tree = {
            "server": self.server,
            "clients": clients,
            "channel": channel,
            "best": dict(self.best),
        }
        if self.privacy is not None:
            tree["privacy"] = self.privacy.state()
        if self.clock is not None:
            tree["clock"] = self.clock.state()
        return tree

    def load_state_tree(self, tree: dict[str, Any], round_: int, ledger: ByteLedger) -> None:
        """Restore what :meth:`state_tree` saved."""
        dev = self.ctx.device
        self.server = {k: v.to(dev) for k, v in tree.get("server", {}).items()}
        self.client_states = self._fresh_states()
        if "clients" in tree:
            self.client_states.load(tree["clients"])
        else:  # a checkpoint of a version that saved each client's state on its own
            self.client_states.load_per_client(tree.get("client", {}))
        channel = tree.get("channel", {})
        self._fresh_memories()
        for kind, store in (
            ("residual", self.residual),
            ("replica", self.replica),
            ("reference", self.reference),
        ):
            for d in ("up", "down"):
                saved = channel.get(d, {}).get(kind, {})
                store[d].load({k: v for k, v in saved.items() if isinstance(v, dict)})
                parts: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
                for text, v in saved.items():  # one tensor a (client, part): older checkpoints
                    if isinstance(v, dict):
                        continue
                    n, name = _parse_key(text)
                    if self.ranks is None or self.ranks.owner(n) == self.ranks.rank:
                        parts.setdefault(name, ([], []))[0].append(n)  # (a rank: its own)
                        parts[name][1].append(v.to(dev))
                for name, (clients, values) in parts.items():
                    store[d].write(clients, name, values)
        self.best = {}
        for key, value in tree.get("best", {}).items():
            if isinstance(value, dict):  # the validation split's "val/<m>", saved nested
                for m, t in value.items():
                    self.best[f"{key}/{m}"] = t.to("cpu", torch.float64)
            else:
                self.best[key] = value.to("cpu", torch.float64)
        if self.privacy is not None:
            self.privacy.load_state(tree.get("privacy", {}))
        if self.clock is not None:
            self.clock.load_state(tree.get("clock", {}))
            ledger.per_client = True
        self.round = round_
        self.ledger = ledger


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


RoundCallback = Callable[[Engine, dict[str, float]], None]


def _sums(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``train/<name>``: the cohort's sum of each per-client metric, read in one copy.

    A round's training metrics go to the host together (issue 39: each read of a GPU's value
    waits for its queue), as float64: the same numbers as one ``float`` each.
    """
    if not metrics:
        return {}
    values = torch.stack([v.sum().to(torch.float64) for v in metrics.values()]).tolist()
    return {f"train/{k}": x for k, x in zip(metrics, values, strict=True)}
