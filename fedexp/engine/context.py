"""What the engine hands every algorithm hook: the model, the task and the local solver."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedexp.data.federated import ClientData
from fedexp.engine.objective import Aux, Objective
from fedexp.engine.optim import SGD, Optimizer
from fedexp.engine.optim import State as OptState
from fedexp.errors import DivergenceError
from fedexp.models.flat import FlatModel
from fedexp.models.task import Task

#: Extra gradient term g(params) added to the loss gradient (e.g. FedProx's μ(θ − x)).
GradExtra = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LocalResult:
    """What a local solver returns.

    Attributes:
        params: the final parameters.
        loss: the mean training loss over the steps.
        opt_state: the optimiser's state after the steps.
    """

    params: torch.Tensor
    loss: float
    opt_state: OptState


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
        optimizer: the run's local optimiser (its state lives in the client's state).
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
    #: the run's local optimiser (``optimizer`` config group; plain SGD by default)
    optimizer: Optimizer = field(default_factory=SGD)
    #: set by the lockstep backend while a round's clients run (``fedexp.engine.backends``)
    batcher: Any = None
    #: held while the shared module runs (client threads of the lockstep backend)
    model_lock: Any = field(default_factory=threading.RLock)
    #: False once the lockstep backend found the model or loss not vmappable
    vmap_ok: bool = True
    #: every client's training data in one tensor (``fedexp.engine.pool``; lockstep only)
    pool: Any = None

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

    # ------------------------------------------------------------- objectives
    def model_loss(
        self,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: Aux,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The task's loss of the model at ``params``; its updated running statistics."""
        logits, buffers = self.model.forward_train(params, x)
        return self.task.loss(logits, y), self.model.with_buffers(params.detach(), buffers)

    def proximal_loss(
        self,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: Aux,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Task loss + (μ/2)‖θ − anchor‖² (``aux["anchor"]``, ``aux["mu"]``; FedProx, Ditto)."""
        loss, post = self.model_loss(params, x, y, aux, u)
        diff = params - aux["anchor"]
        return loss + 0.5 * aux["mu"] * (diff * diff).sum(), post

    def model_objective(self) -> Objective:
        """The task's loss of the model (running statistics frozen to the forward pass)."""
        return Objective(self.model_loss, frozen=self._frozen())

    def proximal_objective(self, anchor: torch.Tensor, mu: float) -> Objective:
        """Task loss + (μ/2)‖θ − anchor‖² (μ = 0 is :meth:`model_objective`)."""
        if mu == 0:
            return self.model_objective()
        aux = {"anchor": anchor.detach(), "mu": torch.tensor(float(mu), device=anchor.device)}
        return Objective(self.proximal_loss, aux=aux, frozen=self._frozen())

    def _frozen(self) -> torch.Tensor | None:
        return self.model.buffer_mask if self.model.has_buffers else None

    def loss_and_grad(
        self,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        objective: Objective | None = None,
        u: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss at ``params`` on (x, y) and its gradient with respect to ``params``."""
        loss, grad, _ = self._loss_grad_post(objective or self.model_objective(), params, x, y, u)
        return loss, grad

    def _loss_grad_post(
        self,
        objective: Objective,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        u: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        p = params.detach().requires_grad_(True)
        if u is None:
            u = torch.zeros(0, device=p.device)
        with self.model_lock:  # functional_call swaps the shared module's parameters
            loss, post = objective.loss(p, x, y, objective.aux, u)
            (grad,) = torch.autograd.grad(loss, p)
        return loss.detach(), grad, None if post is None else post.detach()

    # ---------------------------------------------------------- local solvers
    def train(
        self,
        params: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        *,
        objective: Objective | None = None,
        optimizer: Optimizer | None = None,
        opt_state: OptState | None = None,
        steps: int | None = None,
        lr: float | None = None,
        extra: GradExtra | None = None,
        mask: torch.Tensor | None = None,
        batch_size: int | None = None,
    ) -> LocalResult:
        """Local training of one client: ``steps`` optimiser steps on minibatches.

        Each step draws a minibatch (indices from ``generator``), then ``objective.noise``
        uniforms, computes the objective's gradient, adds ``extra``, applies ``mask``, takes an
        optimiser step, writes the frozen coordinates (running statistics) from the forward
        pass and applies ``objective.project``.

        Args:
            params: starting point (not modified).
            data: the client's data.
            generator: the client's random stream for this round.
            objective: what to minimise (default: the task loss of the model).
            optimizer: the update rule (default: the run's ``optimizer``).
            opt_state: the optimiser's state to continue from (None: fresh).
            steps: number of steps (default :meth:`steps_for`).
            lr: step size (default the run's ``lr``).
            extra: added to each gradient (not batched by the lockstep backend; prefer an
                objective).
            mask: optional 0/1 vector; only coordinates with 1 move.
            batch_size: minibatch size of these steps (default the run's; ≤ 0: every step on
                all of ``data``'s training samples, e.g. pFedMe's K steps on one minibatch,
                given as ``data``).

        Returns:
            The final parameters, the mean loss over the steps and the optimiser state.

        Raises:
            DivergenceError: the loss or the parameters became NaN or infinite.
        """
        steps = self.steps_for(data) if steps is None else steps
        lr = self.lr if lr is None else lr
        objective = objective or self.model_objective()
        optimizer = optimizer or self.optimizer
        if opt_state is None:
            opt_state = optimizer.init(params.detach())
        size = self.batch_size if batch_size is None else batch_size
        if self.batcher is not None and extra is None and (size <= 0 or size == self.batch_size):
            return self.batcher.train(
                params, data, generator, steps, lr, objective, optimizer, opt_state, mask, size <= 0
            )
        return self.local_train(
            params, data, generator, steps, lr, objective, optimizer, opt_state, mask, extra, size
        )

    def train_cohort(
        self,
        params: torch.Tensor,
        cohort: Any,
        *,
        objective: Objective | None = None,
        opt_states: list[OptState | None] | OptState | None = None,
        steps: int | None = None,
        lr: float | None = None,
        mask: torch.Tensor | None = None,
        optimizer: Optimizer | None = None,
        batch: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        """:meth:`train` of a whole cohort at once (``fedexp.engine.cohort``).

        Successive calls draw each client's minibatches in the order its own calls of
        :meth:`train` would (its stream's draw counter is ``cohort.draws``).

        Args:
            params: [m, d] the clients' starting points, in ``cohort.clients`` order.
            cohort: the round's :class:`fedexp.engine.cohort.Cohort`.
            objective: what to minimise, its ``aux`` tensors stacked [m, ...] (0-dim ones
                shared); default the task loss.
            opt_states: each client's optimiser state to continue from (None: fresh), or
                their stack (a previous call's ``CohortLocal.opt_state``).
            steps: local steps (default :meth:`steps_for`, which must then be the same for
                every client of the cohort).
            lr: step size (default the run's ``lr``).
            mask: 0/1, [d] for every client or [m, d]; only coordinates with 1 move.
            optimizer: the update rule (default: the run's ``optimizer``).
            batch: inputs and targets [m, B, ...] every step is taken on, instead of drawn
                minibatches (:func:`fedexp.engine.cohort.draw_batch`; :meth:`train`'s
                ``batch_size=0`` on a drawn minibatch).

        Returns:
            A :class:`fedexp.engine.cohort.CohortLocal`, or None when the cohort cannot run
            as one computation (clients with different step counts, full batches of different
            sizes, optimiser states with different entries): the engine then runs the
            per-client hooks.
        """
        from fedexp.engine.cohort import stack_opt_states, train_cohort

        steps = self.cohort_steps(cohort) if steps is None else steps
        if steps is None:
            return None
        if batch is None and not self.cohort_batches(cohort):
            return None
        optimizer = optimizer or self.optimizer
        if isinstance(opt_states, dict):  # already stacked (a previous call's ``opt_state``)
            stacked = opt_states
        else:
            stacked = stack_opt_states(optimizer, params, opt_states or [None] * params.shape[0])
            if stacked is None:
                return None
        objective = objective or self.model_objective()
        keep = None if mask is None else (mask == 0).expand(params.shape)
        lr = self.lr if lr is None else lr
        return train_cohort(
            self, params, cohort, objective, stacked, steps, lr, keep, optimizer, batch
        )

    def cohort_steps(self, cohort: Any) -> int | None:
        """:meth:`steps_for` of every client of ``cohort`` when it is the same; else None."""
        counts = {self.steps_for(d) for d in cohort.data}
        return counts.pop() if len(counts) == 1 else None

    def cohort_batches(self, cohort: Any) -> bool:
        """Whether ``cohort``'s minibatches stack: drawn ones, or full ones of equal sizes."""
        return self.batch_size > 0 or len({tuple(d.x_train.shape) for d in cohort.data}) == 1

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
        """:meth:`train` on the model's loss with a fresh optimiser state: (params, loss)."""
        out = self.train(params, data, generator, steps=steps, lr=lr, extra=extra, mask=mask)
        return out.params, out.loss

    def local_train(
        self,
        params: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        steps: int,
        lr: float,
        objective: Objective,
        optimizer: Optimizer,
        opt_state: OptState,
        mask: torch.Tensor | None = None,
        extra: GradExtra | None = None,
        batch_size: int | None = None,
    ) -> LocalResult:
        """One client's local training, step by step (what :meth:`train` runs alone)."""
        size = self.batch_size if batch_size is None else batch_size
        self.model.module.train()
        p = params.detach().clone()
        state = dict(opt_state)
        total = torch.zeros((), device=p.device)
        step_lr = lr if objective.lr_scale is None else lr * objective.lr_scale
        keep = None if mask is None else mask == 0
        for _ in range(steps):
            xb, yb = data.batch(size, generator)
            u = torch.zeros(0, device=p.device)
            if objective.noise:
                u = torch.rand(objective.noise, generator=generator).to(p.device)
            loss, grad, post = self._loss_grad_post(objective, p, xb, yb, u)
            if extra is not None:
                grad = grad + extra(p)
            if mask is not None:
                grad = grad * mask
            new, state = optimizer.step(p, grad, state, step_lr)
            if objective.frozen is not None and post is not None:
                new = torch.where(objective.frozen, post, new)
            if keep is not None:
                new = torch.where(keep, p, new)
            if objective.project is not None:
                new = objective.project(new, objective.aux)
            p = new
            total = total + loss
        mean = float(total) / max(steps, 1)
        self.check_finite(p, mean, lr)
        return LocalResult(p, mean, state)

    def check_finite(self, params: torch.Tensor, mean_loss: float, lr: float) -> None:
        """Raise :class:`DivergenceError` if the loss or the parameters are NaN or infinite.

        The round is named as the run's history numbers it (``self.round + 1``: round 1 is
        the first round trained); losses that grow but stay finite are the runner's check
        (``divergence_factor``).
        """
        if not math.isfinite(mean_loss) or not bool(torch.isfinite(params).all()):
            raise DivergenceError(
                f"training loss is {mean_loss} in round {self.round + 1}: the run diverged "
                f"(lower lr={lr}, or check the data for extreme values)"
            )

    @torch.no_grad()
    def evaluate(
        self,
        params: torch.Tensor,
        data: ClientData,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """Metrics of ``params`` on the client's own test split, plus its test loss.

        The test inputs go through ``forward`` (default: the model) in chunks of
        ``eval_batch_size``; the metrics and the loss are computed once, on all the client's
        logits.
        """
        self.model.module.eval()
        size = max(1, self.eval_batch_size)
        fwd = forward or self.model
        logits = torch.cat([fwd(params, chunk) for chunk in torch.split(data.x_test, size)])
        out = self.task.evaluate(logits, data.y_test)
        out["loss"] = float(self.task.loss(logits, data.y_test))
        return out
