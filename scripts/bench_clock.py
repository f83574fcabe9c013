"""What the simulated clock costs a round's wall time (issue 67: at most 5 %).

The same run with ``system=none`` and with ``system=lognormal`` (a deadline no client
misses, so the clock times and sorts every round's clients but the work is the same)
alternates round by round in one process, so that the machine's load moves both alike; the
ratio of the median round times is printed. The clock is host NumPy over the round's clients
(their bytes from the ledger, their steps, a sort), no device read::

    python scripts/bench_clock.py                       # 100 clients, FedAvg, 30 rounds
    python scripts/bench_clock.py --clients 1000 --rounds 20 --compressor stc
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fedexp.engine.round.stages import Uplink  # noqa: E402
from fedexp.engine.runner import build_engine  # noqa: E402
from helpers import compose_config  # noqa: E402


def engine(clients: int, compressor: str, *system: str):  # noqa: ANN201
    cfg = compose_config(
        "dataset=synthetic",
        f"dataset.num_samples={50 * clients}",
        "partition=iid",
        f"num_clients={clients}",
        "participation=0.5",
        "local_steps=5",
        "batch_size=16",
        "device=cpu",
        "progress=none",
        "tracker=none",
        f"compressor={compressor}",
        *system,
    )
    return build_engine(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--compressor", default="none")
    args = parser.parse_args()
    plain = engine(args.clients, args.compressor)
    timed = engine(args.clients, args.compressor, "system=lognormal", "system.deadline=1e9")
    times: dict[str, list[float]] = {"none": [], "lognormal": []}
    for t in range(args.rounds + 2):
        for name, e in (("none", plain), ("lognormal", timed)):
            started = time.perf_counter()
            e.run_round()
            if t >= 2:  # (the first rounds warm the caches)
                times[name].append(time.perf_counter() - started)
    base, clock = (statistics.median(times[k]) for k in ("none", "lognormal"))
    print(
        f"{args.clients} clients, {args.compressor}: round {base * 1e3:.2f} ms (system=none), "
        f"{clock * 1e3:.2f} ms (system=lognormal, deadline): ratio {clock / base:.3f}"
    )
    # the clock's own work a round (its draw and its server side), alone: the ratio above
    # moves with the machine's load by more than this
    who, up = timed.sampler(timed.round), Uplink(None, None, {})
    started = time.perf_counter()
    for _ in range(200):
        timed.clock.draw(timed.round)
        timed.clock.server(timed.round, who, up)
    own = (time.perf_counter() - started) / 200
    print(f"the clock's own work: {own * 1e3:.3f} ms a round, {100 * own / base:.2f} % of a round")


if __name__ == "__main__":
    main()
