"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan, AAAI 2023): adaptive local aggregation.

"FedALA: Adaptive Local Aggregation for Personalized Federated Learning", Algorithm 1; the
authors' code is github.com/TsingZ0/FedALA (``system/utils/ALA.py``). Client i keeps its last
local model Θ_i and element-wise weights W_i ∈ [0, 1] (init 1) for the top p parameter
tensors. On receiving the global model Θ it builds

    Θ̂_i = Θ_i + (Θ − Θ_i) ⊙ W_i   on the top p tensors,   Θ̂_i = Θ   on the lower ones,

learns W_i on a random s % of its training data, minibatch by minibatch,
W_i ← clip(W_i − η_W ∇_W L(Θ̂_i(W_i)), 0, 1) (autograd through Θ̂_i, W_i the only leaf), then
trains Θ̂_i for E local steps (``ctx.train``, the run's optimiser) and uploads FedAvg's
Δ = Θ − θ^E, the change against the received model: with η_s = 1 the server's new model is
the weighted mean of the trained local models, as in the paper. The server is FedAvg's.

Choices, and differences from the paper and the authors' code:

* p counts parameter tensors from the end of the layout (``ctx.model.layout.names``, the
  order of ``model.parameters()``), as the authors' ``layer_idx`` does: a linear layer is two
  tensors (weight, bias), so their ``-p 2`` (``run_me.sh``) is the last layer. ``layers=0``
  means no tensor (Θ̂ = Θ: FedAvg exactly); the authors' ``layer_idx=0``
  selects every tensor (a slicing artefact their docstring adopts): use ``layers=null``.
* Θ̂ is computed as ``torch.lerp(Θ_i, Θ, W)``, which equals Θ bit for bit where W = 1, so
  W ≡ 1 (η_W = 0) is FedAvg exactly (tested).
* Weight learning follows ``ALA.py``: a contiguous slice of ``int(s/100 · n_train)`` training
  samples from a random start, in order, in minibatches of the run's ``batch_size`` (≤ 0: the
  whole slice), W updated after every minibatch. The start is drawn from a separate stream
  (seed, 41, round, client), so the local training draws exactly FedAvg's minibatches.
  The forward pass is in training mode (running statistics it would update are discarded).
