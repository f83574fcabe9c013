"""Local optimisers as pure functions of (parameters, gradient, state).

A client's optimiser state (momentum buffer, Adam's moments and step count) is a
``dict[str, Tensor]`` kept in the client's state under a prefix (``opt.momentum``, ...), so the
engine checkpoints it with everything else and a resumed run continues exactly. The step is
element-wise tensor arithmetic over the last axis, so the same function steps one client's
``[d]`` vector or, in the local solver (:mod:`fedexp.engine.solver.steps`), a cohort's stacked
``[m, d]`` parameters and states at once (a per-client scalar of the state, Adam's step count,
is ``[m]`` there and broadcast over the row): the kernels :func:`torch.func.vmap` of the
one-client step would run, without its wrapping cost at every step.

The updates follow :class:`torch.optim.SGD` and :class:`torch.optim.Adam` (coupled L2 weight
decay, PyTorch's order of operations), which the tests compare against step by step.
"""

from __future__ import annotations

from abc import ABC
from abc import abstractmethod
from collections.abc import Sequence

import torch

from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import OpenFraction
from fedexp.config.ranges import Positive
from fedexp.contract import CohortStates

State = dict[str, torch.Tensor]


class Optimizer(ABC):
    """A local optimiser: ``init`` its state, ``step`` the parameters.

    The ranges of the arguments are declared in the signatures (:mod:`fedexp.config.ranges`)
    and checked with the config, before anything is built.

    Args:
        weight_decay: L2 coefficient ≥ 0 added to the gradient (``grad + wd·θ``).
        persistent: keep the state in the client's state between rounds (PFLlib's one
            optimiser per client); False starts every round from a fresh state (FL-bench's
            ``reset_optimizer_on_global_epoch``).
    """

    def __init__(self, weight_decay: NonNegative = 0.0, persistent: bool = True) -> None:
        self.weight_decay = weight_decay
        self.persistent = persistent

    @abstractmethod
    def init(self, params: torch.Tensor) -> State:
        """Fresh state for ``params`` (an empty dict for plain SGD)."""

    @abstractmethod
    def step(
        self,
        params: torch.Tensor,
        grad: torch.Tensor,
        state: State,
        lr: float,
        scale: torch.Tensor | None = None,
        consts: State | None = None,
    ) -> tuple[torch.Tensor, State]:
        """One update; returns (new parameters, new state). Pure: nothing is modified.

        ``params``, ``grad`` and ``state`` are one client's (``[d]``, scalars 0-d) or a
        cohort's stack (``[m, d]``, scalars ``[m]``); ``lr`` the step size and ``scale``
        per-coordinate factors of it (a tensor of ``params``' shape; None: 1 everywhere);
        ``consts``: this step's entry of :meth:`schedule` (None: computed here).
        """

    def schedule(
        self, state: State, steps: int, lr: float, scale: torch.Tensor | None = None
    ) -> list[State] | None:
        """What ``steps`` successive steps from ``state`` compute of the step count alone.

        Made once a round (a few ops for every step at once, not a few a step: issue 69) and
        handed to :meth:`step` one entry a step; each entry equals what the step would
        compute itself, to the bit. None: nothing to make ahead (the default).
        """
        return None

    def load(self, client_state: State | CohortStates, prefix: str = "opt") -> State | None:
        """The optimiser state stored in ``client_state`` under ``prefix`` (None: fresh).

        Of a :class:`CohortStates`: the cohort's stacked state (rows without one hold zeros,
        a fresh state: every optimiser here starts from zeros), ready for ``Context.train``.
        """
        if not self.persistent:
            return None
        items = client_state.stacks if isinstance(client_state, CohortStates) else client_state
        head = prefix + "."
        found = {k[len(head) :]: v for k, v in items.items() if k.startswith(head)}
        return found or None

    def save(self, opt_state: State, prefix: str = "opt") -> State:
        """``opt_state`` as client-state entries ``<prefix>.<name>`` (none if not persistent)."""
        if not self.persistent:
            return {}
        return {f"{prefix}.{k}": v for k, v in opt_state.items()}


