"""Codecs: what turns a message (a flat float32 vector) into bytes and back.

Honest bytes (``docs/compression.md``): every message that crosses the client/server boundary is
encoded by its codec and the receiver decodes it from those bytes; the engine counts
``len(payload)``. A codec has three steps:

* ``compress(x, generator)``: the lossy operator (identity for lossless codecs). Its output is
  exactly what the receiver will reconstruct; error feedback (see ``fedexp.comm.channel``)
  uses it to keep the residual ``x - compress(x)``.
* ``encode(x_hat)``: bytes for a ``compress`` output.
* ``decode(payload, numel)``: the float32 vector back from the bytes.

``decode(encode(compress(x))) == compress(x)`` exactly, for every codec.

Cohorts: ``compress_many``, ``encode_many`` and ``decode_many`` do the same for the stacked
messages ``[m, d]`` of ``m`` senders. Each message keeps its own payload, byte for byte the
one ``encode`` gives its row, so every sender's bytes are still counted; the
payloads live in one :class:`Payloads` buffer. The defaults loop over the rows; the dense and
sparse codecs override them with one vectorised pass.

On the device: ``sizes_many`` gives each message's exact ``len(encode(row))`` from its code's
length formula, as an int64 tensor ``[m]`` computed where the messages are (no bytes written,
no copy to the host), and ``received_many`` what ``decode(encode(row))`` gives, from the
compressed rows themselves. A codec without a length formula (an entropy coder: its length is
known only from its bytes) returns None, and its bytes are written. The tests check the
formulas against the real payloads.
"""

from __future__ import annotations

from abc import ABC
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import torch

#: The random streams of a cohort's messages for a randomised codec: one torch generator (or
#: None) per message, or int64 stream keys ``[m]`` (counter-based draws, one tensor expression
#: for the whole cohort: :class:`fedexp.comm.randk.RandKCodec`).
Streams: TypeAlias = Sequence[torch.Generator | None] | torch.Tensor


@dataclass(frozen=True, eq=False)
class Payloads:
    """The payloads of a cohort's messages in one contiguous byte buffer.

    Message ``i`` is ``buffer[offsets[i]:offsets[i + 1]]``; its length is what the engine
    counts for that sender ("honest bytes").

    Args:
        buffer: uint8 bytes of all messages (may be read-only).
        offsets: int64 [m + 1], non-decreasing, within ``[0, len(buffer)]``.
    """

    buffer: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        buffer = np.asarray(self.buffer)
        offsets = np.asarray(self.offsets)
        if buffer.dtype != np.uint8 or buffer.ndim != 1:
            raise ValueError("Payloads.buffer must be a 1-D uint8 array")
        if offsets.ndim != 1 or offsets.size < 1 or not np.issubdtype(offsets.dtype, np.integer):
            raise ValueError("Payloads.offsets must be a 1-D integer array of m + 1 entries")
        offsets = offsets.astype(np.int64, copy=False)
        if offsets[0] < 0 or offsets[-1] > buffer.size or np.any(np.diff(offsets) < 0):
            raise ValueError("Payloads.offsets must be non-decreasing within the buffer")
        object.__setattr__(self, "buffer", buffer)
        object.__setattr__(self, "offsets", offsets)

    @classmethod
    def of(cls, payloads: Sequence[bytes]) -> Payloads:
        """Concatenate separate payloads (message ``i`` is ``payloads[i]``)."""
        sizes = np.fromiter((len(p) for p in payloads), dtype=np.int64, count=len(payloads))
        offsets = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(np.frombuffer(b"".join(payloads), dtype=np.uint8), offsets)

    @property
    def sizes(self) -> np.ndarray:
        """Bytes of each message (int64 [m])."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return self.offsets.size - 1

    def __getitem__(self, i: int) -> bytes:
        m = len(self)
        if not -m <= i < m:
            raise IndexError(f"message {i} of {m}")
        i %= m
        return self.buffer[self.offsets[i] : self.offsets[i + 1]].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        return (self[i] for i in range(len(self)))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` detached as float32 ``[m, d]`` on its device; anything but 2-D is an error."""
    if x.dim() != 2:
        raise ValueError(f"expected stacked messages [m, d], got shape {tuple(x.shape)}")
    return x.detach().to(torch.float32)


def check_generators(generators: Streams | None, m: int) -> Streams:
    """One generator (or None, or a stream key) per message; None stands for m Nones."""
    if generators is None:
        return [None] * m
    if len(generators) != m:
        raise ValueError(f"{len(generators)} generators for {m} messages")
    return generators


def overrides(codec: Codec, base: type, name: str) -> bool:
    """Whether ``codec``'s class redefines method ``name`` below ``base``.

    A batched override of ``base`` is only valid for the single-message behaviour it
    mirrors; a subclass that changes that behaviour (e.g. random-k's ``compress`` under
    top-k) falls back to the row-by-row default.
    """
    return getattr(type(codec), name) is not getattr(base, name)


