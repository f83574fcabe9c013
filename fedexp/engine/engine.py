"""The one round loop every algorithm runs in.

The engine owns all state (server, clients, channel residuals and replicas, the byte ledger),
moves every message through its channel as bytes, and calls the algorithm's hooks. The
clients' hooks run through an execution backend (``fedexp.engine.backends``: one after another,
or in lockstep with their local SGD batched); each client draws from its own
(seed, round, client) stream, so results do not depend on the order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedexp.algorithms.base import Algorithm, ClientResult, State
from fedexp.comm.channel import Channel
from fedexp.comm.codec import DenseCodec
from fedexp.data.federated import ClientData
from fedexp.engine import rng
from fedexp.engine.backends import BACKENDS
from fedexp.engine.context import Context
from fedexp.engine.ledger import ByteLedger
from fedexp.errors import ConfigError
from fedexp.metrics import aggregate

# Stream purposes of the channels and the set-up (beside rng.CLIENT etc.).
_UPLINK, _DOWNLINK, _SKETCH = 11, 12, 13


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
        backend: "sequential" or "lockstep" (``fedexp.engine.backends``).
    """

    ctx: Context
    algorithm: Algorithm
    clients: Sequence[ClientData]
    uplink: Channel
    downlink: Channel
    seed: int
    participation: float
    x0: torch.Tensor
    backend: str = "sequential"
    round: int = 0
    ledger: ByteLedger = field(default_factory=ByteLedger)
    server: State = field(default_factory=dict)
    client_states: list[State] = field(default_factory=list)
    up_residual: dict[int, torch.Tensor] = field(default_factory=dict)
    down_reference: dict[int, torch.Tensor] = field(default_factory=dict)
    replica: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        self.server = self.algorithm.init_server(self.ctx, self.x0)
        self.client_states = [
            self.algorithm.init_client(self.ctx, self.x0, n) for n in range(len(self.clients))
        ]

    # ----------------------------------------------------------------- messages
    @property
    def _down_is_exact(self) -> bool:
        ch = self.downlink
        return ch.codec.lossless and not ch.transforms and not ch.error_feedback

    def _send_down(self, n: int, msg: torch.Tensor) -> torch.Tensor:
        """Server → client n.

        A lossless downlink sends the model itself. A lossy one sends the change against a
        reference and the client adds what it decodes to the model it holds (every client
        starts from the common initial model). With error feedback the reference is what the
        client holds (the server's replica of it), so the part not yet transmitted is sent
        later: that gap is the error-feedback memory (Sattler et al. 2019), and no separate
        residual is kept. Without it the reference is the server's previous message, so the
        compression error is dropped.
        """
        gen = rng.generator(self.seed, _DOWNLINK, self.round, n)
        if self._down_is_exact:
            payload, _, _ = self.downlink.send(msg, None, gen)
            self.ledger.add("down", payload, msg.numel())
            return self.downlink.receive(payload, msg.numel(), msg.device)
        held = self.replica.get(n)
        if held is None:  # every client knows the common initial model
            held = self.x0 if msg.shape == self.x0.shape else torch.zeros_like(msg)
        ref = held if self.downlink.error_feedback else self.down_reference.get(n, held)
        payload, _, _ = self.downlink.send(msg - ref, None, gen)
        self.ledger.add("down", payload, msg.numel())
        received = held + self.downlink.receive(payload, msg.numel(), msg.device)
        self.replica[n] = received
        if not self.downlink.error_feedback:
            self.down_reference[n] = msg.detach().clone()
        return received

    def _send_up(self, n: int, update: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Client n → server, through the uplink's transforms, error feedback and codec."""
        gen = rng.generator(self.seed, _UPLINK, self.round, n)
        payload, res, metrics = self.uplink.send(update, self.up_residual.get(n), gen)
        if res is not None:
            self.up_residual[n] = res
        self.ledger.add("up", payload, update.numel())
        return self.uplink.receive(payload, update.numel(), update.device), metrics

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
        t = self.round
        self.ctx.round = t
        self.ledger.start_round()
        sampled = rng.sample_clients(self.seed, t, len(self.clients), self.participation)
        updates: dict[int, torch.Tensor] = {}
        sums: dict[str, float] = {}
        inbox: dict[int, torch.Tensor | None] = {}
        for n in sampled:  # downlink, in client order
            msg = self.algorithm.downlink(self.ctx, self.server, n)
            inbox[n] = None if msg is None else self._send_down(n, msg)

        def client(n: int) -> ClientResult:
            gen = rng.generator(self.seed, rng.CLIENT, t, n)
            return self.algorithm.client_update(
                self.ctx, inbox[n], self.client_states[n], self.clients[n], gen
            )

        results = BACKENDS[self.backend](sampled, client, self.ctx)
        for n in sampled:  # uplink, in client order
            result = results[n]
            self.client_states[n] = result.state
            metrics = dict(result.metrics)
            if result.update is not None:
                updates[n], transform_metrics = self._send_up(n, result.update)
                metrics.update(transform_metrics)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        self.server = self.algorithm.server_update(
            self.ctx, self.server, updates, self._weights(updates)
        )
        self.round = t + 1
        out = {f"train/{k}": v / len(sampled) for k, v in sums.items()}
        out["clients/sampled"] = float(len(sampled))
        out.update(self.algorithm.server_metrics(self.ctx, self.server))
        out.update(self.ledger.metrics())
        return out

    def _weights(self, updates: dict[int, torch.Tensor]) -> dict[int, float]:
        if not updates:
            return {}
        if self.algorithm.weighting == "uniform":
            return {n: 1.0 / len(updates) for n in updates}
        sizes = {n: self.clients[n].num_train for n in updates}
        total = sum(sizes.values())
        return {n: s / total for n, s in sizes.items()}

    # --------------------------------------------------------------- evaluation
    def evaluate(self) -> tuple[dict[str, float], list[dict[str, float]]]:
        """Every client on its own test split; returns (aggregates, per-client metrics)."""
        per_client = []
        for n, data in enumerate(self.clients):
            params = self.algorithm.eval_params(self.ctx, self.server, self.client_states[n], n)
            m = self.ctx.evaluate(params, data)
            m["num_test"] = float(data.num_test)
            per_client.append(m)
        weights = [c["num_test"] for c in per_client]
        scored = [{k: v for k, v in c.items() if k != "num_test"} for c in per_client]
        return aggregate(scored, weights), per_client

    # ----------------------------------------------------------- checkpointing
    def state_tree(self) -> dict[str, Any]:
        """Every tensor of the run's state, as a nested dict for ``checkpoint.save``."""
        return {
            "server": self.server,
            "client": {str(n): s for n, s in enumerate(self.client_states)},
            "uplink_residual": {str(n): r for n, r in self.up_residual.items()},
            "downlink_reference": {str(n): r for n, r in self.down_reference.items()},
            "replica": {str(n): r for n, r in self.replica.items()},
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
        for name, target in (
            ("uplink_residual", self.up_residual),
            ("downlink_reference", self.down_reference),
            ("replica", self.replica),
        ):
            target.clear()
            target.update({int(n): v.to(dev) for n, v in tree.get(name, {}).items()})
        self.round = round_
        self.ledger = ledger


RoundCallback = Callable[[Engine, dict[str, float]], None]
