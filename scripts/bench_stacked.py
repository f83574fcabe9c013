"""Stacked runs against the parallel launcher (issue 41): wall time of whole sweeps.

Each sweep is the real CLI (``fedexp run -m``, ``tracker=none``) in a fresh folder; the figure
is its wall time, start-up included, and the ratio is against ``hydra/launcher=parallel``
(joblib, two workers) on the same machine in the same invocation. ``stacked`` is the
launcher's default (``n_jobs=-1``: a process a core, at most one a group), ``stacked-1`` every
group in one process (``hydra.launcher.n_jobs=1``).

    python scripts/bench_stacked.py seeds              # 4 seeds x 10 rounds (default data)
    python scripts/bench_stacked.py tables             # +experiment=pfednet_tables (300 runs)
    python scripts/bench_stacked.py tables --algorithms fedavg,ditto --repeat 1
    python scripts/bench_stacked.py tables --repeat 1 --extra figures=false

Cases:
  seeds:  ``seed=0,1,2,3 rounds=10``: one group of four runs.
  tables: ``+experiment=pfednet_tables`` (15 algorithms x delta 1..4 x 5 seeds, 100 rounds
          each): one group per algorithm, 20 runs each.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "seeds": ["seed=0,1,2,3", "rounds=10"],
    "tables": ["+experiment=pfednet_tables"],
}
LAUNCHERS = {
    "parallel": ["hydra/launcher=parallel"],
    "stacked-1": ["hydra/launcher=stacked", "hydra.launcher.n_jobs=1"],
    "stacked": ["hydra/launcher=stacked"],
}


def sweep(args: list[str]) -> float:
    """Seconds one sweep takes (it must succeed)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "fedexp", "run", "-m", *args, "tracker=none"]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        took = time.perf_counter() - start
        if proc.returncode != 0 or "0 failed" not in proc.stdout:
            sys.exit(f"{' '.join(args)}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--algorithms", help="tables: these algorithms only (comma-separated)")
    p.add_argument("--repeat", type=int, default=3, help="sweeps per launcher (the median)")
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated")
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every sweep")
    a = p.parse_args()
    args = list(CASES[a.case]) + list(a.extra)
    if a.algorithms:
        args.append(f"algorithm={a.algorithms}")
    chosen = a.launchers.split(",")
    times: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(a.repeat):  # interleaved: a slow minute of the machine hits every launcher
        for name in chosen:
            times[name].append(sweep(args + LAUNCHERS[name]))
            print(f"  {name}: {times[name][-1]:.1f} s", file=sys.stderr, flush=True)
    base = statistics.median(times["parallel"]) if "parallel" in times else None
    print(f"\n`fedexp run -m {' '.join(args)} tracker=none`, median of {a.repeat}:\n")
    print("| launcher | wall s | vs parallel |")
    print("|---|---:|---:|")
    for name in chosen:
        t = statistics.median(times[name])
        ratio = f"{base / t:.2f}x" if base else "-"
        print(f"| {name} | {t:.1f} | {ratio} |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
