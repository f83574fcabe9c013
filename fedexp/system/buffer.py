"""FedBuff's buffer: the clients in flight on the simulated clock (``system.buffer``).

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation" (AISTATS 2022):
C clients train at once, each from the model it downloaded; the server takes uploads as they
arrive and, after K of them, steps

    x ← x − η_g · Σ_{n ∈ K} ω_n s(τ_n) Δ_n,    s(τ) = 1 / √(1 + τ),

τ_n the server steps since client n downloaded its model, ω_n = 1/K in the paper
(``algorithm.weighting=uniform``; the default ``samples`` weights by n_train among the K).
A finished client's slot goes to a newly sampled one, who downloads the current model.

On fedexp's clock (:class:`fedexp.system.clock.Clock`) one engine round is one server step:
the round's cohort is the clients that start now (C in round 0, then as many as finished);
they train at once, as one batched cohort, and their decoded uploads wait here with the time
they will arrive (their start + their time on the clock) until the server takes them.
Everything is NumPy on the host plus the uploads' rows (on the run's device), so a
checkpoint keeps it as tensors (:meth:`Flight.state`) and a resumed run is the same run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field

import numpy as np
import torch

from fedexp.transfer import to_device

#: the checkpoint's key prefix of an upload part (a bare tensor's part "" is "p:")
_PART = "p:"


def staleness_weight(tau: np.ndarray) -> np.ndarray:
    """FedBuff's s(τ) = 1 / √(1 + τ) (float64): 1 for an upload of the current model."""
    return 1.0 / np.sqrt(1.0 + np.asarray(tau, dtype=np.float64))


@dataclass
class Flight:
    """The clients in flight: who, since when, for how long, and what they will upload.

    Attributes:
        clients: their ids ``[b]`` (int64; a client is in flight once at most).
        rounds: the round (server step) each started in, whose model it trains ``[b]``.
        start: the simulated second each started ``[b]`` (float64).
        seconds: each one's time on the clock ``[b]`` (float64, ``clock.client_times``).
        parts: their decoded uploads by part, ``[b, ...]`` stacks in the rows' order (a bare
            tensor's part is ""); empty when the algorithm uploads nothing.
    """

    clients: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    rounds: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    start: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    seconds: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def finish(self) -> np.ndarray:
        """When each upload arrives (float64 simulated seconds)."""
        return self.start + self.seconds

    def add(
        self,
        clients: np.ndarray,
        round_: int,
        start: float,
        seconds: np.ndarray,
        parts: Mapping[str, torch.Tensor],
    ) -> None:
        """Put a cohort that starts at ``start`` in flight (its uploads' rows ``parts``)."""
        m = len(clients)
        self.clients = np.concatenate([self.clients, np.asarray(clients, dtype=np.int64)])
        self.rounds = np.concatenate([self.rounds, np.full(m, round_, dtype=np.int64)])
        self.start = np.concatenate([self.start, np.full(m, start, dtype=np.float64)])
        self.seconds = np.concatenate([self.seconds, np.asarray(seconds, dtype=np.float64)])
        if self.parts and set(parts) != set(self.parts):
            raise ValueError("FedBuff: an upload whose parts differ from those in flight")
        self.parts = {
            k: v if k not in self.parts else torch.cat([self.parts[k], v.to(self.parts[k].device)])
            for k, v in parts.items()
        }

    def take(self, k: int) -> Flight:
        """The ``k`` first to arrive (ties: the lower id), ascending by id; the rest stay."""
        order = np.lexsort((self.clients, self.finish))
        first = order[:k]
        first = first[np.argsort(self.clients[first])]  # (ids are unique)
        rest = np.sort(order[k:])
        taken = self._rows(first)
        left = self._rows(rest)
        self.clients, self.rounds, self.start, self.seconds = (
            left.clients,
            left.rounds,
            left.start,
            left.seconds,
        )
        self.parts = left.parts
        return taken

    def _rows(self, index: np.ndarray) -> Flight:
        """The rows ``index`` as a flight of their own."""
        parts = {}
        for k, v in self.parts.items():
            parts[k] = v[to_device(index.astype(np.int64), v.device)]
        return Flight(
            self.clients[index], self.rounds[index], self.start[index], self.seconds[index], parts
        )

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: every array and upload row as a tensor (exact)."""
        out = {
            "clients": torch.from_numpy(self.clients.copy()),
            "rounds": torch.from_numpy(self.rounds.copy()),
            "start": torch.from_numpy(self.start.copy()),
            "seconds": torch.from_numpy(self.seconds.copy()),
        }
        out.update({_PART + k: v for k, v in self.parts.items()})
        return out

    @classmethod
    def of_state(cls, state: Mapping[str, torch.Tensor], device: torch.device | str) -> Flight:
        """:meth:`state` read back, the upload rows on ``device`` (none saved: empty)."""
        if "clients" not in state:
            return cls()

        def host(key: str, dtype: type) -> np.ndarray:
            return state[key].cpu().numpy().astype(dtype)

        parts = {
            k.removeprefix(_PART): v.to(device) for k, v in state.items() if k.startswith(_PART)
        }
        return cls(
            host("clients", np.int64),
            host("rounds", np.int64),
            host("start", np.float64),
            host("seconds", np.float64),
            parts,
        )
