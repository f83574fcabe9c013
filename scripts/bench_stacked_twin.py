"""What a loss without a batched twin costs: the vmapped path against the stacked one.

An ``Objective`` whose loss has no ``stacked`` form (a researcher's own loss) is stepped by
``torch.func.vmap`` of the one-client loss over the cohort (docs/design.md, "How to add an
algorithm"); the stock losses of a logistic regression and a ReLU MLP also have a batched twin
of their own. Both are run here on the same rounds, alternating, and the ratio is printed
(FedProx: the proximal loss, with and without its twin; SCAFFOLD's linear term rides on
either). Rounds per second in one process, so the machine's load moves both alike::

    python scripts/bench_stacked_twin.py                 # 100 clients, LR and an MLP
    python scripts/bench_stacked_twin.py --clients 10 1000 --rounds 20
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
from fedexp.engine.solver.context import Context  # noqa: E402
from helpers import compose_config  # noqa: E402


def engine(clients: int, model: list[str]):  # noqa: ANN201
    cfg = compose_config(
        "dataset=synthetic",
        f"dataset.num_samples={50 * clients}",
        "partition=iid",
        f"num_clients={clients}",
        "algorithm=fedprox",
        "algorithm.mu=0.1",
        "local_steps=5",
        "batch_size=32",
        "device=cpu",
        "tracker=none",
        "progress=none",
        "checkpoint_every=0",
        *model,
    )
    return build_engine(cfg)


def rate(eng, rounds: int, twin: bool) -> float:  # noqa: ANN001
    """Rounds per second of ``eng`` with or without the objectives' batched twins."""
    keep = Context._stacks
    if not twin:
        Context._stacks = lambda self: False  # type: ignore[method-assign]
    try:
        eng.run_round()  # warm-up
        start = time.perf_counter()
        for _ in range(rounds):
            eng.run_round()
        return rounds / (time.perf_counter() - start)
    finally:
        Context._stacks = keep  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = {"lr": [], "mlp": ["model=mlp", "model.hidden=32"]}
    print("| model | clients | twin (rounds/s) | vmap (rounds/s) | twin / vmap |")
    print("|---|---:|---:|---:|---:|")
    for name, model in models.items():
        for clients in args.clients:
            twin, vm = [], []
            for _ in range(args.repeats):  # alternating: load moves both alike
                twin.append(rate(engine(clients, model), args.rounds, True))
                vm.append(rate(engine(clients, model), args.rounds, False))
            a, b = statistics.median(twin), statistics.median(vm)
            print(f"| {name} | {clients} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
