"""The sweep's summary (printed, and logged on the parent run) and its live terminal display.

See :mod:`fedexp.sweep` for the whole sweep.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from fedexp.sweep.names import child_name
from fedexp.sweep.status import ConfigResult
from fedexp.sweep.status import JobStatus
from fedexp.sweep.status import SweepInfo
from fedexp.sweep.status import _mean
from fedexp.sweep.status import _number
from fedexp.sweep.status import _scan
from fedexp.sweep.status import _std


def metric_label(name: str) -> str:
    """A configuration's name as part of an MLflow metric name (``local δ=2`` → ``local δ:2``).

    MLflow's names take letters, digits, ``_ - . : /`` and spaces; ``=`` becomes ``:``,
    anything else (``/`` too: it would start a chart section) ``_``.
    """
    return re.sub(r"[^\w.\- :]", "_", name.replace("=", ":"))


@dataclass
class SweepSummary:
    """The end of a sweep, as printed on the terminal.

    Attributes:
        jobs: every job's status.
        sweep_dir: the sweep's folder.
        experiment: the MLflow experiment (None with ``tracker=none``).
        report: the ``fedexp report`` command for its tables (None without MLflow).
        link: how to open the sweep in MLflow's ML view (None without MLflow).
        parent_run_id: the parent MLflow run.
        stopped: why the sweep stopped before its end, or None.
        metric: the headline metric of the finished jobs (None when none finished).
        configs: the finished jobs by configuration (:func:`summarise`).
        grouped: what the link groups the runs by (``algorithm, δ``), or None.
        deleted: what was deleted from MLflow because the sweep recorded nothing there.
        tuning: a hyper-parameter search: no "best" line (the test split does not pick;
            ``fedexp report --select-by`` does, on the validation split).
    """

    jobs: list[JobStatus]
    sweep_dir: str
    experiment: str | None = None
    report: str | None = None
    link: str | None = None
    parent_run_id: str | None = None
    stopped: str | None = None
    metric: str | None = None
    configs: list[ConfigResult] = field(default_factory=list)
    grouped: str | None = None
    deleted: str | None = None
    tuning: bool = False

    @property
    def failed(self) -> list[JobStatus]:
        """The jobs that did not finish (failed, or stopped with the sweep)."""
        return [j for j in self.jobs if not j.ok]

    @property
    def killed(self) -> list[JobStatus]:
        """The jobs stopped with the sweep (Ctrl-C, SIGTERM)."""
        return [j for j in self.jobs if j.status == "killed"]

    def counts(self) -> str:
        """``"3 jobs: 2 ok, 1 failed"`` (``, 2 stopped`` when the sweep stopped some)."""
        n, killed = len(self.jobs), len(self.killed)
        text = (
            f"{n} job{'s' if n != 1 else ''}: {n - len(self.failed)} ok, "
            f"{len(self.failed) - killed} failed"
        )
        return text + (f", {killed} stopped" if killed else "")

    def best(self) -> ConfigResult | None:
        """The configuration with the best mean final headline (None: nothing finished)."""
        scored = [c for c in self.configs if c.final]
        return max(scored, key=lambda c: _mean(c.final), default=None)

    def best_line(self) -> str | None:
        """``best: local δ=2  acc/mean 0.8512 ± 0.0123 over 3 seeds (best round 0.8700)``."""
        top = self.best()
        if top is None or self.metric is None:
            return None
        n = len(top.final)
        spread = f" ± {_std(top.final):.4f}" if n > 1 else ""
        what = "all jobs:" if len(self.configs) == 1 and top.name == "all" else f"best: {top.name} "
        return (
            f"{what} {self.metric} {_mean(top.final):.4f}{spread} over {n} "
            f"seed{'s' if n != 1 else ''} (best round {_mean(top.best):.4f})"
        )

    def text(self) -> str:
        """The summary's lines."""
        lines = [f"sweep done, {self.counts()} (folder {self.sweep_dir})"]
        if self.stopped:
            lines = [
                f"sweep stopped before its end ({self.stopped}); {self.counts()} so far "
                f"(folder {self.sweep_dir})"
            ]
        for job in self.failed:
            what = "stopped" if job.status == "killed" else "failed"
            lines.append(f"  {what}: [{job.label}] {job.error}")
        best = None if self.tuning else self.best_line()
        if best:
            lines.append(best)
        if self.deleted:
            lines.append(f"MLflow: nothing recorded ({self.deleted})")
        elif self.experiment is not None:
            parent = f" (parent run {self.parent_run_id})" if self.parent_run_id else ""
            lines.append(f"MLflow experiment: {self.experiment}{parent}")
            if self.link:
                by = f" (opens grouped by {self.grouped}, mean of seeds)" if self.grouped else ""
                lines.append(f"view: {self.link}{by}")
        else:
            lines.append("MLflow: nothing recorded (tracker=none); results in the job folders")
        if self.report is not None and not self.deleted:
            lines.append(f"tables: {self.report}")
        return "\n".join(lines)

    def markdown(self) -> str:
        """The parent run's description: the configurations as a table, then the summary."""
        out = [f"**{self.text().splitlines()[0]}**", ""]
        if self.configs and self.metric:
            m = self.metric
            out += [
                f"| configuration | seeds | final {m} (mean ± sd over seeds) | best {m} |",
                "|---|---:|---:|---:|",
            ]
            for c in sorted(self.configs, key=lambda c: -_mean(c.final))[:40]:
                out.append(
                    f"| {c.name} | {len(c.final)} | {_mean(c.final):.4f} ± {_std(c.final):.4f} "
                    f"| {_mean(c.best):.4f} |"
                )
            if len(self.configs) > 40:
                out.append(f"| … {len(self.configs) - 40} more in sweep_summary.json | | | |")
            out.append("")
        return "\n".join([*out, "```text", self.text(), "```"])


