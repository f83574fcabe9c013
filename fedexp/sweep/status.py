"""What each job of a sweep records in its folder, read back and summarised per configuration.

See :mod:`fedexp.sweep` for the whole sweep.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from fedexp.sweep.names import child_name

#: What the launching process writes for the jobs, in the sweep folder.
SWEEP_FILE = "fedexp_sweep.json"
#: What each job writes in its own folder.
STATUS_FILE = "fedexp_status.json"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@dataclass
class SweepInfo:
    """What the jobs of a sweep need from the launching process (``fedexp_sweep.json``).

    Attributes:
        sweep_id: this sweep's id (the jobs copy it into their status files).
        varying: the keys that vary across the sweep.
        experiment: the MLflow experiment of the sweep's runs (None: no MLflow).
        parent_run_id: the parent run's id (None with ``tracker=none``).
        started: the sweep's start, seconds since the epoch.
        values: each key's values across the sweep (:func:`sweep_values`; run colours).
        live: the launching process draws a live display on its terminal: a job then prints
            nothing there (its line comes from the display).
    """

    sweep_id: str
    varying: list[str]
    experiment: str | None = None
    parent_run_id: str | None = None
    started: float = 0.0
    values: dict[str, list[str] | None] = field(default_factory=dict)
    live: bool = False

    def write(self, sweep_dir: str | Path) -> None:
        """Write ``<sweep_dir>/fedexp_sweep.json``."""
        _write_json(Path(sweep_dir) / SWEEP_FILE, asdict(self))

    @classmethod
    def read(cls, sweep_dir: str | Path) -> SweepInfo | None:
        """The sweep's info, or None where the file is missing or unreadable."""
        try:
            data = json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None


@dataclass
class JobStatus:
    """The outcome of one job of a sweep (``<job dir>/fedexp_status.json``).

    Attributes:
        job: Hydra's job number.
        status: "ok", "failed" or "killed" (stopped with the sweep: Ctrl-C, SIGTERM).
        name: the job's run name (its values of the varying keys, :func:`child_name`).
        overrides: all of the job's overrides.
        error: the one-line error of a failed job.
        run_id: the job's MLflow run, where one was started.
        metrics: the headline metric(s) of a finished job (``{"acc/mean": 0.81}``).
        sweep_id: the sweep's id (:class:`SweepInfo`).
        best: the headline's best over the evaluated rounds (``{"acc/mean": 0.83}``).
    """

    job: int
    status: str
    name: str = ""
    overrides: list[str] = field(default_factory=list)
    error: str = ""
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    sweep_id: str = ""
    best: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the job finished."""
        return self.status == "ok"

    @property
    def label(self) -> str:
        """``job 3 ditto s2``: the job and what sets it apart."""
        return f"job {self.job} {self.name or ' '.join(self.overrides)}".strip()

    def line(self) -> str:
        """The job's one line on the terminal: ``[job 3] ditto s2  acc/mean=0.8123  run …``."""
        if self.ok:
            parts = [self.name, *(f"{k}={v:.4f}" for k, v in self.metrics.items())]
            if self.run_id:
                parts.append(f"run {self.run_id}")
            return f"[job {self.job}] " + "  ".join(p for p in parts if p)
        what = "stopped" if self.status == "killed" else "failed"
        return f"[job {self.job}] {self.name}  {what}: {self.error}".replace("]  ", "] ")


def best_of(rounds_csv: str | Path, key: str) -> float | None:
    """The largest value of ``key`` over the rows of a run's ``rounds.csv`` (None: none)."""
    import csv

    best = None
    try:
        with open(rounds_csv, newline="") as fh:
            for row in csv.DictReader(fh):
                try:
                    value = float(row.get(key) or "nan")
                except ValueError:
                    continue
                if not math.isnan(value) and (best is None or value > best):
                    best = value
    except OSError:
        return None
    return best


def write_status(job_dir: str | Path, status: JobStatus) -> None:
    """Record a job's outcome in its own folder."""
    status.error = (status.error.strip().splitlines() or [""])[0]
    _write_json(Path(job_dir) / STATUS_FILE, asdict(status))


