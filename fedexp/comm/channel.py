"""A one-way channel: update transforms, optional error feedback, then a codec.

The sender applies its transforms (e.g. CER) to the message, adds its error-feedback
residual, compresses, keeps the new residual and encodes to bytes. The receiver decodes the
bytes. The engine owns the residuals (one per sender) so that a checkpoint holds them.

``compress_many`` does the sender's side for a cohort's stacked messages ``[m, d]`` in one pass
(the transforms' batched form, one residual per sender, the codec's ``compress_many``);
``send_many`` / ``receive_many`` add the bytes: each sender still gets its own payload (its
bytes counted on their own) and its own residual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Protocol

import torch

from fedexp.comm.codec import Codec
from fedexp.comm.codec import DenseCodec
from fedexp.comm.codec import Payloads
from fedexp.comm.codec import Streams


class UpdateTransform(Protocol):
    """A deterministic map applied to a message before compression (e.g. CER).

    A transform may also offer ``many(x, scale) -> (out, metrics)``, the same for the rows of
    ``x`` ``[m, d]`` at once, each metric a float64 tensor ``[m]`` of the rows' values
    (:func:`transform_many` loops over the rows otherwise).
    """

    def __call__(
        self, x: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Return the transformed vector and metrics to log (e.g. number of runs).

        ``x / scale`` is the message on the gradient scale (``scale`` = the client lr when
        the message is a model change, 1 for a pseudo-gradient); a transform whose effect
        depends on the magnitude (CER's γ) acts on that scale and returns the result × scale.
        """
        ...


def transform_many(
    transform: UpdateTransform, x: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``transform`` of every row of ``x`` ``[m, d]``: its ``many`` when it has one, else a loop.

    Returns the rows transformed and each metric's values, float64 ``[m]``.
    """
    many = getattr(transform, "many", None)
    if many is not None:
        return many(x, scale)
    rows, metrics = [], {}
    for i, row in enumerate(x):
        out, m = transform(row, scale)
        rows.append(out)
        for k, v in m.items():
            metrics.setdefault(k, [0.0] * x.shape[0])[i] = v
    stacked = torch.stack(rows) if rows else x.clone()
    return stacked, {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}


@dataclass
class Channel:
    """Transforms, then error feedback around a codec, for one direction.

    Args:
        codec: the byte format (and lossy operator) of the messages.
        transforms: applied in order before compression.
        error_feedback: keep ``residual = (x + residual) - compress(x + residual)`` per
            sender and add it to the next message (Sattler et al. 2019, STC).
    """

    codec: Codec = field(default_factory=DenseCodec)
    transforms: Sequence[UpdateTransform] = ()
    error_feedback: bool = False

    def send(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        generator: torch.Generator | None = None,
        scale: float = 1.0,
    ) -> tuple[bytes, torch.Tensor | None, dict[str, float]]:
        """Encode ``x``; return (payload, new residual or None, transform metrics).

        ``scale``: what ``x`` is a step of (the transforms' :class:`UpdateTransform`).
        """
        metrics: dict[str, float] = {}
        x = x.detach().to(torch.float32)
        for transform in self.transforms:
            x, m = transform(x, scale)
            metrics.update(m)
        if self.error_feedback:
            acc = x if residual is None else x + residual
            sent = self.codec.compress(acc, generator)
            return self.codec.encode(sent), acc - sent, metrics
        return self.codec.encode(self.codec.compress(x, generator)), None, metrics

    def receive(self, payload: bytes, numel: int, device: torch.device | str) -> torch.Tensor:
        """Decode a payload onto ``device``."""
        return self.codec.decode(payload, numel).to(device)

    def compress_many(
        self,
        x: torch.Tensor,
        residuals: torch.Tensor | None,
        generators: Streams | None = None,
        scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """The sender's side of ``send`` for every row of ``x`` ``[m, d]`` at once, no bytes.

        Transforms (:func:`transform_many`), then error feedback as in ``send`` row by row
        (Sattler et al. 2019): ``acc = x + residuals``, ``sent = compress_many(acc)``, new
        residuals ``acc - sent``.

        Args:
            x: the stacked messages, one sender per row.
            residuals: ``[m, d]`` residuals of the senders, or None (all zero / none kept).
            generators: one random stream per sender for randomised codecs, or None.
            scale: what ``x`` is a step of (:class:`UpdateTransform`).

        Returns:
            (what the codec sends ``[m, d]``, the new residuals ``[m, d]`` or None without
            error feedback, the transforms' metrics: float64 ``[m]`` each).
        """
        metrics: dict[str, torch.Tensor] = {}
        x = x.detach().to(torch.float32)
        for transform in self.transforms:
            x, m = transform_many(transform, x, scale)
            metrics.update(m)
        if self.error_feedback:
            acc = x if residuals is None else x + residuals
            sent = self.codec.compress_many(acc, generators)
            return sent, acc - sent, metrics
        return self.codec.compress_many(x, generators), None, metrics

    def send_many(
        self,
        x: torch.Tensor,
        residuals: torch.Tensor | None,
        generators: Streams | None = None,
        scale: float = 1.0,
    ) -> tuple[Payloads, torch.Tensor | None]:
        """``send`` of every row of ``x`` ``[m, d]`` at once: :meth:`compress_many`, then bytes.

        Returns:
            (the senders' payloads, the new residuals ``[m, d]`` or None without error
            feedback).
        """
        sent, new, _ = self.compress_many(x, residuals, generators, scale)
        return self.codec.encode_many(sent), new

    def receive_many(
        self, payloads: Payloads, numel: int, device: torch.device | str
    ) -> torch.Tensor:
        """Decode every payload onto ``device``: ``[m, numel]``."""
        return self.codec.decode_many(payloads, numel).to(device)
