"""What the engine hands every algorithm hook: the model, the task and the local solver."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedexp.data.federated import ClientData
from fedexp.errors import DivergenceError
from fedexp.models.flat import FlatModel
from fedexp.models.task import Task

#: Extra gradient term g(params) added to the loss gradient (e.g. FedProx's μ(θ − x)).
GradExtra = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Context:
    """Shared, read-only run facts for the algorithm hooks.

    Attributes:
        model: the network evaluated at flat parameter vectors.
        task: loss and evaluation.
        num_clients: N.
        lr: client learning rate η_l.
        local_steps: local steps per round when ``local_epochs`` is None.
        local_epochs: if set, steps = ceil(local_epochs · n_train / batch_size).
        batch_size: minibatch size (≤ 0: full batch).
        seed: the run's seed (for streams every party can derive, e.g. shared features).
        personal_idx: flat coordinates of the personalised parameters P (MATH §1).
        shared_idx: flat coordinates of the shared parameters S.
        round: the current round (set by the engine before the hooks of a round run).
        eval_batch_size: test inputs per forward pass in :meth:`evaluate` (images would not
            fit one pass).
    """

    model: FlatModel
    task: Task
    num_clients: int
    lr: float
    local_steps: int
    local_epochs: float | None
    batch_size: int
    seed: int = 0
    personal_idx: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    shared_idx: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    round: int = 0
    eval_batch_size: int = 256
    #: set by the lockstep backend while a round's clients run (``fedexp.engine.backends``)
    batcher: Any = None
    #: held while the shared module runs (client threads of the lockstep backend)
    model_lock: Any = field(default_factory=threading.RLock)
    #: False once the lockstep backend found the model or loss not vmappable
    vmap_ok: bool = True

    @property
    def device(self) -> torch.device:
        """Where parameters and data live."""
        return self.model.device

    def steps_for(self, data: ClientData) -> int:
        """Local steps of one client this round."""
        if self.local_epochs is None:
            return self.local_steps
        per_epoch = 1 if self.batch_size <= 0 else math.ceil(data.num_train / self.batch_size)
        return max(1, math.ceil(self.local_epochs * per_epoch))

    def loss_and_grad(
        self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss at ``params`` on (x, y) and its gradient with respect to ``params``."""
        p = params.detach().requires_grad_(True)
        with self.model_lock:  # functional_call swaps the shared module's parameters
            loss = self.task.loss(self.model(p, x), y)
            (grad,) = torch.autograd.grad(loss, p)
        return loss.detach(), grad

    def sgd(
        self,
        params: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        *,
        steps: int | None = None,
        lr: float | None = None,
        extra: GradExtra | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Local SGD on one client's training data.

        Args:
            params: starting point (not modified).
            data: the client's data.
            generator: the client's random stream for this round (batch draws).
            steps: number of steps (default :meth:`steps_for`).
            lr: step size (default the run's ``lr``).
            extra: added to each stochastic gradient (proximal terms).
            mask: optional 0/1 vector; only coordinates with 1 move.

        Returns:
            (final parameters, mean training loss over the steps).

        Raises:
            DivergenceError: the loss became NaN or infinite.
        """
        steps = self.steps_for(data) if steps is None else steps
        lr = self.lr if lr is None else lr
        if self.batcher is not None and extra is None and mask is None and self.batch_size > 0:
            return self.batcher.sgd(params, data, generator, steps, lr)
        return self.local_sgd(params, data, generator, steps, lr, extra, mask)

    def local_sgd(
        self,
        params: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        steps: int,
        lr: float,
        extra: GradExtra | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, float]:
        """One client's local SGD, step by step (what :meth:`sgd` runs without a batcher)."""
        self.model.module.train()
        p = params.detach().clone()
        total = torch.zeros((), device=p.device)
        for _ in range(steps):
            xb, yb = data.batch(self.batch_size, generator)
            loss, grad = self.loss_and_grad(p, xb, yb)
            if extra is not None:
                grad = grad + extra(p)
            if mask is not None:
                grad = grad * mask
            p = p - lr * grad
            total = total + loss
        mean = float(total) / max(steps, 1)
        self.check_finite(p, mean, lr)
        return p, mean

    def check_finite(self, params: torch.Tensor, mean_loss: float, lr: float) -> None:
        """Raise :class:`DivergenceError` if the loss or the parameters are NaN or infinite."""
        if not math.isfinite(mean_loss) or not bool(torch.isfinite(params).all()):
            raise DivergenceError(
                f"training loss is {mean_loss} at round {self.round}: the run diverged "
                f"(lower lr={lr} or check the data for extreme values)"
            )

    @torch.no_grad()
    def evaluate(self, params: torch.Tensor, data: ClientData) -> dict[str, float]:
        """Metrics of ``params`` on the client's own test split, plus its test loss.

        The test inputs go through the model in chunks of ``eval_batch_size``; the metrics and
        the loss are computed once, on all the client's logits.
        """
        self.model.module.eval()
        size = max(1, self.eval_batch_size)
        logits = torch.cat([self.model(params, chunk) for chunk in torch.split(data.x_test, size)])
        out = self.task.evaluate(logits, data.y_test)
        out["loss"] = float(self.task.loss(logits, data.y_test))
        return out
