"""The round's varying parts as objects chosen when a run is built (issue 38).

``Engine.run_round`` reads as a paper's Algorithm 1: sample, downlink, client work, uplink,
aggregate, server step, record. What differs between runs is not an ``if`` in that loop but
one of these objects:

* :class:`Sampler`: who uploads this round (a fixed-size draw, or the DP mechanism's Poisson
  or fixed-size draw) and who trains (those, or every client when the algorithm says
  ``all_train``), as a :class:`Who`;
* the uplink, a chain of :class:`UplinkStage` through which an :class:`Uplink` passes on the
  sending side (clip and local noise, then the channel: codec with error feedback, wire and
  ledger, decode) and, after the processes' exchange
  (:mod:`fedexp.engine.round.exchange`), on the server's side (re-clip and server noise, the
  accountant). No DP is a chain without :class:`Privatize`; a lossless channel is the same
  :class:`Wire` with the dense codec. pfl-research's postprocessors are the model: each stage
  transforms the message on one side and may undo or finish it on the other.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from fedexp.contract import Message
from fedexp.contract import Stacked
from fedexp.engine.round.ledger import ByteLedger

if TYPE_CHECKING:
    from fedexp.privacy.uplink import PrivateUplink

R = TypeVar("R")


@dataclass(frozen=True)
class Who:
    """A round's clients: who uploads and who trains, over all processes and on this one.

    ``my_*`` are this process's own clients of the run-wide lists (all of them in one
    process; over several, those n with n mod P == rank:
    :class:`fedexp.engine.processes.share.Share`).

    Attributes:
        uploaders: who uploads: the round's sampled cohort over all processes, ascending.
        trainers: who receives and trains, over all processes (``uploaders`` itself, or
            every client with ``all_train``).
        my_trainers: this process's clients of ``trainers``: those it runs.
        my_uploaders: this process's clients of ``uploaders``: those whose uploads it sends.
    """

    uploaders: list[int]
    trainers: list[int]
    my_trainers: list[int]
    my_uploaders: list[int]

    def metrics(self) -> dict[str, float]:
        """``clients/sampled``, the uploaders (and ``clients/trained`` when the trainers differ)."""
        out = {"clients/sampled": float(len(self.uploaders))}
        if self.trainers is not self.uploaders:
            out["clients/trained"] = float(len(self.trainers))
        return out


@dataclass(frozen=True)
class Sampler:
    """Who takes part in a round.

    Attributes:
        draw: round -> the sampled clients (``rng.sample_clients`` or the DP mechanism's).
        num_clients: N.
        all_train: every client trains each round (``Algorithm.all_train``); the sampled
            ones alone upload.
        mine: this process's clients of a list (the exchange's).
        members: the clients that may take part, ascending (``holdout_clients`` keeps the
            others out of every round); None: all ``num_clients``.
    """

    draw: Callable[[int], list[int]]
    num_clients: int
    all_train: bool
    mine: Callable[[list[int]], list[int]]
    members: tuple[int, ...] | None = None

    def __call__(self, round_: int) -> Who:
        """The round's :class:`Who`."""
        uploaders = self.draw(round_)
        pool = range(self.num_clients) if self.members is None else self.members
        everyone = self.all_train and len(uploaders) < len(pool)
        trainers = list(pool) if everyone else uploaders
        mine = self.mine(trainers)
        return Who(
            uploaders, trainers, mine, mine if trainers is uploaders else self.mine(uploaders)
        )


@dataclass
class Uplink:
    """What the round's uploads carry through the stages.

    Attributes:
        uploads: this process's uploaders' stacked messages (None: the algorithm uploads
            nothing).
        inbox: its trainers' decoded downlink (a "model" part's DP reference).
        metrics: sums over this process's clients: ``train/`` (per trained client),
            ``channel/`` (per upload), ``privacy/`` counts; added over the processes.
        updates: the decoded uploads, every process's after the exchange.
        uploaded: whether anyone uploaded.
        refs: the DP references of the "model" parts, stacked as the uploads.
        weights: the aggregation weights ω_n.
        report: the round's figures a server-side stage adds (``privacy/epsilon``...).
        summed: this process's Σ_n ω_n u_n, summed slice by slice (a round in slices,
            ``Engine._sliced``), in place of its decoded uploads: the exchange hands the
            server it (``Alone``), or the processes' sums added (``RankExchange``), as the
            round's mean upload (``fedexp.contract.MeanUpload``, of weight 1).
        heard: the uploaders whose uploads the server keeps, where a stage dropped some (the
            simulated clock's deadline, ``fedexp.system.clock``); None: every uploader.
        ledger: where this process counts the round's messages (the exchange's
            ``round_ledger``); :class:`Wire` counts the uploads' bytes in it.
    """

    uploads: Stacked | None
    inbox: Stacked | None
    metrics: dict[str, float]
    updates: Mapping[int, Message] = field(default_factory=dict)
    uploaded: bool = False
    refs: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    report: dict[str, float] = field(default_factory=dict)
    summed: dict[str, torch.Tensor] | None = None
    heard: list[int] | None = None
    ledger: ByteLedger | None = field(default=None, repr=False)


