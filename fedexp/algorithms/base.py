"""The algorithm contract: one client hook over the cohort, a server hook, explicit state.

All state is a ``dict[str, Tensor]`` owned by the engine (so a checkpoint is "save the
state"). A round, for the sampled clients (in sub-cohorts of alike work, ``Context.work_key``):

    msgs   = downlinks(ctx, server, clients)                    # {n: message | None}
    result = client_update(ctx, stacked msgs, states, cohort)   # every client of the cohort
    server = server_update(ctx, server, {n: decoded upload}, {n: weight})

(with ``all_train``, every client receives and trains; the sampled ones upload.)

An algorithm states one client's work once, as its paper writes it, over stacked ``[m, ...]``
tensors; one client alone is a cohort of one. The local solver (``Context.train``,
``fedexp.engine.solver.steps``) decides how the steps execute. Messages cross the client/server
boundary as bytes (``fedexp.comm``); the hooks only see decoded tensors. An algorithm states
its messages and its evaluated vectors once, for the cohort (``downlinks``, ``eval_stack``);
the one-client views (``downlink``, ``eval_params``) are derived. Hooks must not keep state on
``self``. The contract's types live in ``fedexp.contract``.
"""

from __future__ import annotations

from abc import ABC
from abc import abstractmethod
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from fedexp.contract import PART_KINDS
from fedexp.contract import Cohort
from fedexp.contract import CohortResult
from fedexp.contract import CohortStates
from fedexp.contract import Message
from fedexp.contract import Senders
from fedexp.contract import Stacked
from fedexp.contract import StackedUpdates
from fedexp.contract import State
from fedexp.contract import parts_updates
from fedexp.contract import update_parts
from fedexp.contract import weighted_mean
from fedexp.data.client import ClientData
from fedexp.engine.solver.context import Context
from fedexp.transfer import to_device

__all__ = [
    "PART_KINDS",
    "Algorithm",
    "Cohort",
    "CohortResult",
    "CohortStates",
    "Message",
    "Senders",
    "Stacked",
    "StackedUpdates",
    "State",
    "Updates",
    "Weights",
    "broadcast",
    "gather_rows",
    "parts_updates",
    "scatter_rows",
    "update_parts",
    "weighted_mean",
]

#: What :meth:`Algorithm.server_update` receives: the decoded uploads by client (a
#: :class:`StackedUpdates` read as ``{client: upload}``, or a plain dict) ...
Updates = Mapping[int, Message]
#: ... and their aggregation weights ω_n, summing to one over the uploads.
Weights = dict[int, float]


def broadcast(clients: list[int], message: Message) -> StackedUpdates:
    """One message for every client of ``clients``, expanded (stride 0 along the clients).

    What :meth:`Algorithm.downlinks` returns for a message shared by all (the global model,
    SCAFFOLD's (x, c), IFCA's k clusters): the engine then codes it once and counts it m times.
    """
    m = len(clients)
    if isinstance(message, torch.Tensor):
        return StackedUpdates(clients, message.expand(m, *message.shape))
    return StackedUpdates(clients, {k: v.expand(m, *v.shape) for k, v in message.items()})


def gather_rows(table: torch.Tensor, clients: list[int]) -> torch.Tensor:
    """``[m, ...]`` the rows ``clients`` of a server table ``[N, ...]``: one gather."""
    return table.index_select(0, to_device(clients, table.device, torch.int64))


def scatter_rows(table: torch.Tensor, updates: Updates) -> torch.Tensor:
    """``table`` ``[N, d]`` with row n set to client n's upload, for every n of ``updates``.

    What a server that keeps every client's model writes (FedAMP's W, FPFC's Θ): one scatter
    of the stacked uploads (bare tensors), cast to the table's dtype.
    """
    clients = sorted(updates)
    rows = to_device(clients, table.device, torch.int64)
    return table.index_copy(0, rows, update_parts(updates, clients)[""].to(table))


