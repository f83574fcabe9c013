"""Latency of the gloo collectives a round over several processes uses, on this machine.

A round of ``distributed.nproc=P`` exchanges its records with :meth:`Ranks.gather_bytes`
(one ``all_gather`` of a fixed 16 KiB buffer per rank) and, for large weighted sums, an
``all_reduce``. This script times each kind back to back between P spawned processes (one
torch thread each) and prints the median and 90th percentile, so that a round's fixed cost
can be read as "collectives × latency".

    python scripts/bench_collectives.py            # P = 2, 300 repeats
    python scripts/bench_collectives.py --nproc 2 --repeats 1000
"""

from __future__ import annotations

import argparse
import statistics
import time


def _rank(rank: int, size: int, port: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    from fedexp.engine.processes.ranks import Ranks

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    ranks = Ranks(rank, size)
    small = torch.zeros(21)
    record = b"{}" * 200  # a round's records: a few hundred bytes of JSON
    kinds = {
        "gather_bytes (one all_gather of 16 KiB)": lambda: ranks.gather_bytes(record),
        "all_reduce of 21 float32": lambda: dist.all_reduce(small),
        "barrier": dist.barrier,
    }
    for name, call in kinds.items():
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        times.sort()
        if rank == 0:
            p90 = times[int(0.9 * len(times))]
            print(f"| {name} | {1e3 * statistics.median(times):.3f} | {1e3 * p90:.3f} |")
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from fedexp.engine.processes.launch import _free_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    print(f"P = {args.nproc}, {args.repeats} repeats each, back to back\n")
    print("| collective | median (ms) | 90th percentile (ms) |\n|---|---|---|")
    mp.spawn(_rank, args=(args.nproc, _free_port(), args.repeats), nprocs=args.nproc)


if __name__ == "__main__":
    main()
