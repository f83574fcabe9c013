"""pFedNet: shared part x, personalised parts Z on a similarity network.

pFedNet (Zhao, Liu, Liu & He, "Medical Federated Model with Mixture of Personalized and Sharing
Components", Algorithm 5; ``docs/pfednet_math.md`` corrects the drafts' typos): client n's model
is y⁽ⁿ⁾ = Mx + Nz⁽ⁿ⁾. Before training every client sends a sketch of its data;
the server links each client to its k nearest neighbours. Each round client n returns the
pseudo-gradient ∇⁽ⁿ⁾ = (y⁽ⁿ⁾ − y⁽ⁿ⁾_E)/η_l of E local steps (or one stochastic gradient, the
paper's Algorithm 1), and the server takes

* the x-step  x ← x − η_x Σ_n ω_n Mᵀ∇⁽ⁿ⁾ (ω_n = 1/|S_t|), and
* the Z-step  Z ← argmin_Z (1/N)⟨G, Z⟩ + λ Σ_(i,j)∈E ‖z⁽ⁱ⁾ − z⁽ʲ⁾‖_p + ‖Z − Z_t‖²/(2η_z),
  G = [Nᵀ∇⁽¹⁾ … Nᵀ∇⁽ᴺ⁾] (zero columns for clients not sampled), by ADMM
  (``docs/pfednet_math.md`` §3).

Precision: the server keeps Z and the ADMM's W and Ω in float64 from round to round (float32
only on devices without float64, such as MPS) and casts a column to the model's dtype only where
it meets the model (:meth:`PFedNet.downlinks`, :meth:`PFedNet.eval_stack`). Stored in float32,
the columns the fusion penalty has almost fused keep one-ulp differences which that penalty
counts, and the Z-step misses its objective target (``docs/pfednet_math.md`` §5).

Schedules: ``x_rounds = z_rounds = 0`` takes both steps every round; otherwise rounds cycle
through ``x_rounds`` x-rounds then ``z_rounds`` Z-rounds (Algorithm 5). In a phase only the
coordinates it updates are uploaded; ``local_mask`` also freezes the other coordinates during
local training (the authors' image code: a shared phase, then a personal phase).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import NonNegativeInt
from fedexp.config.ranges import Positive
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.contract import update_parts
from fedexp.data.client import ClientData
from fedexp.engine.solver import steps as solver
from fedexp.engine.solver.context import Context
from fedexp.graph import covariance_sketch
from fedexp.graph import kernel_sketch
from fedexp.graph import knn_edges
from fedexp.graph import label_sketch
from fedexp.graph import make_rff
from fedexp.graph import sketch_distances
from fedexp.graph.admm import ZStepSolver
from fedexp.graph.admm import ZStepState
from fedexp.transfer import to_device

_SKETCHES = ("label", "covariance", "kernel", "model")

_RFF_STREAM = 0x5EED


def server_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the server's Z, W and Ω: float64, float32 on MPS (which has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


class PFedNet(Algorithm):
    """pFedNet.

    Args:
        lam: λ, strength of the network penalty (0 decouples the clients' personal parts).
        p: norm of the penalty, 1, 2 or inf (``algorithm.p=inf``).
        eta_x: server step of the shared part (None: the client lr, which makes pFedNet with
            nothing personal equal to FedAvg with server_lr = 1 and uniform weights); 0 keeps
            the shared part at x0 (an ablation), not the client lr.
        eta_z: η_z of the Z-step (None: N·lr, so that with λ = 0 each personal part moves
            exactly as its client's local steps moved it).
        rho: ADMM penalty ρ (None: 1/η_z).
        admm_max_iter: K, the iteration cap of the ADMM.
        admm_eps_abs: absolute tolerance of the residuals (Boyd et al. 2011, §3.3.1).
        admm_eps_rel: relative tolerance.
        sketch: "label", "covariance", "kernel" or "model" (``docs/pfednet_math.md`` §1).
        k: neighbours per client in the k-NN graph.
        metric: "euclidean", "l1" or "frobenius" distance between sketches.
        rff_features: random Fourier features of the kernel sketch.
        bandwidth: RBF bandwidth of the kernel sketch (None: sqrt of the input size).
        sketch_epochs: local epochs of the model sketch.
        x_rounds: I, x-rounds per cycle (0 with z_rounds = 0: both steps every round).
        z_rounds: J, Z-rounds per cycle.
        local_mask: train only the coordinates of the current phase.
        one_gradient: send one minibatch gradient instead of E local steps (Algorithm 1).
    """

    weighting = "uniform"
    update_scale = "gradient"  # clients send the pseudo-gradient (x − x_local) / lr

    def __init__(
        self,
        lam: Annotated[float, Range(ge=0, note="0 decouples the clients")] = 0.01,
        p: Annotated[float, Range(ge=1, inf=True, note="1, 2 or inf")] | str = 2,
        eta_x: Annotated[float, Range(ge=0, note="0 keeps x at x0")] | None = None,
        eta_z: Positive | None = None,
        rho: Positive | None = None,
        admm_max_iter: PositiveInt = 500,
        admm_eps_abs: NonNegative = 1e-7,
        admm_eps_rel: NonNegative = 1e-5,
        sketch: str = "label",
        k: PositiveInt = 3,
        metric: str = "euclidean",
        rff_features: PositiveInt = 256,
        bandwidth: Positive | None = None,
        sketch_epochs: Positive = 1.0,
        x_rounds: NonNegativeInt = 0,
        z_rounds: NonNegativeInt = 0,
        local_mask: bool = False,
        one_gradient: bool = False,
    ) -> None:
        if str(p) not in ("1", "2", "inf", "1.0", "2.0"):
            raise ValueError(f"p={p!r}: expected 1, 2 or inf")
        if sketch not in _SKETCHES:
            raise ValueError(f"sketch={sketch!r}: expected one of {', '.join(_SKETCHES)}")
        if x_rounds < 0 or z_rounds < 0 or (x_rounds == 0) != (z_rounds == 0):
            raise ValueError("x_rounds and z_rounds: both 0 (joint) or both ≥ 1 (alternating)")
        self.lam, self.p = lam, (math.inf if str(p) == "inf" else int(float(p)))
        self.eta_x, self.eta_z, self.rho = eta_x, eta_z, rho
        self.admm = {"max_iter": admm_max_iter, "eps_abs": admm_eps_abs, "eps_rel": admm_eps_rel}
        self.sketch, self.k, self.metric = sketch, k, metric
        self.rff_features, self.bandwidth, self.sketch_epochs = (
            rff_features,
            bandwidth,
            sketch_epochs,
        )
        self.x_rounds, self.z_rounds = x_rounds, z_rounds
        self.local_mask, self.one_gradient = local_mask, one_gradient
        # Derived from server["edges"], rebuilt when missing (after a resume): not state.
        self._solvers: dict[bytes, ZStepSolver] = {}

    # ------------------------------------------------------------------ helpers
    def phase(self, round_: int) -> str:
        """The phase of ``round_``: "joint", "x" or "z" (Algorithm 5's schedule)."""
        if self.x_rounds == 0:
            return "joint"
        return "x" if round_ % (self.x_rounds + self.z_rounds) < self.x_rounds else "z"

    def _models_of(self, ctx: Context, server: State, clients: torch.Tensor) -> torch.Tensor:
        """[m, d] the models y⁽ⁿ⁾ of ``clients`` (int64 [m]): one gather of Z's columns.

        In the model's dtype (that of x): Z's float64 columns are cast here, and only here.
        """
        x = server["x"]
        y = torch.empty(clients.shape[0], ctx.model.layout.numel, device=x.device, dtype=x.dtype)
        y[:, ctx.shared_idx] = x
        y[:, ctx.personal_idx] = server["Z"].index_select(1, clients).T.to(y.dtype)
        return y

    def _sent_idx(self, ctx: Context, phase: str) -> torch.Tensor | None:
        return {"x": ctx.shared_idx, "z": ctx.personal_idx}.get(phase)

    def _upload(
        self, ctx: Context, phase: str, grad: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The upload: the whole pseudo-gradient, or in an x / z round its phase's part.

        The phase's coordinates travel as the part named after the phase, so an error-feedback
        channel keeps one residual per phase (x and z messages differ in length). ``grad``:
        the cohort's [m, d] rows.
        """
        idx = self._sent_idx(ctx, phase)
        return grad if idx is None else {phase: grad[..., idx]}

    def _solver(self, edges: torch.Tensor, num_nodes: int) -> ZStepSolver:
        key = edges.cpu().numpy().tobytes() + num_nodes.to_bytes(8, "little")
        if key not in self._solvers:
            self._solvers[key] = ZStepSolver(edges.cpu(), num_nodes)
        return self._solvers[key]

    # -------------------------------------------------------------------- hooks
    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """X = x0[S]; every column of Z = x0[P] (in :func:`server_dtype`); no graph yet."""
        z0 = x0[ctx.personal_idx].to(server_dtype(ctx.device))
        return {
            "x": x0[ctx.shared_idx].clone(),
            "Z": z0[:, None].repeat(1, ctx.num_clients).contiguous(),
        }

    def client_sketch(
        self, ctx: Context, data: ClientData, generator: torch.Generator
    ) -> torch.Tensor:
        """The client's data sketch (:mod:`fedexp.graph.sketches`), sent once before training."""
        if self.sketch == "label":
            return label_sketch(data.y_train, ctx.task.num_classes)
        if self.sketch == "covariance":
            return covariance_sketch(data.x_train).reshape(-1)
        if self.sketch == "kernel":
            dim = int(data.x_train[0].numel())
            bw = self.bandwidth or math.sqrt(dim)
            shared = torch.Generator().manual_seed(ctx.seed * 1_000_003 + _RFF_STREAM)
            return kernel_sketch(data.x_train, make_rff(dim, self.rff_features, bw, shared))
        per_epoch = 1 if ctx.batch_size <= 0 else math.ceil(data.num_train / ctx.batch_size)
        steps = max(1, math.ceil(self.sketch_epochs * per_epoch))
        # the local steps draw from a stream keyed by the sketch's generator
        key = int(torch.randint(1 << 62, (1,), generator=generator))
        return ctx.train(ctx.model.initial()[None], solver.alone(data, key), steps=steps).params[0]

    def server_setup(self, ctx: Context, server: State, sketches: dict[int, torch.Tensor]) -> State:
        """The k-NN similarity network of the sketches; ADMM variables W = Ω = 0."""
        S = torch.stack([sketches[n] for n in range(ctx.num_clients)])  # noqa: N806
        k = min(self.k, ctx.num_clients - 1)
        edges = (
            knn_edges(sketch_distances(S, self.metric), k)
            if k >= 1
            else torch.zeros(0, 2, dtype=torch.long)
        )
        d2 = server["Z"].shape[0]
        zeros = torch.zeros(d2, edges.shape[0], dtype=server_dtype(ctx.device), device=ctx.device)
        return {**server, "edges": edges.to(ctx.device), "W": zeros, "Omega": zeros.clone()}

    def downlinks(self, ctx: Context, server: State, clients: list[int]) -> StackedUpdates:
        """Every y⁽ⁿ⁾ of the round, [m, d]: one gather of Z's columns."""
        rows = to_device(clients, server["Z"].device)
        return StackedUpdates(clients, self._models_of(ctx, server, rows))

    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """Pseudo-gradient of E local steps (or one gradient), of the phase's coordinates.

        From y⁽ⁿ⁾, E local steps (under ``local_mask`` only the phase's coordinates move);
        send ∇⁽ⁿ⁾ = (y⁽ⁿ⁾ − y⁽ⁿ⁾_E)/η_l, or with ``one_gradient`` one minibatch gradient
        (Algorithm 1).
        """
        assert isinstance(model_in, torch.Tensor)
        phase = self.phase(ctx.round)
        if self.one_gradient:
            loss, grad = solver.loss_and_grad(ctx, model_in, cohort)
        else:
            mask = None
            if self.local_mask and phase != "joint":
                mask = torch.zeros_like(model_in[0])
                mask[self._sent_idx(ctx, phase)] = 1.0
            local = ctx.train(model_in, cohort, mask=mask)
            grad, loss = (model_in - local.params) / ctx.lr, local.loss
        return CohortResult(self._upload(ctx, phase, grad), states, {"train_loss": loss})

    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """x-step and/or Z-step (both given in the module docstring)."""
        if not updates:
            return server
        phase = self.phase(ctx.round)
        d1, d2 = ctx.shared_idx.numel(), ctx.personal_idx.numel()
        full = phase == "joint"
        clients = sorted(updates)
        stack = update_parts(updates, clients)["" if full else phase]  # [m, ...] in order
        out = dict(server)
        if phase in ("joint", "x") and d1 > 0:
            g = stack[:, ctx.shared_idx] if full else stack
            w = to_device([weights[n] for n in clients], g.device, g.dtype)
            eta_x = ctx.lr if self.eta_x is None else self.eta_x
            out["x"] = server["x"] - eta_x * (w[:, None] * g).sum(dim=0)
        if phase in ("joint", "z") and d2 > 0:
            Z = server["Z"]  # noqa: N806
            G = torch.zeros(Z.shape, dtype=server_dtype(ctx.device), device=Z.device)  # noqa: N806
            rows = to_device(clients, Z.device)  # the uploads fit float64 exactly
            G[:, rows] = (stack[:, ctx.personal_idx] if full else stack).T.to(G.dtype)
            out.update(self._z_step(ctx, server, G))
        return out

    def _z_step(self, ctx: Context, server: State, G: torch.Tensor) -> State:  # noqa: N803
        """The Z-step by ADMM, warm-started from the stored W and Ω; Z, W, Ω stay in float64.

        A checkpoint of an older fedexp (Z stored in float32) is widened here.
        """
        eta_z = ctx.num_clients * ctx.lr if self.eta_z is None else self.eta_z
        dtype = server_dtype(ctx.device)
        solver = self._solver(server["edges"], ctx.num_clients)
        warm = ZStepState(
            server["W"], server["Omega"], 1.0 / eta_z if self.rho is None else self.rho
        )
        Z, state, info = solver.solve(  # noqa: N806
            server["Z"].to(dtype),
            G.to(dtype),
            self.lam,
            eta_z,
            self.p,
            rho=self.rho,
            warm=warm,
            **self.admm,
        )
        dev = ctx.device
        return {
            "Z": Z,
            "W": state.W.to(dev, dtype),
            "Omega": state.Omega.to(dev, dtype),
            "admm_iterations": torch.tensor(float(info["iterations"])),
            "admm_primal": torch.tensor(float(info["primal_residual"])),
            "admm_dual": torch.tensor(float(info["dual_residual"])),
        }

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """Every y⁽ⁿ⁾ at once: one gather of Z's columns."""
        return self._models_of(ctx, server, to_device(clients, server["Z"].device))

    def global_vector(
        self, ctx: Context, server: State, average: Callable[[str], torch.Tensor]
    ) -> torch.Tensor | None:
        """The shared part x with the mean personal part z̄ = (1/N) Σ_n z⁽ⁿ⁾ (uniform ω_n).

        The centre the network's fused penalty pulls the personal parts towards; with a
        model that is all personal part (logistic regression) the mean of the clients' models.
        """
        x = server["x"]
        g = torch.empty(ctx.model.layout.numel, device=x.device, dtype=x.dtype)
        g[ctx.shared_idx] = x
        g[ctx.personal_idx] = server["Z"].mean(dim=1).to(g.dtype)
        return g

    def server_metrics(self, ctx: Context, server: State) -> dict[str, float]:
        """Spread of the personal parts (mean ‖z⁽ⁿ⁾ − z̄‖₂) and the last ADMM's figures."""
        Z = server["Z"]  # noqa: N806
        out = {}
        if Z.shape[0] > 0:
            out["pfednet/spread"] = float((Z - Z.mean(dim=1, keepdim=True)).norm(dim=0).mean())
        for key in ("admm_iterations", "admm_primal", "admm_dual"):
            if key in server:
                out[f"pfednet/{key}"] = float(server[key])
        return out