class SGD(Optimizer):
    """SGD with optional heavy-ball or Nesterov momentum (``torch.optim.SGD``, dampening 0).

    The momentum buffer starts at zero, so the first step equals PyTorch's (whose buffer starts
    at the first gradient): μ·0 + g = g.

    Args:
        momentum: μ in [0, 1).
        nesterov: Nesterov momentum (Sutskever et al. 2013), as PyTorch: g + μ·buf.
        weight_decay: L2 coefficient ≥ 0.
        persistent: keep the momentum buffer between rounds.
    """

    def __init__(
        self,
        momentum: OpenFraction = 0.0,
        nesterov: bool = False,
        weight_decay: NonNegative = 0.0,
        persistent: bool = True,
    ) -> None:
        super().__init__(weight_decay, persistent)
        if nesterov and momentum == 0:
            raise ValueError("nesterov=true needs momentum > 0")
        self.momentum, self.nesterov = momentum, nesterov

    def init(self, params: torch.Tensor) -> State:
        """A zero momentum buffer (nothing without momentum)."""
        return {"momentum": torch.zeros_like(params)} if self.momentum > 0 else {}

    def step(
        self,
        params: torch.Tensor,
        grad: torch.Tensor,
        state: State,
        lr: float,
        scale: torch.Tensor | None = None,
        consts: State | None = None,
    ) -> tuple[torch.Tensor, State]:
        """θ ← θ − η·d with d = g (+ μ-momentum), g = ∇ + wd·θ.

        The weight decay in :class:`torch.optim.SGD`'s fused form (``grad.add(param,
        alpha=wd)``: one op, not two); the buffer ``μ·buf + g`` as PyTorch's
        ``buf.mul_(μ).add_(g)``. Nesterov's ``g + μ·buf`` and the momentum step stay two ops
        each: fused (PyTorch's ``grad.add(buf, alpha=μ)``), TDPFed's recorded golden figures
        (``tdpfed-batchnorm``) amplify the last bit beyond their tolerance.
        """
        g = torch.add(grad, params, alpha=self.weight_decay) if self.weight_decay else grad
        if self.momentum == 0:
            return descend(params, g, lr, scale), state
        buf = self.momentum * state["momentum"] + g
        d = g + self.momentum * buf if self.nesterov else buf
        return params - _times(lr, scale) * d, {"momentum": buf}


