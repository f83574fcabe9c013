"""Rounds per second of the fedexp engine vs a plain per-client PyTorch loop.

Same work on both sides: FedAvg, logistic regression, synthetic tabular data (20 features,
50 samples per client, 80/20 split), every client every round, E local SGD steps of batch B,
dense float32 messages. fedexp trains the round's clients as one cohort (its one path,
``fedexp.engine.solver.steps``). The baseline is the usual simulation code: one DataLoader per
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
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fedexp.engine.runner import build_engine  # noqa: E402
from helpers import compose_config  # noqa: E402


def build(num_clients: int, steps: int, batch: int, device: str = "cpu"):
    """The benchmark's engine: FedAvg, LR, 50 synthetic samples a client (80/20 split)."""
    cfg = compose_config(
        "dataset=synthetic",
        f"dataset.num_samples={50 * num_clients}",
        "partition=iid",
        f"num_clients={num_clients}",
        f"local_steps={steps}",
        f"batch_size={batch}",
        f"device={device}",
        "tracker=none",
    )
    return build_engine(cfg)


def fedexp_engine(num_clients: int, rounds: int, steps: int, batch: int):
    engine = build(num_clients, steps, batch)
    engine.run_round()  # warm-up
    gc.collect()  # the build's garbage, not a timed round's
    start = time.perf_counter()
    for _ in range(rounds):
        engine.run_round()
    return rounds / (time.perf_counter() - start), engine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(
    engine,
    rounds: int,
    steps: int,
    batch: int,
    model: nn.Module | None = None,
    loss_fn=None,
    lr: float = 0.1,
    budget_s: float | None = None,
) -> float:
    """The same clients' tensors, trained the usual way: rounds/s.

    ``model`` (default: ``nn.Linear`` with one logit and ``loss_fn`` binary cross-entropy, the
    benchmark's LR) goes to the clients' device. ``budget_s``: the timed rounds stop after
    this many seconds, mid-round too; the rate is then the clients trained per second over
    the number of clients (a round's cost is linear in its clients).
    """
    device = engine.clients[0].x_train.device
    lr_model = model is None
    if lr_model:
        model = nn.Linear(engine.clients[0].x_train.shape[1], 1)
        bce = nn.BCEWithLogitsLoss()

        def loss_fn(logits, y):
            return bce(logits[:, 0], y)

    model = model.to(device)
    loaders = [
        DataLoader(
            TensorDataset(c.x_train, c.y_train.float() if lr_model else c.y_train),
            batch_size=batch,
            shuffle=True,
        )
        for c in engine.clients
    ]
    sizes = torch.tensor([float(c.num_train) for c in engine.clients])
    weights = sizes / sizes.sum()
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    stop_at = None

    def one_round() -> int:
        """Clients trained (all of them, unless the budget ran out mid-round)."""
        nonlocal global_state
        acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for n, loader in enumerate(loaders):
            if stop_at is not None and time.perf_counter() > stop_at:
                return n
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=lr)
            it = iter(loader)
            for _ in range(steps):
                try:
                    xb, yb = next(it)
                except StopIteration:
                    it = iter(loader)
                    xb, yb = next(it)
                opt.zero_grad()
                loss_fn(model(xb), yb).backward()
                opt.step()
            for k, v in model.state_dict().items():
                acc[k] += weights[n] * v
        global_state = acc
        return len(loaders)

    if budget_s is not None:  # a warm-up of a few clients, not a whole round
        stop_at = time.perf_counter() + budget_s / 10
    one_round()
    gc.collect()
    _sync(device)
    start = time.perf_counter()
    stop_at = None if budget_s is None else start + budget_s
    trained = 0
    for _ in range(rounds):
        trained += one_round()
        if stop_at is not None and time.perf_counter() > stop_at:
            break
    _sync(device)
    return trained / len(loaders) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from fedexp.engine.solver import passes

    passes.use_compiled_passes()  # the steady state: the CPU's pass kernel from the start
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
