"""Operations a local step dispatches, by kind: a round at s and at 2s local steps, counted.

The round census (:class:`fedexp.engine.round.census.Census`) counts every ATen operation a
round dispatches; a round of 2s local steps less a round of s steps, over s, is what one
local step of the cohort costs (each op a kernel launch on a GPU, tens of µs of host time on
either). Workloads: FedAvg with the logistic regression on the default data (``model=logreg``),
issue 14's CNN (``scripts/gpu_cnn_rate.py``, vmapped: the path a GPU runs; on the CPU its
cohorts go row by row in channels-last, whose ops grow with the cohort) and the round census's
small VGG8 (``tests/test_round_census.py``'s ``STEP_CASES``, vmapped too: its own grouped
forward pass, ``fedexp.models.grouped``), each with plain SGD, SGD with momentum and weight
decay, and Adam.

    python scripts/count_step_ops.py                  # every workload and optimiser
    python scripts/count_step_ops.py --kinds          # and each one's ops by kind
    python scripts/count_step_ops.py --bench 40       # rounds/s: LR (100 clients), the CNN
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

from fedexp.engine.round.census import Census  # noqa: E402
from fedexp.engine.solver.optim import SGD  # noqa: E402
from fedexp.engine.solver.optim import Adam  # noqa: E402
from fedexp.engine.solver.optim import Optimizer  # noqa: E402

#: the local optimisers counted: name -> a fresh one
OPTIMIZERS = {
    "sgd": lambda: SGD(),
    "momentum+wd": lambda: SGD(momentum=0.9, weight_decay=1e-4),
    "adam": lambda: Adam(),
}


def lr_engine(clients: int = 5):  # noqa: ANN201 - an Engine
    """FedAvg, logistic regression, the default data (``fedexp run``'s defaults)."""
    from fedexp.engine.runner import build_engine
    from helpers import compose_config

    return build_engine(
        compose_config("model=logreg", f"num_clients={clients}", "progress=none", "tracker=none")
    )


def cnn_engine(clients: int = 4):  # noqa: ANN201 - an Engine
    """Issue 14's CNN (``gpu_cnn_rate.engine``), its cohorts vmapped (NCHW weights)."""
    import gpu_cnn_rate

    from fedexp.models.flat import FlatModel

    engine = gpu_cnn_rate.engine(clients, torch.device("cpu"))
    module = engine.ctx.model.module
    engine.ctx.model = FlatModel(module, torch.device("cpu"), channels_last=False)
    return engine


def vgg_engine(clients: int = 4):  # noqa: ANN201 - an Engine
    """The round census's small VGG8 (``STEP_CASES["cnn"]``), its cohorts vmapped (NCHW).

    Its draws as the census makes them, by the compiled kernel from the first round (before
    that the tensor draws' ops differ between the rounds compared: a count off by their
    difference); set for the process, so counted after the other workloads.
    """
    from test_round_census import STEP_CASES

    from fedexp.engine.runner import build_engine
    from fedexp.engine.solver import passes
    from fedexp.models.flat import FlatModel
    from helpers import compose_config

    overrides = [o for o in STEP_CASES["cnn"] if not o.startswith("num_clients=")]
    engine = build_engine(
        compose_config(*overrides, f"num_clients={clients}", "algorithm=fedavg", "device=cpu",
                       "progress=none", "tracker=none", "checkpoint_every=0")
    )  # fmt: skip
    engine.setup()
    module = engine.ctx.model.module
    engine.ctx.model = FlatModel(module, torch.device("cpu"), channels_last=False)
    passes.use_compiled_passes()
    return engine


def per_step(engine, opt: Optimizer, steps: int = 2) -> tuple[float, Counter]:  # noqa: ANN001
    """Ops a local step: (round of 2·steps − round of steps) / steps, and that by kind."""
    engine.ctx.optimizer = opt
    engine.ctx.local_epochs = None
    counts = []
    for s in (steps, 2 * steps):
        engine.ctx.local_steps = s
        engine.run_round()  # the first round at this length (states, draws made ahead)
        with Census() as census:
            engine.run_round()
        counts.append(census.ops)
    diff = counts[1].copy()
    diff.subtract(counts[0])
    return (sum(counts[1].values()) - sum(counts[0].values())) / steps, diff


def rounds_per_s(engine, rounds: int) -> tuple[float, float]:  # noqa: ANN001
    """Rounds/s of ``engine`` over ``rounds`` rounds after one warm-up round (one thread):
    of the wall clock, and of the process's CPU time (what a loaded machine's wall clock
    hides: one thread's work, whoever else runs)."""
    engine.run_round()
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        engine.run_round()
    return rounds / (time.perf_counter() - start), rounds / (time.process_time() - cpu)


def bench(rounds: int) -> None:
    """Rounds/s: LR on 100 clients (``scripts/bench_engine.py``'s: 50 samples, E=5, B=16),
    and issue 14's CNN on 10 clients, as the CPU runs it (channels-last, row by row) and
    vmapped (the GPU's path)."""
    import bench_engine
    import gpu_cnn_rate

    from fedexp.engine.solver import passes

    torch.set_num_threads(1)
    passes.use_compiled_passes()
    cpu = torch.device("cpu")
    cells = {
        "lr, 100 clients": lambda: bench_engine.build(100, 5, 16),
        "cnn, 10 clients, channels-last": lambda: gpu_cnn_rate.engine(10, cpu),
        "cnn, 10 clients, vmapped": lambda: cnn_engine(10),
    }
    for name, build in cells.items():
        count = rounds if name.startswith("lr") else max(1, rounds // 4)
        wall, cpu_time = rounds_per_s(build(), count)
        print(f"{name}: {wall:.2f} rounds/s, {cpu_time:.2f} a CPU second ({count} rounds)",
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", action="store_true", help="each workload's ops by kind")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bench", type=int, default=0, help="rounds/s over this many rounds")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.bench:
        bench(args.bench)
        return
    for name, build in (("lr", lr_engine), ("cnn", cnn_engine), ("vgg", vgg_engine)):
        for opt_name, make in OPTIMIZERS.items():
            ops, kinds = per_step(build(), make(), args.steps)
            print(f"{name:4s} {opt_name:12s} {ops:6.1f} ops a local step")
            if args.kinds:
                for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
                    if n:
                        print(f"      {n / args.steps:6.1f}  {kind}")


if __name__ == "__main__":
    main()
