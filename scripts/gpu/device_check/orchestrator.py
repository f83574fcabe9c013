"""The orchestrator: runs the steps' children to their budgets, keeps the log, writes
``check.json`` and ``summary.md``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .paths import ENTRY
from .paths import ROOT
from .sizes import SIZES
from .step import _jsonable
from .step import _tail
from .summary import summary


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


class Check:
    """Runs the steps' children, keeps the log, writes ``check.json`` and ``summary.md``."""

    def __init__(
        self, mode: str, steps: list[str], total_s: float, out: Path, stretch: float = 1.0
    ) -> None:
        self.mode, self.steps, self.out, self.stretch = mode, steps, out, stretch
        self.sizes = SIZES[mode]
        self.start = time.monotonic()
        self.end = self.start + total_s
        self.total_s = total_s
        self.results: dict[str, dict[str, Any]] = {}
        self.proc: subprocess.Popen | None = None
        self.work = Path(tempfile.mkdtemp(prefix="fedexp-check-work-"))  # the steps' JSON
        self.log = open(out / "log.txt", "a", buffering=1)

    def say(self, line: str) -> None:
        """A progress line, to stdout and the log."""
        stamp = f"[check {time.monotonic() - self.start:6.1f}s]"
        print(f"{stamp} {line}", flush=True)
        self.log.write(f"{stamp} {line}\n")

    def run(self) -> int:
        """Every step (or group), then the summary; 0 unless a step failed."""
        self.say(
            f"mode {self.mode}, steps {', '.join(self.steps)}; budget {self.total_s:.0f} s; "
            f"out {self.out}"
        )
        groups = [self.steps] if self.sizes.inline else [[s] for s in self.steps]
        try:
            for group in groups:
                self._run_group(group)
                self.write()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                _kill_group(self.proc)
            self.write()
            shutil.rmtree(self.work, ignore_errors=True)
            self.say(f"done in {time.monotonic() - self.start:.1f} s; {self.out / 'summary.md'}")
            print("\n" + (self.out / "summary.md").read_text(), flush=True)
            self.log.close()
        failed = [s for s, r in self.results.items() if r.get("status") != "ok"]
        return 1 if failed else 0

    def _run_group(self, group: list[str]) -> None:
        now = time.monotonic()
        left = self.end - now
        deadlines, at = [], now
        for name in group:
            at = min(at + self.sizes.budgets[name] * self.stretch, self.end)
            deadlines.append(at)
        if left < 3:
            for name in group:
                self.results[name] = {"status": "skipped", "error": "no time left"}
                self.say(f"{name}: skipped, no time left")
            return
        self.say(f"{', '.join(group)}: start ({deadlines[-1] - now:.0f} s)")
        # the child's deadlines, as its own monotonic clock reads them (the same clock)
        cmd = [
            sys.executable,
            str(ENTRY),
            "--child",
            ",".join(group),
            "--mode",
            self.mode,
            "--out",
            str(self.out),
            "--work",
            str(self.work),
            "--deadlines",
            ",".join(f"{d:.3f}" for d in deadlines),
        ]
        grace = 15 if self.mode == "gpu" else 5
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            process_group=0,  # its own group (killed with it), in this session (ended with it)
        )
        self.proc = proc
        err_lines: list[str] = []
        readers = [
            threading.Thread(target=self._pump, args=(proc.stdout, True, None), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, False, err_lines), daemon=True),
        ]
        for t in readers:
            t.start()
        try:
            proc.wait(timeout=max(1.0, deadlines[-1] - time.monotonic() + grace))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            proc.wait()
        for t in readers:
            t.join(timeout=5)
        for name in group:
            file = self.work / f"{name}.json"
            try:
                result = json.loads(file.read_text())
            except (OSError, ValueError):
                result = {}
            if result.get("status") is None:
                why = "timeout" if timed_out else f"child exited {proc.returncode}"
                result["status"] = "timeout" if timed_out else "crashed"
                result["error"] = why + (": " + _tail("".join(err_lines), 8) if err_lines else "")
            self.results[name] = result
            self.say(f"{name}: {result['status']} ({result.get('seconds', 0):.1f} s)")

    def _pump(self, stream: Any, echo: bool, keep: list[str] | None) -> None:
        for line in stream:
            self.log.write(line if echo else f"  (stderr) {line}")
            if echo:
                print(line, end="", flush=True)
            if keep is not None:
                keep.append(line)
                del keep[:-40]

    def write(self) -> None:
        """``check.json`` and ``summary.md`` from what the steps have so far."""
        results = dict(self.results)
        for name in self.steps:  # a step still running: its partial figures
            if name not in results:
                with contextlib.suppress(OSError, ValueError):
                    part = json.loads((self.work / f"{name}.json").read_text())
                    results[name] = {**part, "status": part.get("status", "running")}
        doc = {
            "mode": self.mode,
            "budget_s": self.total_s,
            "wall_s": time.monotonic() - self.start,
            "sizes": dataclasses.asdict(self.sizes),
            "steps": results,
        }
        (self.out / "check.json").write_text(json.dumps(doc, indent=1, default=_jsonable))
        (self.out / "summary.md").write_text(summary(doc))
