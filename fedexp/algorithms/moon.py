"""MOON (Li, He, Song, CVPR 2021): FedAvg whose local loss adds a model-contrastive term.

"Model-Contrastive Federated Learning". Client n's local loss on a minibatch is

    ℓ = CE(θ) + μ · ℓ_con,
    ℓ_con = −log( e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ}) )

averaged over the minibatch's rows, with z the representation of the row under the model
being trained, z_glob under the global model the client received this round and z_prev under
the client's previous local model (the model it sent last time it trained), sim the cosine
similarity; z_glob and z_prev take no gradient. The server is FedAvg's. μ = 0 is FedAvg
exactly (tested).

The representation is the input of the model's head (``head``: glob patterns of the head's
parameters, None: the model's ``personal`` ones, e.g. mlp ``head.*``), i.e. the body's
output (:meth:`fedexp.models.flat.FlatModel.forward_with_input`). The paper adds a
projection head (two linear layers, 256 outputs) between the body and the classifier and
contrasts its outputs; fedexp's models have none, so this is the paper's variant without a
projection head (the authors' ``--use_project_head 0``). A model whose head is not one
submodule (a U-Net's decoder), or is the whole model (``model=logreg``: no body, so the
"representation" would be the raw input, the same under every model) is refused before
round 0 with one line.

From the authors' code (the MOON repository, ``--model_buffer_size 1``):

* the global and previous models compute their representations in evaluation mode (BatchNorm's
  running statistics, no dropout), the local model in training mode; likewise here;
* the previous model of a client that never trained: the authors' pool is empty in round 0,
  so their first round has no negative and ℓ_con = 0; a client first sampled later contrasts
  with its own untrained network. Here every client's previous model starts as the common
  initial model x⁰: in round 0 it equals the global model, so ℓ_con = log 2 with a zero
  gradient (the same steps as the authors'; the logged ``train_loss`` is μ·log 2 higher),
  and a client first sampled later contrasts with the untrained x⁰;
* their optimiser is SGD with momentum 0.9 and weight decay 1e-5 (here the run's
  ``optimizer``); μ = 5 for CIFAR-10, 1 for CIFAR-100 and Tiny-ImageNet; τ = 0.5.

Persists per client: ``prev`` (its last local model, flat, running statistics included) and
the optimiser state ``opt.*``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.algorithms.fedper import head_idx
from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import Positive
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Aux
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.steps import unstack_states
from fedexp.errors import ConfigError
from fedexp.models.task import valid_rows


@contextmanager
def _evaluation(module: nn.Module) -> Iterator[None]:
    """``module`` in evaluation mode for the block, its mode restored after."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


def representation_module(ctx: Context, head: Sequence[str] | None) -> str:
    """The submodule whose input is the representation: the one that holds the head.

    Raises:
        ConfigError: the head's parameters are not one submodule's, or are the whole model.
    """
    layout = ctx.model.layout

    def entries() -> torch.Tensor:  # whether each entry is in the head (on the host, once)
        mask = torch.zeros(layout.numel, dtype=torch.bool)
        mask[head_idx(ctx, head).cpu()] = True
        return mask[torch.tensor(layout.offsets, dtype=torch.long)]

    key = ("representation", None if head is None else tuple(head))
    flags = ctx.model.indices_once(key, entries).tolist()
    params = layout.names[: len([o for o in layout.offsets if o < layout.num_params])]
    chosen = [n for n, f in zip(params, flags, strict=False) if f]
    paths = [n.rpartition(".")[0].split(".") for n in chosen]
    common: list[str] = []
    for parts in zip(*paths, strict=False) if paths else ():
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    name = ".".join(common)
    inside = [n for n in params if n.startswith(name + ".")] if name else list(params)
    what = f"the head ({'model.personal' if head is None else list(head)}: {chosen[:4]})"
    if not chosen:
        raise ConfigError(f"algorithm=moon needs a head: {what} has no parameter")
    if not name or len(inside) == len(params) or set(inside) != set(chosen):
        raise ConfigError(
            f"algorithm=moon contrasts the input of the model's head: {what} is "
            f"{'the whole model' if len(chosen) == len(params) else 'not one submodule'}; "
            "choose a model with a body and a head (model=mlp, vgg8, resnet9, densenet) or name "
            "one submodule's parameters (algorithm.head=[...])"
        )
    return name


