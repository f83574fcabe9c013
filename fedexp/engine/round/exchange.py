"""What the run's processes exchange in a round (issue 38).

One process is the trivial exchange (:class:`Alone`): its clients are all clients, its
ledger is the run's, its uploads are the round's. Over several processes
(:class:`RankExchange`, torch.distributed ranks: ``fedexp.engine.processes.ranks``) each
rank works its
own clients and counts their messages in a ledger of its own; after the senders' side of the
uplink, one exchange a round gives every rank the run's metrics, messages and uploads (their
weighted sum alone for a server that reads only that), so every rank takes the same server
step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedexp.contract import MeanUpload
from fedexp.contract import update_parts
from fedexp.engine.processes.ranks import Ranks
from fedexp.engine.processes.ranks import add_floats
from fedexp.engine.processes.ranks import gather_uploads
from fedexp.engine.processes.ranks import reduce_uploads
from fedexp.engine.processes.ranks import sums_record
from fedexp.engine.processes.ranks import weighted_sums
from fedexp.engine.round.ledger import ByteLedger
from fedexp.engine.round.stages import Uplink
from fedexp.engine.round.stages import Who

#: ``(clients, among) -> their weights ω_n`` (float64), as ``Engine.weight_tensor``.
WeightFn = Callable[[list[int], list[int]], torch.Tensor]


class Alone:
    """One process: nothing to exchange."""

    def mine(self, clients: list[int]) -> list[int]:
        """This process's clients of ``clients``: all of them."""
        return clients

    def round_ledger(self, run: ByteLedger) -> ByteLedger:
        """The ledger this process's messages are counted in this round: the run's."""
        return run

    def combine(self, who: Who, up: Uplink, mine: ByteLedger, run: ByteLedger) -> Uplink:
        """The round's uploads, metrics and messages: this process's (counted in ``run``).

        A round summed slice by slice (``Uplink.summed``) hands the server its sum as the
        round's mean upload (:class:`MeanUpload`, of weight 1), as :func:`reduce_uploads`
        hands it the ranks' sum; nothing when no one sent.
        """
        if up.summed is not None:
            up.updates = MeanUpload(up.summed, who.uploaders) if up.summed else {}
        return up


@dataclass
class RankExchange:
    """torch.distributed ranks, each with its own clients (``Ranks.mine``).

    Attributes:
        ranks: the run's processes.
        mean: the server reads the uploads only through Σ_n ω_n u_n (``server_reads="mean"``,
            no DP): the ranks exchange their weighted sums, not the rows.
        weights: the aggregation weights (for the weighted sums).
    """

    ranks: Ranks
    mean: bool
    weights: WeightFn

    def mine(self, clients: list[int]) -> list[int]:
        """This rank's clients of ``clients``."""
        return self.ranks.mine(clients)

    def round_ledger(self, run: ByteLedger) -> ByteLedger:
        """A ledger of this rank's messages, merged into the run's by :meth:`combine`."""
        return ByteLedger(per_client=run.per_client)

    def combine(self, who: Who, up: Uplink, mine: ByteLedger, run: ByteLedger) -> Uplink:
        """Every rank's metrics, messages and uploads (or their weighted sum), on every rank.

        One exchange of the records (metrics, the ledger's round, the weighted sums when
        small), then the uploads' rows (or a larger sum's ``all_reduce``).
        """
        own = {}
        if self.mean and up.summed is not None:  # a round in slices: summed as it went
            own = up.summed
        elif self.mean and up.updates:
            weights = self.weights(who.my_uploaders, who.uploaders)
            own = weighted_sums(update_parts(up.updates, who.my_uploaders), weights)
        records = self.ranks.gather_json([up.metrics, mine.round_record(), sums_record(own)])
        up.metrics = add_floats([r[0] for r in records])
        run.merge([r[1] for r in records])
        if self.mean:
            up.updates, up.uploaded = reduce_uploads(
                self.ranks, who.uploaders, own, [r[2] for r in records]
            )
        else:  # every upload, to every rank
            up.updates, up.refs, up.uploaded = gather_uploads(
                self.ranks, who.uploaders, who.my_uploaders, up.updates, up.refs
            )
        return up
