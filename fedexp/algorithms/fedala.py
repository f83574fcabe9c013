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
* A cohort runs ALA at once: each epoch is the cohort's minibatch steps (every client's
  gradient in one computation, the solver's; a client whose slice is shorter, or whose
  weights are done, sits the extra steps out), and after it the stopping rule of each client
  in its start phase is read on the host (one read an epoch). The start of each slice is its
  stream's first draw, computed for the cohort at once (:func:`first_draws`). A round's work
  grows with the most epochs any client takes, not with the clients.
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
from functools import partial
from typing import Annotated

import numpy as np
import torch

from fedexp import streams
from fedexp.algorithms.base import Cohort
from fedexp.algorithms.base import CohortResult
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import Stacked
from fedexp.algorithms.base import State
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.fedavg import ServerLr
from fedexp.config.ranges import Positive
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.objective import Aux
from fedexp.engine.solver.objective import Objective
from fedexp.engine.solver.steps import stacked_gradients
from fedexp.engine.solver.steps import unstack_states
from fedexp.models.task import PADDING
from fedexp.models.task import valid_rows
from fedexp.transfer import to_device

#: stream purpose of the ALA data slice (beside ``fedexp.streams``'s)
ALA_STREAM = 41


def first_draws(seeds: list[int], highs: np.ndarray) -> np.ndarray:
    """``torch.randint(high, (1,), generator=torch.Generator().manual_seed(seed))`` of each pair.

    That draw is the first output of the generator's MT19937 (Matsumoto & Nishimura 1998),
    seeded with the seed's low 32 bits, modulo ``high`` (< 2³²): computed here for every seed at
    once on the host, without a generator and a tensor op per client (tested against torch).
    """
    mt = np.empty((398, len(seeds)), dtype=np.uint32)  # the state words the first output reads
    mt[0] = [s & 0xFFFFFFFF for s in seeds]
    with np.errstate(over="ignore"):  # arithmetic modulo 2³², as MT19937's
        for j in range(1, 398):
            prev = mt[j - 1]
            mt[j] = np.uint32(1812433253) * (prev ^ (prev >> np.uint32(30))) + np.uint32(j)
    y = (mt[0] & np.uint32(0x80000000)) | (mt[1] & np.uint32(0x7FFFFFFF))
    odd = np.where(y & np.uint32(1), np.uint32(0x9908B0DF), np.uint32(0))
    y = mt[397] ^ (y >> np.uint32(1)) ^ odd
    y ^= y >> np.uint32(11)
    y ^= (y << np.uint32(7)) & np.uint32(0x9D2C5680)
    y ^= (y << np.uint32(15)) & np.uint32(0xEFC60000)
    y ^= y >> np.uint32(18)
    return y.astype(np.int64) % np.asarray(highs, dtype=np.int64)


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
        """Θ̂ = Θ_i + (Θ − Θ_i) ⊙ W on the top tensors, Θ below, statistics per ``stats``.

        Of one client's vectors or of rows of them (``[m, d]``, ``[m, d]``, ``[m, hi − lo]``).
        """
        lo, hi = self.top_range(ctx)
        stats = glob if self.stats == "global" else local
        top = torch.lerp(local[..., lo:hi], glob[..., lo:hi], w)
        return torch.cat([glob[..., :lo], top, stats[..., hi:]], dim=-1)

    # ------------------------------------------------------------------ state
    init_per_client = True  # the state keeps the client's id
    stacks = False  # the ALA slices' starts come from the run's seed (slices)

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
    def ala_loss(
        self,
        ctx: Context,
        w: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        aux: Aux,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """L(Θ̂(W); x, y) of one client, ``aux``: its Θ and Θ_i (statistics updates dropped)."""
        mixed = self.mix(ctx, aux["glob"], aux["local"], w)
        logits, _ = ctx.model.forward_train(mixed, x, valid_rows(y))
        return ctx.task.loss(logits, y), w.detach()

    def slices(
        self, ctx: Context, cohort: Cohort, ids: list[int]
    ) -> tuple[dict[str, torch.Tensor], int, int]:
        """Each client's ALA data: a slice of s % of its training set from a random start.

        The start is the first draw of the client's stream (seed, 41, round, client)
        (:func:`first_draws`); the slice is read in minibatches of ``batch_size`` (≤ 0: the
        whole slice). Returns [m] int64 tensors ``start``, ``size``, ``chunk`` (the minibatch
        size) and ``batches`` (the minibatches of an epoch), then the most minibatches and
        the largest minibatch of any client (from the host's sizes: no read).
        """
        num = np.array([d.num_train for d in cohort.data], dtype=np.int64)
        size = np.minimum(num, np.maximum(1, (self.rand_percent / 100 * num).astype(np.int64)))
        seeds = [streams.derive_seed(ctx.seed, ALA_STREAM, ctx.round, n) for n in ids]
        start = first_draws(seeds, num - size + 1)
        chunk = size if ctx.batch_size <= 0 else np.full_like(size, ctx.batch_size)
        batches = -(-size // chunk)
        table = to_device(np.stack([start, size, chunk, batches]), ctx.device)
        names = ("start", "size", "chunk", "batches")
        return dict(zip(names, table, strict=True)), int(batches.max()), int(chunk.max())

    def minibatch(
        self, cohort: Cohort, ala: dict[str, torch.Tensor], t: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Minibatch t of every client's slice, [m, width, ...].

        Rows past a client's minibatch are padding (target :data:`PADDING`, no weight in the
        loss); a client whose slice has fewer minibatches gets its last one again (its step
        is then not taken).
        """
        step = (ala["batches"] - 1).clamp(max=t)
        cols = torch.arange(width, device=step.device)
        pos = (step * ala["chunk"])[:, None] + cols  # position in the slice
        valid = (cols < ala["chunk"][:, None]) & (pos < ala["size"][:, None])
        x, y = cohort.pool.gather(cohort.rows, ala["start"][:, None] + torch.where(valid, pos, 0))
        valid = valid.view(*valid.shape, *([1] * (y.dim() - 2)))
        return x, torch.where(valid, y if y.is_floating_point() else y.long(), PADDING)

    def ala_objective(self, ctx: Context, glob: torch.Tensor, local: torch.Tensor) -> Objective:
        """L(Θ̂(W)) of the rows ``glob``, ``local`` ([m, d]) as a function of their W."""
        frozen = None  # W has no frozen coordinate; with running statistics the model cannot
        if ctx.model.has_buffers:  # compute by a function of the batch, a mask sends it row by row
            lo, hi = self.top_range(ctx)
            frozen = torch.zeros(hi - lo, dtype=torch.bool, device=glob.device)
        aux = {"glob": glob.detach(), "local": local.detach()}
        return Objective(partial(self.ala_loss, ctx), aux=aux, frozen=frozen)

    def ala_step(
        self, ctx: Context, objective: Objective, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One minibatch of every row: W ← clip(W − η_W ∇_W L(Θ̂(W); x, y), 0, 1); (W, losses).

        Autograd through Θ̂, W the only leaf; the rows' gradients at once
        (:func:`fedexp.engine.solver.steps.stacked_gradients`; row by row if vmap refuses).
        """
        noise = torch.zeros(w.shape[0], 0, device=w.device)
        args = (w.detach(), x, y, objective.aux, noise)
        try:
            grads, (loss, _) = stacked_gradients(ctx, objective)(*args)
        except RuntimeError:
            if not ctx.vmap_ok:
                raise
            ctx.vmap_ok = False  # as the local solver: row by row from now on
            grads, (loss, _) = stacked_gradients(ctx, objective)(*args)
        return torch.clamp(w.detach() - self.eta * grads, 0.0, 1.0), loss.detach()

    def learn_weights(
        self,
        ctx: Context,
        glob: torch.Tensor,
        local: torch.Tensor,
        w: torch.Tensor,
        cohort: Cohort,
        ids: list[int],
        running: list[bool],
        start_phase: list[bool],
    ) -> tuple[torch.Tensor, list[int]]:
        """ALA's weight learning of the cohort's ``running`` clients; (W, epochs of each).

        Epoch after epoch, minibatch by minibatch of its slice (:meth:`slices`), every running
        client takes an :meth:`ala_step`. After an epoch a client stops unless in its start
        phase, whose rule (:meth:`start_done`) reads the epoch's last minibatch loss of every
        client on the host (one read an epoch).
        """
        ala, rounds, width = self.slices(ctx, cohort, ids)
        objective = self.ala_objective(ctx, glob, local)
        losses: list[list[float]] = [[] for _ in ids]
        ctx.model.module.train()
        while any(running):
            on = to_device(running, w.device)
            last = torch.zeros(w.shape[0], device=w.device)
            for t in range(rounds):
                x, y = self.minibatch(cohort, ala, t, width)
                new, loss = self.ala_step(ctx, objective, w, x, y)
                w = torch.where((on & (ala["batches"] > t))[:, None], new, w)
                last = torch.where(ala["batches"] == t + 1, loss, last)
            for i, value in enumerate(last.tolist()):  # the epoch's last minibatch's loss
                if running[i]:
                    losses[i].append(value)
                    running[i] = start_phase[i] and not self.start_done(losses[i])
        return w, [len(history) for history in losses]

    def start_done(self, losses: list[float]) -> bool:
        """Whether the start phase ends after these epoch losses."""
        recent = losses[-self.num_pre_loss :]
        if len(losses) > self.num_pre_loss and statistics.pstdev(recent) < self.threshold:
            return True
        return self.max_start_epochs is not None and len(losses) >= self.max_start_epochs

    # ----------------------------------------------------------------- client
    def adapt(
        self, ctx: Context, glob: torch.Tensor, states: CohortStates, cohort: Cohort
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """ALA of the cohort: (Θ̂ [m, d], the new ``W`` and ``started``, the ALA epochs [m]).

        A client runs ALA unless Θ equals its Θ_i on the coordinates below the statistics
        (what it knows of the round: read on the host once, with its id and start phase).
        """
        theta, w, started = states.stack("theta"), states.stack("W"), states.stack("started")
        lo, hi = self.top_range(ctx)
        m = len(cohort)
        epochs = torch.zeros(m, device=glob.device)
        if hi > lo:
            moved = (glob[:, :hi] != theta[:, :hi]).any(dim=1)
            done = (started[:, 0] > 0).long()
            flags = torch.stack([states.stack("client")[:, 0], moved.long(), done])
            ids, running, done = flags.tolist()
            running = [bool(r) for r in running]
            if any(running):
                start_phase = [not d for d in done]
                w, taken = self.learn_weights(
                    ctx, glob, theta, w, cohort, ids, list(running), start_phase
                )
                started = torch.where(moved[:, None], torch.ones_like(started), started)
                epochs = to_device(taken, epochs.device, epochs.dtype)
        return self.mix(ctx, glob, theta, w).detach(), {"W": w, "started": started}, epochs

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """ALA → Θ̂; E local steps from Θ̂; send Δ = Θ − θ^E (FedAvg's upload).

        ALA is the cohort's at once (its loop over epochs and minibatches, each client's own
        slice and stopping rule); the local steps (the run's optimiser, its state kept) are
        one run of the whole cohort.
        """
        assert isinstance(model_in, torch.Tensor)
        glob = model_in.detach()
        init, adapted, epochs = self.adapt(ctx, glob, states, cohort)
        opt = ctx.optimizer
        local = ctx.train(
            init,
            cohort,
            objective=self.objective(ctx, init),
            opt_states=opt.load(states),
        )
        new_states = unstack_states(states, opt, local.opt_state, theta=local.params, **adapted)
        metrics = {"ala_epochs": epochs, "train_loss": local.loss}
        return CohortResult(model_in - local.params, new_states, metrics)

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Θ_i + (Θ − Θ_i) ⊙ W_i with the current Θ ("mix"), or Θ_i ("local"), of every client."""
        if self.evaluate == "local":
            return states.stack("theta")
        glob = server["x"].expand(len(clients), -1)
        return self.mix(ctx, glob, states.stack("theta"), states.stack("W"))
