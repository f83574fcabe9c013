"""Trace files of ``system=trace``: each client's device and its on/off intervals, as CSV.

The two files take the fields of FedScale's traces (Lai et al., "FedScale: Benchmarking Model
and System Performance of Federated Learning at Scale", ICML 2022; the FedScale repository's
``client_device_capacity`` and ``client_behave_trace``), which FedScale ships as Python
pickles. fedexp never unpickles a file (loading a pickle runs code it names): it reads the
same fields as CSV, one conversion away (docs/design.md, "Time on a simulated clock").

Device file (``system.device_file``), one row a client, in one of two forms told by its header:

* fedexp's: ``client,speed,uplink,downlink[,latency]``: local steps a second, bytes a second
  each way, seconds of latency each way;
* FedScale's: ``client_id,computation,communication``: ``computation`` is the milliseconds
  a sample's forward pass takes, ``communication`` the link's kbit/s. As FedScale does
  (``ClientMetadata.get_completion_time``: a step costs 3 × batch × computation ms, the
  backward pass twice the forward), a client's speed is 1000 / (3 · batch_size ·
  computation) steps a second; its link carries communication · 1000 / 8 bytes a second
  each way.

Availability file (``system.availability_file``), FedScale's ``client_behave_trace`` one row
an interval: ``client_id,active,inactive,finish_time``: the client is on from ``active`` to
``inactive`` seconds (ends included), and its trace repeats every ``finish_time`` seconds, as
FedScale's ``ClientMetadata.is_active`` reads it (``time % finish_time``).

The fedexp clients take the file's clients in ascending id order, client n the (n mod
count)-th, as FedScale maps its clients to the traces. Every value is checked; a bad one is
refused in one line naming the file, the row (its line in the file) and the column.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedexp.errors import ConfigError

#: The device file's columns, by form (the optional ones last).
FEDEXP_DEVICE = ("client", "speed", "uplink", "downlink")
FEDSCALE_DEVICE = ("client_id", "computation", "communication")
AVAILABILITY = ("client_id", "active", "inactive", "finish_time")


@dataclass(frozen=True)
class Devices:
    """The device file's clients (ascending ids) and their values.

    Attributes:
        ids: the file's client ids, ascending.
        speed: local steps a second.
        uplink: bytes a second, client → server.
        downlink: bytes a second, server → client.
        latency: seconds each way, or None (the file has no such column).
    """

    ids: np.ndarray
    speed: np.ndarray
    uplink: np.ndarray
    downlink: np.ndarray
    latency: np.ndarray | None


@dataclass(frozen=True)
class Availability:
    """The availability file: every client's on intervals, repeating.

    Attributes:
        ids: the file's client ids, ascending.
        finish: each client's period (``finish_time``), seconds.
        owner: each interval's client (a position in ``ids``).
        active: each interval's start, seconds.
        inactive: each interval's end, seconds.
    """

    ids: np.ndarray
    finish: np.ndarray
    owner: np.ndarray
    active: np.ndarray
    inactive: np.ndarray

    def available(self, time: float, num_clients: int) -> np.ndarray:
        """Which of ``num_clients`` clients are on at ``time`` seconds (bool ``[N]``).

        Client n follows the file's (n mod count)-th trace at ``time % finish_time``.
        """
        norm = np.mod(time, self.finish)[self.owner]
        on = (self.active <= norm) & (norm <= self.inactive)
        traces = np.bincount(self.owner, weights=on, minlength=len(self.ids)) > 0
        return traces[np.arange(num_clients) % len(self.ids)]


def _frame(path: str, key: str) -> tuple[list[str], np.ndarray]:
    """The CSV's header and its cells (strings, ``[rows, columns]``)."""
    import pandas as pd

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{key}={path!r}: no such file (expected a CSV, docs/design.md)")
    try:
        frame = pd.read_csv(file, dtype=str, keep_default_na=False, skipinitialspace=True)
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as exc:
        said = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{key}={path!r}: not a CSV file ({said})") from None
    if frame.empty:
        raise ConfigError(f"{key}={path!r}: no rows (expected one a client after the header)")
    return [str(c).strip() for c in frame.columns], frame.to_numpy(dtype=object)


