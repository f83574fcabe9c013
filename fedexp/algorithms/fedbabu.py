"""FedBABU (Oh, Kim, Yun, ICLR 2022): train the body only, the head frozen at its random start.

"FedBABU: Towards Enhanced Representation for Federated Image Classification". The model is a
body and a head (classifier). The head keeps its random initial value for the whole of
federated training: every client trains the body alone (E local steps on the task loss with
the head's coordinates masked) and uploads it; the server averages the bodies. Evaluation
personalises: each evaluated client fine-tunes the whole current model (body and head) on its
training data and is tested with the result; nothing of it is kept.

This is :class:`FedPer` (its split, body-only messages both ways and server step) with the
head frozen (:meth:`FedPer.train_mask`), so every client's head is the initial one, which the
server's ``x`` also holds in its head coordinates. The head's bytes never cross the network;
``finetune_steps=0`` evaluates the global model itself (both tested).

From the authors' code (github.com/jhoon-oh/FedBABU): the body and head are split by name
(``linear`` layers are the head), the head's step size is 0 during training, bodies averaged
(BatchNorm statistics with them); personalisation (analysis.ipynb) fine-tunes body and head
together for 5 epochs with one fresh SGD (momentum 0.9), one step size for both: lr 1e-3,
which is their training lr (0.1) after its two ×0.1 decays, i.e. the lr training ended with.
Here: ``finetune_epochs`` (5) passes over the client's training rows (or ``finetune_steps``
steps) of the run's optimiser from a fresh state, at ``finetune_lr`` (None: the run's lr,
which has no decay schedule), on minibatches from the client's evaluation stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import ServerLr
from fedexp.algorithms.fedper import FedPer
from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import Positive
from fedexp.config.ranges import Range
from fedexp.data.client import ClientData
from fedexp.engine.solver.context import Context
from fedexp.errors import ConfigError


class FedBABU(FedPer):
    """FedBABU. Persists per client: ``head`` (the initial head, as FedPer's) and ``opt.*``.

    Args:
        finetune_epochs: τ_ft as passes over the client's training rows at evaluation (the
            paper's 5).
        finetune_steps: τ_ft as steps, which overrides ``finetune_epochs`` (0: the global
            model is evaluated as it is).
        finetune_lr: step size of the fine-tuning (None: the run's lr).
        head: glob patterns of the frozen head (None: the model's ``personal`` patterns).
        server_lr: server step on the averaged body difference (1: the paper's average).
        weighting: "samples" (ω_n ∝ n_train) or "uniform" (the authors' plain mean).
    """

    def __init__(
        self,
        finetune_epochs: NonNegative = 5.0,
        finetune_steps: Annotated[int, Range(ge=0, note="0: the global model")] | None = None,
        finetune_lr: Positive | None = None,
        head: Sequence[str] | None = None,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        super().__init__(head, server_lr, weighting)
        self.finetune_epochs, self.finetune_steps = finetune_epochs, finetune_steps
        self.finetune_lr = finetune_lr
        no_finetune = finetune_steps == 0 or (finetune_steps is None and finetune_epochs == 0)
        self.eval_with_data = not no_finetune

    def train_mask(self, ctx: Context) -> torch.Tensor:
        """1 on the body, 0 on the head: the head never moves (made once a run)."""

        def body() -> torch.Tensor:
            mask = torch.ones(ctx.model.layout.numel, device=ctx.device)
            mask[self.personal_idx(ctx)] = 0.0
            return mask

        key = ("babu-mask", None if self.head is None else tuple(self.head), str(ctx.device))
        return ctx.model.indices_once(key, body)

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """FedAvg's ``x``, whose head coordinates are the frozen head.

        A model without a body or without a head is refused here, before round 0.
        """
        head, d = self.personal_idx(ctx).numel(), ctx.model.layout.numel
        if head == 0 or head == d:
            what = "no head" if head == 0 else "no body (the head is the whole model)"
            raise ConfigError(
                f"algorithm=fedbabu trains a body under a frozen head: this model has {what}; "
                "choose one with both (model=mlp, vgg8, resnet9, densenet) or set algorithm.head"
            )
        return super().init_server(ctx, x0)

    def global_vector(
        self, ctx: Context, server: State, average: Callable[[str], torch.Tensor]
    ) -> torch.Tensor | None:
        """``x``: the federated body with the head every client shares, frozen at x0's."""
        return server["x"]

    def finetune_steps_for(self, ctx: Context, data: ClientData) -> int:
        """τ_ft of one client: ``finetune_steps``, or ``finetune_epochs`` passes of minibatches."""
        if self.finetune_steps is not None:
            return self.finetune_steps
        per_epoch = 1 if ctx.batch_size <= 0 else math.ceil(data.num_train / ctx.batch_size)
        return math.ceil(round(self.finetune_epochs * per_epoch, 9))

    def eval_models(
        self, ctx: Context, server: State, states: list[State], cohort: Cohort
    ) -> torch.Tensor:
        """The current model (body and the frozen head) fine-tuned whole on each client's data.

        Clients of one cohort with different τ_ft (training sets of different sizes) fine-tune
        in groups of equal τ_ft.
        """
        x = server["x"].repeat(len(cohort), 1)
        lr = self.finetune_lr
        steps = [self.finetune_steps_for(ctx, d) for d in cohort.data]
        if len(set(steps)) == 1:
            return ctx.train(x, cohort, steps=steps[0], lr=lr).params
        out = torch.empty_like(x)
        for k in sorted(set(steps)):
            rows = [i for i, s in enumerate(steps) if s == k]
            at = torch.tensor(rows, dtype=torch.int64)  # on the host, as a cohort's rows
            part = Cohort(
                [cohort.clients[i] for i in rows],
                [cohort.data[i] for i in rows],
                cohort.rows[at],
                cohort.keys[at],
                cohort.draws[at],
                cohort.pool,
            )
            out[at.to(x.device)] = ctx.train(x[: len(rows)], part, steps=k, lr=lr).params
        return out
