"""Server optimisers (FedOpt: Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

The server of a method with a global model x treats the weighted mean of the round's uploads
as a pseudo-gradient. The uploads here are FedAvg's Δ_n = x − θ_n (a step *down*), so the
paper's Δ_t = Σ_n ω_n (θ_n − x) is minus their mean ū. Each option is a pure function over the
server state (``config group server_optimizer``, ``Context.server_optimizer``):

* ``sgd`` (the default): x ← x − η_s ū, η_s the algorithm's own ``server_lr`` (FedAvg's
  server, the same operations, so every run without the group is unchanged bit for bit);
* ``adagrad``, ``adam``, ``yogi`` (Algorithm 2), with Δ = −ū:
  m ← β₁ m + (1 − β₁) Δ;
  v ← v + Δ² (Adagrad), β₂ v + (1 − β₂) Δ² (Adam), v − (1 − β₂) Δ² sign(v − Δ²) (Yogi);
  x ← x + η m / (√v + τ), η the optimiser's own ``lr`` (``server_lr`` is not used).

As in the paper there is no bias correction; m starts at 0 and v at v₋₁ = τ² (Algorithm 2
asks v₋₁ ≥ τ²; Flower's strategies start at 0: ``initial_v=0``). The moments live in the server
state under ``sopt.m.<key>`` and ``sopt.v.<key>`` (so a checkpoint holds them and a resumed run
continues exactly), made at the first step. Running statistics (BatchNorm buffers, the model's
``buffer_mask``) are not gradients: they always take the ``sgd`` step x − η_s ū (η_s = 1 by
default: the clients' mean, as TFF averages non-trainable weights), their moments stay put.

The step acts on the one mean the algorithm has computed (``server_reads = "mean"`` holds; a
round trained in memory slices or over several processes has the same mean).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import torch

from fedexp.config.ranges import OpenFraction
from fedexp.config.ranges import Positive
from fedexp.config.ranges import Range

if TYPE_CHECKING:
    from fedexp.engine.solver.context import Context

State = dict[str, torch.Tensor]

#: the prefix of the optimiser's entries in the server state (``sopt.m.x``, ``sopt.v.x``)
PREFIX = "sopt"

#: τ, the adaptivity (the paper's default 1e-3)
Tau = Annotated[float, Range(gt=0, note="the paper's default 1e-3")]
#: v₋₁, the second moment's start (None: τ², Algorithm 2's least value)
InitialV = Annotated[float, Range(ge=0, note="null: τ²")]


def steps_global_model(algorithm: type) -> bool:
    """Whether ``algorithm``'s server moves a global model through ``ctx.server_optimizer``.

    The class that defines its ``server_update`` must say so itself (``server_optimized =
    True`` in its own body), so a subclass of FedAvg with a server of its own is not taken
    for one that uses the optimiser.
    """
    for klass in getattr(algorithm, "__mro__", ()):
        if "server_update" in vars(klass):
            return vars(klass).get("server_optimized", False) is True
    return False


def server_optimizer_of(ctx: Context | None) -> ServerOptimizer:
    """The run's server optimiser, ``ctx.server_optimizer``.

    FedAvg's where ``ctx`` has none (a hand-made context of a test or an API user).
    """
    return getattr(ctx, "server_optimizer", None) or ServerSGD()


def _rows_mask(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``rows`` (bool over the first axis) shaped to broadcast over ``like``."""
    return rows.to(like.device).view(-1, *[1] * (like.dim() - 1))


