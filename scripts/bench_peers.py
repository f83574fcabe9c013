"""Client updates per second of fedexp against a plain PyTorch loop, pfl-research and Flower.

Two workloads, identical in every framework (``scripts/peers/common.py``): FedAvg with every
client every round on (a) logistic regression, d = 30 synthetic features, 100 samples per
client, 5 local SGD steps of batch 32, lr 0.1, N = 10, 100, 1000, 10000 clients; (b) a small
CNN (two conv layers, 1x32x32 inputs, 64,642 parameters), 10 clients x 64 images, 2 local steps
of batch 16, lr 0.1. Each framework runs in its own subprocess (fedexp and the plain loop with
this venv's python, pfl-research and Flower with the peers' venv ``.venv-peers``, Flower inside
a loopback-only network namespace), one warm-up round then ``--rounds`` timed rounds, with the
same torch threads; it reports client updates/s (clients x timed rounds / their wall time) and
the final model's accuracy on the clients' data, and this script takes the peak resident memory
of each subprocess (``wait4``'s max RSS; for Flower also the peak summed over Ray's processes).
Repeats are interleaved (the framework order rotates per repeat); the table gives medians.
The hand-batched limit (``scripts/peers/limit_worker.py``: the tabular round as gathers and
``torch.bmm``, no per-client Python) runs beside them; a second table compares a tabular round
with every client evaluated after it, fedexp against that limit (issue 14: within 10x).

    python scripts/bench_peers.py --setup            # first use: create .venv-peers (PyPI)
    python scripts/bench_peers.py --quick            # N = 10 only, 1 repeat
    python scripts/bench_peers.py                    # N = 10 ... 10000, 3 repeats
    python scripts/bench_peers.py --frameworks fedexp pfl --sizes 100 1000

Exit status 1 when a run failed or the final accuracies of a row disagree by more than
``--acc-tol``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "scripts" / "peers"

#: What ``--setup`` installs into the peers' venv, from PyPI (torch first, alone, as the
#: Makefile does: the CPU build on this kind of machine). flwr 1.42.0 needs a certifi newer
#: than PyPI served when this was pinned; 1.41.0 is the newest that installs. flwr pins ray.
PINS = ("torch==2.13.0", "flwr[simulation]==1.41.0", "pfl[pytorch]==0.6.0")

#: name -> (column title, worker script, runs in the peers' venv)
FRAMEWORKS: dict[str, tuple[str, str, bool]] = {
    "fedexp": ("fedexp", "fedexp_worker.py", False),
    "plain": ("plain PyTorch", "plain_worker.py", False),
    "pfl": ("pfl-research", "pfl_worker.py", True),
    "flower": ("Flower", "flower_worker.py", True),
    "limit": ("hand-batched limit", "limit_worker.py", False),
}
WORKLOAD_TITLES = {
    "tabular": "logistic regression, d = 30, 100 samples/client, 5 steps of 32",
    "cnn": "small CNN (64,642 parameters), 64 images/client, 2 steps of 16",
}
RESULT_PREFIX = "BENCH_PEERS_RESULT "
MIB = 1024.0


@dataclass
class Run:
    """One subprocess: the worker's result line and what this script measured of it."""

    ok: bool
    wall_s: float
    maxrss_mib: float
    tree_peak_mib: float
    result: dict = field(default_factory=dict)
    error: str = ""


@dataclass
class Cell:
    """One framework at one (workload, N): its runs, or why it was not run."""

    runs: list[Run] = field(default_factory=list)
    skipped: str = ""

    def good(self) -> list[Run]:
        """The runs that finished with a result."""
        return [r for r in self.runs if r.ok]

    def median(self, key: str) -> float | None:
        """Median over the good runs of a result key or a measured attribute."""
        values = [
            float(r.result[key]) if key in r.result else float(getattr(r, key)) for r in self.good()
        ]
        return statistics.median(values) if values else None


# --------------------------------------------------------------------------- setup
def venv_python(venv: Path) -> Path:
    """The python of a venv."""
    return venv / "bin" / "python"


