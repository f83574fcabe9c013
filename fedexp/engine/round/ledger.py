"""The byte ledger: what crossed the network, per direction, per round and cumulative."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field

import numpy as np


@dataclass
class ByteLedger:
    """Counts ``len(payload)`` of every message and its dense float32 size (4 bytes an entry)."""

    total: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    total_dense: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    round: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    round_dense: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    messages: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    #: named parts of multi-part messages: "<direction>/<part>" -> bytes, this round and in all
    parts_round: dict[str, int] = field(default_factory=dict)
    parts_total: dict[str, int] = field(default_factory=dict)
    #: whether this round's bytes are also kept client by client (:meth:`client_bytes`: the
    #: simulated clock's, ``fedexp.system``); off, nothing more is kept
    per_client: bool = False
    #: direction -> this round's (clients, bytes each) chunks, as counted (``per_client``)
    _chunks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = field(
        default_factory=lambda: {"up": [], "down": []}, repr=False
    )

    def start_round(self) -> None:
        """Reset the per-round counters."""
        self.round = {"up": 0, "down": 0}
        self.round_dense = {"up": 0, "down": 0}
        self.parts_round = {}
        self._chunks = {"up": [], "down": []}

    def _keep(self, direction: str, clients: Sequence[int] | None, sizes: np.ndarray) -> None:
        """This round's messages of ``clients`` (``sizes`` bytes each), with ``per_client``."""
        if self.per_client and clients is not None:
            ids = np.asarray(clients, dtype=np.int64).reshape(-1)
            sizes = np.broadcast_to(np.asarray(sizes, dtype=np.int64), ids.shape)
            self._chunks[direction].append((ids, sizes))

    def client_bytes(self, direction: str, num_clients: int) -> np.ndarray:
        """This round's bytes of each client in ``direction`` (int64 ``[N]``; ``per_client``)."""
        chunks = self._chunks[direction]
        if not chunks:
            return np.zeros(num_clients, dtype=np.int64)
        ids = np.concatenate([c for c, _ in chunks])
        sizes = np.concatenate([b for _, b in chunks])
        return np.bincount(ids, weights=sizes, minlength=num_clients).astype(np.int64)

    def add(
        self, direction: str, payload: bytes, numel: int, part: str = "", client: int | None = None
    ) -> None:
        """Count one message (part) of ``numel`` entries in ``direction`` ("up" or "down").

        A named ``part`` of a multi-part message is also counted under its name; ``client``:
        whose message it is (kept with :attr:`per_client`).
        """
        self._keep(direction, None if client is None else [client], np.int64(len(payload)))
        if part:
            key = f"{direction}/{part}"
            self.parts_round[key] = self.parts_round.get(key, 0) + len(payload)
            self.parts_total[key] = self.parts_total.get(key, 0) + len(payload)
        self.round[direction] += len(payload)
        self.round_dense[direction] += 4 * numel
        self.total[direction] += len(payload)
        self.total_dense[direction] += 4 * numel
        self.messages[direction] += 1

    def add_many(
        self,
        direction: str,
        count: int,
        size: int,
        numel: int,
        part: str = "",
        clients: Sequence[int] | None = None,
    ) -> None:
        """Count ``count`` messages (parts) of ``size`` bytes and ``numel`` entries each.

        ``clients``: whose messages they are, one each (kept with :attr:`per_client`).
        """
        self._keep(direction, clients, np.int64(size))
        if part:
            key = f"{direction}/{part}"
            self.parts_round[key] = self.parts_round.get(key, 0) + count * size
            self.parts_total[key] = self.parts_total.get(key, 0) + count * size
        self.round[direction] += count * size
        self.round_dense[direction] += count * 4 * numel
        self.total[direction] += count * size
        self.total_dense[direction] += count * 4 * numel
        self.messages[direction] += count

    def add_sizes(
        self,
        direction: str,
        sizes: Sequence[int],
        numel: int,
        part: str = "",
        clients: Sequence[int] | None = None,
    ) -> None:
        """Count one message (part) of ``numel`` entries per entry of ``sizes`` (its bytes).

        ``clients``: whose messages they are, one a size (kept with :attr:`per_client`).
        """
        self._keep(direction, clients, np.asarray(sizes, dtype=np.int64))
        total, count = int(sum(int(b) for b in sizes)), len(sizes)
        if part:
            key = f"{direction}/{part}"
            self.parts_round[key] = self.parts_round.get(key, 0) + total
            self.parts_total[key] = self.parts_total.get(key, 0) + total
        self.round[direction] += total
        self.round_dense[direction] += count * 4 * numel
        self.total[direction] += total
        self.total_dense[direction] += count * 4 * numel
        self.messages[direction] += count

    def metrics(self) -> dict[str, float]:
        """``bytes/up``, ``bytes/up_cum``, ``bytes/up_dense``, ``compression/up`` (and down)."""
        out: dict[str, float] = {}
        for d in ("up", "down"):
            out[f"bytes/{d}"] = self.round[d]
            out[f"bytes/{d}_cum"] = self.total[d]
            out[f"bytes/{d}_dense"] = self.round_dense[d]
            out[f"bytes/{d}_dense_cum"] = self.total_dense[d]
            if self.round[d] > 0:
                out[f"compression/{d}"] = self.round_dense[d] / self.round[d]
            if self.total[d] > 0:
                out[f"compression/{d}_cum"] = self.total_dense[d] / self.total[d]
        for key, total in self.parts_total.items():
            out[f"bytes/{key}"] = self.parts_round.get(key, 0)
            out[f"bytes/{key}_cum"] = total
        return out

    def round_record(self) -> dict:
        """This round's counts (a fresh ledger's, for :meth:`merge` on every rank)."""
        record = {
            "round": self.round,
            "round_dense": self.round_dense,
            "messages": self.messages,
            "parts_round": self.parts_round,
        }
        if self.per_client:  # (the clients' bytes, nonzero ones only: [[clients], [bytes]])
            record["clients"] = {}
            for d in ("up", "down"):
                sent = self.client_bytes(d, 0)
                who = np.flatnonzero(sent)
                record["clients"][d] = [who.tolist(), sent[who].tolist()]
        return record

    def merge(self, records: Sequence[dict]) -> None:
        """Add every rank's :meth:`round_record` of this round (a run over several ranks)."""
        for rec in records:
            for d in ("up", "down"):
                self.round[d] += rec["round"][d]
                self.total[d] += rec["round"][d]
                self.round_dense[d] += rec["round_dense"][d]
                self.total_dense[d] += rec["round_dense"][d]
                self.messages[d] += rec["messages"][d]
            for key, size in rec["parts_round"].items():
                self.parts_round[key] = self.parts_round.get(key, 0) + size
                self.parts_total[key] = self.parts_total.get(key, 0) + size
            for d, (clients, sizes) in rec.get("clients", {}).items():
                self._keep(d, clients, np.asarray(sizes, dtype=np.int64))

    def to_meta(self) -> dict:
        """Cumulative counters for a checkpoint."""
        return {
            "total": self.total,
            "total_dense": self.total_dense,
            "messages": self.messages,
            "parts_total": self.parts_total,
        }

    @classmethod
    def from_meta(cls, meta: dict) -> ByteLedger:
        """Restore the cumulative counters."""
        return cls(
            total=dict(meta["total"]),
            total_dense=dict(meta["total_dense"]),
            messages=dict(meta["messages"]),
            parts_total=dict(meta.get("parts_total", {})),
        )
