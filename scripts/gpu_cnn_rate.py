"""Client updates/s of the issue-14 CNN workload on a GPU: fedexp's engine vs compute bound.

fedexp's rate against the model's compute-bound rate on the same GPU (no Hydra, no MLflow:
runs where only torch is installed).

    python scripts/gpu_cnn_rate.py --clients 10 --rounds 20

The compute-bound rate: the same model's forward + backward + SGD step on one batch of
``clients × batch`` images (every client's minibatch of a step in one batch, one weight set),
timed with CUDA events; a round of the workload is ``steps`` such steps, so the bound is
``clients / (steps × t_step)`` client updates/s. The fedexp rate times whole rounds (the
messages' encoding, decoding and byte counting included) after two warm-up rounds; the
round's clients train as one cohort (fedexp's one path, ``fedexp.engine.solver.steps``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

import common  # noqa: E402

from fedexp.algorithms.fedavg import FedAvg  # noqa: E402
from fedexp.comm.channel import Channel  # noqa: E402
from fedexp.data.federated import ClientData  # noqa: E402
from fedexp.engine.round.engine import Engine  # noqa: E402
from fedexp.engine.solver.context import Context  # noqa: E402
from fedexp.engine.solver.optim import SGD  # noqa: E402
from fedexp.engine.solver.steps import train  # noqa: E402
from fedexp.models.flat import FlatModel  # noqa: E402
from fedexp.models.task import ClassificationTask  # noqa: E402


def engine(clients: int, device: torch.device) -> Engine:
    spec = common.WORKLOADS["cnn"]
    data = [
        ClientData(x.to(device), y.to(device), x.to(device), y.to(device))
        for x, y in common.all_clients("cnn", clients, 0)
    ]
    model = FlatModel(common.make_model("cnn", 0), device)
    ctx = Context(
        model=model,
        task=ClassificationTask(2),
        num_clients=clients,
        lr=spec.lr,
        local_steps=spec.steps,
        local_epochs=None,
        batch_size=spec.batch,
        seed=0,
        personal_idx=torch.zeros(0, dtype=torch.long, device=device),
        shared_idx=torch.arange(model.layout.numel, device=device),
        optimizer=SGD(),
        solver=train,
    )
    return Engine(
        ctx=ctx,
        algorithm=FedAvg(),
        clients=data,
        uplink=Channel(),
        downlink=Channel(),
        seed=0,
        participation=1.0,
        x0=model.initial(),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(e: Engine, rounds: int) -> float:
    device = e.ctx.device
    for _ in range(2):
        e.run_round()
    _sync(device)
    start = time.perf_counter()
    for _ in range(rounds):
        e.run_round()
    _sync(device)
    return rounds * len(e.clients) / (time.perf_counter() - start)


def step_seconds(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn,
    lr: float,
    reps: int = 50,
    warmup: int = 5,
) -> float:
    """Seconds of one forward + backward + ``torch.optim.SGD`` step of ``model`` on the batch
    ``(x, y)`` (on their device; CUDA events on a GPU, the wall clock elsewhere)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    if x.device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            step()
        return (time.perf_counter() - start) / reps
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        step()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) / 1000 / reps


def bound(clients: int, device: torch.device, reps: int = 50) -> float:
    spec = common.WORKLOADS["cnn"]
    model = common.make_model("cnn", 0).to(device)
    x = torch.randn(clients * spec.batch, 1, 32, 32, device=device)
    y = torch.randint(0, 2, (clients * spec.batch,), device=device)
    step_s = step_seconds(model, x, y, torch.nn.CrossEntropyLoss(), spec.lr, reps)
    return clients / (spec.steps * step_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    for n in args.clients:
        row = {"clients": n, "bound": bound(n, dev)}
        row["fedexp"] = rate(engine(n, dev), args.rounds)
        row["fedexp / bound"] = row["fedexp"] / row["bound"]
        print(json.dumps(row))


if __name__ == "__main__":
    main()