def _column(
    cells: np.ndarray,
    header: list[str],
    name: str,
    where: str,
    low: float,
    *,
    strict: bool,
    integer: bool = False,
) -> np.ndarray:
    """Column ``name`` as float64 (int64 with ``integer``), every value checked.

    Raises:
        ConfigError: ``<where>: row 3, column 'speed': 'abc' (expected a number > 0)``, the
            row being the line of the file (the header is row 1).
    """
    expected = f"{'an integer' if integer else 'a number'} {'>' if strict else '≥'} {low:g}"
    import pandas as pd

    text = cells[:, header.index(name)]
    values = pd.to_numeric(pd.Series(text), errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(values) | ((values <= low) if strict else (values < low))
    if integer:
        bad |= np.isfinite(values) & (values != np.round(values))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ConfigError(
            f"{where}: row {i + 2}, column {name!r}: {text[i]!r} (expected {expected})"
        )
    return values.astype(np.int64) if integer else values


def _need(header: list[str], columns: tuple[str, ...], where: str) -> None:
    """Refuse a header without every one of ``columns``."""
    missing = [c for c in columns if c not in header]
    if missing:
        raise ConfigError(
            f"{where}: row 1 (the header), no column {missing[0]!r} (expected the columns "
            f"{', '.join(columns)}; the header has {', '.join(header)})"
        )


def _unique(ids: np.ndarray, header: list[str], column: str, where: str) -> np.ndarray:
    """The order of ``ids`` ascending; a repeated id refused (its second row named)."""
    order = np.argsort(ids, kind="stable")
    twice = np.flatnonzero(np.diff(ids[order]) == 0)
    if twice.size:
        i = int(max(order[twice[0]], order[twice[0] + 1]))
        raise ConfigError(
            f"{where}: row {i + 2}, column {column!r}: client {ids[i]} again (expected one row "
            "a client)"
        )
    return order


def read_devices(path: str, batch_size: int, key: str = "system.device_file") -> Devices:
    """The device file (fedexp's form, or FedScale's, converted: module docstring).

    Args:
        path: the CSV.
        batch_size: the run's batch (FedScale's form counts milliseconds a sample).
        key: the setting that names the file (in messages).

    Raises:
        ConfigError: one line naming the file, the row and the column.
    """
    where = f"{key}={path!r}"
    header, cells = _frame(path, key)
    if "computation" in header or "communication" in header:
        _need(header, FEDSCALE_DEVICE, where)
        if batch_size <= 0:
            raise ConfigError(
                f"{where}: FedScale's form counts milliseconds a sample, so it needs "
                f"batch_size ≥ 1 (batch_size={batch_size} is the full batch)"
            )
        ids = _column(cells, header, "client_id", where, 0, strict=False, integer=True)
        ms = _column(cells, header, "computation", where, 0, strict=True)
        kbps = _column(cells, header, "communication", where, 0, strict=True)
        order = _unique(ids, header, "client_id", where)
        link = kbps[order] * 1000.0 / 8.0
        speed = 1000.0 / (3.0 * batch_size * ms[order])
        return Devices(ids[order], speed, link, link.copy(), None)
    _need(header, FEDEXP_DEVICE, where)
    ids = _column(cells, header, "client", where, 0, strict=False, integer=True)
    values = {c: _column(cells, header, c, where, 0, strict=True) for c in FEDEXP_DEVICE[1:]}
    latency = None
    if "latency" in header:
        latency = _column(cells, header, "latency", where, 0, strict=False)
    order = _unique(ids, header, "client", where)
    return Devices(
        ids[order],
        values["speed"][order],
        values["uplink"][order],
        values["downlink"][order],
        None if latency is None else latency[order],
    )


def read_availability(path: str, key: str = "system.availability_file") -> Availability:
    """The availability file (FedScale's ``client_behave_trace``, one row an interval).

    Raises:
        ConfigError: one line naming the file, the row and the column (an interval that ends
            before it starts, or lies past its client's ``finish_time``; a client whose rows
            give two ``finish_time``).
    """
    where = f"{key}={path!r}"
    header, cells = _frame(path, key)
    _need(header, AVAILABILITY, where)
    client = _column(cells, header, "client_id", where, 0, strict=False, integer=True)
    active = _column(cells, header, "active", where, 0, strict=False)
    inactive = _column(cells, header, "inactive", where, 0, strict=False)
    finish = _column(cells, header, "finish_time", where, 0, strict=True)
    for bad, column, expected in (
        (inactive < active, "inactive", "≥ the row's active"),
        (inactive > finish, "inactive", "≤ the row's finish_time"),
    ):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ConfigError(
                f"{where}: row {i + 2}, column {column!r}: {cells[i, header.index(column)]!r} "
                f"(expected {expected})"
            )
    ids, first, owner = np.unique(client, return_index=True, return_inverse=True)
    period = finish[first]
    bad = np.flatnonzero(finish != period[owner])
    if bad.size:  # two periods of one client
        i, k = int(bad[0]), owner[bad[0]]
        raise ConfigError(
            f"{where}: row {i + 2}, column 'finish_time': "
            f"{cells[i, header.index('finish_time')]!r} (expected {period[k]:g}, client "
            f"{ids[k]}'s finish_time on row {first[k] + 2})"
        )
    return Availability(ids, period, owner.astype(np.int64), active, inactive)
