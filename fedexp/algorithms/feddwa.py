"""FedDWA (Liu, Wu, Chen, Hu, Zhou, Wu, IJCAI 2023): personalised aggregation by the server.

"FedDWA: Personalized Federated Learning with Dynamic Weight Adjustment"; the authors' code is
github.com/Sherrylife/FedDWA (``servers/serverFedDWA.py``, ``clients/clientFedDWA.py``).
Client i trains the personalised model it receives for E local steps → θ_i, then trains θ_i
once more (the "one-step ahead adaptation") → the guidance model θ̂_i, and uploads both. The
server weighs the models received this round for each received client i,

    w_ji ∝ 1 / (‖θ̂_i − θ_j‖² + ε),   j over the clients that uploaded this round,

normalises each column, keeps its K largest weights (the K nearest models), renormalises, and
stores Σ_j w_ji θ_j as client i's personalised model, sent to i the next time it is sampled
(x0 before i's first participation).

Choices, and differences from the paper and the authors' code:

* Guidance model: the paper writes one gradient step; the authors' ``train_one_step`` reruns
  the whole local training (E epochs) from θ_i, keeping the optimiser (plain SGD there).
  ``guide_steps=null`` (default) follows the code (the run's local steps / epochs, from the
  optimiser state after training; only the state after the first training persists);
  ``guide_steps=1`` is the paper's single step (a minibatch step).
* Distances use the trainable parameters only (the authors' ``named_parameters()``); running
  statistics (BatchNorm) are aggregated with the same weights. The authors' clients keep their
  own statistics (they only load parameters); here the whole vector is the personal model.
* ε: the authors add nothing (a zero distance gives an infinite weight and NaN after the
  normalisation); here ε (default 1e-12) keeps the weights finite: a model equal to θ̂_i gets
  almost all the weight, all-equal distances give the plain mean. Weights are computed in
  float64, the aggregate in the models' dtype. Ties in the top-K go to ``torch.topk``'s
  choice (the authors': ``argpartition``).
* Client weights (ω_i ∝ n_train) are not used, as in the authors' code.
* The server computes client i's aggregate when i uploads and sends it at i's next
  participation; the authors push it at the start of the next round to the same clients. The
  message sent is the same.
* Uplink: both parts are models ("model" kind): a lossless channel sends them as they are; a
  lossy one codes the change against the previous upload of the same part, which the server
  holds (``Transport._transmit``), rather than sparsifying a model.
* Evaluation: the authors evaluate the guidance model θ̂_i of the client's last
  participation (``clientFedDWA.test_accuracy``), x0 before it; ``evaluate="guide"`` does
  that, ``"model"`` uses θ_i, ``"personal"`` the server's aggregate for i.

Persists: the server's ``personal`` [N, d] (row i: client i's next model, init x0); each
client's evaluated vector (``guide`` or ``model``, init x0; nothing for ``"personal"``) and
its optimiser state.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Annotated

import torch

from fedexp.algorithms.base import Algorithm
from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import StackedUpdates
from fedexp.algorithms.base import State
from fedexp.algorithms.base import Updates
from fedexp.algorithms.base import Weights
from fedexp.algorithms.base import gather_rows
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.contract import update_parts
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states
from fedexp.transfer import to_device


def dwa_weights(
    guides: torch.Tensor, models: torch.Tensor, topk: int, eps: float = 1e-12
) -> torch.Tensor:
    """FedDWA's weight matrix w[j, i] ∝ 1/(‖θ̂_i − θ_j‖² + ε), top-K per column, columns sum to 1.

    Args:
        guides: [m, d] guidance models θ̂_i (one column each).
        models: [m, d] trained models θ_j (one row each).
        topk: K, weights kept per column (K ≥ m keeps all).
        eps: ε added to the squared distances.

    Returns:
        [m, m] float64 matrix, non-negative, each column summing to one.
    """
    m = models.shape[0]
    # dist[j, i] = ‖θ_j − θ̂_i‖², from the differences (no cancellation), no [m, m, d] tensor
    dist = torch.cdist(models, guides, compute_mode="donot_use_mm_for_euclid_dist").square()
    inv = 1.0 / (dist.to(torch.float64) + eps)
    w = inv / inv.sum(dim=0, keepdim=True)
    if topk < m:
        kept = torch.topk(w, topk, dim=0).indices
        mask = torch.zeros_like(w).scatter_(0, kept, 1.0)
        w = w * mask
        w = w / w.sum(dim=0, keepdim=True)
    return w


class FedDWA(Algorithm):
    """FedDWA.

    Args:
        topk: K, neighbours kept per client (the authors' runs: 5).
        guide_steps: local steps of the guidance model (null: the run's local steps /
            epochs, the authors' code; 1: the paper's one step).
        eps: ε added to the squared distances (the authors: none).
        evaluate: "guide" (θ̂_i, the authors' code), "model" (θ_i) or "personal" (the
            server's aggregate for i).
    """

    uplink_parts = MappingProxyType({"model": "model", "guide": "model"})

    def __init__(
        self,
        topk: PositiveInt = 5,
        guide_steps: PositiveInt | None = None,
        eps: Annotated[float, Range(ge=0, note="0: none, as the authors")] = 1e-12,
        evaluate: str = "guide",
    ) -> None:
        if evaluate not in ("guide", "model", "personal"):
            raise ValueError(f"evaluate={evaluate!r}: expected 'guide', 'model' or 'personal'")
        self.topk, self.guide_steps, self.eps, self.evaluate = topk, guide_steps, eps, evaluate

    # ------------------------------------------------------------------ state
    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """Every client's personalised model starts at x0."""
        return {"personal": x0.expand(ctx.num_clients, -1).clone()}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """The evaluated vector starts at x0."""
        return {} if self.evaluate == "personal" else {self.evaluate: x0.clone()}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """Client i's personalised model Σ_j w_ji θ_j from its last participation, [m, d]."""
        return StackedUpdates(clients, gather_rows(server["personal"], clients))

    # ----------------------------------------------------------------- client
    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """E local steps → θ_i; one more pass → θ̂_i; send both."""
        assert isinstance(model_in, torch.Tensor)
        opt = ctx.optimizer
        local = ctx.train(model_in, cohort, opt_states=opt.load(states))
        guide = ctx.train(local.params, cohort, opt_states=local.opt_state, steps=self.guide_steps)
        kept = {}
        if self.evaluate != "personal":
            kept[self.evaluate] = guide.params if self.evaluate == "guide" else local.params
        new_states = unstack_states(states, opt, local.opt_state, **kept)
        upload = {"model": local.params, "guide": guide.params}
        metrics = {"train_loss": local.loss, "guide_loss": guide.loss}
        return CohortResult(upload, new_states, metrics)

    # ----------------------------------------------------------------- server
    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """Row i ← Σ_j w_ji θ_j for every received i (j over the received clients)."""
        if not updates:
            return server
        clients = sorted(updates)
        parts = update_parts(updates, clients)
        models, guides = parts["model"], parts["guide"]
        p = ctx.model.layout.num_params
        w = dwa_weights(guides[:, :p], models[:, :p], self.topk, self.eps)
        personal = server["personal"]
        idx = to_device(clients, personal.device)
        mixed = (w.T.to(models.dtype) @ models).to(personal.dtype)
        return {**server, "personal": personal.index_copy(0, idx, mixed)}

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """θ̂_i ("guide"), θ_i ("model") or the server's aggregate ("personal"), [m, d]."""
        if self.evaluate == "personal":
            return gather_rows(server["personal"], clients)
        return states.stack(self.evaluate)
