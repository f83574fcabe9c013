"""The byte ledger: what crossed the network, per direction, per round and cumulative."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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

    def start_round(self) -> None:
        """Reset the per-round counters."""
        self.round = {"up": 0, "down": 0}
        self.round_dense = {"up": 0, "down": 0}
        self.parts_round = {}

    def add(self, direction: str, payload: bytes, numel: int, part: str = "") -> None:
        """Count one message (part) of ``numel`` entries in ``direction`` ("up" or "down").

        A named ``part`` of a multi-part message is also counted under its name.
        """
        if part:
            key = f"{direction}/{part}"
            self.parts_round[key] = self.parts_round.get(key, 0) + len(payload)
            self.parts_total[key] = self.parts_total.get(key, 0) + len(payload)
        self.round[direction] += len(payload)
        self.round_dense[direction] += 4 * numel
        self.total[direction] += len(payload)
        self.total_dense[direction] += 4 * numel
        self.messages[direction] += 1

    def add_many(self, direction: str, count: int, size: int, numel: int, part: str = "") -> None:
        """Count ``count`` messages (parts) of ``size`` bytes and ``numel`` entries each."""
        if part:
            key = f"{direction}/{part}"
            self.parts_round[key] = self.parts_round.get(key, 0) + count * size
            self.parts_total[key] = self.parts_total.get(key, 0) + count * size
        self.round[direction] += count * size
        self.round_dense[direction] += count * 4 * numel
        self.total[direction] += count * size
        self.total_dense[direction] += count * 4 * numel
        self.messages[direction] += count

    def add_sizes(self, direction: str, sizes: Sequence[int], numel: int, part: str = "") -> None:
        """Count one message (part) of ``numel`` entries per entry of ``sizes`` (its bytes)."""
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
        return {
            "round": self.round,
            "round_dense": self.round_dense,
            "messages": self.messages,
            "parts_round": self.parts_round,
        }

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