def descend(
    params: torch.Tensor, d: torch.Tensor, lr: float, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain SGD's θ − η·d as :class:`torch.optim.SGD` takes it (``add`` with ``alpha=-lr``).

    That is one ``add``: one fused multiply-add an entry in PyTorch's AVX2 and AVX-512
    kernels (the same bits on either), so SGD's steps without momentum or weight decay equal
    PyTorch's bit for bit there, and a cohort's step reads and writes its stack once instead
    of twice (``lr * d``, then the difference: 1-2 % of a round of issue 14's CNN,
    docs/bench_peers.md).
    Per-coordinate factors multiply ``d`` first, so that a coordinate of factor 1 moves as
    without them (APFL's global model is FedAvg's to the bit). The momentum steps keep
    ``θ − (η·d)``: TDPFed's recorded golden figures amplify the last bit of its Nesterov
    steps beyond their tolerance (tests/test_golden.py, the cases compared on the recording's
    kind of machine only).
    """
    return torch.add(params, d if scale is None else d * scale, alpha=-lr)


def _times(lr: float, scale: torch.Tensor | None) -> float | torch.Tensor:
    """The step size, per coordinate where ``scale`` is given."""
    return lr if scale is None else lr * scale


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015) with PyTorch's bias correction and coupled L2 weight decay.

    Args:
        beta1: first-moment decay, in [0, 1).
        beta2: second-moment decay, in [0, 1).
        eps: added to the bias-corrected root second moment, > 0.
        weight_decay: L2 coefficient ≥ 0 (``torch.optim.Adam``'s, not AdamW's).
        persistent: keep the moments and the step count between rounds.
    """

    def __init__(
        self,
        beta1: OpenFraction = 0.9,
        beta2: OpenFraction = 0.999,
        eps: Positive = 1e-8,
        weight_decay: NonNegative = 0.0,
        persistent: bool = True,
    ) -> None:
        super().__init__(weight_decay, persistent)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def init(self, params: torch.Tensor) -> State:
        """Zero moments; the step count as a 0-d float tensor (vmappable, checkpointable)."""
        return {
            "exp_avg": torch.zeros_like(params),
            "exp_avg_sq": torch.zeros_like(params),
            "step": torch.zeros((), dtype=params.dtype, device=params.device),
        }

    def step(
        self,
        params: torch.Tensor,
        grad: torch.Tensor,
        state: State,
        lr: float,
        scale: torch.Tensor | None = None,
        consts: State | None = None,
    ) -> tuple[torch.Tensor, State]:
        """One Adam step in PyTorch's order of operations.

        The step count's bias corrections from ``consts`` (:meth:`schedule`, made once a
        round) where given. The moments stay ``β·m + (1 − β)·g`` (PyTorch's own ``lerp_`` and
        ``addcmul_``, one op each, move TDPFed's recorded golden figures, which amplify the
        last bit of Adam's first steps, beyond their tolerance).
        """
        g = torch.add(grad, params, alpha=self.weight_decay) if self.weight_decay else grad
        if consts is None:
            consts = self._consts(state["step"] + 1, params.dim(), lr, scale)
        m = self.beta1 * state["exp_avg"] + (1 - self.beta1) * g
        v = self.beta2 * state["exp_avg_sq"] + (1 - self.beta2) * g * g
        denom = v.sqrt() / consts["root"] + self.eps
        new = params - consts["size"] * m / denom
        return new, {"exp_avg": m, "exp_avg_sq": v, "step": consts["step"]}

    def _consts(self, t: torch.Tensor, dim: int, lr: float, scale: torch.Tensor | None) -> State:
        """The step count ``t``'s step size η/(1 − β1ᵗ) and √(1 − β2ᵗ).

        Shaped to broadcast over a parameter tensor of ``dim`` axes.
        """
        tb = t.reshape(*t.shape, *[1] * (dim - t.dim()))  # over the row's coordinates
        bc1 = 1 - self.beta1**tb
        bc2 = 1 - self.beta2**tb
        return {"step": t, "size": _times(lr, scale) / bc1, "root": bc2.sqrt()}

    def schedule(
        self, state: State, steps: int, lr: float, scale: torch.Tensor | None = None
    ) -> list[State] | None:
        """The bias corrections of ``steps`` steps, made at once: ``[steps, m]`` step counts.

        Per-coordinate factors (``scale``) would make them ``[steps, m, d]``: none made then.
        """
        if scale is not None or steps <= 0:
            return None
        t0 = state["step"]
        counts = torch.arange(1, steps + 1, dtype=t0.dtype, device=t0.device)
        t = t0 + counts.view(steps, *[1] * t0.dim())  # [steps, *t0.shape]
        tb = t.view(*t.shape, 1) if t0.dim() else t
        bc1 = 1 - self.beta1**tb
        bc2 = 1 - self.beta2**tb
        size, root = (lr / bc1).unbind(0), bc2.sqrt().unbind(0)
        return [
            {"step": c, "size": s, "root": r}
            for c, s, r in zip(t.unbind(0), size, root, strict=True)
        ]


def stack_states(opt: Optimizer, params: torch.Tensor, states: Sequence[State | None]) -> State:
    """The clients' optimiser states stacked per entry (fresh ones from ``opt.init``)."""
    if all(s is None for s in states):  # one fresh state, repeated (ops do not grow with m)
        fresh = opt.init(params[0])
        return {k: v.expand(params.shape[0], *v.shape).clone() for k, v in fresh.items()}
    full = [opt.init(params[i]) if s is None else s for i, s in enumerate(states)]
    names = sorted(full[0])
    if any(sorted(s) != names for s in full):
        raise ValueError(f"optimiser states with different entries in one cohort: {names}")
    return {k: torch.stack([s[k].detach() for s in full]) for k in names}