* Start phase: ALA is skipped while Θ equals Θ_i (round 0, where every Θ_i = Θ = x0: the
  authors' "deactivate ALA at the 1st communication iteration"); at the first participation
  where it runs, W is trained epoch after epoch until the population standard deviation of
  the last ``num_pre_loss`` epoch losses (each the loss of the epoch's last minibatch) is below
  ``threshold``, and for one epoch at every later participation. ``threshold=0.01`` is the
  paper's setting (the authors' README: "we set it to 0.01 in our paper by default", a small
  threshold lengthening the start phase); ``ALA.py``'s default, which their run scripts leave
  in place, is 0.1 (``algorithm.threshold=0.1`` reproduces their code). ``num_pre_loss=10``
  is ``ALA.py``'s. Their loop has no cap; ``max_start_epochs`` adds one (null: none).
* Participation: only the sampled clients run ALA (the paper's Algorithm 1). The authors'
  simulation runs ALA on every client every round (``send_models`` loops over all clients);
  their runs use full participation, where the two agree.
* Running statistics (BatchNorm) get no gradient and are not in W: with ``stats="global"``
  Θ̂ takes the global model's (so W ≡ 1 is FedAvg for every model); ``stats="local"`` keeps the
  client's own, which is what the authors' code does in effect (it only ever copies
  ``parameters()``).
* Evaluation: the authors evaluate their clients after ALA and before local training, i.e.
  Θ̂_i. ``evaluate="mix"`` (default) evaluates Θ_i + (Θ − Θ_i) ⊙ W_i with the current global
  Θ and the stored W_i (W is not re-learnt, evaluation sees no training data);
  ``evaluate="local"`` the model after the client's last local training, Θ_i.

Persists: each client's ``theta`` (Θ_i, after its local training), ``W`` (the weights of
the top-p coordinates), ``started`` ([1], 1 once the start phase is done), ``client`` ([1],
its index, for its ALA stream) and its optimiser state; the server's ``x``.
"""

from __future__ import annotations

import statistics
from typing import Annotated

import torch

from fedexp.algorithms.base import Cohort, CohortResult, Stacked, State
from fedexp.algorithms.fedavg import FedAvg, ServerLr
from fedexp.config.ranges import Positive, PositiveInt, Range
from fedexp.data.client import ClientData
from fedexp.engine import rng
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.steps import unstack_states

#: stream purpose of the ALA data slice (beside ``fedexp.engine.rng``'s)
ALA_STREAM = 41


class FedALA(FedAvg):
    """FedALA.

    Args:
        eta: η_W, step of the aggregation weights (the authors: 1.0).
        rand_percent: s, percent of the training data W is learnt on (the authors: 80).
        layers: p, parameter tensors counted from the end that ALA mixes (2: the last linear
            layer's weight and bias, the authors' ``-p 2``); 0: none (FedAvg); null: all.
        threshold: start phase stops when the std of the last ``num_pre_loss`` epoch losses
            is below it (the paper: 0.01; ``ALA.py``'s default: 0.1).
        num_pre_loss: losses in that standard deviation (``ALA.py``: 10).
        max_start_epochs: cap on the start phase's epochs (null: none, as the authors).
        stats: running statistics of Θ̂: "global" (the received model's) or "local" (Θ_i's).
        evaluate: "mix" (Θ_i + (Θ − Θ_i) ⊙ W_i with the current Θ) or "local" (Θ_i).
        server_lr: as FedAvg.
        weighting: as FedAvg.
    """

    def __init__(
        self,
        eta: Annotated[float, Range(ge=0, note="0: FedAvg")] = 1.0,
        rand_percent: Annotated[float, Range(gt=0, le=100)] = 80,
        layers: Annotated[int, Range(ge=0, note="0: FedAvg; null: all")] | None = 2,
        threshold: Positive = 0.01,
        num_pre_loss: PositiveInt = 10,
        max_start_epochs: PositiveInt | None = 100,
        stats: str = "global",
        evaluate: str = "mix",
        server_lr: ServerLr = 1.0,
        weighting: str = "samples",
    ) -> None:
        super().__init__(server_lr, weighting)
        if stats not in ("global", "local"):
            raise ValueError(f"stats={stats!r}: expected 'global' or 'local'")
        if evaluate not in ("mix", "local"):
            raise ValueError(f"evaluate={evaluate!r}: expected 'mix' or 'local'")
        self.eta, self.rand_percent, self.layers = eta, rand_percent, layers
        self.threshold, self.num_pre_loss = threshold, num_pre_loss
        self.max_start_epochs, self.stats, self.evaluate = max_start_epochs, stats, evaluate

    # ----------------------------------------------------------------- layout
    def top_range(self, ctx: Context) -> tuple[int, int]:
        """[lo, hi): the flat coordinates of the top p parameter tensors (contiguous)."""
        layout = ctx.model.layout
        hi = layout.num_params
        offsets = [off for off in layout.offsets if off < hi]
        if self.layers is None or self.layers >= len(offsets):
            return 0, hi
        if self.layers == 0:
            return hi, hi
        return offsets[len(offsets) - self.layers], hi

    def mix(
        self, ctx: Context, glob: torch.Tensor, local: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """Θ̂ = Θ_i + (Θ − Θ_i) ⊙ W on the top tensors, Θ below, statistics per ``stats``."""
        lo, hi = self.top_range(ctx)
        stats = glob if self.stats == "global" else local
        return torch.cat([glob[:lo], torch.lerp(local[lo:hi], glob[lo:hi], w), stats[hi:]])

    # ------------------------------------------------------------------ state
    init_per_client = True  # the state keeps the client's id

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """Θ_i = x0, W_i = 1, start phase pending."""
        lo, hi = self.top_range(ctx)
        return {
            "theta": x0.clone(),
            "W": torch.ones(hi - lo, dtype=x0.dtype, device=x0.device),
            "started": torch.zeros(1, device=x0.device),
            "client": torch.full((1,), client, dtype=torch.long, device=x0.device),
        }

    # -------------------------------------------------------------------- ALA
    def ala_step(
        self,
        ctx: Context,
        glob: torch.Tensor,
        local: torch.Tensor,
        w: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One minibatch: W ← clip(W − η_W ∇_W L(Θ̂(W); x, y), 0, 1); returns (W, loss)."""
        leaf = w.detach().requires_grad_(True)
        ctx.model.module.train()
        logits, _ = ctx.model.forward_train(self.mix(ctx, glob, local, leaf), x)
        loss = ctx.task.loss(logits, y)
        (grad,) = torch.autograd.grad(loss, leaf)
        return torch.clamp(leaf.detach() - self.eta * grad, 0.0, 1.0), loss.detach()

    def learn_weights(
        self,
        ctx: Context,
        glob: torch.Tensor,
        local: torch.Tensor,
        w: torch.Tensor,
        data: ClientData,
        generator: torch.Generator,
        start_phase: bool,
    ) -> tuple[torch.Tensor, int, float]:
        """ALA's weight learning on a random slice of s % of the data; (W, epochs, loss)."""
        n = data.num_train
        size = min(n, max(1, int(self.rand_percent / 100 * n)))
        start = int(torch.randint(n - size + 1, (1,), generator=generator))
        xs, ys = data.x_train[start : start + size], data.y_train[start : start + size]
        chunk = size if ctx.batch_size <= 0 else ctx.batch_size
        batches = list(zip(torch.split(xs, chunk), torch.split(ys, chunk), strict=True))
        glob, local = glob.detach(), local.detach()
        losses: list[float] = []
        while True:
            for xb, yb in batches:
                w, loss = self.ala_step(ctx, glob, local, w, xb, yb)
            losses.append(float(loss))  # the epoch's last minibatch, as the authors
            if not start_phase:
                break
            recent = losses[-self.num_pre_loss :]
            if len(losses) > self.num_pre_loss and statistics.pstdev(recent) < self.threshold:
                break
            if self.max_start_epochs is not None and len(losses) >= self.max_start_epochs:
                break
        return w, len(losses), losses[-1]

    # ----------------------------------------------------------------- client
    def adapt(
        self, ctx: Context, glob: torch.Tensor, state: State, data: ClientData
    ) -> tuple[torch.Tensor, State, float]:
        """ALA of one client: (Θ̂, its new ``W`` and ``started``, the ALA epochs taken)."""
        theta, w, started = state["theta"], state["W"], state["started"]
        lo, hi = self.top_range(ctx)
        epochs = 0.0
        if hi > lo and not torch.equal(glob[:hi], theta[:hi]):
            stream = rng.generator(ctx.seed, ALA_STREAM, ctx.round, int(state["client"][0]))
            start_phase = not bool(started[0] > 0)
            w, taken, _ = self.learn_weights(ctx, glob, theta, w, data, stream, start_phase)
            started, epochs = torch.ones_like(started), float(taken)
        return self.mix(ctx, glob, theta, w).detach(), {"W": w, "started": started}, epochs

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: list[State], cohort: Cohort
    ) -> CohortResult:
        """ALA → Θ̂; E local steps from Θ̂; send Δ = Θ − θ^E (FedAvg's upload).

        ALA runs client by client (its own stream and stopping rule); the local steps (the
        run's optimiser, its state kept) are one run of the whole cohort.
        """
        assert isinstance(model_in, torch.Tensor)
        glob = model_in.detach()
        done = [
            self.adapt(ctx, glob[i], s, d)
            for i, (s, d) in enumerate(zip(states, cohort.data, strict=True))
        ]
        init = torch.stack([a[0] for a in done])
        opt = ctx.optimizer
        local = ctx.train(
            init,
            cohort,
            objective=self.objective(ctx, init),
            opt_states=[opt.load(s) for s in states],
        )
        adapted = [{**s, **a[1]} for s, a in zip(states, done, strict=True)]
        new_states = unstack_states(adapted, opt, local.opt_state, theta=local.params)
        epochs = torch.tensor([a[2] for a in done], device=init.device)
        metrics = {"ala_epochs": epochs, "train_loss": local.loss}
        return CohortResult(model_in - local.params, new_states, metrics)

    def eval_params(
        self, ctx: Context, server: State, client_state: State, client: int
    ) -> torch.Tensor:
        """Θ_i + (Θ − Θ_i) ⊙ W_i with the current Θ ("mix"), or Θ_i ("local")."""
        if self.evaluate == "local":
            return client_state["theta"]
        return self.mix(ctx, server["x"], client_state["theta"], client_state["W"])
