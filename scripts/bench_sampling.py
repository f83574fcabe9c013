"""Cost of shuffled passes against draws with replacement (issue 23, ``sampling``).

Builds one engine per setting in this process (synthetic tabular data, logistic regression,
``--clients`` clients of 50 samples, every client every round, ``--steps`` local SGD steps of
batch 32, dense messages, one torch thread), runs a warm-up round, then times ``--rounds``
rounds of each setting in turn, ``--repeats`` times, and prints the medians and the ratio
shuffle / replacement; also the time of one cohort's index draw alone.

    .venv/bin/python scripts/bench_sampling.py                  # 1,000 clients
    .venv/bin/python scripts/bench_sampling.py --clients 10000 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]


def build(sampling: str, clients: int, steps: int, out: Path):  # noqa: ANN201
    """An engine of the workload with ``sampling``."""
    from fedexp.engine.runner import build_engine
    from helpers import compose_config

    cfg = compose_config(
        "dataset=synthetic", f"dataset.num_samples={50 * clients}", "dataset.num_features=20",
        "partition=iid", f"num_clients={clients}", f"local_steps={steps}", "batch_size=32",
        "progress=none", "checkpoint_every=0", "device=cpu", "tracker=none", f"sampling={sampling}",
        output_dir=out,
    )  # fmt: skip
    engine = build_engine(cfg)
    engine.setup()
    engine.run_round()
    gc.collect()
    return engine


def main() -> None:
    """Parse the options, time both settings, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from fedexp import streams
    from fedexp.engine.solver import passes

    passes.use_compiled_passes()  # the steady state: the CPU's pass kernel from the start
    from fedexp.engine.solver import passes

    out = Path("/tmp/fedexp-bench-sampling")
    engines = {s: build(s, args.clients, args.steps, out / s) for s in passes.SAMPLINGS}
    times: dict[str, list[float]] = {s: [] for s in engines}
    for _ in range(args.repeats):
        for s, engine in engines.items():
            start = time.perf_counter()
            for _ in range(args.rounds):
                engine.run_round()
            times[s].append((time.perf_counter() - start) / args.rounds)
    keys = streams.stream_keys(0, streams.CLIENT, 0, list(range(args.clients)))
    draws, num = torch.zeros_like(keys), torch.full_like(keys, 40)
    draw: dict[str, float] = {}
    for s in engines:
        best = []
        for _ in range(20):
            start = time.perf_counter()
            passes.minibatch_indices(keys, draws, 32, num, s)
            best.append(time.perf_counter() - start)
        draw[s] = min(best)
    print(f"{args.clients} clients, {args.steps} steps of batch 32, median of {args.repeats}")
    print("| sampling | s / round | client updates / s | one cohort draw (ms) |")
    print("|---|---|---|---|")
    for s in engines:
        t = statistics.median(times[s])
        print(f"| {s} | {t:.4f} | {args.clients / t:,.0f} | {draw[s] * 1e3:.2f} |")
    ratio = statistics.median(times["shuffle"]) / statistics.median(times["replacement"])
    print(f"shuffle / replacement, time a round: {ratio:.2f}")


if __name__ == "__main__":
    main()