class ServerOptimizer:
    """The server's step on the mean upload ū of a global model (``sgd``: FedAvg's).

    Attributes:
        name: the option's name in the ``server_optimizer`` group.
        adaptive: whether the step keeps moments in the server state (refused for methods
            without a global model moved by the mean upload).
    """

    name = "sgd"
    adaptive = False

    def step(
        self,
        ctx: Context,
        server: State,
        key: str,
        mean: torch.Tensor,
        server_lr: float,
        *,
        idx: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> State:
        """The new server state: ``server[key]`` moved by the mean upload ``mean``.

        Args:
            ctx: the run's context (the model's running-statistics mask).
            server: the server state.
            key: the entry moved (``"x"``; IFCA's ``"clusters"``).
            mean: ū = Σ ω_n Δ_n, Δ_n = x − θ_n, shaped as ``server[key]`` (or its ``idx``
                coordinates).
            server_lr: the algorithm's η_s (the ``sgd`` step's size).
            idx: only these coordinates of the last axis move (FedPer's body); None: all.
            rows: bool over the first axis: only these rows move (IFCA's chosen clusters).
        """
        x = server[key]
        if idx is None:
            new = x - server_lr * mean
        else:
            new = x.clone()
            new[..., idx] = x[..., idx] - server_lr * mean
        if rows is not None:
            new = torch.where(_rows_mask(rows, new), new, x)
        return {**server, key: new}


class ServerSGD(ServerOptimizer):
    """x ← x − η_s ū with η_s the algorithm's ``server_lr`` (FedAvg's server; the default)."""


class _Adaptive(ServerOptimizer):
    """FedOpt's adaptive step (Algorithm 2); subclasses give the second-moment rule."""

    adaptive = True

    def __init__(
        self,
        lr: Positive,
        beta1: OpenFraction = 0.9,
        beta2: OpenFraction = 0.99,
        tau: Tau = 1e-3,
        initial_v: InitialV | None = None,
    ) -> None:
        self.lr, self.beta1, self.beta2, self.tau = lr, beta1, beta2, tau
        self.initial_v = tau * tau if initial_v is None else initial_v

    def second(self, v: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        """The new second moment from v and Δ²."""
        raise NotImplementedError

    def step(
        self,
        ctx: Context,
        server: State,
        key: str,
        mean: torch.Tensor,
        server_lr: float,
        *,
        idx: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> State:
        """m, v and x ← x + η m / (√v + τ) on ``server[key]`` (see :meth:`ServerOptimizer.step`).

        The moments are shaped as the moved coordinates (``idx``'s); rows not in ``rows`` keep
        x, m and v; running statistics take the ``sgd`` step and keep their moments.
        """
        x = server[key]
        cur = x if idx is None else x[..., idx]
        m_key, v_key = f"{PREFIX}.m.{key}", f"{PREFIX}.v.{key}"
        m, v = server.get(m_key), server.get(v_key)
        if m is None or v is None:
            m, v = torch.zeros_like(cur), torch.full_like(cur, self.initial_v)
        elif m.shape != cur.shape or v.shape != cur.shape:
            raise ValueError(
                f"server state {m_key} has shape {tuple(m.shape)}, the moved {key} "
                f"{tuple(cur.shape)}: a checkpoint of another model or algorithm"
            )
        delta = (-mean).to(cur.dtype)  # the paper's Δ_t = mean(θ_n − x)
        new_m = self.beta1 * m + (1 - self.beta1) * delta
        new_v = self.second(v, delta * delta)
        new = cur + self.lr * new_m / (new_v.sqrt() + self.tau)
        if ctx.model.has_buffers:  # running statistics: the clients' mean, no moments
            stats = ctx.model.buffer_mask if idx is None else ctx.model.buffer_mask[idx]
            new = torch.where(stats, cur - server_lr * mean, new)
            new_m, new_v = torch.where(stats, m, new_m), torch.where(stats, v, new_v)
        if rows is not None:
            keep = _rows_mask(rows, new)
            new = torch.where(keep, new, cur)
            new_m, new_v = torch.where(keep, new_m, m), torch.where(keep, new_v, v)
        if idx is not None:
            full = x.clone()
            full[..., idx] = new
            new = full
        return {**server, key: new, m_key: new_m, v_key: new_v}


class ServerAdagrad(_Adaptive):
    """FedAdagrad: v ← v + Δ² (no β₂: the squares accumulate).

    Args:
        lr: η, the server step (the paper's best values: around 10^{-1}).
        beta1: β₁ ∈ [0, 1), the momentum of m (0: Adagrad without momentum, as Keras's).
        tau: τ > 0, the adaptivity.
        initial_v: v₋₁ (null: τ², Algorithm 2's least value).
    """

    name = "adagrad"

    def __init__(
        self,
        lr: Positive = 0.1,
        beta1: OpenFraction = 0.9,
        tau: Tau = 1e-3,
        initial_v: InitialV | None = None,
    ) -> None:
        super().__init__(lr, beta1, 0.0, tau, initial_v)

    def second(self, v: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        """The squares accumulate: v + Δ²."""
        return v + g2


class ServerAdam(_Adaptive):
    """FedAdam: v ← β₂ v + (1 − β₂) Δ² (no bias correction, as the paper).

    Args:
        lr: η, the server step (the paper's best values: around 10^{-2}).
        beta1: β₁ ∈ [0, 1).
        beta2: β₂ ∈ [0, 1).
        tau: τ > 0, the adaptivity.
        initial_v: v₋₁ (null: τ²).
    """

    name = "adam"

    def __init__(
        self,
        lr: Positive = 0.01,
        beta1: OpenFraction = 0.9,
        beta2: OpenFraction = 0.99,
        tau: Tau = 1e-3,
        initial_v: InitialV | None = None,
    ) -> None:
        super().__init__(lr, beta1, beta2, tau, initial_v)

    def second(self, v: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        """An exponential average: β₂ v + (1 − β₂) Δ²."""
        return self.beta2 * v + (1 - self.beta2) * g2


class ServerYogi(ServerAdam):
    """FedYogi: v ← v − (1 − β₂) Δ² sign(v − Δ²); FedAdam's settings (``ServerAdam``).

    Args:
        lr: η, the server step (the paper's best values: around 10^{-2}).
        beta1: β₁ ∈ [0, 1).
        beta2: β₂ ∈ [0, 1).
        tau: τ > 0, the adaptivity.
        initial_v: v₋₁ (null: τ²).
    """

    name = "yogi"

    def second(self, v: torch.Tensor, g2: torch.Tensor) -> torch.Tensor:
        """Additive: v − (1 − β₂) Δ² sign(v − Δ²)."""
        return v - (1 - self.beta2) * g2 * torch.sign(v - g2)
