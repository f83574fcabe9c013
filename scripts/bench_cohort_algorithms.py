"""Rounds per second of each algorithm: this working tree against a baseline git revision.

Issue 22 ("One path for every client") replaced the engine's backends (``sequential``, and
``lockstep``: a greenlet barrier batching per-client hooks, plus an opt-in cohort path) by one
path: every algorithm's ``client_update`` over the round's clients as one cohort
(``fedexp.engine.solver.steps``). This script measures, in one run, the rounds/s of every algorithm
on both sides: the baseline revision (default ``c973b3d``, main before the refactor) with
``backend=lockstep`` (its fastest backend: the cohort path where an algorithm had one, the
greenlet barrier otherwise), checked out as a temporary ``git worktree``, and this working
tree as it is (uncommitted changes included).

Each side runs in its own worker subprocess (this script's ``--worker`` mode, with
``PYTHONPATH`` putting that tree first, so ``import fedexp`` is that tree's code; the worker
reports ``fedexp.__file__`` and the script checks it). Both workers build the same run with
the same code (``compose_config`` of the tree's ``tests/helpers.py`` and
``fedexp.engine.runner.build_engine``, ``Engine.setup``, ``Engine.run_round``: the API both
revisions share), run one warm-up round (then ``gc.collect()``: the build's garbage would
otherwise cost the first timed round a full collection, ~0.4 s), then time ``--rounds``
rounds per request; requests are interleaved (baseline, current, baseline, current, ...),
one at a time, ``--repeats`` times. The table gives the medians, the ratio current /
baseline and whether the last round's training metrics of both sides agree (they ran the
same rounds from the same seed).

Workload: synthetic tabular data (20 features, 50 samples per client), logistic regression
(FedPer, FedRep, FedRoD, pFedNet and TDPFed an MLP with 16 hidden units, whose head is
personal; FedBN that MLP with BatchNorm), every client every round, E local SGD steps of
batch B, dense messages, one torch thread per worker.

    python scripts/bench_cohort_algorithms.py                       # 1,000 clients
    python scripts/bench_cohort_algorithms.py --clients 100 --algorithms ditto fedrep
    python scripts/bench_cohort_algorithms.py --baseline main~3 --algorithms fedavg
    python scripts/bench_cohort_algorithms.py --baseline 0db6c30 --baseline-override  # after it
    echo 3 | python scripts/bench_cohort_algorithms.py --worker --algorithm fedavg  # one side

An algorithm that fails on one side (build, import or a round) is an error row. The
baseline's lockstep backend needs the ``greenlet`` package, no longer a dependency of fedexp:
``.venv/bin/pip install greenlet`` first.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]

ALGORITHMS = [
    "fedavg",
    "fedprox",
    "local",
    "ditto",
    "fedavg_ft",
    "fedprox_ft",
    "fedamp",
    "fpfc",
    "l2gd",
    "fedper",
    "fedrep",
    "apfl",
    "fedrod",
    "pfedsop",
    "pfedme",
    "feddwa",
    "ifca",
    "superfed",
    "tdpfed",
    "fedala",
    "pfednet",
    "fedbn",
]
#: a model with a body and a head (logistic regression is all head: nothing would be shared)
HEADED = ["model=mlp", "model.hidden=16"]
#: per-algorithm settings that keep the default run well-posed at many clients
EXTRA = {
    "fpfc": ["algorithm.rho=0.001", "algorithm.penalty=mcp", "algorithm.a=1001"],
    "fedamp": ["algorithm.heuristic=true"],
    "fedbn": [*HEADED, "model.norm=batch"],
    "fedper": HEADED,
    "fedrep": [*HEADED, "algorithm.head_steps=2"],
    "fedrod": HEADED,
    "l2gd": ["algorithm.p=0.3"],
    "pfednet": HEADED,
    "superfed": ["algorithm.warmup_rounds=0"],
    "tdpfed": HEADED,
}
#: what only the baseline is given: its fastest backend ("today's lockstep figures")
BASELINE_OVERRIDES = ["backend=lockstep"]
#: relative tolerance of the last round's training metrics across the two sides
METRIC_RTOL = 1e-4


# --------------------------------------------------------------------------- worker
def overrides(args: argparse.Namespace) -> list[str]:
    """The run's config overrides (the same on both sides, bar ``--override``)."""
    return [
        "dataset=synthetic",
        f"dataset.num_samples={50 * args.clients}",
        "partition=iid",
        f"num_clients={args.clients}",
        f"local_steps={args.steps}",
        f"batch_size={args.batch}",
        "device=cpu",
        "tracker=none",
        f"algorithm={args.algorithm}",
        *EXTRA.get(args.algorithm, []),
        *args.override,
    ]