def setup_peers(venv: Path) -> None:
    """Create ``venv`` with :data:`PINS` unless its stamp says it has them already."""
    stamp = venv / ".bench-peers-installed"
    wanted = "\n".join(PINS) + "\n"
    if stamp.exists() and stamp.read_text() == wanted and venv_python(venv).exists():
        print(f"# {venv.name}: up to date ({', '.join(PINS)})", file=sys.stderr)
        return
    py = str(venv_python(venv))
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [py, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        [py, "-m", "pip", "install", "--quiet", PINS[0]],
        [py, "-m", "pip", "install", "--quiet", *PINS],
    ]
    for cmd in steps:
        print(f"# {shlex.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True)
    check = "import torch, flwr, pfl, ray; print(torch.__version__)"
    version = subprocess.run([py, "-c", check], check=True, capture_output=True, text=True)
    if not version.stdout.startswith(PINS[0].split("==")[1]):
        raise SystemExit(f"{venv}: torch {version.stdout.strip()} instead of {PINS[0]}")
    stamp.write_text(wanted)


# --------------------------------------------------------------------------- running
def worker_command(
    framework: str, workload: str, clients: int, args: argparse.Namespace
) -> list[str]:
    """The command line of one worker subprocess."""
    _, script, peer = FRAMEWORKS[framework]
    python = str(venv_python(args.peers_venv)) if peer else sys.executable
    cmd = [
        python,
        str(PEERS / script),
        f"--workload={workload}",
        f"--clients={clients}",
        f"--rounds={args.cnn_rounds if workload == 'cnn' else args.rounds}",
        f"--threads={args.threads}",
        f"--seed={args.seed}",
    ]
    if framework == "flower":
        cmd.append(f"--actors={args.flower_actors}")
        if args.netns:
            # a fresh network namespace with only the loopback interface (Ray binds to all)
            cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', *cmd]
    return cmd


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the workers: thread counts, the peers' folder on the path."""
    env = dict(os.environ)
    threads = str(args.threads)
    env.update(
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        PYTHONPATH=os.pathsep.join(p for p in (str(PEERS), env.get("PYTHONPATH", "")) if p),
        RAY_USAGE_STATS_ENABLED="0",
        RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0",
        FLWR_TELEMETRY_ENABLED="0",
        BENCH_PEERS_NETNS="loopback-only" if args.netns else "host",
    )
    return env


class TreeSampler(threading.Thread):
    """Samples the summed RSS of a process and its descendants (psutil) until it ends."""

    def __init__(self, pid: int, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak = 0
        self.seen: dict[int, object] = {}
        self.done = threading.Event()

    def run(self) -> None:
        """Poll until :attr:`done` is set or the root process is gone."""
        try:
            import psutil
        except ImportError:
            return
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.done.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                self.seen.setdefault(p.pid, p)
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self.done.wait(self.interval)

    def end_leftovers(self) -> None:
        """Kill the descendants it saw that outlived the worker (e.g. a stray Ray process)."""
        for pid, proc in self.seen.items():
            if pid == self.pid:
                continue
            try:
                if proc.is_running():  # psutil checks the creation time: no reused pid
                    proc.kill()
            except Exception:  # noqa: BLE001 (gone meanwhile)
                pass


def run_worker(cmd: list[str], env: dict[str, str], timeout: float) -> Run:
    """Run one worker; its result line, wall time and peak memory."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=ROOT, start_new_session=True
        )
        lines: list[bytes] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        sampler = TreeSampler(proc.pid)
        sampler.start()
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's own process group
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.done.set()
        sampler.join()
        sampler.end_leftovers()
        reader.join(timeout=10)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    maxrss = usage.ru_maxrss / MIB  # KiB on Linux
    tree = max(sampler.peak / MIB**2, maxrss)
    results = [ln.decode()[len(RESULT_PREFIX) :] for ln in lines if ln.startswith(b"BENCH_")]
    if proc.returncode == 0 and results:
        return Run(True, wall, maxrss, tree, json.loads(results[-1]))
    why = f"killed after {timeout:.0f} s" if killed.is_set() else f"exit {proc.returncode}"
    tail = "\n".join(stderr.strip().splitlines()[-15:])
    return Run(False, wall, maxrss, tree, error=f"{why}\n{tail}")


def estimate_s(cell: Cell, prev_clients: int, clients: int, rounds: int) -> float | None:
    """Seconds a run at ``clients`` should take, from the runs at ``prev_clients``.

    The per-update cost of the timed rounds times the updates to come, plus what the smaller
    runs spent besides their updates (start-up, imports, Ray); None without a good run.
    """
    rate, wall = cell.median("updates_per_s"), cell.median("wall_s")
    if rate is None or wall is None:
        return None
    fixed = max(0.0, wall - (rounds + 1) * prev_clients / rate)
    return fixed + (rounds + 1) * clients / rate


def rotate(items: list[str], k: int) -> list[str]:
    """``items`` rotated left by ``k``."""
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


def benchmark(args: argparse.Namespace) -> dict[tuple[str, int, str], Cell]:
    """Every (workload, N, framework) cell, sizes in increasing order, repeats interleaved."""
    cells: dict[tuple[str, int, str], Cell] = {}
    env = worker_env(args)
    for workload in args.workloads:
        sizes = sorted(args.sizes) if workload == "tabular" else [args.cnn_clients]
        for i, n in enumerate(sizes):
            active = []
            for fw in args.frameworks:
                cell = cells.setdefault((workload, n, fw), Cell())
                if i > 0:
                    prev = cells[workload, sizes[i - 1], fw]
                    if prev.skipped:
                        over = f"over budget at N = {sizes[i - 1]:,}"
                        cell.skipped = prev.skipped if "failed" in prev.skipped else over
                    elif not prev.good():
                        cell.skipped = f"failed at N = {sizes[i - 1]}"
                    else:
                        est = estimate_s(prev, sizes[i - 1], n, args.rounds)
                        if est is not None and est > args.budget:
                            cell.skipped = f"est. {est:,.0f} s > budget {args.budget:,.0f} s"
                if fw == "limit" and workload != "tabular":
                    cell.skipped = "tabular only"
                if cell.skipped:
                    print(f"# {workload} N={n} {fw}: skipped ({cell.skipped})", file=sys.stderr)
                else:
                    active.append(fw)
            for r in range(args.repeats):
                for fw in rotate(active, r):
                    cmd = worker_command(fw, workload, n, args)
                    run = run_worker(cmd, env, timeout=3 * args.budget + 300)
                    cells[workload, n, fw].runs.append(run)
                    where = f"# {workload} N={n} repeat {r + 1}/{args.repeats} {fw}:"
                    if run.ok:
                        res = run.result
                        print(
                            f"{where} {res['updates_per_s']:,.1f} updates/s, accuracy "
                            f"{res['accuracy']:.3f}, {run.wall_s:.1f} s, "
                            f"{run.maxrss_mib:,.0f} MiB (tree {run.tree_peak_mib:,.0f} MiB)",
                            file=sys.stderr,
                            flush=True,
                        )
                    else:
                        print(f"{where} FAILED ({run.error})", file=sys.stderr, flush=True)
    return cells


# --------------------------------------------------------------------------- report
def fmt_rate(x: float) -> str:
    """Updates/s to 3-4 significant figures with thousands separators."""
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def cell_text(cell: Cell, framework: str) -> str:
    """A table cell: median updates/s and peak memory, or why there is none."""
    if cell.skipped:
        return f"skipped ({cell.skipped})"
    rate = cell.median("updates_per_s")
    if rate is None:
        return "failed"
    text = f"{fmt_rate(rate)} · {cell.median('maxrss_mib'):,.0f} MiB"
    tree = cell.median("tree_peak_mib")
    if framework == "flower" and tree is not None:
        text += f" (Σ {tree:,.0f} MiB)"
    failed = len(cell.runs) - len(cell.good())
    return text + (f" ({failed} failed)" if failed else "")


def installed_versions(python: Path) -> dict[str, str]:
    """Versions of the packages the table names, as installed for ``python`` (none: {})."""
    code = (
        "import json, importlib.metadata as m\n"
        "out = {}\n"
        "for name in ('torch', 'fedexp', 'pfl', 'flwr', 'ray'):\n"
        "    try:\n"
        "        out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "print(json.dumps(out))"
    )
    if not python.exists():
        return {}
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else {}


def table(
    cells: dict[tuple[str, int, str], Cell], args: argparse.Namespace, peers: dict[str, str]
) -> tuple[str, bool]:
    """The Markdown table and whether every row's accuracies agree."""
    titles = []
    for fw in args.frameworks:
        title = FRAMEWORKS[fw][0]
        if fw == "pfl":
            title += f" {peers.get('pfl', '?')}"
        elif fw == "flower":
            title += f" {peers.get('flwr', '?')}"
        titles.append(title)
    ratio_to = [fw for fw in ("pfl", "flower", "plain", "limit") if fw in args.frameworks]
    ratio_titles = [
        f"fedexp / {'limit' if fw == 'limit' else FRAMEWORKS[fw][0].split()[0]}" for fw in ratio_to
    ]
    head = ["workload", "N", *titles, *ratio_titles, "accuracy (min–max)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 3) + "---|"]
    agree = True
    rows = sorted({(w, n) for w, n, _ in cells}, key=lambda k: (args.workloads.index(k[0]), k[1]))
    for workload, n in rows:
        row = [cells[workload, n, fw] for fw in args.frameworks]
        texts = [cell_text(c, fw) for c, fw in zip(row, args.frameworks, strict=True)]
        rates = {fw: c.median("updates_per_s") for c, fw in zip(row, args.frameworks, strict=True)}
        ours = rates.get("fedexp")
        ratios = [f"{ours / rates[fw]:.2f}x" if ours and rates[fw] else "n/a" for fw in ratio_to]
        accs = [a for a in (c.median("accuracy") for c in row) if a is not None]
        if accs:
            spread = max(accs) - min(accs)
            ok = spread <= args.acc_tol
            agree &= ok
            verdict = "ok" if ok else f"**differ by {spread:.3f}**"
            acc_text = f"{min(accs):.3f}–{max(accs):.3f} {verdict}"
        else:
            acc_text = "n/a"
        name = "logistic regression" if workload == "tabular" else "small CNN"
        lines.append("| " + " | ".join([name, f"{n:,}", *texts, *ratios, acc_text]) + " |")
    return "\n".join(lines), agree


def limit_table(cells: dict[tuple[str, int, str], Cell], args: argparse.Namespace) -> str:
    """Seconds of a tabular round with every client evaluated: fedexp against the limit.

    Issue 14's goal: a round of 1,000 tabular clients, evaluation included, within 10x of the
    hand-batched limit (``scripts/peers/limit_worker.py``) measured in the same run.
    """
    if not {"limit", "fedexp"} <= set(args.frameworks) or "tabular" not in args.workloads:
        return ""
    lines = ["| N | fedexp (s) | limit (s) | fedexp / limit |", "|---:|---:|---:|---:|"]
    for n in sorted(args.sizes):
        lim = cells["tabular", n, "limit"].median("round_eval_s")
        mine = cells["tabular", n, "fedexp"].median("round_eval_s")
        ratio = f"{mine / lim:.1f}x" if mine and lim else "n/a"
        texts = [f"{v:.4f}" if v else "n/a" for v in (mine, lim)]
        lines.append("| " + " | ".join([f"{n:,}", *texts, ratio]) + " |")
    return (
        "\nA tabular round with every client evaluated after it (median of 3 such rounds a "
        "run, then of the repeats): fedexp's `Engine.run_round()` + `Engine.evaluate()` "
        "(accuracy, balanced accuracy, AUC and loss per client, their aggregates) against "
        "the limit's batched round + per-client accuracy and loss:\n\n" + "\n".join(lines)
    )


def notes(
    cells: dict[tuple[str, int, str], Cell],
    args: argparse.Namespace,
    load: str,
    versions: dict[str, str],
    peers: dict[str, str],
) -> str:
    """What the table's figures are, and the environment they were taken in."""
    network = "inside a loopback-only network namespace" if args.netns else "on the host network"
    peer_text = (
        f"peers' venv: torch {peers.get('torch', '?')}, pfl {peers.get('pfl', '?')}, "
        f"flwr {peers.get('flwr', '?')}, ray {peers.get('ray', '?')}"
        if peers
        else "no peers' venv"
    )
    out = [
        "",
        f"- Workloads: {WORKLOAD_TITLES['tabular']}, lr 0.1; "
        f"{WORKLOAD_TITLES['cnn']}, lr 0.1. FedAvg, every client every round, "
        f"1 warm-up round then {args.rounds} timed rounds (CNN: {args.cnn_rounds}); "
        f"median of {args.repeats} interleaved repeat(s).",
        "- Cells: client updates/s (clients × timed rounds / their wall time) · peak RSS of "
        "the subprocess (wait4 max RSS: its largest process); Flower's Σ: the peak of the "
        "RSS summed over its processes (driver and Ray's), sampled every 0.2 s.",
        "- fedexp / X: fedexp's updates/s over X's (the round's clients as one cohort, "
        "fedexp.engine.solver.steps). Accuracy: the "
        "final global model on all the clients' data; the row agrees when the frameworks' "
        f"medians are within {args.acc_tol}.",
        f"- {args.threads} torch thread(s) in every process; Flower: {args.flower_actors} Ray "
        f"actor(s) of 1 CPU, {network}.",
        f"- Versions: torch {versions.get('torch', '?')}, fedexp {versions.get('fedexp', '?')}; "
        f"{peer_text}; Python {platform.python_version()}; {os.cpu_count()} CPU(s); "
        f"load average {load}.",
    ]
    skipped = [
        f"{FRAMEWORKS[fw][0]} at N = {n:,} ({w})"
        for (w, n, fw), c in cells.items()
        if "budget" in c.skipped
    ]
    if skipped:
        out.append(
            f"- Skipped (estimated from the next smaller N to take more than --budget "
            f"{args.budget:,.0f} s): {', '.join(skipped)}."
        )
    seen = sorted(
        {i for c in cells.values() for r in c.good() for i in r.result.get("interfaces", [])}
    )
    if seen:
        out.append(f"- Network interfaces Flower's worker saw: {', '.join(seen)}.")
    failed = [
        f"{FRAMEWORKS[fw][0]} at N = {n:,} ({w}): {r.error.splitlines()[0]}"
        for (w, n, fw), c in cells.items()
        for r in c.runs
        if not r.ok
    ]
    if failed:
        out.append("- Failed runs: " + "; ".join(failed) + " (stderr tails above).")
    return "\n".join(out)


# --------------------------------------------------------------------------- main
def command_line() -> str:
    """The command as typed, with the interpreter relative to the working directory."""
    exe = Path(sys.executable)
    try:
        exe_text = str(exe.relative_to(Path.cwd()))
    except ValueError:
        exe_text = str(exe)
    return shlex.join([exe_text, *sys.argv])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="store_true", help="create/update the peers' venv")
    parser.add_argument("--quick", action="store_true", help="N = 10 only, 1 repeat")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--cnn-clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after 1 warm-up")
    parser.add_argument(
        "--cnn-rounds",
        type=int,
        default=20,
        help="timed rounds of the CNN workload (a round of 10 clients is ~0.2 s)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads everywhere")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budget", type=float, default=600.0, help="skip a run estimated to take longer (s)"
    )
    parser.add_argument("--acc-tol", type=float, default=0.03)
    parser.add_argument(
        "--frameworks", nargs="+", choices=list(FRAMEWORKS), default=list(FRAMEWORKS)
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=["tabular", "cnn"], default=["tabular", "cnn"]
    )
    parser.add_argument("--flower-actors", type=int, default=1, help="Ray actors (1 CPU each)")
    parser.add_argument(
        "--no-netns",
        dest="netns",
        action="store_false",
        help="run Flower on the host network (when unshare -n is not allowed)",
    )
    parser.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    parser.add_argument("--json", type=Path, default=ROOT / "outputs" / "bench_peers.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeats, args.cnn_clients = [10], 1, 10
    if min(args.sizes) < 1 or min(args.repeats, args.rounds, args.cnn_rounds, args.threads) < 1:
        parser.error("sizes, --repeats, --rounds, --cnn-rounds and --threads must be at least 1")
    return args


def main() -> None:
    """Set up, run every cell, print the table."""
    args = parse_args()
    print(command_line(), flush=True)
    needs_peers = any(FRAMEWORKS[fw][2] for fw in args.frameworks)
    if args.setup and needs_peers:
        setup_peers(args.peers_venv)
    elif needs_peers and not venv_python(args.peers_venv).exists():
        raise SystemExit(
            f"{args.peers_venv} is missing: run with --setup once (installs {', '.join(PINS)} "
            "from PyPI), or leave out pfl and flower with --frameworks"
        )
    versions = installed_versions(Path(sys.executable))
    peers = installed_versions(venv_python(args.peers_venv)) if needs_peers else {}
    load_start = os.getloadavg()[0]
    cells = benchmark(args)
    load = f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    text, agree = table(cells, args, peers)
    print()
    print(text)
    print(limit_table(cells, args))
    print(notes(cells, args, load, versions, peers))
    failed = any(not r.ok for c in cells.values() for r in c.runs)
    verdict = "ok" if agree else "FAILED"
    print(f"\naccuracy check: {verdict}; failed runs: {'yes' if failed else 'none'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    raw = {
        "command": command_line(),
        "cells": [
            {
                "workload": w,
                "clients": n,
                "framework": fw,
                "skipped": c.skipped,
                "runs": [r.__dict__ for r in c.runs],
            }
            for (w, n, fw), c in cells.items()
        ],
    }
    args.json.write_text(json.dumps(raw, indent=1))
    shown = args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json
    print(f"(raw results: {shown})")
    sys.exit(0 if agree and not failed else 1)


if __name__ == "__main__":
    main()
