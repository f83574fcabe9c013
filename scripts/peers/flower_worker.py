"""Flower's runner of ``scripts/bench_peers.py`` (the peers' venv python, loopback-only netns).

Flower's simulation runtime with its Message API, as its PyTorch quickstart builds an app: a
``ClientApp`` whose ``train`` loads the received ``ArrayRecord`` into the model, takes the local
SGD steps on the client's ``DataLoader`` and replies with the new ``state_dict`` and its
``num-examples``; a ``ServerApp`` running the ``FedAvg`` strategy (every node trains each round,
no federated evaluation) for one warm-up round and ``--rounds`` timed ones; started with
``flwr.simulation.run_simulation`` on the Ray backend. The strategy's ``evaluate_fn``, called
on the server after every round, marks the round's end (and measures the accuracy after the
last). ``--actors`` Ray actors with one CPU each run the ClientApps; each sets ``--threads``
torch threads and keeps its clients' data and one model in memory once loaded.

Ray listens on every interface: ``scripts/bench_peers.py`` runs this inside ``unshare -n``
with only the loopback interface up.

    unshare -n sh -c 'ip link set lo up && exec .venv-peers/bin/python \
        scripts/peers/flower_worker.py --workload tabular --clients 10'
"""

from __future__ import annotations

import logging
import os
import socket

import common
import torch
from flwr.app import ArrayRecord
from flwr.app import ConfigRecord
from flwr.app import Context
from flwr.app import Message
from flwr.app import MetricRecord
from flwr.app import RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

client_app = ClientApp()

#: Per actor process: the model of each workload, each client's DataLoader, the shared pattern.
_MODELS: dict[str, torch.nn.Module] = {}
_LOADERS: dict[tuple[str, int, int], torch.utils.data.DataLoader] = {}
_PATTERNS: dict[tuple[str, int], torch.Tensor] = {}


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """One client's round: load the global model, local SGD steps, reply with the model."""
    config = msg.content["config"]
    workload, seed = str(config["workload"]), int(config["seed"])
    spec = common.WORKLOADS[workload]
    client = int(context.node_config["partition-id"])
    if workload not in _MODELS:
        torch.set_num_threads(int(config["threads"]))
        _MODELS[workload] = common.make_model(workload, seed)
    model = _MODELS[workload]
    key = (workload, seed, client)
    if key not in _LOADERS:
        if (workload, seed) not in _PATTERNS:
            _PATTERNS[workload, seed] = common.shared_pattern(workload, seed)
        x, y = common.client_data(workload, client, seed, _PATTERNS[workload, seed])
        _LOADERS[key] = common.loader(x, y, spec.batch)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loss = common.train_steps(model, _LOADERS[key], spec.steps, spec.lr)
    reply = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"train_loss": loss, "num-examples": spec.samples}),
        }
    )
    return Message(content=reply, reply_to=msg)


def main() -> None:
    """Run the simulation and print the result line."""
    parser = common.base_args(__doc__.split("\n")[0])
    parser.add_argument("--actors", type=int, default=1, help="Ray actors (1 CPU each)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = common.Clock()
    out: dict[str, float] = {}
    server_app = ServerApp()

    @server_app.main()
    def server_main(grid: Grid, context: Context) -> None:
        model = common.make_model(args.workload, args.seed)
        rounds = args.rounds + 1

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0:
                clock.round_start()
                return None
            clock.round_end()
            if server_round == rounds:
                model.load_state_dict(arrays.to_torch_state_dict())
                clients = common.all_clients(args.workload, args.clients, args.seed)
                out["accuracy"] = common.accuracy(model, clients)
            return None

        strategy = FedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=args.clients,
            min_available_nodes=args.clients,
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=rounds,
            train_config=ConfigRecord(
                {"workload": args.workload, "seed": args.seed, "threads": args.threads}
            ),
            evaluate_fn=evaluate,
        )

    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=args.clients,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {
                "num_cpus": args.actors,
                "num_gpus": 0,
                "include_dashboard": False,
                "_node_ip_address": "127.0.0.1",
            },
        },
    )
    if "accuracy" not in out:
        raise SystemExit("the Flower simulation ended before its last round")
    import flwr
    import ray

    common.report(
        {
            "framework": "flower",
            "workload": args.workload,
            "clients": args.clients,
            "accuracy": out["accuracy"],
            "flwr": flwr.__version__ if hasattr(flwr, "__version__") else "?",
            "ray": ray.__version__,
            "actors": args.actors,
            "netns": os.environ.get("BENCH_PEERS_NETNS", "?"),
            "interfaces": [name for _, name in socket.if_nameindex()],
            **clock.summary(args.clients),
        }
    )


if __name__ == "__main__":
    main()
