"""A binary logistic regression's loss and gradient over a cohort in closed form (issue 69).

Of m stacked models ``θ = (w, b)`` (``[m, d]``, :class:`fedexp.models.tabular.LogisticRegression`
with one logit) on their minibatches, the mean binary cross-entropy
(:meth:`fedexp.models.task.ClassificationTask.loss_stacked`) has the gradient

    ∂L/∂z = (1 − t − σ(−z)) / n  at each valid row (0 at padding),  ∂L/∂w = Σ ∂L/∂z · x,
    ∂L/∂b = Σ ∂L/∂z,

so a local step needs no autograd graph: :class:`BinaryLogistic` computes the losses and
gradients that one backward pass of the stacked loss gives (``fedexp.engine.solver.steps``'s
vmapped path), bit for bit, with the kernels autograd would run (``softplus_backward`` of the
same cotangent, the weight's gradient one ``bmm`` of the inputs), in about half the operations:
no autograd bookkeeping, the masks' gradient made in one division, the logits' bias and the
gradient's layout handled as one ``[m, 1, d]`` row. ``tests/test_solver.py`` holds it equal
to autograd's; ``tests/test_round_census.py`` counts a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedexp.models.tabular import LogisticRegression
from fedexp.models.task import PADDING
from fedexp.models.task import ClassificationTask
from fedexp.models.task import Task

#: the parameters of a one-logit :class:`fedexp.models.tabular.LogisticRegression`, in order
_NAMES = (("linear.weight",), ("linear.weight", "linear.bias"))


@dataclass(frozen=True)
class BinaryLogistic:
    """m binary logistic regressions' gradients and losses (``Objective.stacked_grad``).

    Called as ``(params, x, y, aux, u, full) -> (grads [m, d], losses [m])``. Equal (and
    hashed) by its fields: a captured round's key (:mod:`fedexp.engine.solver.capture`) is
    the same every round.

    Attributes:
        inputs: features of a flattened input (the weight's length).
        bias: whether the model has an intercept (the flat vector's last entry).
    """

    inputs: int
    bias: bool

    def __call__(
        self,
        params: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: object,
        u: torch.Tensor,
        full: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients ``[m, d]`` and mean losses ``[m]`` at ``params``.

        On ``x`` ``[m, B, ...]`` and ``y`` ``[m, B]`` (``full``: no label is
        :data:`fedexp.models.task.PADDING`).
        """
        m, d = params.shape
        size = y.shape[1]
        x = x.flatten(2)
        row = params.view(m, 1, d)
        w, b = row.split([self.inputs, 1], -1) if self.bias else (row, None)
        z = torch.bmm(w, x.transpose(1, 2))  # [m, 1, B]: the narrow layer's (W xᵀ) orientation
        if b is not None:
            z = z + b
        y = y.view(m, 1, size)
        # 1 − t at every valid row (a padding row's term is masked below): of 0/1 labels a
        # comparison, of float targets (soft ones too) the loss's own expression
        negative = 1 - y.to(z.dtype) if y.is_floating_point() else y == 0
        neg_z = z.neg()
        per_sample = F.softplus(neg_z).add(z * negative)
        if full:
            # the loss's cotangent 1/B at every row, contiguous as autograd hands it on
            # (softplus_backward takes a broadcast gradient element by element: other bits)
            loss = per_sample.sum(-1).view(m) / size
            dz = torch.full((m, 1, size), 1.0 / size, dtype=z.dtype, device=z.device)
        else:
            valid = y != PADDING
            count = valid.sum(-1, keepdim=True, dtype=z.dtype)  # n (exact in floats)
            loss = (torch.where(valid, per_sample, 0.0).sum(-1, keepdim=True) / count).view(m)
            dz = valid / count  # 1/n at the valid rows: the masked mean's cotangent
        # d/dz of softplus(−z) + (1 − t) z, as autograd sums its two branches
        dz = (dz * negative).sub(torch.ops.aten.softplus_backward(dz, neg_z, 1.0, 20.0))
        grad = torch.bmm(dz, x)  # [m, 1, inputs]
        if b is not None:
            grad = torch.cat([grad, dz.sum(-1, keepdim=True)], -1)
        return grad.view(m, d), loss


def closed_form(model: object, task: Task) -> BinaryLogistic | None:
    """The closed-form gradient of ``model`` under ``task``'s loss where it has one.

    ``model`` a :class:`fedexp.models.flat.FlatModel`: a one-logit logistic regression under
    cross-entropy, its parameters all trained, no buffers; else None (autograd).
    """
    module = getattr(model, "module", None)
    layout = getattr(model, "layout", None)
    if (
        not isinstance(module, LogisticRegression)
        or not isinstance(task, ClassificationTask)
        or layout is None
        or layout.names not in _NAMES
        or layout.num_params != layout.numel
        or module.linear.out_features != 1
    ):
        return None
    return BinaryLogistic(module.linear.in_features, len(layout.names) == 2)
