"""Rounds per second of each algorithm's cohort path against the greenlet barrier (issue 14).

Both are ``backend=lockstep``: the cohort path runs an algorithm's ``cohort_update`` (the whole
round's clients as stacked computations); the greenlet barrier runs its ``client_update`` per
client as greenlets whose ``Context.train`` calls are batched (what every algorithm had before
it got a cohort path, and what the others still run). Same data, draws and models (the tests
compare them); only the Python per client differs. Logistic regression on synthetic tabular
data (20 features, 50 samples per client; FedPer, FedRep, FedRoD, pFedNet and TDPFed an MLP with
16 hidden units, whose head is personal), every client every round, E local SGD steps, dense
messages, one torch thread; medians of interleaved repeats.

    python scripts/bench_cohort_algorithms.py                       # 1,000 clients
    python scripts/bench_cohort_algorithms.py --clients 100 --algorithms ditto fedrep
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fedexp.engine.runner import build_engine  # noqa: E402
from helpers import compose_config  # noqa: E402

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
]
#: a model with a body and a head (logistic regression is all head: nothing would be shared)
HEADED = ["model=mlp", "model.hidden=16"]
#: per-algorithm settings that keep the default run well-posed at many clients
EXTRA = {
    "fpfc": ["algorithm.rho=0.001", "algorithm.penalty=mcp", "algorithm.a=1001"],
    "fedamp": ["algorithm.heuristic=true"],
    "fedper": HEADED,
    "fedrep": [*HEADED, "algorithm.head_steps=2"],
    "fedrod": HEADED,
    "l2gd": ["algorithm.p=0.3"],
    "pfednet": HEADED,
    "superfed": ["algorithm.warmup_rounds=0"],
    "tdpfed": HEADED,
}


def engine_for(algorithm: str, clients: int, steps: int, batch: int, cohort: bool):
    """A built engine after one warm-up round; ``cohort=False`` refuses the cohort path."""
    cfg = compose_config(
        "dataset=synthetic",
        f"dataset.num_samples={50 * clients}",
        "partition=iid",
        f"num_clients={clients}",
        f"local_steps={steps}",
        f"batch_size={batch}",
        "device=cpu",
        "tracker=none",
        "backend=lockstep",
        f"algorithm={algorithm}",
        *EXTRA.get(algorithm, []),
    )
    engine = build_engine(cfg)
    engine.setup()
    if not cohort:
        engine._cohort_update = lambda *args, **kwargs: None
    engine.run_round()
    return engine


def rounds_per_s(engine, rounds: int) -> float:
    """Timed rounds of a warmed-up engine."""
    start = time.perf_counter()
    for _ in range(rounds):
        engine.run_round()
    return rounds / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.clients} clients, E = {args.steps}, batch {args.batch}, rounds/s (median)")
    print("| algorithm | greenlet barrier | cohort path | cohort / barrier |")
    print("|---|---:|---:|---:|")
    for name in args.algorithms:
        engines = {
            mode: engine_for(name, args.clients, args.steps, args.batch, mode == "cohort")
            for mode in ("barrier", "cohort")
        }
        times: dict[str, list[float]] = {"barrier": [], "cohort": []}
        for _ in range(args.repeats):  # interleaved
            for mode, engine in engines.items():
                times[mode].append(rounds_per_s(engine, args.rounds))
        barrier, cohort = (statistics.median(times[m]) for m in ("barrier", "cohort"))
        print(f"| {name} | {barrier:.2f} | {cohort:.2f} | {cohort / barrier:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
