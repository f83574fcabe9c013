"""What the engine hands every algorithm hook: the model, the task and the local solver."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import torch

from fedexp.contract import Cohort
from fedexp.contract import Senders
from fedexp.data.augment import NoAugmentation
from fedexp.data.client import ClientData
from fedexp.engine.solver.objective import Aux
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.optim import SGD
from fedexp.engine.solver.optim import Optimizer
from fedexp.engine.solver.server_optim import ServerOptimizer
from fedexp.engine.solver.server_optim import ServerSGD
from fedexp.errors import DivergenceError
from fedexp.models.flat import FlatModel
from fedexp.models.logistic import closed_form
from fedexp.models.task import Task
from fedexp.models.task import valid_rows


@dataclass
class Context:
    """Shared, read-only run facts for the algorithm hooks.

    Attributes:
        model: the network evaluated at flat parameter vectors.
        task: loss and evaluation.
        num_clients: N.
        lr: client learning rate η_l.
        local_steps: local steps per round when ``local_epochs`` is None.
        local_epochs: if set, E: steps = ⌈E · ⌈n_train / batch_size⌉⌉ (E whole: E epochs
            of ⌈n/B⌉ minibatches, the last of each short).
        batch_size: minibatch size (≤ 0: full batch).
        sampling: "shuffle" (shuffled passes) or "replacement"
            (:func:`fedexp.engine.solver.passes.minibatch_indices`).
        seed: the run's seed (for streams every party can derive, e.g. shared features).
        personal_idx: flat coordinates of the personalised parameters P (``model.personal``).
        shared_idx: flat coordinates of the shared parameters S.
        round: the current round (set by the engine before the hooks of a round run).
        eval_batch_size: test inputs per forward pass in :meth:`evaluate` (images would not
            fit one pass).
        optimizer: the run's local optimiser (its state lives in the client's state).
        server_optimizer: the server's step on a global model (its moments live in the server
            state, ``fedexp.engine.solver.server_optim``).
    """

    model: FlatModel
    task: Task
    num_clients: int
    lr: float
    local_steps: int
    local_epochs: float | None
    batch_size: int
    sampling: str = "shuffle"
    seed: int = 0
    personal_idx: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    shared_idx: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    round: int = 0
    #: the round's senders, every process's and slice's (set by the engine before
    #: ``server_update``): their count |S_t| and training samples
    senders: Senders = field(default_factory=Senders)
    eval_batch_size: int = 256
    #: bytes a local step of the cohort may fill (``memory_budget``, resolved); the solver
    #: trains the cohort in slices of clients that fit it (0: slices by data size only)
    memory_budget: int = 0
    #: :func:`fedexp.engine.memory.client_step_bytes`' estimates, by minibatch shape
    step_bytes: dict = field(default_factory=dict, repr=False)
    #: the training batches' augmentation (``augment`` config group; none by default)
    augment: Any = field(default_factory=NoAugmentation)
    #: the run's local optimiser (``optimizer`` config group; plain SGD by default)
    optimizer: Optimizer = field(default_factory=SGD)
    #: the server's step on the mean upload of a global model (``server_optimizer`` config
    #: group; FedAvg's x − η_s ū by default; FedAdagrad, FedAdam, FedYogi)
    server_optimizer: ServerOptimizer = field(default_factory=ServerSGD)
    #: False once the solver found the model or loss not vmappable (then row by row)
    vmap_ok: bool = True
    #: the local solver, ``(ctx, params, cohort, **options) -> CohortLocal``: the run's builder
    #: hands it :func:`fedexp.engine.solver.steps.train` (the context imports no solver)
    solver: Callable[..., Any] | None = field(default=None, repr=False)

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
        """The task's loss of the model at ``params``; its updated running statistics.

        The statistics are those of the batch's rows that are not padding.
        """
        # the valid rows only where BatchNorm's statistics read them (3 ops a step saved)
        rows = valid_rows(y) if getattr(self.model, "functional_stats", True) else None
        logits, buffers = self.model.forward_train(params, x, rows)
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

    def model_loss_stacked(
        self,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: Aux,
        u: torch.Tensor,
        full: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`model_loss` of m clients at once: losses ``[m]``, and ``params`` as posts.

        ``params`` ``[m, d]``, ``x`` ``[m, B, ...]``; no running statistics (:meth:`_stacks`);
        ``full``: no target is padding (the task's loss skips its masks). The posts are
        ``params`` themselves: nothing is frozen, and the solver reads posts only where
        something is (no detached copy made a step).
        """
        logits = self.model.forward_stacked(params, x)
        return self.task.loss_stacked(logits, y, full), params

    def proximal_loss_stacked(
        self,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: Aux,
        u: torch.Tensor,
        full: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`proximal_loss` of m clients at once (``aux``: ``[m, d]`` anchors, ``[m]`` μ)."""
        loss, post = self.model_loss_stacked(params, x, y, aux, u, full)
        diff = params - aux["anchor"]
        return loss + 0.5 * aux["mu"] * (diff * diff).sum(-1), post

    def _stacks(self) -> bool:
        """Whether the model and task compute a cohort's losses without vmap.

        A logistic regression, a ReLU MLP and, vmapped, a VGG8 without BatchNorm do
        (:attr:`fedexp.models.flat.FlatModel.stacks`).
        """
        return self.model.stacks and hasattr(self.task, "loss_stacked")

    def model_objective(self) -> Objective:
        """The task's loss of the model (running statistics frozen to the forward pass)."""
        if not self._stacks():
            return Objective(self.model_loss, frozen=self._frozen())
        # a binary logistic regression's gradient in closed form (no autograd graph a step)
        grad = closed_form(self.model, self.task)
        return Objective(
            self.model_loss, frozen=self._frozen(), stacked=self.model_loss_stacked,
            stacked_grad=grad,
        )  # fmt: skip

    def proximal_objective(self, anchor: torch.Tensor, mu: float) -> Objective:
        """Task loss + (μ/2)‖θ − anchor‖² (μ = 0 is :meth:`model_objective`)."""
        if mu == 0:
            return self.model_objective()
        aux = {"anchor": anchor.detach(), "mu": torch.full((), float(mu), device=anchor.device)}
        stacked = self.proximal_loss_stacked if self._stacks() else None
        return Objective(self.proximal_loss, aux=aux, frozen=self._frozen(), stacked=stacked)

    def _frozen(self) -> torch.Tensor | None:
        return self.model.buffer_mask if self.model.has_buffers else None

    def loss_grad_post(
        self,
        objective: Objective,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        u: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One client's objective at ``params`` on (x, y): (loss, gradient, post), autograd."""
        p = params.detach().requires_grad_(True)
        if u is None:
            u = torch.zeros(0, device=p.device)
        loss, post = objective.loss(p, x, y, objective.aux, u)
        (grad,) = torch.autograd.grad(loss, p)
        return loss.detach(), grad, None if post is None else post.detach()

    # ---------------------------------------------------------- local solver
    def train(self, params: torch.Tensor, cohort: Cohort, **options: Any) -> Any:
        """Local training of every client of ``cohort`` (the run's :attr:`solver`).

        ``params`` [m, d] are the clients' starting points in cohort order; ``options`` are
        the solver's (objective, opt_states, steps, lr, mask, optimizer, batch). Returns its
        ``CohortLocal`` (params [m, d], loss [m], opt_state).
        """
        if self.solver is None:
            raise RuntimeError("Context.train: no local solver was given (Context(solver=...))")
        return self.solver(self, params, cohort, **options)

    def work_key(self, data: ClientData) -> Hashable:
        """Clients with equal keys take the same steps on alike batches: one sub-cohort.

        The step count (:meth:`steps_for`), and with full batches (``batch_size`` ≤ 0) the
        shape of the training set every step is taken on.
        """
        full = tuple(data.x_train.shape) if self.batch_size <= 0 else None
        return self.steps_for(data), full

    def cohort_steps(self, cohort: Cohort) -> int:
        """:meth:`steps_for` of the clients of ``cohort`` (one sub-cohort: the same for all)."""
        counts = {self.steps_for(d) for d in cohort.data}
        if len(counts) != 1:
            raise ValueError(f"a cohort with different step counts {sorted(counts)}")
        return counts.pop()

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
