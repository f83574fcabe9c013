"""A client's local training problem as a pure function of (parameters, minibatch).

An :class:`Objective` is what :meth:`fedexp.engine.solver.context.Context.train` minimises: a loss
over a flat vector (the model's, or an algorithm's joint vector such as APFL's (w, v, α) or
FedRoD's (model, personal head)), with everything that differs between clients in ``aux``
tensors. Because the loss function itself is shared, the local solver
(:mod:`fedexp.engine.solver.steps`) stacks a cohort's parameters, ``aux`` tensors, masks and
optimiser states and takes each step of the whole cohort as one :func:`torch.func.vmap` (or,
for a linear model, its own batched operations: ``Objective.stacked``); a
loss that vmap cannot run is rerun row by row (each client's gradient by plain autograd) with
the same random draws.

The loss returns ``(loss, post)``: ``post`` is the vector with its non-gradient coordinates
(BatchNorm running statistics, ``frozen``) updated by the forward pass. With nothing frozen
return ``params.detach()`` (vmap needs a tensor there; ``post`` is then ignored).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field
from dataclasses import replace

import torch

Aux = Mapping[str, torch.Tensor]
#: loss(params, x, y, aux, u) -> (scalar loss, params with updated frozen coordinates | None);
#: ``u`` holds ``noise`` uniform draws of the client's stream for this step.
LossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Aux, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor | None],
]
#: stacked(params, x, y, aux, u, full) -> (losses [m], posts [m, d]) of m clients' stacked rows;
#: ``full``: no target is :data:`fedexp.models.task.PADDING` (the loss may skip its masks).
StackedLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Aux, torch.Tensor, bool],
    tuple[torch.Tensor, torch.Tensor | None],
]
#: stacked_grad(params, x, y, aux, u, full) -> (grads [m, d], losses [m]): ``stacked``'s gradients
#: in closed form, the bits one backward pass of it gives (no autograd graph).
StackedGradFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Aux, torch.Tensor, bool],
    tuple[torch.Tensor, torch.Tensor],
]
#: project(params, aux) -> params, applied after every step (e.g. clipping APFL's α to [0, 1]).
ProjectFn = Callable[[torch.Tensor, Aux], torch.Tensor]


@dataclass(frozen=True)
class Objective:
    """A local training problem.

    Attributes:
        loss: a module-level function, a bound method, or ``functools.partial`` of one over
            objects every client shares (``partial(self.loss, ctx)``: the run's model and
            task), so that clients can be batched; per-client data goes in ``aux``.
        aux: per-client tensors the loss reads (anchors, class priors, ...); for a cohort
            stacked ``[m, ...]`` in cohort order (0-dim tensors are shared by every client).
        frozen: boolean mask of coordinates that take ``post``'s value instead of a step.
        lr_scale: per-coordinate multiplier of the step size (e.g. APFL's η_α / η).
        noise: uniform draws per step passed to the loss as ``u`` (SuPerFed's λ ~ U(0, 1)),
            drawn from the client's stream after the minibatch indices.
        project: applied to the parameters after every step.
        stacked: the m clients' ``(losses [m], posts [m, d])`` from their stacked
            parameters, minibatches, ``aux`` and ``u``, as ``vmap(loss)`` gives them, computed
            by batched operations of the model's own (a linear model's); None: vmap ``loss``.
            Its last argument says that no target is padding (every batch whole), so that
            it may skip its masks.
        linear: a linear term ⟨c, θ⟩ added to the objective, c ``[m, d]`` stacked per client
            (or ``[d]`` shared): a gradient offset (SCAFFOLD's correction c − c_i, FedDyn's
            −∇L̃_i). The solver adds c to every step's gradient, on every path (vmapped, own
            batched form, row by row), so a loss needs no twin for it; the reported loss is
            ``loss``'s alone (a linear term has no meaning of its own as a loss).
        stacked_grad: ``stacked``'s losses and their gradients in closed form, the same bits
            as autograd's, where the model and loss have one (a binary logistic regression's
            cross-entropy: :mod:`fedexp.models.logistic`); set with ``stacked`` alone, and for
            nothing frozen. None: one backward pass of ``stacked`` (or of vmap's).
    """

    loss: LossFn
    aux: Aux = field(default_factory=dict)
    frozen: torch.Tensor | None = None
    lr_scale: torch.Tensor | None = None
    noise: int = 0
    project: ProjectFn | None = None
    stacked: StackedLossFn | None = None
    linear: torch.Tensor | None = None
    stacked_grad: StackedGradFn | None = None

    def with_linear(self, c: torch.Tensor | None) -> Objective:
        """This objective plus ⟨c, θ⟩ (added to any linear term it has; None: unchanged)."""
        if c is None:
            return self
        return replace(self, linear=c if self.linear is None else self.linear + c)
