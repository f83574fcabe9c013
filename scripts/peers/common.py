"""What every runner of ``scripts/bench_peers.py`` shares: the workloads, their data and models.

Imported by the workers in both virtual environments (the project's ``.venv`` and the peers'
``.venv-peers``), so it needs torch alone. Both environments pin the same torch (2.13.0), and the
data are drawn with torch generators: every framework trains on bit-identical clients.

* ``tabular``: logistic regression on d = 30 synthetic features, 100 samples per client, binary
  labels drawn from a logistic model around a shared weight vector; 5 local SGD steps of batch 32,
  lr 0.1.
* ``cnn``: a small CNN (two 5x5 conv layers with max-pooling, two linear layers; 64,642
  parameters) on 1x32x32 images, 64 per client, two classes told apart by a faint shared pattern
  in noise; 2 local SGD steps of batch 16, lr 0.1.

Each worker prints one line ``BENCH_PEERS_RESULT {json}`` on stdout (:func:`report`).
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

#: Prefix of the result line a worker prints on stdout.
RESULT_PREFIX = "BENCH_PEERS_RESULT "


@dataclass(frozen=True)
class Workload:
    """One benchmark workload, identical in every framework.

    Attributes:
        name: ``tabular`` or ``cnn``.
        input_shape: shape of one input.
        samples: samples per client (all of them train; accuracy is measured on them too).
        steps: local SGD steps per client and round.
        batch: minibatch size of a step.
        lr: client learning rate (plain SGD, no momentum); the server averages (FedAvg,
            weighted by samples, all equal here).
    """

    name: str
    input_shape: tuple[int, ...]
    samples: int
    steps: int
    batch: int
    lr: float


WORKLOADS: dict[str, Workload] = {
    "tabular": Workload("tabular", (30,), samples=100, steps=5, batch=32, lr=0.1),
    "cnn": Workload("cnn", (1, 32, 32), samples=64, steps=2, batch=16, lr=0.1),
}

#: Amplitude of the class pattern in the CNN workload's unit-variance noise.
IMAGE_SIGNAL = 0.3
#: Scale of the tabular workload's true weights (margin x·w* has standard deviation ~3).
TABULAR_SCALE = 3.0


class LogisticRegression(nn.Module):
    """``linear(flatten(x))`` with one logit (fedexp's ``model=logreg`` for two classes)."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, 1]``."""
        return self.linear(x.flatten(1))


class SmallCNN(nn.Module):
    """conv 1→16 (5x5), max-pool, conv 16→32 (5x5), max-pool, linear 800→64, linear 64→2.

    64,642 parameters: 416 + 12,832 + 51,264 + 130.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 5 * 5, 64)
        self.fc2 = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, 2]`` of ``[n, 1, 32, 32]`` images."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


#: Parameters of :class:`SmallCNN` (the issue's figure).
CNN_PARAMETERS = 64_642


def make_model(workload: str, seed: int) -> nn.Module:
    """The workload's model, initialised from ``seed`` alone (the same in every framework)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if workload == "tabular":
            return LogisticRegression(WORKLOADS["tabular"].input_shape[0])
        return SmallCNN()


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy for one logit, cross-entropy otherwise (fedexp's task loss)."""
    if logits.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(logits[:, 0], y.to(logits.dtype))
    return F.cross_entropy(logits, y)


def correct(logits: torch.Tensor, y: torch.Tensor) -> int:
    """Number of right predictions (logit > 0 for one output, argmax otherwise)."""
    pred = (logits[:, 0] > 0).long() if logits.shape[-1] == 1 else logits.argmax(dim=1)
    return int((pred == y).sum())


def _client_generator(seed: int, client: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * (seed + 1) + client)


def _shared_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(7_919 * (seed + 1))


def shared_pattern(workload: str, seed: int) -> torch.Tensor:
    """What every client shares: the true weights (tabular) or the class pattern (cnn)."""
    g = _shared_generator(seed)
    if workload == "tabular":
        d = WORKLOADS["tabular"].input_shape[0]
        return torch.randn(d, generator=g) * (TABULAR_SCALE / math.sqrt(d))
    coarse = torch.randn(1, 1, 8, 8, generator=g)
    fine = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)[0]
    return (fine - fine.mean()) / fine.std()


def client_data(
    workload: str, client: int, seed: int, pattern: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``client``'s inputs and labels, drawn from its own (seed, client) generator.

    Args:
        workload: ``tabular`` or ``cnn``.
        client: the client's index.
        seed: the run's seed.
        pattern: :func:`shared_pattern` (computed here when not given).
    """
    spec = WORKLOADS[workload]
    shared = shared_pattern(workload, seed) if pattern is None else pattern
    g = _client_generator(seed, client)
    x = torch.randn(spec.samples, *spec.input_shape, generator=g)
    if workload == "tabular":
        p = torch.sigmoid(x @ shared)
        y = (torch.rand(spec.samples, generator=g) < p).long()
    else:
        y = torch.randint(0, 2, (spec.samples,), generator=g)
        x += (2.0 * y - 1.0).view(-1, 1, 1, 1) * IMAGE_SIGNAL * shared
    return x, y


def all_clients(workload: str, num_clients: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Every client's (inputs, labels)."""
    pattern = shared_pattern(workload, seed)
    return [client_data(workload, n, seed, pattern) for n in range(num_clients)]


@torch.no_grad()
def accuracy(model: nn.Module, clients: list[tuple[torch.Tensor, ...]]) -> float:
    """Accuracy of ``model`` on all the clients' data pooled."""
    model.eval()
    right = total = 0
    for x, y in clients:
        right += correct(model(x), y)
        total += int(y.shape[0])
    return right / total


def loader(x: torch.Tensor, y: torch.Tensor, batch: int) -> DataLoader:
    """A client's shuffling ``DataLoader`` of full batches (the usual simulation code)."""
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True)


def train_steps(model: nn.Module, data: DataLoader, steps: int, lr: float) -> float:
    """``steps`` steps of ``torch.optim.SGD`` on ``data`` (restarted when exhausted).

    Returns:
        The mean training loss over the steps.
    """
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    it = iter(data)
    total = torch.zeros(())
    for _ in range(steps):
        try:
            xb, yb = next(it)
        except StopIteration:
            it = iter(data)
            xb, yb = next(it)
        opt.zero_grad()
        loss = loss_fn(model(xb), yb)
        loss.backward()
        opt.step()
        total += loss.detach()
    return float(total) / steps


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """Worker-side timings: set-up (start to first round), rounds, the timed span."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.round_ends: list[float] = []
        self.first_round_start: float | None = None

    def round_start(self) -> None:
        """Mark the start of the first round (later calls do nothing)."""
        if self.first_round_start is None:
            self.first_round_start = time.perf_counter()

    def round_end(self) -> None:
        """Mark the end of a round."""
        self.round_ends.append(time.perf_counter())

    def timed_s(self) -> float:
        """Seconds from the end of the warm-up round to the end of the last round."""
        if len(self.round_ends) < 2:
            raise RuntimeError(f"{len(self.round_ends)} round(s) timed: expected at least 2")
        return self.round_ends[-1] - self.round_ends[0]

    def summary(self, num_clients: int) -> dict[str, float]:
        """``updates_per_s`` and the worker's own timings."""
        timed = self.timed_s()
        rounds = len(self.round_ends) - 1
        first = self.first_round_start if self.first_round_start is not None else self.start
        return {
            "timed_rounds": rounds,
            "timed_s": timed,
            "updates_per_s": num_clients * rounds / timed,
            "setup_s": first - self.start,
            "train_s": self.round_ends[-1] - first,
        }


def report(result: dict) -> None:
    """Print the worker's result line (the orchestrator reads the last one on stdout)."""
    result = {**result, "worker_peak_rss_mib": peak_rss_mib(), "torch": torch.__version__}
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def base_args(description: str):
    """The arguments every worker takes."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    return parser
