"""FedRoD (Chen & Chao, ICLR 2022): a generic model trained for balance, a personal head on top.

"On Bridging Generic and Personalized Federated Learning for Image Classification", the
linear-head variant (Fed-RoD (linear); the hypernetwork variant is not implemented). The model
is body f and generic head g (all of θ, shared and averaged as FedAvg); each client adds a
personal head p, its own. Every minibatch:

* θ = (f, g) takes a step on the balanced softmax (BSM) loss: the task loss of the
  prior-adjusted logits g(f(x)) + log π, π the client's class frequencies (Ren et al. 2020), so
  every client fits the same class-balanced objective whatever its label mix;
* p takes a step on the task loss of g(z).detach() + p(z.detach()), z = f(x): it learns the
  client's own correction on top of the generic predictor, and its gradient reaches neither f
  nor g.

Both steps are one step of the run's optimiser on the joint vector [θ ; p]: the losses are
summed, and since the BSM term does not depend on p and the personal term does not reach θ,
each part gets exactly its own gradient (PFLlib's FedRoD takes the BSM step first, then the p
step on the features and generic logits computed before it: the same thing). The
client uploads Δ = θ_in − θ_out and the server is FedAvg's. A client is evaluated with
g(z) + p(z) (``evaluate_with="generic"``: with g(z) alone, the paper's G-FL figure).

The personal forward is the model at θ with its body coordinates detached and its head
coordinates replaced by p. For a linear head that is exactly p(z.detach()); for a deeper head
(a U-Net decoder) it is the natural generalisation: the head's layers at p, on the body's
detached features. p holds only the head's parameters: running statistics of a head's
BatchNorm are the generic model's, and every running statistic follows the generic forward
(``Objective.frozen``). With dropout the two forwards draw their own masks.

Balanced softmax for each model kind:

* C logits: cross-entropy of logits + log π.
* One logit (binary logistic regression, trained with BCE): softmax over [0, z] + [log π0,
  log π1] is the softmax over [0, z + log(π1/π0)], so the BSM loss is BCE of z + log(π1/π0).
* Segmentation (C channels per pixel, Dice + cross-entropy): π are the client's pixel class
  frequencies and the task loss takes the prior-adjusted logits, so its cross-entropy part is
  exactly the per-pixel BSM (the paper is classification only).

Class counts come from the client's training labels at its first participation and persist.
An empty class is counted as ``count_floor`` samples (1 by default: it changes no non-empty
class, since counts are whole numbers, and keeps log π finite; with a zero count a one-logit
model's log(π1/π0) is ±∞ and the loss is not finite).

Sources and differences: the authors published no code (github.com/hongyouc/Fed-RoD holds a
README only); the rules above follow the paper's description (a generic predictor trained with a
class-balanced loss, a personal module on top of it minimising the client's empirical risk) and
PFLlib's implementation (clientrod.py), which agree (summary: docs/algorithms.md). p starts at
zero (``personal_init="zero"``, the default), so before any training the personalised model is
the generic one; PFLlib and FL-bench copy the generic head instead (``personal_init="copy"``),
which also avoids the symmetric start of a zero head deeper than one layer. The run's optimiser
(and its weight decay) acts on p as on θ; PFLlib gives p its own SGD with the same step size,
which plain SGD and per-coordinate momentum or Adam make the same. The hypernetwork that
generates p is not implemented.

Persists per client: p (``"p"``), the class counts (``"counts"``) and the optimiser state of
[θ ; p] (``"opt.*"``). With uniform class counts the BSM loss is the task loss, so θ follows
FedAvg exactly; p = 0 makes the personalised model the generic one (both tested).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import Positive
from fedexp.engine.clients.pool import padded
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Aux
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.steps import unstack_states
from fedexp.errors import ConfigError
from fedexp.models.task import valid_rows


def class_counts(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Samples (or pixels, for segmentation masks) of each class in ``y``, as floats."""
    return torch.bincount(y.reshape(-1).long(), minlength=num_classes)[:num_classes].float()


