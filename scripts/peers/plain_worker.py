"""The plain PyTorch loop of ``scripts/bench_peers.py`` (``scripts/bench_engine.py``'s baseline).

The usual simulation code: one ``DataLoader`` per client, ``load_state_dict`` of the global
model, ``torch.optim.SGD``, ``state_dict`` averaging weighted by samples (no encoding, no byte
counting). One warm-up round, then ``--rounds`` timed rounds.

    python scripts/peers/plain_worker.py --workload tabular --clients 10 --rounds 2
"""

from __future__ import annotations

import common
import torch


def main() -> None:
    """Run the loop and print the result line."""
    args = common.base_args(__doc__.split("\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    clock = common.Clock()
    spec = common.WORKLOADS[args.workload]
    clients = common.all_clients(args.workload, args.clients, args.seed)
    loaders = [common.loader(x, y, spec.batch) for x, y in clients]
    sizes = torch.tensor([float(y.shape[0]) for _, y in clients])
    weights = (sizes / sizes.sum()).tolist()
    model = common.make_model(args.workload, args.seed)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}

    for _ in range(args.rounds + 1):
        clock.round_start()
        acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
        for w, data in zip(weights, loaders, strict=True):
            model.load_state_dict(global_state)
            common.train_steps(model, data, spec.steps, spec.lr)
            for k, v in model.state_dict().items():
                acc[k] += w * v
        global_state = acc
        clock.round_end()

    model.load_state_dict(global_state)
    common.report(
        {
            "framework": "plain",
            "workload": args.workload,
            "clients": args.clients,
            "accuracy": common.accuracy(model, clients),
            **clock.summary(args.clients),
        }
    )


if __name__ == "__main__":
    main()
