"""The algorithm contract: a client hook and a server hook over explicit state.

All state is a ``dict[str, Tensor]`` owned by the engine (so a checkpoint is "save the
state"). A round is, for each sampled client n:

    msg   = downlink(ctx, server, n)                      # None: nothing is sent
    upd, client_state, metrics = client_update(ctx, msg, client_state, data, generator)
    server = server_update(ctx, server, {n: decoded upd}, {n: weight})

Messages cross the client/server boundary as bytes (``fedexp.comm``); the hooks only ever see
decoded tensors. Evaluation uses ``eval_params``. Hooks must not keep state on ``self``.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from fedexp.data.federated import ClientData
from fedexp.engine.cohort import Cohort, CohortResult
from fedexp.engine.context import Context

State = dict[str, torch.Tensor]
#: What crosses the network: one tensor, or named parts (IFCA: the k cluster models down).
Message = torch.Tensor | dict[str, torch.Tensor]
#: How a message part is coded (``fedexp.engine.engine.Engine._transmit``).
PART_KINDS = ("model", "update", "exact")


@dataclass
class ClientResult:
    """What a client hook returns.

    Attributes:
        update: the message for the server: a tensor, a dict of named parts, or None (the
            client sends nothing).
        state: the client's new state.
        metrics: scalars to average over the round's clients (e.g. train loss).
    """

    update: Message | None
    state: State
    metrics: dict[str, float] = field(default_factory=dict)


class Algorithm(ABC):
    """Base of every algorithm; subclasses are small files (one per algorithm).

    Attributes:
        weighting: "samples" (ω_n ∝ n_train, FedAvg) or "uniform" (ω_n = 1/N, pFedNet).
        downlink_parts: the kind of each downlink part (:data:`PART_KINDS`; "" names a bare
            tensor); unlisted parts are "model": a lossy channel codes their change.
        uplink_parts: the same for the uplink; unlisted parts are "update", coded as they are.
        update_scale: what the "update" and "model" parts that cross the wire are a step of:
            "step" (a model change, lr × a pseudo-gradient: FedAvg's x − x_local) or
            "gradient" (pFedNet's and pFedSOP's pseudo-gradient (x − x_local) / lr).
            Scale-dependent transforms (CER) act on the gradient scale, so that one γ means
            the same for every algorithm (the engine passes ``scale = lr`` for "step").
    """

    weighting: str = "samples"
    downlink_parts: Mapping[str, str] = MappingProxyType({})
    uplink_parts: Mapping[str, str] = MappingProxyType({})
    update_scale: str = "step"

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """Server state before round 0 (default: the global model ``x``)."""
        return {"x": x0.clone()}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """Client state before round 0 (default: empty)."""
        return {}

    def downlink(self, ctx: Context, server: State, client: int) -> Message | None:
        """The message sent to ``client`` this round (default: the global model)."""
        return server["x"]

    def downlinks(
        self, ctx: Context, server: State, clients: list[int]
    ) -> dict[int, Message | None]:
        """Every sampled client's :meth:`downlink` message of the round, in one call.

        The engine's entry point; the default asks :meth:`downlink` client by client. An
        algorithm whose messages are cheaper computed together (FedAMP's cloud models)
        overrides it; the messages must equal :meth:`downlink`'s up to rounding.
        """
        return {n: self.downlink(ctx, server, n) for n in clients}

    @abstractmethod
    def client_update(
        self,
        ctx: Context,
        model_in: Message | None,
        state: State,
        data: ClientData,
        generator: torch.Generator,
    ) -> ClientResult:
        """Local work of one client; ``model_in`` is the decoded downlink message."""

    def cohort_update(
        self,
        ctx: Context,
        model_in: torch.Tensor | dict[str, torch.Tensor] | None,
        states: list[State],
        cohort: Cohort,
    ) -> CohortResult | None:
        """Optional: every sampled client's :meth:`client_update` as one computation.

        Called by the engine with ``backend=lockstep`` (issue 14's cohort path,
        ``fedexp.engine.cohort``) with the downlink messages stacked ``[m, ...]`` in
        ``cohort.clients`` order (messages with named parts: a dict of such stacks, part by
        part; None when nothing is sent). It must give what
        :meth:`client_update` gives each client (up to floating-point summation order: the
        tests compare the two). Return None to run the per-client hooks (the default).
        """
        return None

    @abstractmethod
    def server_update(
        self,
        ctx: Context,
        server: State,
        updates: dict[int, Message],
        weights: dict[int, float],
    ) -> State:
        """New server state from the decoded updates (weights sum to one over ``updates``)."""

    def eval_params(
        self, ctx: Context, server: State, client_state: State, client: int
    ) -> torch.Tensor:
        """The vector client ``client`` is evaluated with (default: the global model)."""
        return server["x"]

    def predict(self, ctx: Context, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Logits of ``x`` under :meth:`eval_params`'s vector (default: the model at it)."""
        return ctx.model(params, x)

    # Optional set-up exchange before round 0 (e.g. pFedNet's similarity network).
    def client_sketch(
        self, ctx: Context, data: ClientData, generator: torch.Generator
    ) -> torch.Tensor | None:
        """A summary of the client's data sent once before training (default: none)."""
        return None

    def server_setup(self, ctx: Context, server: State, sketches: dict[int, torch.Tensor]) -> State:
        """Use the decoded sketches (default: nothing to do)."""
        return server

    def server_metrics(self, ctx: Context, server: State) -> dict[str, float]:
        """Scalars about the server state to log each round (default: none)."""
        return {}


class StackedUpdates(Mapping):
    """A cohort's received updates as one ``[m, ...]`` tensor, read as ``{client: row}``.

    What the cohort path hands ``server_update`` instead of a dict of m row views (a view
    costs ~600 bytes: 60 MB a round at 100,000 clients); :func:`weighted_mean` reads the
    stack directly.

    Args:
        clients: the senders, ascending (row i is ``clients[i]``'s update).
        stack: ``[m, ...]`` the decoded updates.
    """

    def __init__(self, clients: list[int], stack: torch.Tensor) -> None:
        if len(clients) != stack.shape[0] or any(
            a >= b for a, b in zip(clients, clients[1:], strict=False)
        ):
            raise ValueError("StackedUpdates needs ascending clients, one per row")
        self.clients, self.stack = clients, stack

    def __getitem__(self, n: int) -> torch.Tensor:
        i = bisect.bisect_left(self.clients, n)
        if i == len(self.clients) or self.clients[i] != n:
            raise KeyError(n)
        return self.stack[i]

    def __iter__(self):  # noqa: ANN204 - Mapping's
        return iter(self.clients)

    def __len__(self) -> int:
        return len(self.clients)


def weighted_mean(updates: Mapping[int, torch.Tensor], weights: dict[int, float]) -> torch.Tensor:
    """Σ_n ω_n u_n over the received updates."""
    clients = sorted(updates)
    if isinstance(updates, StackedUpdates):  # rows in ascending client order: one product
        stack = updates.stack
        w = torch.tensor([weights[n] for n in clients], dtype=stack.dtype, device=stack.device)
        return (w @ stack.reshape(len(clients), -1)).reshape(stack.shape[1:])
    stacked = torch.stack([updates[n] for n in clients])
    w = torch.tensor([weights[n] for n in clients], dtype=stacked.dtype, device=stacked.device)
    return (w[:, None] * stacked).sum(dim=0)
