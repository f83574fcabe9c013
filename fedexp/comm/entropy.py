"""A lossless entropy stage on top of any codec's bytes.

``EntropyCodec(inner)`` compresses ``inner.encode(x)`` with a general-purpose lossless
compressor: ``zlib`` or ``lzma`` (Python standard library) or ``zstd`` (when the
``zstandard`` package is installed). ``compress`` is the inner codec's, so error feedback and
``lossless`` behave as for the inner codec.

Wire format::

    uint8   method  0 = stored (inner bytes as they are), 1 = zlib, 2 = zstd, 3 = lzma
    bytes           the (compressed) inner payload

The encoder falls back to "stored" when compression does not shrink the inner payload, so a
message never costs more than one byte over the inner codec's.

Cohorts: the inner codec's batched ``compress_many`` and ``encode_many`` / ``decode_many``, then
the compressor message by message on the host: an entropy coder's length is known only from
its bytes (no length formula, ``sizes_many`` is None), so its bytes are always written. That
loop runs no tensor op.
"""

from __future__ import annotations

import lzma
import zlib
from typing import Annotated

import torch

from fedexp.comm.codec import Codec
from fedexp.comm.codec import DenseCodec
from fedexp.comm.codec import Payloads
from fedexp.comm.codec import Streams
from fedexp.comm.codec import overrides
from fedexp.config.ranges import Range

try:  # pragma: no cover - depends on the environment
    import zstandard
except ImportError:  # pragma: no cover
    zstandard = None

_STORED, _ZLIB, _ZSTD, _LZMA = 0, 1, 2, 3
_METHODS = {"zlib": _ZLIB, "zstd": _ZSTD, "lzma": _LZMA}
#: The lowest level each method takes (zlib's -1 is its default, zstd's negative ones its
#: fast modes, down to any int) and the highest.
_LEVELS = {"zlib": (-1, 9), "zstd": (None, 22), "lzma": (0, 9)}

#: A compression level: the union of the methods' ranges; each method's own is checked when
#: the codec is built (it depends on ``method``).
Level = Annotated[int, Range(le=22, note="zlib -1..9, lzma 0..9, zstd ≤ 22; null: the default")]


def zstd_available() -> bool:
    """Whether the optional ``zstandard`` package is importable."""
    return zstandard is not None


class EntropyCodec(Codec):
    """Lossless byte-level compression of another codec's payload.

    Args:
        inner: the codec whose bytes are compressed (dense float32 when None). In a config
            this is a nested ``_target_`` node.
        method: ``"zlib"``, ``"zstd"`` (needs the ``zstandard`` package) or ``"lzma"``.
        level: compression level (None: the library default; zlib 6, zstd 3, lzma 6): zlib
            -1..9 (-1: its default), lzma 0..9, zstd up to 22 (negative: its fast modes).
    """

    def __init__(
        self, inner: Codec | None = None, method: str = "zlib", level: Level | None = None
    ) -> None:
        if method not in _METHODS:
            raise ValueError(f"method={method!r}: expected one of {sorted(_METHODS)}")
        if method == "zstd" and zstandard is None:
            raise ValueError("method='zstd' needs the 'zstandard' package (pip install zstandard)")
        low, high = _LEVELS[method]
        if level is not None and not ((low is None or level >= low) and level <= high):
            span = f"{low}..{high}" if low is not None else f"≤ {high}"
            raise ValueError(f"level={level}: method={method!r} takes levels {span}")
        self.inner = DenseCodec() if inner is None else inner
        self.method = method
        self.level = level
        self.lossless = self.inner.lossless
        self.randomised = self.inner.randomised

    def compress(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The inner codec's lossy operator."""
        return self.inner.compress(x, generator)

    def compress_many(self, x: torch.Tensor, generators: Streams | None = None) -> torch.Tensor:
        """The inner codec's batched lossy operator."""
        if overrides(self, EntropyCodec, "compress"):
            return super().compress_many(x, generators)
        return self.inner.compress_many(x, generators)

    def received_many(self, x_hat: torch.Tensor) -> torch.Tensor:
        """What the inner codec's decoder gives (the entropy stage is lossless)."""
        if overrides(self, EntropyCodec, "decode"):
            return super().received_many(x_hat)
        return self.inner.received_many(x_hat)

    def encode_many(self, x_hat: torch.Tensor) -> Payloads:
        """The inner payloads in one pass, then each compressed (or stored) on its own."""
        if overrides(self, EntropyCodec, "encode"):
            return super().encode_many(x_hat)
        return Payloads.of([self._wrap(raw) for raw in self.inner.encode_many(x_hat)])

    def decode_many(self, payloads: Payloads, numel: int) -> torch.Tensor:
        """Each payload's entropy stage undone, then the inner codec's batched decoder.

        Raises:
            ValueError: naming the first message whose entropy stage is malformed.
        """
        if overrides(self, EntropyCodec, "decode"):
            return super().decode_many(payloads, numel)
        raws = []
        for i, payload in enumerate(payloads):
            try:
                raws.append(self._unwrap(payload))
            except ValueError as exc:
                raise ValueError(f"message {i}: {exc}") from None
        return self.inner.decode_many(Payloads.of(raws), numel)

    def _pack(self, raw: bytes) -> bytes:
        if self.method == "zlib":
            return zlib.compress(raw, -1 if self.level is None else self.level)
        if self.method == "zstd":
            level = 3 if self.level is None else self.level
            return zstandard.ZstdCompressor(level=level).compress(raw)
        return lzma.compress(raw, preset=6 if self.level is None else self.level)

    def encode(self, x: torch.Tensor) -> bytes:
        """One method byte, then the compressed inner payload (or the inner payload stored)."""
        return self._wrap(self.inner.encode(x))

    def _wrap(self, raw: bytes) -> bytes:
        """The method byte and the compressed ``raw``, or ``raw`` stored when not smaller."""
        packed = self._pack(raw)
        if len(packed) >= len(raw):
            return bytes([_STORED]) + raw
        return bytes([_METHODS[self.method]]) + packed

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Undo the entropy stage (by the method byte), then the inner codec's decode."""
        return self.inner.decode(self._unwrap(payload), numel)

    def _unwrap(self, payload: bytes) -> bytes:
        """The inner payload of ``payload`` (the entropy stage undone, by its method byte)."""
        if not payload:
            raise ValueError("empty entropy-coded payload")
        method, body = payload[0], payload[1:]
        if method == _STORED:
            raw = body
        elif method == _ZLIB:
            raw = zlib.decompress(body)
        elif method == _ZSTD:
            if zstandard is None:
                raise ValueError("payload is zstd-compressed but 'zstandard' is not installed")
            raw = zstandard.ZstdDecompressor().decompress(body)
        elif method == _LZMA:
            raw = lzma.decompress(body)
        else:
            raise ValueError(f"unknown entropy method byte {method}")
        return raw

    def __repr__(self) -> str:
        return f"EntropyCodec({self.inner!r}, method={self.method!r}, level={self.level})"
