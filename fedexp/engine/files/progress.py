"""Progress over rounds: a rich bar with the latest metrics on a TTY, log lines otherwise.

The bar keeps ``round N/M``, the bar itself and the ETA whole at any width from about 40
columns up: only the metrics text after them is cut short (ending in ``…``).

Inside a job of a sweep (``fedexp run -m``), :func:`job_label` marks every log line of the job,
the progress lines included, with the job's id (``[job 3] round 2/50 acc/mean=...``), so that
the lines of parallel jobs can be told apart. A sweep's job keeps its per-round lines off the
terminal (``quiet``: its console handlers pass warnings and errors only) and in its own log file
(Hydra's ``<job dir>/<job name>.log``), and records its round in ``<job dir>/fedexp_progress.json``
(:data:`PROGRESS_FILE`), which the sweep's live display reads (:mod:`fedexp.sweep`): a sweep
prints one line per job, whatever the launcher. The job's settings are per thread: the runs of
a stacked sweep (``hydra/launcher=stacked``) are threads of one process, each a job.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn
from rich.progress import MofNCompleteColumn
from rich.progress import Progress
from rich.progress import ProgressColumn
from rich.progress import Task
from rich.progress import TextColumn
from rich.progress import TimeRemainingColumn
from rich.table import Column
from rich.text import Text

log = logging.getLogger("fedexp")

_SHOWN = (
    "acc/mean",
    "iou/mean",
    "dice/mean",
    "train/train_loss",
    "pfednet/spread",
    "bytes/up_cum",
    "bytes/down_cum",
)


class _Job(threading.local):
    """This thread's sweep job (:func:`job_label`); the class's values outside a job."""

    #: the current job's label ("job 3") inside a sweep job, else None
    label: str | None = None
    #: whether the current job runs beside others (a parallel launcher): no bar then
    parallel = False
    #: the current sweep job's folder (its progress file goes there), else None
    folder: Path | None = None
    #: whether the sweep's launcher draws a live display of its own (then no bar from a job)
    live = False


_job = _Job()
#: A sweep job's round, for the sweep's live display: ``{"round": 3, "total": 50, ...}``.
PROGRESS_FILE = "fedexp_progress.json"
#: Seconds between two writes of the progress file (the last round is always written).
_PROGRESS_EVERY_S = 0.5


def _fmt(metrics: dict[str, float]) -> str:
    parts = []
    for key in _SHOWN:
        if key in metrics:
            v = metrics[key]
            parts.append(f"{key}={v:.4g}" if not key.startswith("bytes") else f"{key}={int(v)}")
    return " ".join(parts)


#: The quiet filter of the sweep job whose work runs in this context (:func:`job_label`). A
#: stacked group's merged client work runs on the group's own thread, in a copy of the
#: context of the job that started it: its lines (``memory: ...``) are that job's to hush.
_quiet_job: contextvars.ContextVar[_Quiet | None] = contextvars.ContextVar(
    "fedexp_quiet_job", default=None
)


class _Quiet(logging.Filter):
    """Lets warnings and errors through a console handler, not the info lines (rounds).

    Args:
        thread: hush this thread's records only (a stacked sweep's job), and those logged
            in its context on another thread (its group's merged work); None: every record.
    """

    def __init__(self, thread: int | None = None) -> None:
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        mine = record.thread == self.thread or _quiet_job.get() is self
        if self.thread is not None and not mine:
            return True
        return record.levelno >= logging.WARNING


def _console(handler: logging.Handler) -> bool:
    """Whether ``handler`` writes to a stream other than a file (the terminal, a pipe)."""
    return isinstance(handler, logging.StreamHandler) and not isinstance(
        handler, logging.FileHandler
    )


class _JobPrefix(logging.Filter):
    """Puts ``[job N] `` before the message of every record a handler emits (once a record).

    Args:
        prefix: ``"[job N] "``.
        thread: mark this thread's records only (a stacked sweep's job); None: every record.
    """

    def __init__(self, prefix: str, thread: int | None = None) -> None:
        super().__init__()
        self.prefix, self.thread = prefix, thread

    def filter(self, record: logging.LogRecord) -> bool:
        if self.thread is not None and record.thread != self.thread:
            return True
        if not getattr(record, "fedexp_job", False):
            record.msg = f"{self.prefix}{record.msg}"
            record.fedexp_job = True
        return True


def job_prefix() -> str:
    """``"[job 3] "`` inside a sweep job (:func:`job_label`), else ``""``: for printed lines."""
    return f"[{_job.label}] " if _job.label else ""


def job_line(text: str, *, err: bool = False) -> None:
    """Print ``text`` with the job's mark (:func:`job_prefix`) as one line, in one write.

    The jobs of a sweep share the terminal (the processes of the parallel launcher, the
    threads of the stacked one). ``print`` writes the text and its newline in two calls, which
    an unbuffered stream (``python -u``, ``PYTHONUNBUFFERED=1``) passes on as two writes: two
    jobs ending together then print ``[job 0] a[job 1] b`` and an empty line. One write of a
    short line to a pipe or a terminal is never split.

    Args:
        text: the line, without its newline.
        err: to stderr (errors), else stdout.
    """
    stream = sys.stderr if err else sys.stdout
    stream.write(f"{job_prefix()}{text}\n")
    stream.flush()


@contextmanager
def job_label(
    label: str,
    *,
    parallel: bool = False,
    quiet: bool = False,
    folder: str | Path | None = None,
    live: bool = False,
    own_thread: bool = False,
) -> Iterator[None]:
    """Mark every log line of the job run inside the block with ``[label]``.

    The mark is a filter on the handlers of the root logger and of every logger with handlers
    of its own (MLflow's), as they are when the block starts (Hydra configures a job's logging
    before it calls the task function); it is removed when the block ends.

    Args:
        label: e.g. ``"job 3"``.
        parallel: the job runs beside others (joblib, SLURM): ``progress=auto`` then writes log
            lines, never a bar (bars of parallel processes would overwrite each other).
        quiet: the console handlers among them (not the files) pass warnings and errors only:
            a sweep's job writes its per-round lines to its log file, not to the terminal.
        folder: the job's folder: each round is recorded in its :data:`PROGRESS_FILE`.
        live: the sweep's launcher draws a live display: no bar from the job, even if asked.
        own_thread: the job is a thread beside the sweep's other jobs (a stacked sweep): the
            mark and the quiet apply to this thread's records only.
    """
    job = _job
    before = job.label, job.parallel, job.folder, job.live
    job.label, job.parallel, job.live = label, parallel, live
    job.folder = Path(folder) if folder is not None else None
    thread = threading.get_ident() if own_thread else None
    marker = _JobPrefix(f"[{label}] ", thread)
    loggers = [logging.getLogger()]
    loggers += [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    handlers = list(dict.fromkeys(h for lg in loggers for h in lg.handlers))
    quieted = [h for h in handlers if _console(h)] if quiet else []
    hush = _Quiet(thread)
    for handler in handlers:
        handler.addFilter(marker)
    for handler in quieted:
        handler.addFilter(hush)
    token = _quiet_job.set(hush if quieted else None)
    try:
        yield
    finally:
        _quiet_job.reset(token)
        for handler in handlers:
            handler.removeFilter(marker)
        for handler in quieted:
            handler.removeFilter(hush)
        job.label, job.parallel, job.folder, job.live = before


def read_progress(folder: str | Path) -> dict | None:
    """A sweep job's last recorded round (:data:`PROGRESS_FILE`), or None."""
    try:
        return json.loads((Path(folder) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None


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
        mode: "auto", "bar", "log" or "none". "auto": a bar on a terminal, else log lines; in
            the jobs of a sweep log lines (to the job's log file: :func:`job_label`), as "bar"
            is where the sweep draws a live display of its own.
        console: where the bar is drawn (default: stderr); tests pass a recording console.
    """

    def __init__(
        self, total: int, start: int = 0, mode: str = "auto", console: Console | None = None
    ) -> None:
        if mode not in ("auto", "bar", "log", "none"):
            raise ValueError(f"progress={mode!r}: expected auto, bar, log or none")
        console = console or Console(file=sys.stderr)
        if mode == "auto":
            mode = "bar" if console.is_terminal and _job.label is None else "log"
        elif mode == "bar" and _job.live:
            mode = "log"
        self.mode, self.total, self.start = mode, total, start
        self._latest: dict[str, float] = {}
        self._written = 0.0  # when the progress file was last written
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
        if _job.folder is not None:
            self._record(round_)
        if self._bar is not None:
            self._bar.update(self._task, completed=round_, info=_fmt(self._latest))
        elif self.mode == "log":
            log.info("round %d/%d %s", round_, self.total, _fmt(self._latest))

    def _record(self, round_: int) -> None:
        """Write the job's round to its progress file (at most every 0.5 s; never raises)."""
        now = time.monotonic()
        if round_ < self.total and now - self._written < _PROGRESS_EVERY_S:
            return
        self._written = now
        data = {"round": round_, "total": self.total, "info": _fmt(self._latest)}
        try:
            path = Path(_job.folder) / PROGRESS_FILE
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError:
            pass

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