class LiveSweep:
    """A sweep on a terminal: one live bar, a line per running job, a line per finished job.

    Runs in the process that launches the sweep, whatever the launcher: a thread reads the
    job folders every half second (the status files of the finished jobs, the progress files
    of the running ones, :mod:`fedexp.engine.files.progress`) and redraws, with rich::

        [job 0] fedavg δ=1 s0  acc/mean=0.8123  run 3f2a…      (printed once, above)
        sweep ━━━━━━━━━━━━╸━━━━━━━  9/24 jobs  1 failed  2 running  ETA 0:03:10
          job 9   local δ=1 s0   round 12/50  acc/mean=0.79
          job 10  local δ=1 s1   round 3/50

    Args:
        sweep_dir: the sweep's folder.
        info: the sweep (its id, start, varying keys).
        total: the number of jobs, where known (a grid), for the bar and the ETA.
        console: where to draw (default: stdout).
    """

    POLL_S = 0.5

    def __init__(
        self, sweep_dir: str, info: SweepInfo, total: int | None, console: Any = None
    ) -> None:
        from rich.console import Console

        self.sweep_dir, self.info, self.total = sweep_dir, info, total
        self.console = console or Console(file=sys.stdout)
        self._printed: set[Path] = set()
        self._done = self._failed = 0
        self._running: list[tuple[int, str, dict | None]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._live: Any = None

    def start(self) -> LiveSweep:
        """Start drawing (and the thread that reads the job folders)."""
        from rich.live import Live

        self._live = Live(
            self._render(),
            console=self.console,
            refresh_per_second=4,
            transient=True,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self._live.start()
        self._thread = threading.Thread(target=self._loop, name="fedexp-sweep", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.POLL_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001, S112 - a display must never stop a sweep
                continue

    def poll(self) -> None:
        """Read the job folders: print the newly finished jobs, redraw the bar."""
        from fedexp.engine.files.progress import read_progress

        with self._lock:
            done, pending = _scan(self.sweep_dir, self.info.sweep_id, self.info.started)
            for folder, status in sorted(done.items(), key=lambda kv: kv[1].job):
                if folder not in self._printed:
                    self._printed.add(folder)
                    style = None if status.ok else "red"
                    self.console.print(status.line(), style=style, markup=False, highlight=False)
            self._done = len(done)
            self._failed = sum(not s.ok for s in done.values())
            self._running = [
                (
                    _number(folder, 0),
                    child_name(overrides, self.info.varying),
                    read_progress(folder),
                )
                for folder, overrides in sorted(pending.items())
            ]
            if self._live is not None:
                self._live.update(self._render())

    def _render(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        elapsed = time.time() - self.info.started
        of = f"/{self.total}" if self.total else ""
        parts = [f"{self._done}{of} jobs"]
        if self._failed:
            parts.append(f"{self._failed} failed")
        parts.append(f"{len(self._running)} running")
        if self.total and self._done:
            left = elapsed / self._done * max(0, self.total - self._done)
            parts.append(f"ETA {time.strftime('%H:%M:%S', time.gmtime(left))}")
        head = Table.grid(padding=(0, 1))
        head.add_row(
            Text("sweep", style="bold"),
            ProgressBar(total=self.total or None, completed=self._done, width=24),
            Text("  ".join(parts), no_wrap=True, overflow="ellipsis"),
        )
        rows = []
        for number, name, progress in self._running:
            where = ""
            if progress:
                shown = [
                    item
                    for item in str(progress.get("info", "")).split()
                    if item.startswith(("acc/mean=", "iou/mean="))
                ]
                where = " ".join([f"round {progress.get('round')}/{progress.get('total')}", *shown])
            line = f"  job {number:<3} {name}  {where}".rstrip()
            rows.append(Text(line, no_wrap=True, overflow="ellipsis", style="dim"))
        return Group(head, *rows)

    def stop(self) -> None:
        """Stop drawing: the last finished jobs are printed, the bar goes."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.poll()
        except Exception:  # noqa: BLE001, S110 - a display must never stop a sweep
            pass
        if self._live is not None:
            self._live.stop()
            self._live = None


def _terminal() -> bool:
    """Whether stdout is a terminal that can take a live display."""
    from rich.console import Console

    console = Console(file=sys.stdout)
    return console.is_terminal and not console.is_dumb_terminal
