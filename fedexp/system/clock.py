"""The simulated clock: a round's stage that times its clients (``system`` group).

A client's time in a round is

    t_n = down_n / downlink_n + latency_n + steps_n / speed_n + up_n / uplink_n + latency_n,

with ``down_n`` and ``up_n`` the bytes the ledger counted for it this round (so a codec,
error feedback or DP change the time exactly as they change the bytes) and ``steps_n`` its
local steps. A synchronous round lasts until the last client the server waits for. Deadlines
and over-selection follow Bonawitz et al., "Towards Federated Learning at Scale: System
Design" (MLSys 2019): the server keeps the first K = the round's cohort to report, among
those done within ``deadline`` seconds; the others' uploads are dropped, their bytes stay
counted (``clock/wasted_bytes``). Unavailable clients are never sampled.

The clock is chosen when the engine is built (``Engine._choose_stages``): the sampler's draw
(:meth:`Clock.draw`) and the first link of the uplink chain (:meth:`Clock.server`, after the
processes' exchange, so every process times every client alike). All of it is NumPy on host
arrays the round already has: no device read, no loop over clients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedexp import streams
from fedexp.contract import Message, StackedUpdates
from fedexp.engine.round.stages import Uplink, UplinkStage, Who, take_rows
from fedexp.system.settings import SystemModel, over_sampled


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
    """

    model: SystemModel
    seed: int
    participation: float
    members: np.ndarray
    bytes_of: Callable[[], tuple[np.ndarray, np.ndarray]]
    steps_of: Callable[[], np.ndarray]
    elapsed: float = 0.0
    _steps: np.ndarray | None = field(default=None, repr=False)
    #: the round's draw: clients off, and the seconds the server waited for one to be on
    _off: int = field(default=0, repr=False)
    _idle: float = field(default=0.0, repr=False)

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
        server waits for the first to come on (that wait is the round's too).
        """
        self._idle = 0.0
        on = self.available(round_, self.elapsed)
        pool = self.members[on[self.members]]
        if not pool.size and self.model.trace is not None:
            start = self._next_on(self.elapsed)
            self._idle = start - self.elapsed
            on = self.available(round_, start)
            pool = self.members[on[self.members]]
        self._off = int(len(self.members) - pool.size)
        want = min(pool.size, over_sampled(self.target, self.model.over_select))
        if want >= pool.size:
            return pool.tolist()
        gen = np.random.default_rng(streams.derive_seed(self.seed, streams.SAMPLING, round_))
        return np.sort(gen.choice(pool, size=want, replace=False)).tolist()

    def server(self, round_: int, who: Who, up: Uplink) -> Uplink:
        """Time the round's senders, drop those the server does not wait for, advance the clock.

        Adds ``clock/round_s``, ``clock/cum_s``, ``clock/wasted_bytes`` (the dropped
        clients' bytes both ways), ``clients/dropped`` and ``clients/unavailable``.
        """
        if self._steps is None:
            self._steps = self.steps_of()
        model = self.model
        up_bytes, down_bytes = self.bytes_of()
        clients = np.asarray(who.sampled, dtype=np.int64)
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

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: the simulated seconds so far (float64, exact)."""
        return {"elapsed": torch.tensor(self.elapsed, dtype=torch.float64)}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore :meth:`state` (a checkpoint without one: the clock at 0)."""
        value = state.get("elapsed")
        self.elapsed = 0.0 if value is None else float(value.double().item())


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