def worker(args: argparse.Namespace) -> int:
    """Build the run in ``--tree``, warm up, then time ``n`` rounds per stdin line ``n``.

    Writes one JSON line per step to stdout: ``{"ready": ...}`` once built and warmed up,
    then ``{"rounds_per_s": ..., "metrics": ...}`` per request; ``{"error": ...}`` and exit
    status 1 on any failure. Everything else the run prints goes to stderr.
    """
    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol's lines alone on stdout

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    tree = Path(args.tree).resolve()
    try:
        sys.path.insert(0, str(tree / "tests"))
        sys.path.insert(1, str(tree))
        import torch

        torch.set_num_threads(args.threads)
        from fedexp.engine.solver import passes

        passes.use_compiled_passes()  # the steady state: the CPU's pass kernel from the start
        import fedexp
        from fedexp.engine.runner import build_engine
        from helpers import compose_config

        where = Path(fedexp.__file__).resolve()
        if not where.is_relative_to(tree):
            raise RuntimeError(f"import fedexp found {where}, outside {tree}")
        engine = build_engine(compose_config(*overrides(args)))
        engine.setup()
        engine.run_round()  # warm-up
        gc.collect()  # the build's garbage: else a full collection lands in the first request
        emit({"ready": True, "fedexp": str(where), "threads": torch.get_num_threads()})
        for line in sys.stdin:
            if not line.strip():
                continue
            rounds = int(line)
            start = time.perf_counter()
            for _ in range(rounds):
                metrics = engine.run_round()
            elapsed = time.perf_counter() - start
            train = {k: float(v) for k, v in metrics.items() if k.startswith("train/")}
            emit({"rounds_per_s": rounds / elapsed, "round": engine.round, "metrics": train})
    except Exception as exc:  # noqa: BLE001 - reported to the parent as an error row
        traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        emit({"error": f"{type(exc).__name__}: {first}"})
        return 1
    return 0


# --------------------------------------------------------------------------- parent
class Side:
    """One tree's worker subprocess for one algorithm."""

    def __init__(self, name: str, tree: Path, extra: list[str], args: argparse.Namespace) -> None:
        self.name, self.tree = name, tree
        self.err: IO[bytes] = tempfile.TemporaryFile()
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            f"--tree={tree}",
            f"--algorithm={args.algorithm}",
            f"--clients={args.clients}",
            f"--steps={args.steps}",
            f"--batch={args.batch}",
            f"--threads={args.threads}",
            *(f"--override={o}" for o in extra),
        ]
        env = dict(os.environ)
        threads = str(args.threads)
        env.update(
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            PYTHONPATH=os.pathsep.join(
                p for p in (str(tree), str(tree / "tests"), env.get("PYTHONPATH", "")) if p
            ),
        )
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=env,
            cwd=tree,
            text=True,
        )
        self.error = ""
        self.fedexp = ""
        self.rates: list[float] = []
        self.metrics: dict[str, float] = {}

    def _read(self) -> dict[str, Any] | None:
        """The worker's next JSON line (None, and ``error`` set, if it has none)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.error = f"worker exited {self.proc.returncode}: {self.stderr_tail(1)}"
            return None
        msg = json.loads(line)
        if "error" in msg:
            self.error = msg["error"]
            return None
        return msg

    def ready(self) -> bool:
        """Wait until the worker has built the run and warmed up."""
        msg = self._read()
        if msg is None:
            return False
        self.fedexp = msg["fedexp"]
        return True

    def measure(self, rounds: int) -> bool:
        """One timed request of ``rounds`` rounds."""
        if self.error:
            return False
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{rounds}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.error = f"worker gone: {self.stderr_tail(1)}"
            return False
        msg = self._read()
        if msg is None:
            return False
        self.rates.append(msg["rounds_per_s"])
        self.metrics = msg["metrics"]
        return True

    def stderr_tail(self, lines: int) -> str:
        """The last ``lines`` lines of the worker's stderr."""
        self.err.seek(0)
        text = self.err.read().decode(errors="replace").strip().splitlines()
        return " / ".join(text[-lines:]) if text else "(no stderr)"

    def close(self) -> None:
        """End the worker (EOF on its stdin) and drop its stderr."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def git(*args: str, cwd: Path = ROOT) -> str:
    """A git command's stdout (stripped); exits with git's message on failure."""
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def agreement(base: dict[str, float], cur: dict[str, float]) -> str:
    """Whether two sides' last-round training metrics agree (same rounds, same seed)."""
    common = sorted(set(base) & set(cur))
    if not common:
        return "n/a"
    worst = 0.0
    for k in common:
        a, b = base[k], cur[k]
        if not (math.isfinite(a) and math.isfinite(b)):
            worst = max(worst, 0.0 if a == b else math.inf)
        else:
            worst = max(worst, abs(a - b) / max(abs(a), abs(b), 1e-12))
    text = "same" if worst <= METRIC_RTOL else f"**differ** (rel. {worst:.1e})"
    missing = sorted(set(base) ^ set(cur))
    return text + (f"; only one side: {', '.join(missing)}" if missing else "")