def cohort_class_counts(cohort: Cohort, num_classes: int) -> torch.Tensor:
    """[m, C] :func:`class_counts` of each cohort client's training labels, read at once.

    The clients' training rows gathered padded from their pool (``pool.padded``), so that
    the ops do not grow with the cohort; client by client where they are not pooled.
    """
    gathered = padded([d.pooled() for d in cohort.data])
    if gathered is None:
        return torch.stack([class_counts(d.y_train, num_classes) for d in cohort.data])
    _, y, lengths = gathered
    m, longest = y.shape[:2]
    y = y.reshape(m, longest, -1).long()
    valid = torch.arange(longest, device=y.device) < lengths.to(y.device)[:, None]
    labels = torch.where(valid[..., None] & (y < num_classes), y, num_classes).reshape(m, -1)
    counts = torch.zeros(m, num_classes + 1, dtype=torch.int64, device=y.device)
    counts.scatter_add_(1, labels, torch.ones_like(labels))
    return counts[:, :num_classes].float()


def log_priors(counts: torch.Tensor, floor: float = 1.0) -> torch.Tensor:
    """The log class priors log π of ``counts`` ([..., C]), an empty class counted as ``floor``."""
    counts = counts.clamp_min(floor)
    return (counts / counts.sum(dim=-1, keepdim=True)).log()


