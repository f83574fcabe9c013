"""Step ``sweep``: a ``pfednet_tables``-style sweep on the device, one job a run and stacked,
and the CPU's as the baseline."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .paths import ROOT
from .paths import _pythonpath
from .sizes import Sizes
from .step import Step
from .step import _device
from .step import _tail


class _Sweep:
    """``fedexp run -m +experiment=pfednet_tables`` over ``algorithms`` (δ = 1, seed 0), its
    output read as it comes (each job's line timed) until :meth:`finish`."""

    def __init__(
        self,
        sizes: Sizes,
        device: str,
        algorithms: tuple[str, ...],
        root: Path,
        seeds: int = 1,
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="sweep-", dir=root))
        # (one process: the merge itself, not processes side by side)
        stacked = ["hydra/launcher=stacked", "hydra.launcher.n_jobs=1"] if seeds > 1 else []
        cmd = [
            sys.executable,
            "-c",
            "from fedexp.cli import entry; entry()",
            "run",
            "-m",
            "+experiment=pfednet_tables",
            "tracker=none",
            f"device={device}",
            f"rounds={sizes.sweep_rounds}",
            f"algorithm={','.join(algorithms)}",
            "partition.delta=1",
            f"seed={','.join(str(k) for k in range(seeds))}",
            *stacked,
            f"hydra.sweep.dir={self.tmp / 'multirun'}",
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), _pythonpath()])}
        env.pop("MLFLOW_TRACKING_URI", None)
        self.row: dict[str, Any] = {
            "device": device,
            "algorithms": list(algorithms),
            "seeds": seeds,
            "launcher": "stacked" if stacked else "basic",
            "jobs": {},
            "total": len(algorithms) * seeds,
        }
        self.lines: list[str] = []
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,  # (in the step's process group: stopped with the step)
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            now = time.monotonic() - self.start
            if line.startswith("sweep:"):
                self.first = now
            m = re.match(r"\[job (\d+)\]\s+(.*?)\s+(\S+=\S+)\s*$", line)
            if m:
                self.row["jobs"][f"{m.group(1)} {m.group(2)}"] = m.group(3).strip()
                self.last = now

    def finish(self, deadline: float) -> dict[str, Any]:
        """Its figures once it ends, or is stopped at ``deadline`` (monotonic)."""
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()  # (Hydra's basic launcher runs the jobs in this one process)
            self.proc.wait()
        self.reader.join(timeout=5)
        row = self.row
        row["exit_code"] = self.proc.returncode
        row["wall_s"] = time.monotonic() - self.start
        row["done"] = len(row["jobs"])
        if self.first is not None and self.last is not None and row["done"]:
            row["s_per_job"] = (self.last - self.first) / row["done"]
        if self.proc.returncode:
            row["output_tail"] = _tail("".join(self.lines))
        shutil.rmtree(self.tmp, ignore_errors=True)
        return row


def step_sweep(s: Step) -> None:
    """The sweep on this device (one job a run, then stacked), then the CPU's (the baseline)."""
    dev = _device()
    z = s.sizes
    cpu_share = 0.25 if z.sweep_cpu and dev.type == "cuda" else 0.0
    s.result["rounds"] = z.sweep_rounds
    sweep = _Sweep(z, dev.type, z.sweep_algorithms, s.work)
    row = sweep.finish(time.monotonic() + s.left() * 0.35)
    s.result["device"] = row
    s.save()
    s.say(f"{dev.type}: {row['done']} jobs in {row['wall_s']:.1f} s, {row.get('s_per_job')} s/job")
    if z.sweep_seeds > 1:
        sweep = _Sweep(z, dev.type, z.sweep_algorithms, s.work, seeds=z.sweep_seeds)
        row = sweep.finish(time.monotonic() + s.left() * (1 - cpu_share))
        s.result["stacked"] = row
        s.save()
        s.say(
            f"{dev.type} stacked: {row['done']} jobs in {row['wall_s']:.1f} s, "
            f"{row.get('s_per_job')} s/job"
        )
    if cpu_share:
        sweep = _Sweep(z, "cpu", z.sweep_algorithms[: z.sweep_cpu], s.work)
        row = sweep.finish(s.deadline)
        s.result["cpu"] = row
        s.say(f"cpu: {row['done']} jobs in {row['wall_s']:.1f} s, {row.get('s_per_job')} s/job")
    rows = (s.result["device"], s.result.get("stacked"), s.result.get("cpu"))
    failed = [r for r in rows if r and r["exit_code"] > 0]
    if failed:  # (a sweep stopped at its time, -9, keeps the jobs it finished)
        raise RuntimeError(f"the sweep exited {failed[0]['exit_code']}: {failed[0]['output_tail']}")
