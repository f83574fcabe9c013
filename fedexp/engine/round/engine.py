"""The one round loop every algorithm runs in.

The engine owns all state (server, clients, channel residuals and replicas, the byte ledger),
moves every message through its channel as bytes (its ``Transport``, handed the ledger each
message is counted in), and calls the algorithm's hooks. The
round's clients work as one cohort (``Algorithm.client_update`` over stacked tensors; the
local solver, ``fedexp.engine.solver.steps``, runs their steps together), in sub-cohorts where their
step counts differ; each client draws from its own (seed, round, client) stream, so results
do not depend on the grouping or the order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedexp import streams
from fedexp.algorithms.base import Algorithm
from fedexp.comm.channel import Channel
from fedexp.comm.codec import DenseCodec
from fedexp.contract import Cohort
from fedexp.contract import CohortResult
from fedexp.contract import MeanUpload
from fedexp.contract import Message
from fedexp.contract import Senders
from fedexp.contract import Stacked
from fedexp.contract import State
from fedexp.contract import update_parts
from fedexp.data.client import ClientData
from fedexp.data.client import client_ids
from fedexp.engine.clients.pool import ClientTable
from fedexp.engine.clients.pool import TrainPool
from fedexp.engine.clients.states import ClientStates
from fedexp.engine.memory import peak_mib
from fedexp.engine.memory import reset_peak
from fedexp.engine.processes.ranks import Ranks
from fedexp.engine.processes.ranks import weighted_sums
from fedexp.engine.processes.share import Share
from fedexp.engine.round import checkpointing
from fedexp.engine.round.cohorts import merge_results
from fedexp.engine.round.cohorts import sub_cohorts
from fedexp.engine.round.evaluation import Evaluation
from fedexp.engine.round.exchange import Alone
from fedexp.engine.round.exchange import RankExchange
from fedexp.engine.round.ledger import ByteLedger
from fedexp.engine.round.stacking import Member
from fedexp.engine.round.stacking import Work
from fedexp.engine.round.stages import Privatize
from fedexp.engine.round.stages import Sampler
from fedexp.engine.round.stages import Uplink
from fedexp.engine.round.stages import UplinkStage
from fedexp.engine.round.stages import Who
from fedexp.engine.round.stages import Wire
from fedexp.engine.round.stages import rows_of
from fedexp.engine.round.stages import take_rows
from fedexp.engine.round.stages import weakly
from fedexp.engine.round.transport import Transport
from fedexp.engine.round.transport import _exact
from fedexp.engine.solver.context import Context
from fedexp.privacy.uplink import PrivateUplink
from fedexp.system.checks import check_buffer
from fedexp.system.clock import Clock
from fedexp.system.clock import local_steps
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
class Engine(Evaluation):
    """Federated simulation state and the round loop.

    Messages move through the engine's :class:`fedexp.engine.round.transport.Transport`
    (:attr:`transport`), clients are scored by :class:`fedexp.engine.round.evaluation.Evaluation`'s
    methods.

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
    #: the channels, their memories per (client, part) (error-feedback residuals, replicas,
    #: references), messages through them counted in the ledger it is handed
    transport: Transport = field(init=False, repr=False)
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
        self.transport = Transport(
            self.ctx,
            self.algorithm,
            self.uplink,
            self.downlink,
            self.seed,
            self.x0,
            len(self.clients),
            None if self.store is None else self.store / "channel",
            self.share,
        )
        self._choose_stages()
        self.pool = TrainPool.of(self.clients) if self.clients else None
        self.server = self.algorithm.init_server(self.ctx, self.x0)
        self.client_states = self.fresh_states()
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
        wire = Wire(self.transport.send_up)
        lossy = not _exact(self.uplink)
        if privacy is None:
            self.stages = [wire]
        else:
            self.stages = [Privatize(privacy, self.x0, lossy, weakly(self._received)), wire]
        if self.clock is not None:  # first on the server's side: it may drop late uploads
            self.stages.insert(0, self.clock)

    @property
    def _keeps_all(self) -> bool:
        """Whether the server steps on every upload of the round's cohort at once.

        Not where a clock drops some, nor with FedBuff's buffer (a step takes uploads of
        earlier rounds' cohorts): the uploads then stay per client, never pre-summed.
        """
        return self.system is None or self.system.keeps_all

    def _clock(self, members: tuple[int, ...] | None) -> Clock:
        """The simulated clock of :attr:`system` (the ledger then keeps each client's bytes).

        Raises:
            ConfigError: a FedBuff buffer the run cannot take (``check_buffer``).
        """
        assert self.system is not None
        self.ledger.per_client = True
        n = len(self.clients)
        clock = Clock(
            self.system,
            self.seed,
            self.participation,
            np.arange(n) if members is None else np.asarray(members, dtype=np.int64),
            weakly(self._client_bytes),
            weakly(self._client_steps),
            weights_of=weakly(self._weight_tensor),
            device=self.ctx.device,
        )
        if self.system.buffer is not None:
            mode = "none" if self.privacy is None else str(self.privacy.settings.mode)
            algo, buffer = self.algorithm, self.system.buffer
            steps = algo.server_reads == "mean" and getattr(algo, "server_optimized", False)
            check_buffer(buffer, clock.target, steps, type(algo).__name__, mode, algo.all_train)
        return clock

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

    @property
    def share(self) -> Share | None:
        """This process's place among the run's processes (its clients); None: it alone."""
        return None if self.ranks is None else self.ranks.share

    def fresh_states(self) -> ClientStates:
        """Every client at its initial state (made when read: nothing is stored until then)."""
        algo, ctx, x0 = self.algorithm, self.ctx, self.x0
        return ClientStates(
            len(self.clients),
            lambda n: algo.init_client(ctx, x0, n),
            ctx.device,
            self.store,
            share=self.share,
            shared_init=not algo.init_per_client,
        )

    # ------------------------------------------------------------------ set-up
    def setup(self) -> dict[str, float]:
        """The one-off exchange before round 0: client sketches up (dense), server set-up.

        Over several processes each counts its own clients' sketches, then the run's ledger
        adds every process's.
        """
        sketches: dict[int, torch.Tensor] = {}
        codec = DenseCodec()
        ranks = self.ranks
        everyone = list(range(len(self.clients)))
        mine = self.ledger if ranks is None else ByteLedger()
        for n in everyone if ranks is None else ranks.mine(everyone):
            sketch = self.algorithm.client_sketch(
                self.ctx, self.clients[n], streams.generator(self.seed, _SKETCH, n)
            )
            if sketch is None:
                continue
            payload = codec.encode(sketch.reshape(-1))
            mine.add("up", payload, sketch.numel())
            sketches[n] = codec.decode(payload, sketch.numel()).to(self.ctx.device)
        if ranks is not None:  # every rank's sketches, in client order
            got = ranks.gather_tensors({str(n): s for n, s in sketches.items()})
            found = {int(k): v.to(self.ctx.device) for g in got for k, v in g.items()}
            sketches = dict(sorted(found.items()))
            self.ledger.merge(ranks.gather_json(mine.round_record()))
        self.server = self.algorithm.server_setup(self.ctx, self.server, sketches)
        return {"bytes/setup_up": float(self.ledger.total["up"])}

    # ---------------------------------------------------------------- the round
    def run_round(self) -> dict[str, float]:
        """Run round ``self.round`` and advance it; returns the round's training metrics.

        Algorithm 1 of every paper: sample, downlink, client work, uplink, aggregate, server
        step, record. Over several processes each runs its own clients and counts their
        messages in a ledger of its own (:meth:`Alone.round_ledger`: one process counts in the
        run's); the exchange (:attr:`exchange`) gives every rank the decoded uploads, which
        then takes the same server step, and adds every rank's counts to the run's ledger.
        """
        started = time.perf_counter()
        reset_peak(self.ctx.device)
        t = self.ctx.round = self.round
        self.ledger.start_round()
        ledger = self.exchange.round_ledger(self.ledger)
        who = self.sampler(t)
        self.last_sampled = who.uploaders
        slices = self._round_slices(who)
        if slices is None:
            up = self._sending(t, who, ledger)
        else:
            up = self._sliced(t, who, slices, ledger)
        up = self.exchange.combine(who, up, ledger, self.ledger)
        mean = isinstance(up.updates, MeanUpload)  # (slices, or a "mean" server's ranks)
        up.weights = up.updates.weights if mean else self._weights(up.updates)
        for stage in self.stages:  # re-clip, server noise, the accountant
            up = stage.server(t, who, up)
        # the senders over every slice and process (a "mean" server may get one summed upload)
        heard = who.uploaders if up.heard is None else up.heard  # (a deadline may drop some)
        self.ctx.senders = Senders(heard, self._host_sizes(), self.ctx.num_clients)
        self.server = self.algorithm.server_update(self.ctx, self.server, up.updates, up.weights)
        self.round = t + 1
        return self._record(who, up, started)

    def _sending(self, t: int, who: Who, ledger: ByteLedger) -> Uplink:
        """This process's trainers' downlink, work and states; its uploaders' side of the uplink.

        The messages' bytes are counted in ``ledger`` (this process's, this round).
        """
        inbox, result = self._train(t, who.my_trainers, ledger)
        self.client_states.write(who.my_trainers, result.states)
        sums = _sums(result.metrics)
        uploads = rows_of(result.updates, who.my_trainers, who.my_uploaders)
        up = Uplink(uploads, inbox, sums, ledger=ledger)
        for stage in self.stages:  # clip, local noise, codec, wire and ledger, decode
            up = stage.client(t, who, up)
        return up

    def _round_slices(self, who: Who) -> list[Who] | None:
        """``who``'s trainers here in slices whose stacks fit ``memory_budget``; None: whole.

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
        if len(who.my_trainers) <= size:
            return None
        if not self._slices_told:
            log.info("rounds in slices of %d clients (memory_budget)", size)
            self._slices_told = True
        mine, uploaders = who.my_trainers, set(who.my_uploaders)
        return [
            Who(who.uploaders, who.trainers, part, [n for n in part if n in uploaders])
            for part in (mine[a : a + size] for a in range(0, len(mine), size))
        ]

    def _sliced(self, t: int, who: Who, slices: list[Who], ledger: ByteLedger) -> Uplink:
        """:meth:`_sending` slice by slice: the uploads' Σ_n ω_n u_n as the round's one upload.

        Each slice's decoded uploads are weighted (ω_n among the round's senders) and summed,
        then freed; the sum (``Uplink.summed``) goes to the exchange, which gives the server
        the processes' sum as the round's mean upload (:class:`fedexp.contract.MeanUpload`,
        of weight 1: ``Alone.combine``, :func:`fedexp.engine.processes.ranks.reduce_uploads`).
        Metrics are the slices' sums; ``ledger`` counts every message as it is sent.
        """
        total: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        uploaded = False
        for part in slices:
            up = self._sending(t, part, ledger)
            for k, v in up.metrics.items():
                metrics[k] = metrics.get(k, 0.0) + v
            uploaded = uploaded or up.uploaded
            if up.updates and part.my_uploaders:
                weights = self._weight_tensor(part.my_uploaders, who.uploaders)
                parts = update_parts(up.updates, part.my_uploaders)
                for k, v in weighted_sums(parts, weights).items():
                    total[k] = total[k] + v if k in total else v
            del up
        return Uplink(None, None, metrics, uploaded=uploaded, summed=total)

    def _train(
        self, t: int, trainers: list[int], ledger: ByteLedger
    ) -> tuple[Stacked | None, CohortResult]:
        """The trainers' downlink and client work: (their decoded inbox, their results).

        The downlink's bytes are counted in ``ledger``. A Poisson-sampled cohort, or a rank's
        share of one, may be empty.
        """
        if not trainers:
            return None, CohortResult(None, [], {})
        msgs = self.algorithm.downlinks(self.ctx, self.server, trainers)
        inbox = self.transport.send_down(trainers, msgs, t, ledger)
        return inbox, self._client_work(trainers, inbox)

    def _record(self, who: Who, up: Uplink, started: float) -> dict[str, float]:
        """The round's figures.

        The clients' metrics are the mean over who trained, the channel's over who uploaded;
        then the stages', the sampler's, the server's and the ledger's.
        """
        out = {k: v / len(who.trainers) for k, v in up.metrics.items() if k.startswith("train/")}
        for k, v in up.metrics.items():
            if k.startswith("channel/"):
                name = f"train/{k.removeprefix('channel/')}"
                out[name] = out.get(name, 0.0) + v / len(who.uploaders)
        out.update(up.report)
        out.update(who.metrics())
        out.update(self.algorithm.server_metrics(self.ctx, self.server))
        out.update(self.ledger.metrics())
        out["time/round_s"] = time.perf_counter() - started
        out["memory/peak_mib"] = peak_mib(self.ctx.device)
        return out

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
        return results[0][1] if len(results) == 1 else merge_results(results, len(sampled))

    def _cohorts(
        self, clients: list[int], purpose: int
    ) -> list[tuple[list[int], Cohort, Hashable]]:
        """``clients`` in sub-cohorts by ``Context.work_key`` (:func:`sub_cohorts`).

        Returns:
            (positions in ``clients``, the cohort, its work key) of each sub-cohort.

        Each cohort's clients draw from their (seed, ``purpose``, round, client) streams.
        """
        data = self.client_data(clients)
        return sub_cohorts(self.ctx, clients, data, self.seed, purpose, self.round, self.pool)

    def client_data(self, clients: Sequence[int]) -> list[ClientData]:
        """The data of ``clients`` (a table's made at once)."""
        if isinstance(self.clients, ClientTable):
            return self.clients.many(clients)
        return [self.clients[n] for n in clients]

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

        Over several processes a collective: rank 0 gets the whole tree, the other ranks None
        (:func:`fedexp.engine.round.checkpointing.state_tree`).
        """
        return checkpointing.state_tree(self)

    def load_state_tree(self, tree: dict[str, Any], round_: int, ledger: ByteLedger) -> None:
        """Restore what :meth:`state_tree` saved; the run goes on at ``round_`` with ``ledger``."""
        checkpointing.load_state_tree(self, tree)
        if self.clock is not None:  # (the clock reads each client's bytes)
            ledger.per_client = True
        self.round = round_
        self.ledger = ledger


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
