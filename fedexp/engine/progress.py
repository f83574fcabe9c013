"""Progress over rounds: a rich bar with the latest metrics on a TTY, log lines otherwise.

The bar keeps ``round N/M``, the bar itself and the ETA whole at any width from about 40
columns up: only the metrics text after them is cut short (ending in ``…``).

Inside a job of a sweep (``fedexp run -m``), :func:`job_label` marks every log line of the job,
the progress lines included, with the job's id (``[job 3] round 2/50 acc/mean=...``), so that
the lines of parallel jobs can be told apart; the bar starts with the same label.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

log = logging.getLogger("fedexp")

_SHOWN = (
    "acc/mean",
    "iou/mean",
    "train/train_loss",
    "pfednet/spread",
    "bytes/up_cum",
    "bytes/down_cum",
)

#: The current job's label ("job 3") inside a sweep job, else None (see :func:`job_label`).
_label: str | None = None
#: Whether the current job runs beside others (a parallel launcher): no bar then.
_parallel = False


def _fmt(metrics: dict[str, float]) -> str:
    parts = []
    for key in _SHOWN:
        if key in metrics:
            v = metrics[key]
            parts.append(f"{key}={v:.4g}" if not key.startswith("bytes") else f"{key}={int(v)}")
    return " ".join(parts)


class _JobPrefix(logging.Filter):
    """Puts ``[job N] `` before the message of every record a handler emits (once a record)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "fedexp_job", False):
            record.msg = f"{self.prefix}{record.msg}"
            record.fedexp_job = True
        return True


def job_prefix() -> str:
    """``"[job 3] "`` inside a sweep job (:func:`job_label`), else ``""``: for printed lines."""
    return f"[{_label}] " if _label else ""


@contextmanager
def job_label(label: str, *, parallel: bool = False) -> Iterator[None]:
    """Mark every log line of the job run inside the block with ``[label]``.

    The mark is a filter on the handlers of the root logger and of every logger with handlers
    of its own (MLflow's), as they are when the block starts (Hydra configures a job's logging
    before it calls the task function); it is removed when the block ends.

    Args:
        label: e.g. ``"job 3"``.
        parallel: the job runs beside others (joblib, SLURM): ``progress=auto`` then writes log
            lines, never a bar (bars of parallel processes would overwrite each other).
    """
    global _label, _parallel
    before = _label, _parallel
    _label, _parallel = label, parallel
    marker = _JobPrefix(f"[{label}] ")
    loggers = [logging.getLogger()]
    loggers += [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    handlers = list(dict.fromkeys(h for lg in loggers for h in lg.handlers))
    for handler in handlers:
        handler.addFilter(marker)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(marker)
        _label, _parallel = before


class _MetricsColumn(ProgressColumn):
    """The latest metrics on one line, ellipsised to the width left by the other columns.

    Its table column may wrap (so rich shrinks it first when the line is too long) while the
    text itself never wraps: it is cut with ``…`` instead, and round, bar and ETA stay whole.
    """

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("info", "")), no_wrap=True, overflow="ellipsis")


class RoundProgress:
    """Context manager showing round progress.

    Args:
        total: number of rounds.
        start: rounds already done (resume).
        mode: "auto", "bar", "log" or "none". "auto": a bar on a terminal, except in the
            parallel jobs of a sweep, else log lines.
        console: where the bar is drawn (default: stderr); tests pass a recording console.
    """

    def __init__(
        self, total: int, start: int = 0, mode: str = "auto", console: Console | None = None
    ) -> None:
        if mode not in ("auto", "bar", "log", "none"):
            raise ValueError(f"progress={mode!r}: expected auto, bar, log or none")
        console = console or Console(file=sys.stderr)
        if mode == "auto":
            mode = "bar" if console.is_terminal and not _parallel else "log"
        self.mode, self.total, self.start = mode, total, start
        self._latest: dict[str, float] = {}
        self._bar: Progress | None = None
        if mode == "bar":
            fixed = {"table_column": Column(no_wrap=True)}
            self._bar = Progress(
                TextColumn(escape(f"{job_prefix()}round"), style="bold", **fixed),
                MofNCompleteColumn(**fixed),
                BarColumn(bar_width=20),
                TimeRemainingColumn(**fixed),
                _MetricsColumn(),
                console=console,
                transient=False,
            )

    def __enter__(self) -> RoundProgress:
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task(
                "rounds", total=self.total, completed=self.start, info=""
            )
        return self

    def update(self, round_: int, metrics: dict[str, float]) -> None:
        """Report that ``round_`` rounds are done, with that round's metrics."""
        self._latest.update(metrics)
        if self._bar is not None:
            self._bar.update(self._task, completed=round_, info=_fmt(self._latest))
        elif self.mode == "log":
            log.info("round %d/%d %s", round_, self.total, _fmt(self._latest))

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
