"""Rounds per second of the fedexp engine vs a plain per-client PyTorch loop.

Same work on both sides: FedAvg, logistic regression, synthetic tabular data (20 features,
50 samples per client, 80/20 split), every client every round, E local SGD steps of batch B,
dense float32 messages. fedexp trains the round's clients as one cohort (its one path,
``fedexp.engine.solver``). The baseline is the usual simulation code: one DataLoader per
client, ``load_state_dict`` of the global model, ``torch.optim.SGD``, ``state_dict`` averaging.

    python scripts/bench_engine.py                   # 10, 100, 1000 clients
    python scripts/bench_engine.py --clients 10 100  --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fedexp.engine.runner import build_engine  # noqa: E402
from helpers import compose_config  # noqa: E402


def fedexp_engine(num_clients: int, rounds: int, steps: int, batch: int):
    cfg = compose_config(
        "dataset=synthetic",
        f"dataset.num_samples={50 * num_clients}",
        "partition=iid",
        f"num_clients={num_clients}",
        f"local_steps={steps}",
        f"batch_size={batch}",
        "device=cpu",
        "tracker=none",
    )
    engine = build_engine(cfg)
    engine.run_round()  # warm-up
    gc.collect()  # the build's garbage, not a timed round's
    start = time.perf_counter()
    for _ in range(rounds):
        engine.run_round()
    return rounds / (time.perf_counter() - start), engine


def plain_loop(engine, rounds: int, steps: int, batch: int) -> float:
    """The same clients' tensors, trained the usual way."""
    d_in = engine.clients[0].x_train.shape[1]
    model = nn.Linear(d_in, 1)
    loaders = [
        DataLoader(TensorDataset(c.x_train, c.y_train.float()), batch_size=batch, shuffle=True)
        for c in engine.clients
    ]
    sizes = torch.tensor([float(c.num_train) for c in engine.clients])
    weights = sizes / sizes.sum()
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = nn.BCEWithLogitsLoss()

    def one_round() -> None:
        nonlocal global_state
        acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for n, loader in enumerate(loaders):
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            it = iter(loader)
            for _ in range(steps):
                try:
                    xb, yb = next(it)
                except StopIteration:
                    it = iter(loader)
                    xb, yb = next(it)
                opt.zero_grad()
                loss_fn(model(xb)[:, 0], yb).backward()
                opt.step()
            for k, v in model.state_dict().items():
                acc[k] += weights[n] * v
        global_state = acc

    one_round()
    gc.collect()
    start = time.perf_counter()
    for _ in range(rounds):
        one_round()
    return rounds / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, 1 thread, E={args.steps}, B={args.batch}, "
        f"{args.rounds} timed rounds after one warm-up round\n"
    )
    print("| clients | plain PyTorch + DataLoader | fedexp | fedexp / plain |")
    print("|---:|---:|---:|---:|")
    for n in args.clients:
        rounds = max(1, args.rounds if n <= 100 else args.rounds // 2)
        ours, engine = fedexp_engine(n, rounds, args.steps, args.batch)
        base = plain_loop(engine, rounds, args.steps, args.batch)
        print(f"| {n} | {base:.2f} | {ours:.2f} | {ours / base:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
