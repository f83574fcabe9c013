"""fedexp's runner of ``scripts/bench_peers.py``: the real engine on the shared workloads.

The run settings come from the composed config, as ``fedexp run`` would compose them
(``algorithm=fedavg compressor=none optimizer=sgd``, the workload's ``lr``, ``local_steps``,
``batch_size``); the engine is then built as ``fedexp.engine.runner.build_engine``
builds it, with the benchmark's clients (every sample trains and is evaluated) and model in
place of the config's dataset and model. Dense float32 messages are encoded, counted and
decoded as in every run. The round's clients train as one cohort (fedexp's one path,
``fedexp.engine.solver.steps``). One warm-up round, then ``--rounds`` timed rounds; then
``--eval-rounds`` rounds each followed by the evaluation of every client (``Engine.evaluate``:
accuracy, balanced accuracy, AUC and loss per client), whose median is ``round_eval_s``.

    python scripts/peers/fedexp_worker.py --workload tabular --clients 10
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import common
import torch

ROOT = Path(__file__).resolve().parents[2]


def build(args, data: list):
    """The engine for ``data`` (``ClientData``; mirrors ``fedexp.engine.runner._build`` past
    the data)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fedexp.config.instantiate import instantiate_checked
    from fedexp.engine.round.engine import Engine
    from fedexp.engine.runner import build_channel
    from fedexp.engine.solver.context import Context
    from fedexp.engine.solver.steps import train
    from fedexp.models.flat import FlatModel
    from fedexp.models.task import ClassificationTask
    from helpers import compose_config

    spec = common.WORKLOADS[args.workload]
    cfg = compose_config(
        "algorithm=fedavg",
        "compressor=none",
        "optimizer=sgd",
        "tracker=none",
        "device=cpu",
        f"num_clients={args.clients}",
        f"local_steps={spec.steps}",
        f"batch_size={spec.batch}",
        f"lr={spec.lr}",
        f"seed={args.seed}",
    )
    device = torch.device("cpu")
    module = common.make_model(args.workload, args.seed)
    if args.workload == "tabular":  # fedexp's own model=logreg, at the peers' initial point
        from fedexp.models.tabular import LogisticRegression

        ours = LogisticRegression(module.linear.in_features, 1)
        ours.load_state_dict(module.state_dict())
        module = ours
    model = FlatModel(module, device)
    ctx = Context(
        model=model,
        task=ClassificationTask(2),
        num_clients=cfg.num_clients,
        lr=cfg.lr,
        local_steps=cfg.local_steps,
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        personal_idx=torch.zeros(0, dtype=torch.long),
        shared_idx=torch.arange(model.layout.numel),
        optimizer=instantiate_checked(cfg.optimizer, "optimizer"),
        solver=train,
    )
    return Engine(
        ctx=ctx,
        algorithm=instantiate_checked(cfg.algorithm, "algorithm"),
        clients=data,
        uplink=build_channel(cfg.compressor.uplink, "compressor.uplink"),
        downlink=build_channel(cfg.compressor.downlink, "compressor.downlink"),
        seed=cfg.seed,
        participation=cfg.participation,
        x0=model.initial(),
    )


def one_buffer(workload: str, num_clients: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`common.all_clients`'s data, written client by client into one buffer.

    How data are best handed to fedexp: one tensor of every client's rows, the clients made
    by ``TrainPool.clients_of`` (no tensor object per client; the engine's pool is that
    buffer, no copy). Each client's freshly drawn tensors are freed as soon as they are
    copied, so the process never holds two copies.

    Returns:
        (all inputs, all labels), client after client.
    """
    spec = common.WORKLOADS[workload]
    pattern = common.shared_pattern(workload, seed)
    total = num_clients * spec.samples
    xs = torch.empty(total, *spec.input_shape)
    ys = torch.empty(total, dtype=torch.long)
    for n in range(num_clients):
        x, y = common.client_data(workload, n, seed, pattern)
        a = n * spec.samples
        xs[a : a + spec.samples], ys[a : a + spec.samples] = x, y
    return xs, ys


def main() -> None:
    """Run the engine and print the result line."""
    parser = common.base_args(__doc__.split("\n")[0])
    parser.add_argument("--eval-rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fedexp.engine.solver import passes

    passes.use_compiled_passes()  # the steady state: the CPU's pass kernel from the start
    from fedexp.engine.memory import keep_freed_memory

    keep_freed_memory()  # as a run's process does (fedexp.engine.runner.run)
    clock = common.Clock()
    from fedexp.engine.clients.pool import TrainPool

    xs, ys = one_buffer(args.workload, args.clients, args.seed)
    # every client is evaluated on its own training data (the test split is the training set)
    sizes = [common.WORKLOADS[args.workload].samples] * args.clients
    engine = build(args, TrainPool.clients_of(xs, ys, sizes))
    engine.setup()
    for _ in range(args.rounds + 1):
        clock.round_start()
        engine.run_round()
        clock.round_end()

    with_eval = []  # rounds with every client evaluated after them (issue 14's limit row)
    for _ in range(args.eval_rounds):
        start = time.perf_counter()
        engine.run_round()
        engine.evaluate()
        with_eval.append(time.perf_counter() - start)

    module = common.make_model(args.workload, args.seed)
    torch.nn.utils.vector_to_parameters(engine.server["x"], module.parameters())
    import fedexp

    common.report(
        {
            "framework": "fedexp",
            "workload": args.workload,
            "clients": args.clients,
            # every client's data pooled, in slices of 100,000 samples
            "accuracy": common.accuracy(
                module, list(zip(xs.split(100_000), ys.split(100_000), strict=True))
            ),
            "fedexp": getattr(fedexp, "__version__", "?"),
            "bytes_up": float(engine.ledger.total["up"]),
            "round_eval_s": sorted(with_eval)[len(with_eval) // 2] if with_eval else None,
            **clock.summary(args.clients),
        }
    )


if __name__ == "__main__":
    main()
