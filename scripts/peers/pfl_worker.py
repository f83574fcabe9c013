"""pfl-research's runner of ``scripts/bench_peers.py`` (run with the peers' venv python).

pfl's simulated federated set-up, as its benchmarks build it: a ``FederatedDataset`` of the
clients (``MinimizeReuseUserSampler``: a cohort of N visits every client once a round), a
``PyTorchModel`` (local ``torch.optim.SGD``; central ``SGD`` with lr 1 on the averaged model
difference: plain FedAvg), ``WeightByDatapoints``, ``SimulatedBackend`` and
``FederatedAveraging.run``. One warm-up central iteration, then ``--rounds`` timed ones, timed
by a callback after each iteration.

pfl's own ``Dataset.iter`` walks a client's data in fixed slices (100 samples in batches of 32:
32, 32, 32, 4) and stops at the end of an epoch; the clients here yield exactly ``steps``
minibatches of ``batch`` samples drawn at random each round (what fedexp and the plain loop
train on), so every framework takes the same steps.

    .venv-peers/bin/python scripts/peers/pfl_worker.py --workload tabular --clients 10
"""

from __future__ import annotations

import common
import numpy as np
import torch

# isort: off
# pfl's tutorials import its model module first: that selects pfl's PyTorch ops
from pfl.model.pytorch import PyTorchModel
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByDatapoints
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.dataset import Dataset
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import MinimizeReuseUserSampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted

# isort: on


class PflNet(torch.nn.Module):
    """The workload's model with the ``loss`` and ``metrics`` methods pfl asks for."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.net(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean training loss of a batch."""
        self.train()
        return common.loss_fn(self.net(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Weighted]:
        """Loss and accuracy of a batch, weighted by its size."""
        self.eval()
        logits = self.net(x)
        n = int(y.shape[0])
        return {
            "loss": Weighted(float(common.loss_fn(logits, y)) * n, n),
            "accuracy": Weighted(common.correct(logits, y), n),
        }


class StepsDataset(Dataset):
    """A client's data whose ``iter(batch)`` yields ``steps`` random minibatches of ``batch``.

    Evaluation (``batch`` None or at least the client's size) gets the whole data at once.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, steps: int, user_id: int) -> None:
        super().__init__((x, y), user_id=str(user_id))
        self.steps = steps

    def iter(self, batch_size: int | None):  # noqa: A003 (pfl's name)
        """Training minibatches, or the whole data for evaluation."""
        x, y = self.raw_data
        n = int(y.shape[0])
        if batch_size is None or batch_size >= n:
            yield x, y
            return
        idx = torch.randint(n, (self.steps, batch_size))
        for row in idx:
            yield x[row], y[row]


class RoundTimer(TrainingProcessCallback):
    """Marks the end of every central iteration on the worker's clock."""

    def __init__(self, clock: common.Clock) -> None:
        self.clock = clock

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration: int):
        """Record the time; never stop training."""
        self.clock.round_end()
        return False, Metrics()


def main() -> None:
    """Run pfl's simulation and print the result line."""
    args = common.base_args(__doc__.split("\n")[0]).parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    clock = common.Clock()
    spec = common.WORKLOADS[args.workload]
    clients = common.all_clients(args.workload, args.clients, args.seed)

    def make_dataset(user_id: int) -> StepsDataset:
        x, y = clients[user_id]
        return StepsDataset(x, y, spec.steps, user_id)

    training = FederatedDataset(make_dataset, MinimizeReuseUserSampler(list(range(args.clients))))
    net = PflNet(common.make_model(args.workload, args.seed))
    params = [p for p in net.parameters() if p.requires_grad]
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(params, lr=1.0),
    )
    backend = SimulatedBackend(
        training_data=training, val_data=None, postprocessors=[WeightByDatapoints()]
    )
    rounds = args.rounds + 1
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=rounds,
        evaluation_frequency=rounds + 1,  # iteration 0 (the warm-up) only
        train_cohort_size=args.clients,
        val_cohort_size=None,
    )
    train_params = NNTrainHyperParams(
        local_learning_rate=spec.lr,
        local_num_epochs=None,
        local_batch_size=spec.batch,
        local_num_steps=spec.steps,
    )
    clock.round_start()
    FederatedAveraging().run(
        algorithm_params=algorithm_params,
        backend=backend,
        model=model,
        model_train_params=train_params,
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[RoundTimer(clock)],
    )
    import pfl

    common.report(
        {
            "framework": "pfl",
            "workload": args.workload,
            "clients": args.clients,
            "accuracy": common.accuracy(net.net, clients),
            "pfl": getattr(pfl, "__version__", "?"),
            **clock.summary(args.clients),
        }
    )


if __name__ == "__main__":
    main()