#: The error of a job folder without a status file (see :func:`read_statuses`).
NO_STATUS = "no status recorded: the job stopped before its end (killed? out of memory?)"
#: The error of a job that a stopped sweep ended.
STOPPED = "stopped with the sweep"


def _scan(
    sweep_dir: str | Path, sweep_id: str, since: float
) -> tuple[dict[Path, JobStatus], dict[Path, list[str]]]:
    """The sweep's job folders: those with a status of this sweep, and those without one.

    Returns:
        ``({folder: status}, {folder: its overrides})``: a folder without a status file is
        one whose ``.hydra/overrides.yaml`` was written since ``since`` (a job that started).
    """
    import yaml

    root = Path(sweep_dir)
    done: dict[Path, JobStatus] = {}
    for path in root.rglob(STATUS_FILE):
        try:
            status = JobStatus(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if status.sweep_id == sweep_id:
            done[path.parent] = status
    pending: dict[Path, list[str]] = {}
    for path in root.rglob(".hydra/overrides.yaml"):
        folder = path.parent.parent
        try:
            if folder in done or path.stat().st_mtime < since - 1:
                continue
            pending[folder] = [str(o) for o in yaml.safe_load(path.read_text()) or []]
        except (OSError, yaml.YAMLError):
            pending[folder] = []
    return done, pending


def _number(folder: Path, default: int) -> int:
    return int(folder.name) if folder.name.isdigit() else default


def read_statuses(
    sweep_dir: str | Path, sweep_id: str, since: float, varying: Iterable[str] = ()
) -> list[JobStatus]:
    """Every job of the sweep ``sweep_id`` under ``sweep_dir``, by job number.

    A job is a folder holding a status file of this sweep, or Hydra's ``.hydra/overrides.yaml``
    written since ``since`` (the job started); the latter without a status file counts as
    failed (the job was killed or crashed before it could record its end), named by its values
    of the ``varying`` keys.
    """
    varying = list(varying)
    done, pending = _scan(sweep_dir, sweep_id, since)
    jobs = dict(done)
    for folder, overrides in pending.items():
        jobs[folder] = JobStatus(
            job=_number(folder, len(jobs)),
            status="failed",
            name=child_name(overrides, varying),
            overrides=overrides,
            error=NO_STATUS,
            sweep_id=sweep_id,
        )
    return sorted(jobs.values(), key=lambda s: s.job)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: list[float]) -> float:
    """Sample standard deviation (ddof = 1, as ``fedexp report``); 0 for one value."""
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclass
class ConfigResult:
    """One configuration of a sweep (its values of the varying keys but the seed).

    Attributes:
        name: ``local δ=2`` (:func:`child_name` without the seed; ``all`` when only the seed
            varies).
        final: the headline at the last round, one value per finished job (seed).
        best: the headline's best over the evaluated rounds, one value per finished job.
    """

    name: str
    final: list[float] = field(default_factory=list)
    best: list[float] = field(default_factory=list)

    def row(self, metric: str) -> dict[str, Any]:
        """The configuration as a row of the parent run's ``sweep_summary.json`` table."""
        return {
            "configuration": self.name,
            "seeds": len(self.final),
            f"final {metric} mean": _mean(self.final),
            f"final {metric} std": _std(self.final),
            f"final {metric} min": min(self.final, default=math.nan),
            f"final {metric} max": max(self.final, default=math.nan),
            f"best {metric} mean": _mean(self.best),
            f"best {metric} std": _std(self.best),
        }


def summarise(jobs: Iterable[JobStatus], varying: Iterable[str]) -> tuple[str | None, list]:
    """The finished jobs by configuration: the headline metric and a :class:`ConfigResult` each.

    Returns:
        ``(metric, configurations)``: the headline (``acc/mean``; None when no job finished)
        and the configurations in the order of their first job.
    """
    keys = [k for k in varying if k != "seed"]
    metric = None
    configs: dict[str, ConfigResult] = {}
    for job in jobs:
        if not job.ok or not job.metrics:
            continue
        metric = metric or next(iter(job.metrics))
        if metric not in job.metrics:
            continue
        name = child_name(job.overrides, keys) or "all"
        config = configs.setdefault(name, ConfigResult(name))
        config.final.append(job.metrics[metric])
        config.best.append(job.best.get(metric, job.metrics[metric]))
    return metric, list(configs.values())
