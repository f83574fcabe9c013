"""Client updates per second of one run on P processes against the same run on one.

Issue "Beyond one process": ``distributed.nproc=P`` splits every round's clients over P ranks
(client n on rank n mod P); the ranks gather the decoded uploads and take the same server
step. This script runs the same configuration with ``distributed.nproc=1`` and ``=P`` in one
invocation (interleaved, ``--repeats`` times), reads each round's ``time/round_s`` (rank 0's
wall time of the round, the gather included) and reports the median over the rounds after
the first, the client updates per second (sampled clients / round time), the ratio to one
process with one torch thread, the peak resident memory of the processes and whether the
final accuracy agrees. One process is also run with a torch thread per core (the P ranks
get one thread each). ``--sides ... 2xapart`` adds this machine's ceiling for two ranks: two
one-process runs of N/2 clients each, started together (their rates added).

Workload: synthetic tabular data (``--features``, ``--samples`` per client), logistic
regression, ``participation`` 0.1, 5 local SGD steps of batch 8, dense messages, no tracker.

The parent polls /proc for every process of a run (rank 0 and the ranks it starts) and
reports each one's peak resident memory: all of it (``VmRSS``, which counts the pages of
``store=disk``'s memory-mapped files that are in memory) and the anonymous part (``RssAnon``:
what is not the files; each process's, rank 0 first), and rank 0's anonymous memory at the
end of each round (after the build: what the rounds hold).

    python scripts/bench_distributed.py                               # N = 100,000, P = 2
    python scripts/bench_distributed.py --clients 10000 --algorithms fedavg --rounds 5
    python scripts/bench_distributed.py --sides 1x1 2x1 2xapart --repeats 3  # and the ceiling
    # 10^6 Ditto clients (d = 31), their data and states on disk, 3 rounds:
    python scripts/bench_distributed.py --clients 1000000 --samples 10 --features 30 \
        --algorithms ditto --rounds 3 --repeats 1 --store disk --sides 1x1 2x1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
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
    if args.pages == "small":  # every tensor from torch's allocator (4 KiB pages)
        from fedexp.engine.clients import hugepages

        hugepages.MIN_BYTES = 1 << 62
    cfg = compose_config(
        "dataset=synthetic",
        f"dataset.num_samples={args.clients * args.samples}",
        f"dataset.num_features={args.features}",
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
        f"store={args.store}",
        f"output_dir=/tmp/bench_distributed/{args.algorithm}-{args.nproc}-{args.tag}",
    )
    tracker = NullTracker()
    rounds_anon: list[int] = []  # rank 0's anonymous memory after each round (MiB)

    def keep(engine: object, metrics: dict) -> None:
        rounds_anon.append(_memory(os.getpid())["RssAnon"])

    result = run(cfg, tracker=tracker, callbacks=[keep])
    times = [v for _, v in sorted(tracker.metrics["time/round_s"].items())][1:]
    sampled = [v for _, v in sorted(tracker.metrics["clients/sampled"].items())][1:]
    print(
        json.dumps(
            {
                "round_s": statistics.median(times),
                "updates_per_s": statistics.median(
                    s / t for s, t in zip(sampled, times, strict=True)
                ),
                "acc": result.metrics["acc/mean"],
                "round_anon_mib": max(rounds_anon),
            }
        )
    )


def _memory(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``RssAnon`` of process ``pid`` in MiB (empty once it has gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            found[key] = int(value.split()[0]) // 1024
    return found


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the ranks it started)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return out


def _is_rank(pid: int, procs: list[subprocess.Popen]) -> bool:
    """Whether ``pid`` is a worker or a rank one started (spawn), not a helper process."""
    if any(proc.pid == pid for proc in procs):
        return True
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _measure(
    algorithm: str, nproc: int, threads: int, args: argparse.Namespace, apart: int = 0
) -> dict:
    """One run of ``nproc`` ranks; or, with ``apart`` = P, P one-process runs of N/P at once.

    The P runs apart are the ceiling of P ranks on this machine: each holds a rank's share of
    the clients and of the round's work, and none waits for another or repeats the others'
    work (sampling among all N, the server step). Their client updates per second add up.
    """
    copies = max(1, apart)
    procs = []
    for copy in range(copies):
        cmd = [sys.executable, __file__, "--worker", "--algorithm", algorithm]
        cmd += ["--nproc", str(nproc), "--threads", str(threads), "--tag", f"{apart}-{copy}"]
        for key in ("clients", "samples", "features", "rounds", "store", "pages"):
            value = getattr(args, key)
            value = value[0] if isinstance(value, list) else value
            cmd += [f"--{key}", str(value // copies if key == "clients" else value)]
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    peaks: dict[int, dict[str, int]] = {}  # pid -> peak of each figure
    while any(proc.poll() is None for proc in procs):  # (the pipes hold what workers print)
        for pid in (p for proc in procs for p in _tree(proc.pid)):
            if pid not in peaks and not _is_rank(pid, procs):
                continue  # multiprocessing's resource tracker
            for key, value in _memory(pid).items():
                peak = peaks.setdefault(pid, {})
                peak[key] = max(peak.get(key, 0), value)
        time.sleep(0.2)
    found = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{algorithm} P={nproc} failed:\n{err[-3000:]}")
        found.append(json.loads(out.strip().splitlines()[-1]))
    result = found[0]
    if apart:  # the copies' rates add up; a round takes as long as the slowest copy's
        result["updates_per_s"] = sum(f["updates_per_s"] for f in found)
        result["round_s"] = max(f["round_s"] for f in found)
        result["round_anon_mib"] = max(f["round_anon_mib"] for f in found)
    ranks = list(peaks.values())  # the workers, then the ranks they started
    result["rss_mib"] = max(p.get("VmRSS", 0) for p in ranks)
    result["anon_mib"] = [p.get("RssAnon", 0) for p in ranks]  # rank 0 first
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=20, help="rows a client (train + test)")
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--store", default="memory", choices=["memory", "disk"])
    parser.add_argument(
        "--sides",
        nargs="+",
        default=None,
        help="P x threads to run, e.g. 1x1 2x1 (default: all); Pxapart: P one-process runs of "
        "N/P clients at once, the ceiling of P ranks on this machine",
    )
    parser.add_argument(
        "--pages",
        nargs="+",
        default=["huge"],
        choices=["huge", "small"],
        help="the large CPU tensors on huge pages (fedexp.engine.clients.hugepages) or torch's own",
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--algorithm", default="fedavg", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.pages = args.pages[0]
        _worker(args)
        return
    print(
        f"N = {args.clients:,} clients, q = 0.1, {args.rounds} rounds (the first not timed), "
        f"{args.repeats} repeats, medians; store={args.store}\n"
    )
    cores = os.cpu_count() or 1
    # (P, torch threads of a process); threads "apart": P one-process runs of N/P at once
    sides: list[tuple[int, int | str]] = [(1, 1), (1, cores), (args.nproc, 1)]
    if args.sides:
        sides = [
            (int(a), b if b == "apart" else int(b))
            for a, _, b in (side.partition("x") for side in args.sides)
        ]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    head = "| algorithm | pages | P × threads | round (s) | client updates/s | vs 1 × 1 |"
    head += " peak RSS a process (MiB) | of it not files, each (MiB) | rounds, not files | acc |"
    print(head)
    print("|---|---|---|---|---|---|---|---|---|---|")
    pages = args.pages
    for algorithm in args.algorithms:
        runs = {(k, side): [] for k in pages for side in sides}
        for _ in range(args.repeats):  # interleaved: every side and kind of page in turn
            for k in pages:
                for p, threads in sides:
                    args.pages = [k]
                    apart = p if threads == "apart" else 0
                    nproc, per = (1, 1) if apart else (p, threads)
                    runs[(k, (p, threads))].append(_measure(algorithm, nproc, per, args, apart))
        for (k, (p, threads)), rows in runs.items():
            first = runs.get((k, (1, 1)), runs[(k, sides[0])])
            base = statistics.median(r["updates_per_s"] for r in first)
            rate = statistics.median(r["updates_per_s"] for r in rows)
            rss = max(r["rss_mib"] for r in rows)
            each = zip(*(r["anon_mib"] for r in rows), strict=False)  # every process, rank 0 first
            anon = " / ".join(f"{max(a):,.0f}" for a in each)
            round_s = statistics.median(r["round_s"] for r in rows)
            acc = "(N/P each)" if threads == "apart" else f"{rows[-1]['acc']:.4f}"
            print(
                f"| {algorithm} | {k} | {p} × {threads} | {round_s:.3f} | {rate:,.0f} "
                f"| {rate / base:.2f} | {rss:,.0f} ({rss / total:.1%} of {total / 1024:.0f} GiB) "
                f"| {anon} | {max(r['round_anon_mib'] for r in rows):,.0f} "
                f"| {acc} |"
            )


if __name__ == "__main__":
    main()