def prior_adjusted(logits: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """Logits + log π over the class axis (dim 1); one logit gets log(π1/π0).

    Raises:
        ValueError: the model's outputs match neither the C classes nor one binary logit.
    """
    num_classes, out = log_prior.shape[-1], logits.shape[1]
    if out == 1 and num_classes == 2:
        adjust = log_prior[1:] - log_prior[:1]
    elif out == num_classes:
        adjust = log_prior
    else:
        raise ValueError(f"the model has {out} outputs for {num_classes} classes")
    return logits + adjust.reshape(1, -1, *([1] * (logits.dim() - 2)))


class _JointLoss:
    """FedRoD's minibatch loss over [θ ; p] for one run's model (one object for all clients)."""

    def __init__(self, ctx: Context, head: torch.Tensor) -> None:
        self.ctx, self.head = ctx, head  # ctx kept alive: the cache is keyed by its id
        self.d = ctx.model.layout.numel

    def personal(self, theta: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """θ with its head coordinates replaced by p, every other coordinate detached."""
        return theta.detach().index_put((self.head,), p)

    def loss(
        self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, aux: Aux, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The generic BSM loss of g(z) plus the task loss of g(z).detach() + p(z.detach())."""
        model, task = self.ctx.model, self.ctx.task
        theta, p = w[: self.d], w[self.d :]
        rows = valid_rows(y)
        logits_g, buffers = model.forward_train(theta, x, rows)
        logits_p = model.forward_train(self.personal(theta, p), x, rows)[0]
        generic = task.loss(prior_adjusted(logits_g, aux["log_prior"]), y)
        personal = task.loss(logits_g.detach() + logits_p, y)
        post = w.detach()  # a tensor even without statistics: vmap returns no None
        if buffers is not None:
            post = torch.cat([model.with_buffers(theta.detach(), buffers), p.detach()])
        return generic + personal, post


class FedRoD(FedAvg):
    """FedRoD with a linear personal head (Chen & Chao, ICLR 2022).

    Args:
        head: glob patterns of the head's parameters (None: the model config's ``personal``
            patterns, e.g. mlp ``head.*``; logistic regression's head is the whole model).
        count_floor: count given to a class absent from a client's training data.
        personal_init: "zero" (p = 0: the personalised model starts as the generic one) or
            "copy" (p starts as the initial generic head, as PFLlib and FL-bench do).
        evaluate_with: "personal" (g(z) + p(z)) or "generic" (g(z) alone).
        server_lr: as FedAvg.
        weighting: as FedAvg.
    """

    def __init__(
        self,
        head: list[str] | None = None,
        count_floor: Positive = 1.0,
        personal_init: str = "zero",
        evaluate_with: str = "personal",
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        if personal_init not in ("zero", "copy"):
            raise ValueError(f"personal_init={personal_init!r}: expected 'zero' or 'copy'")
        if evaluate_with not in ("personal", "generic"):
            raise ValueError(f"evaluate_with={evaluate_with!r}: expected 'personal' or 'generic'")
        super().__init__(server_lr, weighting)
        self.head = None if head is None else list(head)
        self.count_floor = count_floor
        self.personal_init, self.evaluate_with = personal_init, evaluate_with
        self._losses: dict[int, _JointLoss] = {}  # a cache per run, not state

    def _joint(self, ctx: Context) -> _JointLoss:
        """The run's joint loss (one object for every client and round: built once)."""
        joint = self._losses.get(id(ctx))
        if joint is None:
            if not getattr(ctx.task, "exclusive", True):
                raise ConfigError(
                    "algorithm=fedrod: its balanced softmax reweights exclusive classes by their "
                    "priors; dataset.region=all trains overlapping regions (one sigmoid each); "
                    "choose one region (dataset.region=whole, core or enhancing)"
                )
            layout = ctx.model.layout
            if self.head is None:
                idx = ctx.personal_idx
            else:
                idx = layout.matched(self.head, "algorithm.head", ctx.device)
            idx = idx[idx < layout.num_params].to(ctx.device)
            if idx.numel() == 0:
                raise ConfigError(
                    f"FedRoD needs a head: the patterns {self.head or 'model.personal'} match no "
                    f"parameter of {', '.join(layout.names[:6])}..."
                )
            joint = self._losses[id(ctx)] = _JointLoss(ctx, idx)
        return joint

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """The personal head: zeros, or the initial generic head (``personal_init``)."""
        head = self._joint(ctx).head
        p = x0[head].clone() if self.personal_init == "copy" else torch.zeros_like(x0[head])
        return {"p": p}

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """E joint steps on [θ ; p] (BSM for θ, personal loss for p); send Δ = θ_in − θ_out."""
        assert isinstance(model_in, torch.Tensor)
        joint, opt, dev = self._joint(ctx), ctx.optimizer, model_in.device
        if "counts" in states and "counts" not in states.present:  # every client's, kept
            counts = states.stack("counts")
        else:  # from the training labels at a first participation (the others' alike)
            counts = cohort_class_counts(cohort, ctx.task.num_classes).to(dev)
        p = states.stack("p")
        frozen = None
        if ctx.model.has_buffers:  # running statistics follow the generic forward; p has none
            keep = torch.zeros(p.shape[1], dtype=torch.bool, device=dev)
            frozen = torch.cat([ctx.model.buffer_mask, keep])
        aux = {"log_prior": log_priors(counts, self.count_floor).to(model_in.dtype)}
        local = ctx.train(
            torch.cat([model_in, p], dim=1),
            cohort,
            objective=Objective(joint.loss, aux=aux, frozen=frozen),
            opt_states=opt.load(states),
        )
        theta, p = local.params[:, : joint.d], local.params[:, joint.d :]
        new_states = unstack_states(states, opt, local.opt_state, p=p, counts=counts)
        return CohortResult(model_in - theta, new_states, {"train_loss": local.loss})

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """[x ; p_n] of every client at once ([x ; 0], shared, with ``"generic"``)."""
        x, p = server["x"], states.stack("p")
        if self.evaluate_with == "generic":
            shared = torch.cat([x, p.new_zeros(p.shape[1:])])
            return shared.expand(len(clients), -1)
        return torch.cat([x.expand(len(clients), -1), p], dim=1)

    def global_vector(
        self, ctx: Context, server: State, average: Callable[[str], torch.Tensor]
    ) -> torch.Tensor | None:
        """[x ; 0]: the generic predictor g (a zero head p adds nothing to its logits)."""
        x = server["x"]
        return torch.cat([x, x.new_zeros(self._joint(ctx).head.numel())])

    def predict(self, ctx: Context, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """g(z) + p(z): the model at θ plus the model at θ with its head replaced by p."""
        joint = self._joint(ctx)
        theta, p = params[: joint.d], params[joint.d :]
        if self.evaluate_with == "generic":
            return ctx.model(theta, x)
        return ctx.model(theta, x) + ctx.model(joint.personal(theta, p), x)