class Codec(ABC):
    """Base class of all codecs: a lossy ``compress`` plus an exact byte format."""

    #: True when ``compress`` is the identity (decode(encode(x)) == x for any x).
    lossless: bool = False
    #: True when ``compress`` draws from its ``generator`` (the engine then derives the
    #: sender's stream; deterministic codecs get None and cost no seeding).
    randomised: bool = False

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Return the value the receiver will reconstruct (identity by default).

        Args:
            x: flat float32 vector.
            generator: random stream of the sender for randomised codecs.
        """
        return x

    @abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """Serialise a ``compress`` output to bytes."""

    @abstractmethod
    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Rebuild the flat float32 vector (on the CPU) from ``payload``."""

    def compress_many(self, x: torch.Tensor, generators: Streams | None = None) -> torch.Tensor:
        """``compress`` of every row of ``x`` ``[m, d]``, stacked (the default loops).

        Args:
            x: the stacked messages, one per row.
            generators: one random stream per row for randomised codecs (None: all None).

        Returns:
            ``[m, d]``; row ``i`` equals ``compress(x[i], generators[i])``. A codec whose
            ``compress`` is the identity returns ``x`` itself, as ``compress`` does.
        """
        if x.dim() != 2:
            raise ValueError(f"expected stacked messages [m, d], got shape {tuple(x.shape)}")
        gens = check_generators(generators, x.shape[0])
        if not overrides(self, Codec, "compress"):
            return x
        if x.shape[0] == 0:
            return x.detach().to(torch.float32).clone()
        return torch.stack([self.compress(row, g) for row, g in zip(x, gens, strict=True)])

    def encode_many(self, x_hat: torch.Tensor) -> Payloads:
        """``encode`` of every row of ``x_hat`` ``[m, d]`` (the default loops).

        Returns:
            :class:`Payloads` whose message ``i`` is ``encode(x_hat[i])`` byte for byte.
        """
        if x_hat.dim() != 2:
            raise ValueError(f"expected stacked messages [m, d], got shape {tuple(x_hat.shape)}")
        return Payloads.of([self.encode(row) for row in x_hat])

    def decode_many(self, payloads: Payloads, numel: int) -> torch.Tensor:
        """``decode`` of every message, stacked: CPU float32 ``[m, numel]`` (default loops)."""
        if len(payloads) == 0:
            return torch.zeros((0, numel), dtype=torch.float32)
        return torch.stack([self.decode(p, numel) for p in payloads])

    def sizes_many(self, x_hat: torch.Tensor) -> torch.Tensor | None:
        """``len(encode(row))`` of every row of ``x_hat`` ``[m, d]`` from the code's length formula.

        int64 ``[m]`` on ``x_hat``'s device, computed without writing a byte; None when the
        codec has no formula (its bytes must be written to be counted). The default: None.
        """
        return None

    def received_many(self, x_hat: torch.Tensor) -> torch.Tensor:
        """``decode(encode(row))`` of every row of a ``compress_many`` output, on its device.

        ``x_hat`` itself by the codecs' contract (``decode(encode(compress(x))) ==
        compress(x)``); a codec whose format does not carry some of its values' bits (a
        sparse code drops the sign of a kept zero) says so here.
        """
        return x_hat


class DenseCodec(Codec):
    """Dense little-endian float32: exactly 4 bytes per entry, no header."""

    lossless = True

    def __repr__(self) -> str:
        return "DenseCodec()"

    def encode(self, x: torch.Tensor) -> bytes:
        """Raw float32 bytes of ``x``."""
        # astype without a copy where float32 is little-endian already: one copy, into bytes
        flat = x.detach().to("cpu", torch.float32).contiguous().numpy()
        return flat.astype("<f4", copy=False).tobytes()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Read ``numel`` float32 values; a size mismatch is an error."""
        if len(payload) != 4 * numel:
            raise ValueError(f"dense payload has {len(payload)} bytes, expected {4 * numel}")
        return torch.from_numpy(np.frombuffer(payload, dtype="<f4").copy())

    def encode_many(self, x_hat: torch.Tensor) -> Payloads:
        """The raw float32 bytes of the whole block: message ``i`` is row ``i`` (``4 d`` bytes)."""
        rows = as_rows(x_hat).to("cpu").contiguous().numpy().astype("<f4")
        m, d = rows.shape
        offsets = np.arange(m + 1, dtype=np.int64) * (4 * d)
        return Payloads(rows.reshape(-1).view(np.uint8), offsets)

    def decode_many(self, payloads: Payloads, numel: int) -> torch.Tensor:
        """Read every message as ``numel`` float32 values in one ``frombuffer``.

        Raises:
            ValueError: naming the first message whose size is not ``4 * numel``.
        """
        sizes = payloads.sizes
        wrong = np.flatnonzero(sizes != 4 * numel)
        if wrong.size:
            i = int(wrong[0])
            raise ValueError(
                f"message {i}: dense payload has {int(sizes[i])} bytes, expected {4 * numel}"
            )
        m = len(payloads)
        lo = int(payloads.offsets[0])
        values = payloads.buffer[lo : lo + 4 * numel * m].view("<f4").reshape(m, numel)
        # the received tensor reads the payload buffer itself (one that ``encode_many`` wrote
        # is the payload's own copy); a read-only buffer (bytes) is copied
        return torch.from_numpy(values if values.flags.writeable else values.copy())

    def sizes_many(self, x_hat: torch.Tensor) -> torch.Tensor | None:
        """``4 d`` bytes a message (no header)."""
        if overrides(self, DenseCodec, "encode"):
            return None
        m, d = x_hat.shape
        return torch.full((m,), 4 * d, dtype=torch.int64, device=x_hat.device)