def compare(name: str, trees: dict[str, Path], args: argparse.Namespace) -> str:
    """One algorithm's table row: both workers, their interleaved requests, the medians."""
    sub = argparse.Namespace(**{**vars(args), "algorithm": name})
    sides = [
        Side("baseline", trees["baseline"], args.baseline_override, sub),
        Side("current", trees["current"], [], sub),
    ]
    try:
        for side in sides:  # both build at once; nothing is timed until both are ready
            if side.ready():
                print(f"# {name} {side.name}: fedexp from {side.fedexp}", file=sys.stderr)
        for _ in range(args.repeats):  # interleaved, one request at a time
            for side in sides:
                side.measure(args.rounds)
    finally:
        for side in sides:
            side.close()
    base, cur = sides
    cells = [f"{statistics.median(s.rates):.2f}" if s.rates else "error" for s in sides]
    if base.rates and cur.rates:
        ratio = f"{statistics.median(cur.rates) / statistics.median(base.rates):.2f}x"
        same = agreement(base.metrics, cur.metrics)
    else:
        ratio, same = "n/a", "n/a"
    errors = "; ".join(f"{s.name}: {s.error}" for s in sides if s.error)
    return f"| {name} | {cells[0]} | {cells[1]} | {ratio} | {same} | {errors} |"


def main() -> int:
    """Parse the options; run the worker, or the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="c973b3d", help="git revision to compare with")
    parser.add_argument(
        "--baseline-override",
        nargs="*",
        default=BASELINE_OVERRIDES,
        help="overrides of the baseline side only (default: its lockstep backend; give none "
        "for a baseline after the one path)",
    )
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per request")
    parser.add_argument("--repeats", type=int, default=3, help="requests per side")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    worker_opts = parser.add_argument_group("worker mode (one side; what the comparison runs)")
    worker_opts.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker_opts.add_argument("--tree", default=str(ROOT), help="the source tree to import")
    worker_opts.add_argument("--algorithm", default="fedavg")
    worker_opts.add_argument(
        "--override", action="append", default=[], help="an extra config override"
    )
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if min(args.clients, args.rounds, args.repeats, args.threads) < 1:
        parser.error("--clients, --rounds, --repeats and --threads must be at least 1")

    rev = git("rev-parse", "--verify", f"{args.baseline}^{{commit}}")
    head = git("rev-parse", "--short", "HEAD")
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        tree = Path(tmp) / "baseline"
        git("worktree", "add", "--detach", str(tree), rev)
        try:
            print(
                f"baseline {rev[:7]} ({git('log', '-1', '--format=%s', rev)[:60]}) with "
                f"{' '.join(args.baseline_override)}; current: working tree at {head}{dirty}"
            )
            print(
                f"{args.clients} clients, E = {args.steps}, batch {args.batch}, "
                f"{args.threads} torch thread(s); rounds/s, median of {args.repeats} "
                f"interleaved request(s) of {args.rounds} round(s) after 1 warm-up round\n"
            )
            print("| algorithm | baseline | current | current / baseline | metrics | error |")
            print("|---|---:|---:|---:|---|---|", flush=True)
            trees = {"baseline": tree, "current": ROOT}
            for name in args.algorithms:
                print(compare(name, trees, args), flush=True)
        finally:
            git("worktree", "remove", "--force", str(tree))
    return 0


if __name__ == "__main__":
    sys.exit(main())