def contrastive_loss(
    ctx: Context,
    at: str,
    params: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    aux: Aux,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Task loss + μ ℓ_con on one client's minibatch (``aux``: glob, prev [d]; mu, tau)."""
    model = ctx.model
    rows = valid_rows(y)
    logits, buffers, z = model.forward_with_input(params, x, at, rows)
    with torch.no_grad(), _evaluation(model.module):
        z_glob = model.forward_with_input(aux["glob"], x, at)[2]
        z_prev = model.forward_with_input(aux["prev"], x, at)[2]
    pos = F.cosine_similarity(z, z_glob, dim=-1) / aux["tau"]
    neg = F.cosine_similarity(z, z_prev, dim=-1) / aux["tau"]
    con = torch.logaddexp(pos, neg) - pos  # −log(e^pos / (e^pos + e^neg)), per row
    con = torch.where(rows, con, 0.0).sum() / rows.sum()
    loss = ctx.task.loss(logits, y) + aux["mu"] * con
    return loss, model.with_buffers(params.detach(), buffers)


class MOON(FedAvg):
    """MOON. Persists per client: ``prev`` (its last local model) and ``opt.*``.

    Args:
        mu: μ ≥ 0, weight of the model-contrastive term (0: FedAvg).
        tau: τ > 0, temperature of the contrastive softmax.
        head: glob patterns of the head's parameters, whose submodule's input is the
            representation (None: the model's ``personal`` patterns).
        server_lr: as FedAvg.
        weighting: as FedAvg.
    """

    def __init__(
        self,
        mu: NonNegative = 1.0,
        tau: Positive = 0.5,
        head: Sequence[str] | None = None,
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        if isinstance(head, str):
            raise ValueError(f"head={head!r}: expected a list of glob patterns")
        super().__init__(server_lr, weighting)
        self.mu, self.tau = mu, tau
        self.head = None if head is None else [str(p) for p in head]

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """FedAvg's; a model without a representation is refused here, before round 0."""
        representation_module(ctx, self.head)
        return super().init_server(ctx, x0)

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """The previous model of a client that never trained: the common initial model."""
        return {"prev": x0.clone()}

    def objective(
        self, ctx: Context, anchor: torch.Tensor, prev: torch.Tensor | None = None
    ) -> Objective:
        """Task loss + μ ℓ_con against the received ``anchor`` and ``prev`` ([m, d] each).

        μ = 0: the task loss alone (FedAvg's objective). ``prev`` None: the anchor.
        """
        if self.mu == 0:
            return ctx.model_objective()
        dev = anchor.device
        aux = {
            "glob": anchor.detach(),
            "prev": (anchor if prev is None else prev).detach(),
            "mu": torch.full((), float(self.mu), device=dev),
            "tau": torch.full((), float(self.tau), device=dev),
        }
        loss = partial(contrastive_loss, ctx, representation_module(ctx, self.head))
        frozen = ctx.model.buffer_mask if ctx.model.has_buffers else None
        return Objective(loss, aux=aux, frozen=frozen)

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """E local steps on CE + μ ℓ_con; keep the trained model as ``prev``; send Δ."""
        assert isinstance(model_in, torch.Tensor)
        opt = ctx.optimizer
        prev = states.stack("prev").to(model_in)
        local = ctx.train(
            model_in,
            cohort,
            objective=self.objective(ctx, model_in.detach(), prev),
            opt_states=opt.load(states),
        )
        new_states = unstack_states(states, opt, local.opt_state, prev=local.params)
        return CohortResult(model_in - local.params, new_states, {"train_loss": local.loss})