class Algorithm(ABC):
    """Base of every algorithm; subclasses are small files (one per algorithm).

    Attributes:
        weighting: "samples" (ω_n ∝ n_train, FedAvg) or "uniform" (ω_n = 1/N, pFedNet).
        downlink_parts: the kind of each downlink part (:data:`PART_KINDS`; "" names a bare
            tensor); unlisted parts are "model": a lossy channel codes their change.
        uplink_parts: the same for the uplink; unlisted parts are "update", coded as they are.
        all_train: every client trains each round, and only the sampled ones upload
            (pFedMe's and TDPFed's Algorithm 1: the server broadcasts to all clients, all
            update their personal models, the server aggregates a sampled subset); False (the
            default): only the sampled clients receive, train and upload.
        update_scale: what the "update" and "model" parts that cross the wire are a step of:
            "step" (a model change, lr × a pseudo-gradient: FedAvg's x − x_local) or
            "gradient" (pFedNet's and pFedSOP's pseudo-gradient (x − x_local) / lr).
            Scale-dependent transforms (CER) act on the gradient scale, so that one γ means
            the same for every algorithm (the engine passes ``scale = lr`` for "step"). For
            parts of different scales, a mapping by part name (unlisted parts: "step"):
            SCAFFOLD's Δy is a step, its Δc a gradient.
        server_reads: "mean" when :meth:`server_update` reads the uploads only through their
            weighted mean Σ ω_n u_n (of each part), so that central DP can noise that sum once
            (DP-FedAvg); "each" (the default, the safe one) when it reads uploads one by one,
            so that central DP must noise each (``fedexp.privacy.uplink``). A test holds every
            "mean" declaration to it.
    """

    weighting: str = "samples"
    all_train: bool = False
    downlink_parts: Mapping[str, str] = MappingProxyType({})
    uplink_parts: Mapping[str, str] = MappingProxyType({})
    update_scale: str | Mapping[str, str] = "step"
    server_reads: str = "each"
    #: :meth:`init_client` depends on the client (a per-client random start, the client's
    #: id); False (the default): every client starts alike, so the engine makes the initial
    #: state once for the whole population (``tests/test_round_census.py`` holds this).
    init_per_client: bool = False
    #: :meth:`client_update` reads nothing of its run beyond its arguments and the context's
    #: model, task and solver settings, so that the cohorts of several runs may be trained in
    #: one call (stacked runs, ``fedexp.engine.round.stacking``); False where it reads the
    #: run's seed (FedALA's slices, L2GD's coins): its runs' work is then called run by run.
    #: ``tests/test_stacking.py`` holds every algorithm to it.
    stacks: bool = True
    #: :meth:`server_update` moves a global model by the mean upload through
    #: ``ctx.server_optimizer`` (FedAvg's step, or FedAdagrad, FedAdam, FedYogi); declared by
    #: the class that defines ``server_update`` itself (a subclass with a server of its own
    #: is not taken for one): an adaptive ``server_optimizer`` is refused without it
    server_optimized: bool = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Refuse a subclass that writes a one-client view: the contract asks each thing once.

        Raises:
            TypeError: the class defines ``downlink`` or ``eval_params`` (derived from
                ``downlinks`` and ``eval_stack``, which the engine calls: an override would
                be silently left out of the round).
        """
        super().__init_subclass__(**kwargs)
        for view, stacked in (("downlink", "downlinks"), ("eval_params", "eval_stack")):
            if view in cls.__dict__:
                raise TypeError(
                    f"{cls.__qualname__}.{view}: one client's view is derived; write "
                    f"{stacked}(ctx, server, ..., clients) for the cohort instead"
                )

    def init_server(self, ctx: Context, x0: torch.Tensor) -> State:
        """Server state before round 0 (default: the global model ``x``)."""
        return {"x": x0.clone()}

    def init_client(self, ctx: Context, x0: torch.Tensor, client: int) -> State:
        """Client state before round 0 (default: empty)."""
        return {}

    def downlinks(
        self, ctx: Context, server: State, clients: list[int]
    ) -> Mapping[int, Message | None]:
        """Every sampled client's message of the round (``clients`` ascending), in one call.

        What an algorithm states (the engine's entry point; :meth:`downlink` derives one
        client's from it). A :class:`StackedUpdates` of ``clients``, its stacks ``[m, ...]``,
        keeps the round's ops from growing with the cohort: one message for all expanded
        (:func:`broadcast`), per-client messages made by one gather (:func:`gather_rows`).
        ``{n: None}``: nothing is sent. Default: the global model for every client, expanded.
        """
        return broadcast(clients, server["x"])

    def downlink(self, ctx: Context, server: State, client: int) -> Message | None:
        """The message sent to ``client`` alone: its row of :meth:`downlinks` (not overridden)."""
        return self.downlinks(ctx, server, [client])[client]

    @abstractmethod
    def client_update(
        self, ctx: Context, model_in: Stacked | None, states: CohortStates, cohort: Cohort
    ) -> CohortResult:
        """Local work of every client of ``cohort``.

        ``model_in``: the decoded downlink messages stacked ``[m, ...]`` in
        ``cohort.clients`` order (named parts: a dict of such stacks; None when nothing is
        sent); ``states``: the clients' states stacked by key, in the same order (read them
        with ``states.stack(key)`` and ``ctx.optimizer.load(states)``, return
        ``states.updated(...)``: a fixed number of ops for any cohort; ``states[i]`` reads
        client i's alone, at a cost per client).
        """

    @abstractmethod
    def server_update(
        self, ctx: Context, server: State, updates: Updates, weights: Weights
    ) -> State:
        """New server state from the decoded updates (weights sum to one over ``updates``)."""

    def eval_stack(
        self, ctx: Context, server: State, states: CohortStates, clients: list[int]
    ) -> torch.Tensor:
        """``[m, d]`` the vectors ``clients`` are evaluated with, at once.

        What an algorithm states (the engine calls it; :meth:`eval_params` derives one
        client's from it), in a fixed number of ops for any cohort: the global model expanded,
        ``states.stack(key)``, one gather of server rows (:func:`gather_rows`). A vector
        shared by every client is returned expanded (stride 0 along the clients), which the
        evaluation reads as one plain forward pass. Default: the global model, expanded (no
        read of the states: their keys, an optimiser's momentum, cost nothing).
        """
        x = server["x"]
        return x.expand(len(clients), *x.shape)

    def eval_params(
        self, ctx: Context, server: State, client_state: State, client: int
    ) -> torch.Tensor:
        """The vector client ``client`` is evaluated with: its row of :meth:`eval_stack`.

        Derived, not overridden: the view of one client of what :meth:`eval_stack` states.
        """
        states = CohortStates.of_rows([client_state])
        return self.eval_stack(ctx, server, states, [client])[0]

    #: True when :meth:`eval_models` computes the evaluated vectors from the clients' data
    eval_with_data: bool = False

    def eval_models(
        self, ctx: Context, server: State, states: list[State], cohort: Cohort
    ) -> torch.Tensor:
        """[m, d] the vectors the clients of ``cohort`` are evaluated with, from their data.

        Called by the engine instead of :meth:`eval_stack` when :attr:`eval_with_data` is
        set: for protocols that do work on a client's training data before testing it
        (FedAvg-FT fine-tunes the current global model; IFCA estimates the client's cluster).
        The cohort draws from evaluation streams (``streams.EVAL``), apart from the training
        draws; nothing it computes is kept. Default: :meth:`eval_stack` of the cohort.
        """
        return self.eval_stack(ctx, server, CohortStates.of_rows(states), cohort.clients)

    def predict(self, ctx: Context, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Logits of ``x`` under :meth:`eval_params`'s vector (default: the model at it)."""
        return ctx.model(params, x)

    def global_vector(
        self, ctx: Context, server: State, average: Callable[[str], torch.Tensor]
    ) -> torch.Tensor | None:
        """The run's global model, a vector :meth:`predict` reads; None: the method has none.

        What the evaluation scores beside the personal models (``global/acc/mean``, and the
        gain of personalisation ``gain/...``, docs/protocols.md) and what a new client starts
        from (:meth:`newcomer`). Default: the server's ``x`` where it is a whole model and
        the method predicts with the model itself. ``average(key)``: the clients'
        training-sample-weighted mean of their state ``key`` (every training client's), for a
        method whose only models are the clients' (local-only's one-shot average).
        """
        x = server.get("x")
        if x is None or type(self).predict is not Algorithm.predict:
            return None
        return x if x.numel() == ctx.model.layout.numel else None

    def newcomer(
        self, ctx: Context, server: State, global_model: torch.Tensor | None, x0: torch.Tensor
    ) -> torch.Tensor | None:
        """The vector a client that never trained starts from (``holdout_clients``).

        The engine takes ``holdout_steps`` local steps from it on the new client's training
        split and scores the result on its test split (``new/acc/mean``; the protocol of
        pFedHN, Shamsian et al., ICML 2021, and Per-FedAvg, Fallah et al., NeurIPS 2020).
        Default: the global model (:meth:`global_vector`, here ``global_model``; None: no
        newcomer rule, no ``new/`` metrics). ``x0``: the run's common initial model.
        """
        return global_model

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
