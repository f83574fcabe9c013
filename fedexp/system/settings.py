"""The ``system`` config group: each client's device, links and availability.

``fedexp run system=lognormal`` gives every client a compute speed (local steps a second),
an uplink and a downlink (bytes a second), a latency (seconds each way) and an availability,
and times each round on a simulated clock (:mod:`fedexp.system.clock`); ``system=none`` (the
default) changes nothing. Profiles:

* ``uniform``: every client the same values;
* ``lognormal``: each value the median times exp(σ·z), z a standard normal drawn once per
  client and quantity from the run's keyed streams ((seed, ``streams.SYSTEM``, quantity,
  client)), so a client's device does not depend on the processes, the stacking, the
  population's size or a resume;
* ``trace``: the values read from a device file and the on/off intervals from an
  availability file (:mod:`fedexp.system.trace`: FedScale's traces as CSV).

Deadlines and over-selection are those of Bonawitz et al., "Towards Federated Learning at
Scale: System Design" (MLSys 2019): the server waits until ``deadline`` seconds at most, and
samples ``over_select`` more clients than it needs, keeping the first to report.
``buffer`` makes the rounds asynchronous: FedBuff, Nguyen et al., "Federated Learning with
Buffered Asynchronous Aggregation" (AISTATS 2022), :mod:`fedexp.system.buffer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import numpy as np

from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import Positive
from fedexp.config.ranges import PositiveFraction
from fedexp.config.ranges import Range
from fedexp.errors import ConfigError
from fedexp.system.trace import Availability
from fedexp.system.trace import read_availability
from fedexp.system.trace import read_devices

PROFILES = ("none", "uniform", "lognormal", "trace")
#: the per-client quantities, in the order of their streams' index
QUANTITIES = ("speed", "uplink", "downlink", "latency")


@dataclass(frozen=True)
class SystemModel:
    """Every client's device and links, and the round's rules (what the clock reads).

    Attributes:
        speed: local steps a second ``[N]``.
        uplink: bytes a second, client → server ``[N]``.
        downlink: bytes a second, server → client ``[N]``.
        latency: seconds each way ``[N]``.
        availability: the chance a client is on in a round (each round's coin from
            (seed, ``streams.AVAILABLE``, round, client)); 1: always on.
        trace: on/off intervals (``system=trace``), read at the round's simulated start.
        deadline: seconds a round waits at most (None: for every sampled client).
        over_select: the share of clients sampled beyond those the round keeps.
        buffer: FedBuff's K, the uploads a server step takes (None: synchronous rounds).
    """

    speed: np.ndarray
    uplink: np.ndarray
    downlink: np.ndarray
    latency: np.ndarray
    availability: float = 1.0
    trace: Availability | None = None
    deadline: float | None = None
    over_select: float = 0.0
    buffer: int | None = None

    @property
    def keeps_all(self) -> bool:
        """Whether each round's server step takes every upload of that round's cohort.

        No deadline, no over-selection, no buffer (FedBuff steps on K uploads of any round's).
        """
        return self.deadline is None and self.over_select == 0 and self.buffer is None

    @property
    def always_on(self) -> bool:
        """Whether every client is on in every round."""
        return self.trace is None and self.availability == 1.0


def _normals(seed: int, quantity: int, num_clients: int) -> np.ndarray:
    """One standard normal a client (float64 ``[N]``), from (seed, SYSTEM, quantity, client)."""
    import torch
    from scipy.special import ndtri

    from fedexp import streams

    keys = streams.stream_keys(seed, streams.SYSTEM, quantity, torch.arange(num_clients))
    uniform = ((keys >> 10).to(torch.float64) + 0.5) * 2.0**-53  # in (0, 1)
    return ndtri(uniform.numpy())


class System:
    """The ``system`` group's node.

    Args:
        profile: "none" (no clock: today's rounds), "uniform", "lognormal" or "trace".
        speed: local steps a second (lognormal: the median).
        uplink: bytes a second from a client (lognormal: the median); 125000 = 1 Mbit/s.
        downlink: bytes a second to a client (lognormal: the median).
        latency: seconds each way (lognormal: the median).
        availability: the chance a client is on in a round (uniform, lognormal).
        speed_spread: σ of log(speed) (lognormal).
        uplink_spread: σ of log(uplink) (lognormal).
        downlink_spread: σ of log(downlink) (lognormal).
        latency_spread: σ of log(latency) (lognormal).
        device_file: the trace's device CSV (trace; null: ``speed``... for every client).
        availability_file: the trace's on/off intervals CSV (trace; null: always on).
        deadline: seconds the server waits for a round's uploads; the later ones are dropped,
            their bytes counted as sent (null: no deadline).
        over_select: sample ⌈K·(1 + over_select)⌉ clients and keep the first K to finish.
        buffer: FedBuff (:mod:`fedexp.system.buffer`): the round's cohort C stays in flight,
            the server steps on the first ``buffer`` uploads to arrive, staleness-weighted,
            and as many new clients start (null: synchronous rounds).
    """

    def __init__(
        self,
        profile: str = "none",
        speed: Positive = 10.0,
        uplink: Positive = 125_000.0,
        downlink: Positive = 1_250_000.0,
        latency: NonNegative = 0.05,
        availability: PositiveFraction = 1.0,
        speed_spread: NonNegative = 0.0,
        uplink_spread: NonNegative = 0.0,
        downlink_spread: NonNegative = 0.0,
        latency_spread: NonNegative = 0.0,
        device_file: str | None = None,
        availability_file: str | None = None,
        deadline: Annotated[float | None, Range(gt=0)] = None,
        over_select: NonNegative = 0.0,
        buffer: Annotated[int | None, Range(ge=1)] = None,
    ) -> None:
        if profile not in PROFILES:
            raise ValueError(f"system.profile={profile!r}: expected one of {', '.join(PROFILES)}")
        spreads = {
            "speed_spread": speed_spread,
            "uplink_spread": uplink_spread,
            "downlink_spread": downlink_spread,
            "latency_spread": latency_spread,
        }
        if profile != "lognormal":
            for key, value in spreads.items():
                if value:
                    raise ValueError(
                        f"system.{key}={value}: a spread is system=lognormal's, not "
                        f"system.profile={profile}'s"
                    )
        if profile != "trace":
            for key, value in (
                ("device_file", device_file),
                ("availability_file", availability_file),
            ):
                if value:
                    raise ValueError(
                        f"system.{key}={value!r}: a trace file is read with system=trace only"
                    )
        if profile == "none" and (deadline is not None or over_select):
            raise ValueError(
                "system.deadline and system.over_select time the clients: choose a profile "
                "(system=uniform, lognormal or trace)"
            )
        if buffer is not None and profile == "none":
            raise ValueError(
                f"system.buffer={buffer}: FedBuff's clients finish on the simulated clock: "
                "choose a profile (system=uniform, lognormal or trace)"
            )
        if buffer is not None and (deadline is not None or over_select):
            key, value = (
                ("deadline", deadline) if deadline is not None else ("over_select", over_select)
            )
            raise ValueError(
                f"system.{key}={value} with system.buffer={buffer}: FedBuff keeps every upload "
                f"until the server takes it; remove system.{key} or set system.buffer=null"
            )
        self.profile = profile
        self.values = {"speed": speed, "uplink": uplink, "downlink": downlink, "latency": latency}
        self.spreads = spreads
        self.availability = availability
        self.device_file = device_file
        self.availability_file = availability_file
        self.deadline = deadline
        self.over_select = over_select
        self.buffer = buffer

    @property
    def enabled(self) -> bool:
        """Whether the run has a clock (a profile other than ``none``)."""
        return self.profile != "none"

    def check_files(self, batch_size: int) -> None:
        """Read the trace files, refusing a bad one in one line (the CLI's check)."""
        self._devices(batch_size)
        if self.availability_file:
            read_availability(self.availability_file)

    def _devices(self, batch_size: int):  # noqa: ANN202 - Devices | None
        return read_devices(self.device_file, batch_size) if self.device_file else None

    def build(self, num_clients: int, seed: int, batch_size: int) -> SystemModel | None:
        """Every client's values (None for ``none``).

        Raises:
            ConfigError: a trace file or value that cannot be read (one line: file, row,
                column).
        """
        if not self.enabled:
            return None
        n = num_clients
        values = {k: np.full(n, float(v)) for k, v in self.values.items()}
        trace = None
        if self.profile == "lognormal":
            for q, key in enumerate(QUANTITIES):
                sigma = self.spreads[f"{key}_spread"]
                if sigma:
                    values[key] = values[key] * np.exp(sigma * _normals(seed, q, n))
        elif self.profile == "trace":
            devices = self._devices(batch_size)
            if devices is not None:
                row = np.arange(n) % len(devices.ids)
                values["speed"] = devices.speed[row]
                values["uplink"] = devices.uplink[row]
                values["downlink"] = devices.downlink[row]
                if devices.latency is not None:
                    values["latency"] = devices.latency[row]
            if self.availability_file:
                trace = read_availability(self.availability_file)
        for key, v in values.items():
            if not np.isfinite(v).all():
                raise ConfigError(f"system.{key}: a client's value overflows ({key} = inf)")
        return SystemModel(
            values["speed"],
            values["uplink"],
            values["downlink"],
            values["latency"],
            availability=self.availability if trace is None else 1.0,
            trace=trace,
            deadline=self.deadline,
            over_select=self.over_select,
            buffer=self.buffer,
        )

    def describe(self) -> str:
        """One line for the log: the profile and the rules."""
        rules = []
        if self.deadline is not None:
            rules.append(f"deadline {self.deadline:g} s")
        if self.over_select:
            rules.append(f"over-selection {self.over_select:g}")
        if self.buffer is not None:
            rules.append(f"FedBuff, a server step every {self.buffer} uploads")
        said = f"system={self.profile}" + (f" ({', '.join(rules)})" if rules else "")
        return said + ": rounds on a simulated clock (clock/round_s, clock/cum_s)"


def over_sampled(target: int, over_select: float) -> int:
    """⌈K·(1 + over_select)⌉: how many clients a round samples to keep ``target``."""
    return math.ceil(target * (1.0 + over_select) - 1e-9)