class UplinkStage:
    """One link of the uplink chain: the identity on both sides unless overridden."""

    def client(self, round_: int, who: Who, up: Uplink) -> Uplink:
        """On the sending side, before the processes' exchange (this process's uploaders)."""
        return up

    def server(self, round_: int, who: Who, up: Uplink) -> Uplink:
        """On the server's side, after the exchange (every uploader's decoded upload)."""
        return up


@dataclass
class Wire(UplinkStage):
    """The channel: codec with error feedback, bytes on the wire and in the ledger, decode.

    Attributes:
        send: ``(uploaders, stacked uploads, round, ledger) -> (decoded uploads, the channel's
            summed metrics)``, the bytes counted in the ledger: the engine's transport
            (``Transport.send_up``).
    """

    send: Callable[
        [list[int], Stacked | None, int, ByteLedger],
        tuple[Mapping[int, Message], dict[str, float]],
    ]

    def client(self, round_: int, who: Who, up: Uplink) -> Uplink:
        """Every upload through the channel, its bytes counted in :attr:`Uplink.ledger`."""
        assert up.ledger is not None, "the uplink's bytes need a ledger to be counted in"
        up.updates, sums = self.send(who.my_uploaders, up.uploads, round_, up.ledger)
        up.metrics.update({f"channel/{k}": v for k, v in sums.items()})
        up.uploaded = up.uploads is not None
        return up


@dataclass
class Privatize(UplinkStage):
    """Client-level DP (``fedexp.privacy.uplink.PrivateUplink``'s two ends).

    On the sending side each upload is clipped (and noised for local DP) before the codec; on
    the server's side what arrived is re-clipped and noised (central DP), weighted uniformly,
    and the round is counted by the accountant. An empty Poisson cohort still gets central
    DP's noise on its (empty) sum (:meth:`PrivateUplink.empty_release`).

    Attributes:
        privacy: the mechanism.
        x0: the common initial model (a "model" part's last-resort reference).
        lossy: whether the channel may deliver more than was clipped (error feedback).
        received: () -> what a client would receive this round (the shape of an empty
            cohort's noise); None: an empty cohort releases nothing.
    """

    privacy: PrivateUplink
    x0: torch.Tensor
    lossy: bool
    received: Callable[[], Message | None] | None = None

    def client(self, round_: int, who: Who, up: Uplink) -> Uplink:
        """Clip (and locally noise) this process's uploads; their counts into the metrics."""
        if up.uploads is None:
            return up
        uploads = up.uploads
        inbox = rows_of(up.inbox, who.my_trainers, who.my_uploaders)
        parts = uploads if isinstance(uploads, dict) else {"": uploads}
        up.refs = self.privacy.references(parts, inbox, self.x0)
        up.uploads, counts = self.privacy.client_side(round_, who.my_uploaders, uploads, up.refs)
        up.metrics.update(counts)
        return up

    def server(self, round_: int, who: Who, up: Uplink) -> Uplink:
        """Re-clip and noise what arrived (central DP), uniform weights; count the round."""
        counts = {k: v for k, v in up.metrics.items() if k.startswith("privacy/")}
        report: dict[str, float] = {}
        if up.uploaded:
            up.updates, up.weights, report = self.privacy.server_side(
                round_, who.uploaders, up.updates, up.refs, lossy=self.lossy
            )
        elif not who.uploaders and self.received is not None and self.privacy.summed:
            up.updates, up.weights, report = self.privacy.empty_release(round_, self.received())
        report.update(self.privacy.end_round(round_, who.uploaders, up.uploaded, counts))
        up.report.update(report)
        return up


def weakly(method: Callable[..., R]) -> Callable[..., R]:
    """``method`` (bound) without keeping its object alive.

    An engine's stages hold the engine's methods; a cycle would keep the engine (its states,
    its ``store=disk`` folder) until the garbage collector runs, not until the run lets go.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> R:
        bound = ref()
        assert bound is not None, "the engine of this stage is gone"
        return bound(*args)

    return call


def take_rows(stacked: Stacked | None, index: torch.Tensor) -> Stacked | None:
    """Rows ``index`` of a cohort's stacked messages (of each named part)."""
    if stacked is None:
        return None
    if isinstance(stacked, torch.Tensor):
        return stacked[index]
    return {name: part[index] for name, part in stacked.items()}


def rows_of(stacked: Stacked | None, trainers: list[int], uploaders: list[int]) -> Stacked | None:
    """The uploaders' rows of the trainers' ``stacked`` messages (the uploaders are trainers)."""
    if trainers is uploaders or stacked is None:
        return stacked
    where = {n: i for i, n in enumerate(trainers)}
    return take_rows(stacked, torch.tensor([where[n] for n in uploaders], dtype=torch.int64))
