"""Client updates per second of one run on P processes against the same run on one.

Issue "Beyond one process": ``distributed.nproc=P`` splits every round's clients over P ranks
(client n on rank n mod P); the ranks gather the decoded uploads and take the same server
step. This script runs the same configuration with ``distributed.nproc=1`` and ``=P`` in one
invocation (interleaved, ``--repeats`` times), reads each round's ``time/round_s`` (rank 0's
wall time of the round, the gather included) and reports the median over the rounds after
the first, the client updates per second (sampled clients / round time), the ratio to one
process with one torch thread, the peak resident memory of the processes and whether the
final accuracy agrees. One process is also run with a torch thread per core (the P ranks
get one thread each).

Workload: synthetic tabular data (20 features, ``--samples`` per client), logistic
regression, ``participation`` 0.1, 5 local SGD steps of batch 8, dense messages, no tracker.

    python scripts/bench_distributed.py                               # N = 100,000, P = 2
    python scripts/bench_distributed.py --clients 10000 --algorithms fedavg --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    from fedexp.engine.runner import run
    from fedexp.tracking.base import NullTracker
    from helpers import compose_config

    if args.nproc == 1:
        torch.set_num_threads(args.threads)
    cfg = compose_config(
        "dataset=synthetic",
        f"dataset.num_samples={args.clients * args.samples}",
        "dataset.num_sites=10",
        "model=logreg",
        "partition=iid",
        f"algorithm={args.algorithm}",
        f"num_clients={args.clients}",
        "participation=0.1",
        "local_steps=5",
        "batch_size=8",
        f"rounds={args.rounds}",
        "eval_every=1000",
        "checkpoint_every=0",
        "progress=none",
        "tracker=none",
        "device=cpu",
        f"distributed.nproc={args.nproc}",
        f"output_dir=/tmp/bench_distributed/{args.algorithm}-{args.nproc}",
    )
    tracker = NullTracker()
    result = run(cfg, tracker=tracker)
    times = [v for _, v in sorted(tracker.metrics["time/round_s"].items())][1:]
    sampled = [v for _, v in sorted(tracker.metrics["clients/sampled"].items())][1:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "round_s": statistics.median(times),
                "updates_per_s": statistics.median(
                    s / t for s, t in zip(sampled, times, strict=True)
                ),
                "acc": result.metrics["acc/mean"],
                "peak_mib": peak,
                "peak_child_mib": children,
            }
        )
    )


def _measure(algorithm: str, nproc: int, threads: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--algorithm",
        algorithm,
        "--nproc",
        str(nproc),
        "--clients",
        str(args.clients),
        "--samples",
        str(args.samples),
        "--rounds",
        str(args.rounds),
        "--threads",
        str(threads),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise SystemExit(f"{algorithm} P={nproc} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=20, help="training rows a client")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--algorithm", default="fedavg", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    print(
        f"N = {args.clients:,} clients, q = 0.1, {args.rounds} rounds (the first not timed), "
        f"{args.repeats} repeats, medians; P = {args.nproc} against 1\n"
    )
    cores = os.cpu_count() or 1
    sides = [(1, 1), (1, cores), (args.nproc, 1)]  # (P, torch threads of a process)
    head = "| algorithm | P × threads | round (s) | client updates/s | vs 1 × 1 | peak RSS (MiB) |"
    print(head + " acc |")
    print("|---|---|---|---|---|---|---|")
    for algorithm in args.algorithms:
        runs: dict[tuple[int, int], list[dict]] = {side: [] for side in sides}
        for _ in range(args.repeats):
            for p, threads in sides:
                runs[(p, threads)].append(_measure(algorithm, p, threads, args))
        base = statistics.median(r["updates_per_s"] for r in runs[(1, 1)])
        for (p, threads), rows in runs.items():
            rate = statistics.median(r["updates_per_s"] for r in rows)
            peak = max(r["peak_mib"] for r in rows)
            child = max(r["peak_child_mib"] for r in rows)
            mem = f"{peak:.0f}" + (f" + {child:.0f} a rank" if p > 1 else "")
            round_s = statistics.median(r["round_s"] for r in rows)
            print(
                f"| {algorithm} | {p} × {threads} | {round_s:.3f} | {rate:,.0f} "
                f"| {rate / base:.2f} | {mem} | {rows[-1]['acc']:.4f} |"
            )


if __name__ == "__main__":
    main()
