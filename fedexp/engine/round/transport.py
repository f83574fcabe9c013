"""Messages through their channels: the engine's transport.

:class:`Transport` is the part of :class:`fedexp.engine.round.engine.Engine` that moves a round's
messages: each part of a message through the channel of its direction by its kind
(``model``, ``update``, ``exact``), error-feedback residuals and replicas kept per
(client, part), every payload counted in the byte ledger; a cohort's messages in one pass
where the channel allows it, else message by message. What is counted: ``docs/design.md``,
"Messages and bytes".
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fedexp.comm.channel import Channel
from fedexp.comm.codec import DenseCodec
from fedexp.contract import Message, State
from fedexp.engine import rng
from fedexp.engine.clients.part_memory import PartKey, PartMemory
from fedexp.engine.round.ledger import ByteLedger

if TYPE_CHECKING:
    from fedexp.algorithms.base import Algorithm
    from fedexp.engine.solver.context import Context

# Stream purposes of the channels (beside rng.CLIENT etc.).
_UPLINK, _DOWNLINK = 11, 12


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


class Transport:
    """The engine's channels, residuals, replicas and ledger (a mixin of ``Engine``)."""

    ctx: Context
    algorithm: Algorithm
    uplink: Channel
    downlink: Channel
    seed: int
    round: int
    x0: torch.Tensor
    ledger: ByteLedger
    residual: dict[str, PartMemory]
    replica: dict[str, PartMemory]
    reference: dict[str, PartMemory]
    _server0: State | None

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
        on an accelerator its bytes are counted from the sizes (dense float32 has no header:
        4 bytes an entry) and it stays on the device. Anything else goes through
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
        encoding of every payload, each counted at its own size). Returns the
        decoded messages ``[m, numel]``.
        """
        purpose = _UPLINK if direction == "up" else _DOWNLINK
        gens = None
        if channel.codec.randomised:
            gens = [
                rng.generator(self.seed, purpose, self.round, n, *_part_key(name)) for n in clients
            ]
        numel, dev = flat.shape[1], flat.device
        if kind == "update":
            store = self.residual[direction]
            old = store.rows(clients, name)
            res = None
            if channel.error_feedback and any(r is not None for r in old):
                res = torch.stack([torch.zeros_like(flat[0]) if r is None else r for r in old])
            payloads, new = channel.send_many(flat, res, gens)
            if new is not None:
                store.write(clients, name, new.unbind(0))  # copied into the rows
            received = channel.receive_many(payloads, numel, dev)
        else:
            held = torch.stack(
                [
                    h if h is not None else self._initial_part(direction, n, name, flat[i])
                    for i, (n, h) in enumerate(
                        zip(clients, self.replica[direction].rows(clients, name), strict=True)
                    )
                ]
            )
            ref = held
            if not channel.error_feedback:
                refs = self.reference[direction].rows(clients, name)
                ref = torch.stack([held[i] if r is None else r for i, r in enumerate(refs)])
            payloads, _ = channel.send_many(flat - ref, None, gens)
            received = held + channel.receive_many(payloads, numel, dev)
            self.replica[direction].write(clients, name, received.unbind(0))
            if not channel.error_feedback:
                self.reference[direction].write(clients, name, flat.unbind(0))
        self.ledger.add_sizes(direction, payloads.sizes, numel, part=name)
        return received
