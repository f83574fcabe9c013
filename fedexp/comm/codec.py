"""Codecs: what turns a message (a flat float32 vector) into bytes and back.

MATH.md §8 ("honest bytes"): every message that crosses the client/server boundary is
encoded by its codec and the receiver decodes it from those bytes; the engine counts
``len(payload)``. A codec has three steps:

* ``compress(x, generator)``: the lossy operator (identity for lossless codecs). Its output is
  exactly what the receiver will reconstruct; error feedback (see ``fedexp.comm.channel``)
  uses it to keep the residual ``x - compress(x)``.
* ``encode(x_hat)``: bytes for a ``compress`` output.
* ``decode(payload, numel)``: the float32 vector back from the bytes.

``decode(encode(compress(x))) == compress(x)`` exactly, for every codec.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch


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


class DenseCodec(Codec):
    """Dense little-endian float32: exactly 4 bytes per entry, no header (MATH §8)."""

    lossless = True

    def encode(self, x: torch.Tensor) -> bytes:
        """Raw float32 bytes of ``x``."""
        return x.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Read ``numel`` float32 values; a size mismatch is an error."""
        if len(payload) != 4 * numel:
            raise ValueError(f"dense payload has {len(payload)} bytes, expected {4 * numel}")
        return torch.from_numpy(np.frombuffer(payload, dtype="<f4").copy())
