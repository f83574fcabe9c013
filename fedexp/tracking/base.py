"""The tracker interface the engine logs through, and a null tracker for tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fedexp.tracking.dataset_input import DatasetRecord


class Tracker(Protocol):
    """Where a run's params, per-round metrics and artifacts go."""

    def start(
        self,
        run_name: str,
        params: dict[str, str],
        tags: dict[str, str],
        resume_run_id: str | None = None,
    ) -> str:
        """Open (or reopen) the run; returns its id.

        A store that does not hold ``resume_run_id`` (the run began with another tracker)
        opens a new run and returns its id: the runner then replays the checkpoint's history.
        """
        ...

    def last_step(self, key: str) -> int | None:
        """The largest step logged for ``key`` in this run (None if none)."""
        ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log one round's metrics in one batch (all or nothing)."""
        ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a local file."""
        ...

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Log ``rows`` (one dict a row) as a table artifact named ``artifact_file`` (.json)."""
        ...

    def log_dataset(self, record: DatasetRecord) -> None:
        """Record the run's data set as an input, once (a resumed run does not add it again)."""
        ...

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags."""
        ...

    def end(self, status: str = "FINISHED") -> None:
        """Close the run with FINISHED, FAILED or KILLED."""
        ...

    def describe(self) -> str:
        """One line: where the records are and how to look at them."""
        ...


class NullTracker:
    """Keeps everything in memory (tests, dry runs).

    Args:
        uri: ignored (accepted so that ``tracker=none`` works with any experiment config).
        experiment: ignored, likewise.
    """

    def __init__(self, uri: str | None = None, experiment: str | None = None) -> None:
        self.metrics: dict[str, dict[int, float]] = {}
        #: every step a batch of metrics was logged at (a round; ``round`` is not a metric)
        self.steps: set[int] = set()
        self.params: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.artifacts: list[str] = []
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self.datasets: list[DatasetRecord] = []
        self.status: str | None = None

    def start(
        self,
        run_name: str,
        params: dict[str, str],
        tags: dict[str, str],
        resume_run_id: str | None = None,
    ) -> str:
        """Record params and tags."""
        self.params.update(params)
        self.tags.update(tags)
        return resume_run_id or "null-run"

    def last_step(self, key: str) -> int | None:
        """Largest logged step of ``key``."""
        steps = self.metrics.get(key)
        return max(steps) if steps else None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Store metrics."""
        self.steps.add(step)
        for k, v in metrics.items():
            self.metrics.setdefault(k, {})[step] = v

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Remember the file name."""
        self.artifacts.append(Path(path).name)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Keep the rows under the file name."""
        self.tables[artifact_file] = [dict(r) for r in rows]
        self.artifacts.append(artifact_file)

    def log_dataset(self, record: DatasetRecord) -> None:
        """Keep the record, once per digest."""
        if all(d.sha256 != record.sha256 for d in self.datasets):
            self.datasets.append(record)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Store tags."""
        self.tags.update(tags)

    def end(self, status: str = "FINISHED") -> None:
        """Store the final status."""
        self.status = status

    def describe(self) -> str:
        """Nothing is persisted."""
        return "metrics were kept in memory only (tracker=none)"
