"""Messages through their channels: the engine's transport.

:class:`Transport`, which the engine builds once and calls, moves a round's messages: each
part of a message through the channel of its direction by its kind (``model``, ``update``,
``exact``), error-feedback residuals and replicas kept per (client, part), every payload
counted in the byte ledger it is handed; a cohort's messages in one pass where the channel
allows it, else message by message. What is counted: ``docs/design.md``, "Messages and bytes".

A cohort's pass dispatches a fixed number of tensor ops and host reads for any cohort: the
residuals, replicas and references are read and written as ``[m, d]`` stacks (one gather and
one scatter each, :class:`PartMemory`), the transforms and the codec run batched
(``Channel.compress_many``), a randomised codec draws from counter-based stream keys. On the
CPU the payloads are written and decoded (honest bytes); elsewhere (:attr:`Transport.encode_on`)
each message's exact length comes from its codec's length formula as a tensor ``[m]``
(``Codec.sizes_many``) and the bit streams are written only for a codec without one (an
entropy coder, message by message on the host).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from fedexp import streams
from fedexp.comm.channel import Channel
from fedexp.comm.codec import Codec
from fedexp.comm.codec import DenseCodec
from fedexp.contract import Message
from fedexp.contract import Stacked
from fedexp.contract import StackedUpdates
from fedexp.contract import State
from fedexp.contract import part_scale
from fedexp.engine.clients.part_memory import PartMemory
from fedexp.engine.round.ledger import ByteLedger
from fedexp.transfer import to_device

if TYPE_CHECKING:
    from fedexp.algorithms.base import Algorithm
    from fedexp.engine.processes.share import Share
    from fedexp.engine.solver.context import Context

# Stream purposes of the channels (beside streams.CLIENT etc.).
_UPLINK, _DOWNLINK = 11, 12
_MASK63 = (1 << 63) - 1


def _part_key(name: str) -> tuple[int, ...]:
    """Extra stream key of a named part (none for a bare tensor: the streams of v1)."""
    return (zlib.crc32(name.encode()),) if name else ()


def _exact(channel: Channel) -> bool:
    return channel.codec.lossless and not channel.transforms and not channel.error_feedback


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
    """A run's channels and what they remember: messages through them as bytes, counted.

    Built once by the engine from the run's settings. What it holds is the channels' memories
    per direction (``"up"``, ``"down"``): :attr:`residual` (error feedback), :attr:`replica`
    (what a receiver holds of a "model" part) and :attr:`reference` (a sender's last message
    of one), ``(client, part) -> tensor`` each (:class:`PartMemory`; a checkpoint saves and
    restores them: ``fedexp.engine.round.checkpointing``). Every method that sends
    takes the round (whose streams a randomised codec draws from) and the ledger its bytes are
    counted in, and returns what the receivers decode.

    Args:
        ctx: the run's context (the learning rate that scales CER's γ; the device).
        algorithm: its message parts' kinds and scales, and the downlinks of its initial
            server state (what a receiver holds of a "model" part before the first message).
        uplink: channel of client → server messages.
        downlink: channel of server → client messages.
        seed: root of the channels' streams.
        x0: the common initial model.
        num_clients: N.
        store: the folder of the memories' files (``store=disk``); None: in memory.
        share: this process's place among the processes (a :class:`Share`): a rank keeps its
            own clients' memories; None: every client's.
    """

    #: the device types on which a cohort's payloads are written and decoded (honest bytes:
    #: the receiver decodes what was sent); on others each message's length is its codec's
    #: length formula (exact, checked against the payloads by the tests) and the receiver's
    #: value is computed from the sent one on the device
    encode_on: ClassVar[tuple[str, ...]] = ("cpu",)

    def __init__(
        self,
        ctx: Context,
        algorithm: Algorithm,
        uplink: Channel,
        downlink: Channel,
        seed: int,
        x0: torch.Tensor,
        num_clients: int,
        store: Path | None = None,
        share: Share | None = None,
    ) -> None:
        self.ctx, self.algorithm, self.seed, self.x0 = ctx, algorithm, seed, x0
        self.channels = {"up": uplink, "down": downlink}
        self._num_clients, self._store, self._share = num_clients, store, share
        #: the initial server state (derived, not checkpointed), built when a part needs it
        self._server0: State | None = None
        self.residual: dict[str, PartMemory] = {}
        self.replica: dict[str, PartMemory] = {}
        self.reference: dict[str, PartMemory] = {}
        self.clear()

    # ------------------------------------------------------------------ memories
    def clear(self) -> None:
        """The memories, empty: in memory, or files under ``store`` (``store=disk``)."""
        for kind, memories in self.memories().items():
            for d in ("up", "down"):
                folder = None if self._store is None else self._store / f"{kind}-{d}"
                memories[d] = PartMemory(self._num_clients, self.ctx.device, folder, self._share)

    def memories(self) -> dict[str, dict[str, PartMemory]]:
        """Each kind of memory by direction (``"residual"``, ``"replica"``, ``"reference"``)."""
        return {"residual": self.residual, "replica": self.replica, "reference": self.reference}

    # ------------------------------------------------------------------ a round's messages
    def send_down(
        self,
        clients: list[int],
        msgs: Mapping[int, Message | None],
        round_: int,
        ledger: ByteLedger,
    ) -> Stacked | None:
        """The round's downlink messages (``Algorithm.downlinks``) through their channel.

        Returns them decoded, stacked ``[m, ...]`` in ``clients`` order (None: nothing sent);
        bytes counted in ``ledger``. In one pass when it can (:meth:`send_cohort`; messages
        made at once as a :class:`StackedUpdates` go as they are), else message by message.
        """
        if isinstance(msgs, StackedUpdates) and msgs.clients == clients:  # made at once
            stacked = self.send_cohort("down", clients, msgs.stack, round_, ledger)
            if stacked is not None:
                return stacked
        rows = [msgs[n] for n in clients]
        stacked = self.send_cohort("down", clients, _stack_parts(rows), round_, ledger)
        if stacked is not None or all(m is None for m in rows):
            return stacked
        name = type(self.algorithm).__name__
        if any(m is None for m in rows):
            raise ValueError(f"{name}: downlinks to some clients only")
        sent = [
            self.send("down", n, m, round_, ledger)[0] for n, m in zip(clients, rows, strict=True)
        ]
        decoded = _stack_parts(sent)
        if decoded is None:
            raise ValueError(f"{name}: downlinks of different shapes")
        return decoded

    def send_up(
        self, senders: list[int], uploads: Stacked | None, round_: int, ledger: ByteLedger
    ) -> tuple[Mapping[int, Message], dict[str, float]]:
        """The senders' stacked uploads through their channel; bytes counted in ``ledger``.

        Returns (decoded uploads, the channel's metrics summed over the messages: CER's).
        """
        sums: dict[str, float] = {}
        updates: dict[int, Message] = {}
        if uploads is None or not senders:
            return updates, sums
        received = self.send_cohort("up", senders, uploads, round_, ledger, sums)
        if received is not None:  # a stack (of each named part)
            return StackedUpdates(senders, received), sums
        for i, n in enumerate(senders):  # message by message (transforms: CER)
            updates[n], metrics = self.send("up", n, _row(uploads, i), round_, ledger)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        if isinstance(uploads, torch.Tensor):  # the server reads a stack either way
            return StackedUpdates(senders, torch.stack([updates[n] for n in senders])), sums
        return updates, sums

    def send(
        self, direction: str, n: int, msg: Message, round_: int, ledger: ByteLedger
    ) -> tuple[Message, dict[str, float]]:
        """Every part of one message (a tensor, or a dict of named parts) through its channel.

        Returns (what the receiver decodes, the channel's metrics); bytes counted in ``ledger``.
        """
        kinds = self.algorithm.uplink_parts if direction == "up" else self.algorithm.downlink_parts
        default = "update" if direction == "up" else "model"
        if isinstance(msg, torch.Tensor):
            return self._transmit(direction, n, "", kinds.get("", default), msg, round_, ledger)
        out, metrics = {}, {}
        for name in sorted(msg):
            kind = kinds.get(name, default)
            out[name], m = self._transmit(direction, n, name, kind, msg[name], round_, ledger)
            metrics.update(m)
        return out, metrics

    def send_cohort(
        self,
        direction: str,
        clients: list[int],
        stacked: torch.Tensor | dict[str, torch.Tensor] | None,
        round_: int,
        ledger: ByteLedger,
        metrics: dict[str, float] | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Every client's message through its channel in one pass, part by part.

        ``stacked``: the clients' messages ``[m, ...]`` in client order, or for messages with
        named parts a dict of such stacks (:func:`_stack_parts`). Returns the decoded messages
        in the same form, or None, with nothing sent, when some part cannot go in one pass
        (the per-client :meth:`send` then runs): a part is empty, or the channel's
        transforms report metrics (CER's) on the uplink and no ``metrics`` dict is given to
        add them to. ``metrics``: the transforms' metrics are added to it, summed over the
        messages as the caller of :meth:`send` sums them (a message's value of a metric is
        that of its last part reporting it).

        A part sent exactly as dense float32 is, on the CPU, encoded and decoded as one block
        (each client's message is its 4·numel bytes of it); on an accelerator its bytes are
        counted from the sizes (dense float32 has no header: 4 bytes an entry) and it stays on
        the device. Anything else goes through :meth:`_transmit_cohort`, or, a model sent as
        it is through a lossless codec, :meth:`_deliver`. Parts of different names are
        independent (their own residuals, replicas and streams), so part by part equals
        client by client.
        """
        if stacked is None or not clients:
            return None
        parts = {"": stacked} if isinstance(stacked, torch.Tensor) else stacked
        channel = self.channels[direction]
        kinds = self.algorithm.uplink_parts if direction == "up" else self.algorithm.downlink_parts
        default = "update" if direction == "up" else "model"
        plan = {}
        for name, stack in parts.items():
            kind = kinds.get(name, default)
            dense = kind == "exact" or (type(channel.codec) is DenseCodec and _exact(channel))
            if math.prod(stack.shape[1:]) == 0:
                return None
            coded = not dense and not (kind == "model" and _exact(channel))
            if coded and channel.transforms and direction == "up" and metrics is None:
                return None  # the caller would lose the transforms' metrics
            plan[name] = (kind, dense)
        values: dict[str, torch.Tensor] = {}
        out = {}
        for name, stack in sorted(parts.items()):
            part_values: dict[str, torch.Tensor] = {}
            kind, dense = plan[name]
            out[name] = self._send_part_cohort(
                direction, clients, name, kind, dense, stack.detach(), round_, ledger, part_values
            )
            values.update(part_values)
        if metrics is not None and values:
            _add_sums(metrics, values)
        return out[""] if isinstance(stacked, torch.Tensor) else out

    # ------------------------------------------------------------------ one part
    def _transmit(
        self,
        direction: str,
        n: int,
        name: str,
        kind: str,
        msg: torch.Tensor,
        round_: int,
        ledger: ByteLedger,
    ) -> tuple[torch.Tensor, dict[str, float]]:
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

        A lossy part goes through :meth:`_transmit_cohort` as a cohort of one: a message sent
        alone is the one it is in any cohort (its stream, residual and bytes).
        """
        channel = self.channels[direction]
        shape, flat = msg.shape, msg.detach().reshape(-1)
        numel, dev = flat.numel(), msg.device
        if kind == "exact" or (kind == "model" and _exact(channel)):
            codec = DenseCodec() if kind == "exact" else channel.codec
            payload = codec.encode(flat.to(torch.float32))
            received = codec.decode(payload, numel).to(dev)
            ledger.add(direction, payload, numel, part=name, client=n)
            return received.reshape(shape).to(msg.dtype), {}
        values: dict[str, torch.Tensor] = {}
        received = self._transmit_cohort(
            direction, [n], name, kind, channel, flat[None], round_, ledger, values
        )
        metrics = {k: float(v[0]) for k, v in values.items()}
        return received[0].reshape(shape).to(msg.dtype), metrics

    def _send_part_cohort(
        self,
        direction: str,
        clients: list[int],
        name: str,
        kind: str,
        dense: bool,
        stack: torch.Tensor,
        round_: int,
        ledger: ByteLedger,
        metrics: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One part of every client's message in one pass (:meth:`send_cohort`).

        ``metrics``: the transforms' per-message metrics go there (float64 ``[m]`` each).
        """
        m, shape = len(clients), stack.shape[1:]
        numel = math.prod(shape)
        channel = self.channels[direction]
        same = m > 1 and stack.stride(0) == 0  # one message for all (the global model)
        if not dense and kind == "model" and _exact(channel):  # the model itself, lossless
            rows = stack.reshape(m, numel)[: 1 if same else m].to(torch.float32)
            received = self._deliver(direction, name, channel.codec, rows, numel, clients, ledger)
            return received.expand(m, numel).reshape(m, *shape).to(stack.dtype)
        if not dense:
            flat = stack.reshape(m, numel)
            received = self._transmit_cohort(
                direction, clients, name, kind, channel, flat, round_, ledger, metrics
            )
            return received.reshape(m, *shape).to(stack.dtype)
        if stack.device.type in self.encode_on:
            codec = DenseCodec()
            rows = stack.reshape(m, numel)
            if same:  # the same message: encode it once, count it m times
                rows = rows[:1]
            payloads = codec.encode_many(rows.to(torch.float32))  # the bytes on the wire
            received = codec.decode_many(payloads, numel).reshape(-1, *shape)
            received = received.expand(m, *shape).to(stack.dtype)
        else:
            received = stack.to(torch.float32).to(stack.dtype)
        ledger.add_many(direction, m, 4 * numel, numel, part=name, clients=clients)
        return received

    def _deliver(
        self,
        direction: str,
        name: str,
        codec: Codec,
        sent: torch.Tensor,
        numel: int,
        clients: list[int],
        ledger: ByteLedger,
    ) -> torch.Tensor:
        """What the receivers decode of the coded messages ``sent`` ``[r, numel]``; bytes counted.

        ``count`` = ``len(clients)`` messages cross the wire: one per row, or (``r`` = 1) the
        one row to all ``count`` receivers (each client's bytes kept by the ledger with
        ``per_client``). Where payloads are written (:attr:`encode_on`, or a codec without
        a length formula) each message is counted at ``len(payload)``; elsewhere at its
        codec's length formula (``Codec.sizes_many``, one read of the sizes) and the receivers'
        value is ``Codec.received_many`` of ``sent``, on its device: no bit stream is written.
        """
        dev, count = sent.device, len(clients)
        on_host = dev.type in self.encode_on
        sizes = None if on_host else codec.sizes_many(sent)
        if sizes is None:
            payloads = codec.encode_many(sent)
            counted = payloads.sizes.tolist()
            if on_host:
                received = codec.decode_many(payloads, numel).to(dev)
            else:
                received = codec.received_many(sent)
        else:
            counted = sizes.tolist()
            received = codec.received_many(sent)
        if sent.shape[0] == count:
            ledger.add_sizes(direction, counted, numel, part=name, clients=clients)
        else:
            ledger.add_many(direction, count, int(counted[0]), numel, part=name, clients=clients)
        return received

    def _transmit_cohort(
        self,
        direction: str,
        clients: list[int],
        name: str,
        kind: str,
        channel: Channel,
        flat: torch.Tensor,
        round_: int,
        ledger: ByteLedger,
        metrics: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`_transmit` of every client's part ``name`` through a lossy channel at once.

        The same messages, residuals, replicas and bytes as client by client (``update``:
        error-feedback residuals stacked; ``model``: the change against each receiver's
        reference), the transforms and the codec in one pass (``Channel.compress_many``),
        bytes and decoding by :meth:`_deliver`. A fixed number of tensor ops for any cohort:
        each memory is one ``[m, numel]`` gather and one scatter (:class:`PartMemory`), who
        holds one is known on the host, a randomised codec draws from the clients' stream
        keys (:meth:`_stream_keys`). Returns the decoded messages ``[m, numel]``;
        ``metrics`` gets the transforms' per-message metrics.
        """
        m, numel = flat.shape
        keys = None
        if channel.codec.randomised:
            keys = self._stream_keys(direction, clients, name, round_, flat.device)
        # CER's γ acts on the gradient scale whatever the algorithm sends (Algorithm.update_scale,
        # part by part where it declares parts of different scales: SCAFFOLD's Δy and Δc)
        scale = self.ctx.lr if part_scale(self.algorithm.update_scale, name) == "step" else 1.0
        codec = channel.codec
        if kind == "update":
            store = self.residual[direction]
            res = None
            if channel.error_feedback and store.has(clients, name).any():
                res = store.stack(clients, name)
            sent, new, values = channel.compress_many(flat, res, keys, scale)
            if new is not None:
                store.write_stack(clients, name, new)  # copied into the rows
            received = self._deliver(direction, name, codec, sent, numel, clients, ledger)
        else:
            held = self._held(direction, clients, name, flat)
            ref = held
            if not channel.error_feedback:
                ref = self._reference(direction, clients, name, held)
            sent, _, values = channel.compress_many(flat - ref, None, keys, scale)
            received = held + self._deliver(direction, name, codec, sent, numel, clients, ledger)
            self.replica[direction].write_stack(clients, name, received)
            if not channel.error_feedback:
                self.reference[direction].write_stack(clients, name, flat)
        if metrics is not None:
            metrics.update(values)
        return received

    # ------------------------------------------------------------------ what the receivers hold
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

    def _initial_rows(
        self, direction: str, clients: list[int], name: str, flat: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`_initial_part` of every client of ``clients``, ``[f, numel]``.

        The downlink's from the algorithm's messages of its initial server state made at once
        (``Algorithm.downlinks``, stacked as the engine stacks a round's: one message for all
        is expanded, not copied); the uplink's (the common model or zeros) expanded.
        """
        f, numel = len(clients), flat.shape[1]
        if direction == "down":
            if self._server0 is None:
                self._server0 = self.algorithm.init_server(self.ctx, self.x0)
            msgs = self.algorithm.downlinks(self.ctx, self._server0, clients)
            if isinstance(msgs, StackedUpdates) and msgs.clients == clients:
                stacked = msgs.stack
            else:
                stacked = _stack_parts([msgs[n] for n in clients])
            if stacked is None:  # messages of several shapes: client by client
                like = flat[0]
                return torch.stack([self._initial_part(direction, n, name, like) for n in clients])
            part = stacked if name == "" or not isinstance(stacked, dict) else stacked.get(name)
            if isinstance(part, torch.Tensor) and math.prod(part.shape[1:]) == numel:
                return part.detach().reshape(f, numel).to(flat)
        if tuple(self.x0.shape) == (numel,):
            return self.x0.expand(f, numel)
        return torch.zeros((1, numel), dtype=flat.dtype, device=flat.device).expand(f, numel)

    def _held(
        self, direction: str, clients: list[int], name: str, flat: torch.Tensor
    ) -> torch.Tensor:
        """What the receivers hold of a "model" part ``[m, numel]``: replicas, else initial."""
        memory = self.replica[direction]
        has = memory.has(clients, name)
        if has.all():
            return memory.stack(clients, name)
        fresh = np.flatnonzero(~has)
        initial = self._initial_rows(direction, [clients[i] for i in fresh], name, flat)
        if not has.any():
            return initial
        stack = memory.stack(clients, name)
        index = to_device(fresh, stack.device, torch.int64)
        return stack.index_copy(0, index, initial.to(stack))

    def _reference(
        self, direction: str, clients: list[int], name: str, held: torch.Tensor
    ) -> torch.Tensor:
        """The senders' last messages of a "model" part (without error feedback), else ``held``."""
        memory = self.reference[direction]
        has = memory.has(clients, name)
        if not has.any():
            return held
        stack = memory.stack(clients, name)
        if has.all():
            return stack
        mask = to_device(has, held.device)[:, None]
        return torch.where(mask, stack, held)

    def _stream_keys(
        self, direction: str, clients: list[int], name: str, round_: int, device: torch.device
    ) -> torch.Tensor:
        """The clients' (seed, channel, round, client[, part]) stream keys, int64 ``[m]``.

        Counter-based (:func:`fedexp.streams.stream_keys`): a client's draws are the same
        whether its message goes alone or in any cohort, on any device.
        """
        purpose = _UPLINK if direction == "up" else _DOWNLINK
        ids = to_device(clients, device, torch.int64)
        keys = streams.stream_keys(self.seed, purpose, round_, ids)
        for part in _part_key(name):
            keys = streams.mix64(keys ^ part) & _MASK63
        return keys


def _add_sums(metrics: dict[str, float], values: dict[str, torch.Tensor]) -> None:
    """Add each metric's per-message values (float64 ``[m]``) to ``metrics``, message by message.

    One read of all of them; the sum in message order, as the per-message path adds them.
    """
    names = list(values)
    rows = torch.stack([values[k].to(torch.float64) for k in names]).tolist()
    for key, row in zip(names, rows, strict=True):
        total = metrics.get(key, 0.0)
        for v in row:
            total += v
        metrics[key] = total
