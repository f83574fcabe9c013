"""The simulated clock: a round's stage that times its clients (``system`` group).

A client's time in a round is

    t_n = down_n / downlink_n + latency_n + steps_n / speed_n + up_n / uplink_n + latency_n,

with ``down_n`` and ``up_n`` the bytes the ledger counted for it this round (so a codec,
error feedback or DP change the time exactly as they change the bytes) and ``steps_n`` its
local steps. A synchronous round lasts until the last client the server waits for. Deadlines
and over-selection follow Bonawitz et al., "Towards Federated Learning at Scale: System
Design" (MLSys 2019): the server keeps the first K = the round's cohort to report, among
those done within ``deadline`` seconds; the others' uploads are dropped, their bytes stay
counted (``clock/wasted_bytes``). Unavailable clients are never sampled. With
``system.buffer`` the rounds are FedBuff's server steps instead (:mod:`fedexp.system.buffer`):
the clients in flight are never sampled again until they arrive, and a step takes the first
``buffer`` uploads to arrive, staleness-weighted.

The clock is chosen when the engine is built (``Engine._choose_stages``): the sampler's draw
(:meth:`Clock.draw`) and the first link of the uplink chain (:meth:`Clock.server`, after the
processes' exchange, so every process times every client alike). All of it is NumPy on host
arrays the round already has: no device read, no loop over clients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field

import numpy as np
import torch

from fedexp import streams
from fedexp.contract import Message
from fedexp.contract import StackedUpdates
from fedexp.contract import parts_updates
from fedexp.contract import update_parts
from fedexp.engine.round.stages import Uplink
from fedexp.engine.round.stages import UplinkStage
from fedexp.engine.round.stages import Who
from fedexp.engine.round.stages import take_rows
from fedexp.system.buffer import Flight
from fedexp.system.buffer import staleness_weight
from fedexp.system.settings import SystemModel
from fedexp.system.settings import over_sampled


def local_steps(sizes: np.ndarray, steps: int, epochs: float | None, batch_size: int) -> np.ndarray:
    """Every client's local steps a round (``Context.steps_for``, for all at once), int64.

    Args:
        sizes: the clients' training-set sizes ``[N]``.
        steps: ``local_steps`` (used when ``epochs`` is None).
        epochs: ``local_epochs``, or None.
        batch_size: the batch (≤ 0: the full batch, one step an epoch).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if epochs is None:
        return np.full(sizes.shape, steps, dtype=np.int64)
    per_epoch = np.ones_like(sizes) if batch_size <= 0 else -(-sizes // batch_size)
    return np.maximum(1, np.ceil(epochs * per_epoch)).astype(np.int64)


def client_times(
    model: SystemModel, clients: np.ndarray, up: np.ndarray, down: np.ndarray, steps: np.ndarray
) -> np.ndarray:
    """The seconds each of ``clients`` takes this round (float64, module docstring).

    ``up``, ``down``, ``steps``: every client's bytes each way and local steps ``[N]``.
    """
    c = clients
    return (
        down[c] / model.downlink[c]
        + model.latency[c]
        + steps[c] / model.speed[c]
        + up[c] / model.uplink[c]
        + model.latency[c]
    )


def keep_first(
    times: np.ndarray, clients: np.ndarray, target: int, deadline: float | None
) -> np.ndarray:
    """Which clients the server keeps (bool, ``clients``' order): the first ``target`` done.

    Among those done by ``deadline`` (all with None), the ``target`` fastest; ties go to the
    lower client id.
    """
    on_time = np.ones(len(times), dtype=bool) if deadline is None else times <= deadline
    order = np.lexsort((clients, times))
    order = order[on_time[order]][:target]
    kept = np.zeros(len(times), dtype=bool)
    kept[order] = True
    return kept


def round_seconds(
    times: np.ndarray, kept: np.ndarray, target: int, deadline: float | None
) -> float:
    """How long the server waited: for the last kept client, or until the deadline.

    With the round's ``target`` kept it stops at the last of them; else it waited for every
    client (no deadline) or until the deadline (some were late).
    """
    if not len(times):
        return 0.0
    if kept.sum() >= target or deadline is None or (times <= deadline).all():
        return float(times[kept].max()) if kept.any() else float(times.max())
    return float(deadline)


@dataclass
class Clock(UplinkStage):
    """The round's simulated time, its sampling among available clients and its drops.

    Attributes:
        model: every client's device, links and availability, and the round's rules.
        seed: the run's seed (the sampling and availability streams).
        participation: the share of clients a round keeps (K = max(1, round(q·N))).
        members: the clients that may take part, ascending (every client: ``range(N)``).
        bytes_of: () -> this round's bytes of every client, (up ``[N]``, down ``[N]``): the
            ledger's (``ByteLedger.client_bytes``), every process's.
        steps_of: () -> every client's local steps ``[N]`` (read once).
        elapsed: the simulated seconds so far (checkpointed).
        weights_of: ``(clients, among) -> ω_n`` (float64), the engine's aggregation weights
            (``Engine._weight_tensor``): FedBuff's among the K uploads a step takes.
        device: where the uploads in flight live (the run's device).
        flight: FedBuff's clients in flight (``system.buffer``; None: synchronous rounds),
            checkpointed.
    """

    model: SystemModel
    seed: int
    participation: float
    members: np.ndarray
    bytes_of: Callable[[], tuple[np.ndarray, np.ndarray]]
    steps_of: Callable[[], np.ndarray]
    elapsed: float = 0.0
    weights_of: Callable[[list[int], list[int]], torch.Tensor] | None = None
    device: torch.device | str = "cpu"
    flight: Flight | None = field(default=None, repr=False)
    _steps: np.ndarray | None = field(default=None, repr=False)
    #: the round's draw: clients off, and the seconds the server waited for one to be on
    _off: int = field(default=0, repr=False)
    _idle: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if self.model.buffer is not None and self.flight is None:
            self.flight = Flight()

    @property
    def num_clients(self) -> int:
        """N."""
        return len(self.model.speed)

    @property
    def target(self) -> int:
        """K, the clients a round keeps: ``streams.sample_clients``'s count of the members."""
        return max(1, int(round(self.participation * len(self.members))))

    def available(self, round_: int, time: float) -> np.ndarray:
        """Which clients are on in ``round_`` at ``time`` seconds (bool ``[N]``)."""
        model, n = self.model, self.num_clients
        if model.trace is not None:
            return model.trace.available(time, n)
        if model.availability >= 1.0:
            return np.ones(n, dtype=bool)
        keys = streams.stream_keys(self.seed, streams.AVAILABLE, round_, torch.arange(n))
        uniform = (keys >> 10).to(torch.float64) * 2.0**-53  # (63-bit keys: in [0, 1))
        return uniform.numpy() < model.availability

    def _next_on(self, time: float) -> float:
        """The first time ≥ ``time`` at which a traced member is on (its next interval)."""
        trace = self.model.trace
        assert trace is not None
        used = np.unique(self.members % len(trace.ids))
        mine = np.isin(trace.owner, used)
        period = trace.finish[trace.owner[mine]]
        norm = np.mod(time, period)
        start, end = trace.active[mine], trace.inactive[mine]
        wait = np.where((start <= norm) & (norm <= end), 0.0, np.mod(start - norm, period))
        return time + float(wait.min()) if wait.size else time

    def draw(self, round_: int) -> list[int]:
        """The round's sampled clients: ⌈K·(1 + over_select)⌉ of the members who are on.

        Drawn as ``streams.sample_clients`` draws (the same (seed, SAMPLING, round) stream, a
        choice without replacement): with every client on and no over-selection, the same
        cohort as a run without a clock. Where no member is on (a trace's quiet hours) the
        server waits for the first to come on (that wait is the round's too). With FedBuff's
        buffer, the clients that start now: the cohort C less those in flight, drawn among
        the others (round 0: all C; then as many as the last step took, or more where an
        earlier draw found fewer on).
        """
        self._idle = 0.0
        busy = np.zeros(self.num_clients, dtype=bool)
        if self.flight is not None:
            busy[self.flight.clients] = True
        on = self.available(round_, self.elapsed)
        pool = self.members[on[self.members] & ~busy[self.members]]
        if not pool.size and not busy.any() and self.model.trace is not None:
            start = self._next_on(self.elapsed)
            self._idle = start - self.elapsed
            on = self.available(round_, start)
            pool = self.members[on[self.members]]
        self._off = int(len(self.members) - on[self.members].sum())
        want = over_sampled(self.target, self.model.over_select) - int(busy.sum())
        want = min(pool.size, max(0, want))
        if want >= pool.size:
            return pool.tolist()
        gen = np.random.default_rng(streams.derive_seed(self.seed, streams.SAMPLING, round_))
        return np.sort(gen.choice(pool, size=want, replace=False)).tolist()

    def server(self, round_: int, who: Who, up: Uplink) -> Uplink:
        """Time the round's uploaders, drop those the server does not wait for, advance the clock.

        Adds ``clock/round_s``, ``clock/cum_s``, ``clock/wasted_bytes`` (the dropped
        clients' bytes both ways), ``clients/dropped`` and ``clients/unavailable``.
        """
        if self._steps is None:
            self._steps = self.steps_of()
        if self.flight is not None:
            return self._buffered(round_, who, up)
        model = self.model
        up_bytes, down_bytes = self.bytes_of()
        clients = np.asarray(who.uploaders, dtype=np.int64)
        times = client_times(model, clients, up_bytes, down_bytes, self._steps)
        target = len(clients) if model.keeps_all else min(self.target, len(clients))
        kept = keep_first(times, clients, target, model.deadline)
        seconds = self._idle + round_seconds(times, kept, target, model.deadline)
        self.elapsed += seconds
        dropped = clients[~kept]
        if dropped.size:
            up = _drop(up, clients[kept].tolist())
        wasted = up_bytes[dropped].sum() + down_bytes[dropped].sum()
        up.report.update(
            {
                "clock/round_s": seconds,
                "clock/cum_s": self.elapsed,
                "clock/wasted_bytes": float(wasted),
                "clients/dropped": float(dropped.size),
                "clients/unavailable": float(self._off),
            }
        )
        return up

    def _buffered(self, round_: int, who: Who, up: Uplink) -> Uplink:
        """FedBuff's step: the new cohort in flight, the first K to arrive to the server.

        The cohort that trained this round starts now (the clock's time, after any wait for
        a client to come on) and arrives after its :func:`client_times`; the step takes the
        K first to arrive among all in flight (ties: the lower id; all, if fewer), the clock
        moves to the last of them, and their weights are ω_n·s(τ_n), ω_n among the K and
        τ_n = this round less the round each started in. Adds ``clock/round_s``,
        ``clock/cum_s``, ``async/staleness_mean``, ``async/staleness_max``,
        ``async/in_flight`` (after the step), and the synchronous clock's keys (nothing is
        dropped: ``clock/wasted_bytes`` and ``clients/dropped`` are 0).
        """
        flight, now = self.flight, self.elapsed + self._idle
        assert flight is not None and self.model.buffer is not None
        clients = np.asarray(who.uploaders, dtype=np.int64)
        if clients.size:
            up_bytes, down_bytes = self.bytes_of()
            seconds = client_times(self.model, clients, up_bytes, down_bytes, self._steps)
            parts = update_parts(up.updates, who.uploaders) if up.updates else {}
            flight.add(
                clients, round_, now, seconds, {k: v.to(self.device) for k, v in parts.items()}
            )
        taken = flight.take(min(self.model.buffer, len(flight)))
        wait = 0.0
        if len(taken):  # until the last of the K (its start ≤ now: never backwards)
            last = int(np.argmax(taken.finish))
            wait = max(0.0, float((taken.start[last] - now) + taken.seconds[last]))
        spent = self._idle + wait
        self.elapsed += spent
        ids = taken.clients.tolist()
        tau = round_ - taken.rounds
        if ids:
            assert self.weights_of is not None
            omega = self.weights_of(ids, ids).numpy()
            weights = omega * staleness_weight(tau)
            up.weights = dict(zip(ids, weights.tolist(), strict=True))
        else:
            up.weights = {}
        up.updates = parts_updates(taken.parts, ids) if ids and taken.parts else {}
        up.heard = ids
        up.report.update(
            {
                "clock/round_s": spent,
                "clock/cum_s": self.elapsed,
                "clock/wasted_bytes": 0.0,
                "clients/dropped": 0.0,
                "clients/unavailable": float(self._off),
                "async/staleness_mean": float(tau.mean()) if ids else 0.0,
                "async/staleness_max": float(tau.max()) if ids else 0.0,
                "async/in_flight": float(len(flight)),
            }
        )
        return up

    def state(self) -> dict[str, torch.Tensor | dict[str, torch.Tensor]]:
        """What a checkpoint keeps: the simulated seconds so far (float64, exact).

        With FedBuff also its clients in flight and their uploads (:meth:`Flight.state`).
        """
        out: dict[str, torch.Tensor | dict[str, torch.Tensor]] = {
            "elapsed": torch.tensor(self.elapsed, dtype=torch.float64)
        }
        if self.flight is not None:
            out["flight"] = self.flight.state()
        return out

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state` (a checkpoint without one: the clock at 0, none in flight)."""
        value = state.get("elapsed")
        self.elapsed = 0.0 if value is None else float(value.double().item())
        if self.flight is not None:
            self.flight = Flight.of_state(state.get("flight", {}), self.device)


def _drop(up: Uplink, kept: list[int]) -> Uplink:
    """``up`` with the kept senders' uploads alone, their weights ω_n among themselves."""
    updates: Mapping[int, Message] = up.updates
    if isinstance(updates, StackedUpdates):
        parts = updates.parts()
        device = next(iter(parts.values())).device
        rows = np.searchsorted(np.asarray(updates.clients, dtype=np.int64), kept)
        index = torch.as_tensor(rows, dtype=torch.int64).to(device)
        up.updates = StackedUpdates(kept, take_rows(updates.stack, index))
    elif updates:
        up.updates = {n: updates[n] for n in kept if n in updates}
    total = sum(up.weights[n] for n in kept)  # ω_n among the kept (host floats, no tensor)
    up.weights = {n: up.weights[n] / total for n in kept} if kept else {}
    up.heard = kept
    return up
