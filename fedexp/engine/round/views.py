"""What an evaluation scores beside each client's own model: the global model, new clients.

Personalised FL is judged against two references (docs/protocols.md, "Global, personal and
new clients"):

* **the global model** on every client's test split (``global/acc/mean``...), and the gain of
  personalisation per client, ``gain/<m> = <m> − global/<m>`` (for a loss, global − personal:
  a gain is positive where the client's own model is better), with the share of clients it
  hurts (``gain/acc/hurt``);
* **new clients** (the protocol of pFedHN, Shamsian et al., ICML 2021, and Per-FedAvg, Fallah
  et al., NeurIPS 2020): ``holdout_clients`` keeps a fraction of the clients out of every
  round; at a full evaluation each receives what a new client would
  (``Algorithm.newcomer``), takes ``holdout_steps`` local steps on its training split, and is
  scored on its test split (``new/acc/mean``...).

This module holds the choice of the held-out clients, the names of the views and the gains;
:class:`fedexp.engine.round.evaluation.Evaluation` runs them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from fedexp import streams
from fedexp.metrics import GAIN
from fedexp.metrics import lower_is_better

#: Prefix of the global model's metrics on the clients' test splits.
GLOBAL = "global/"
#: Prefix of the new (held-out) clients' metrics.
NEW = "new/"
#: Prefixes of the views that are not a client's own model (no ``best_mean`` of them).
VIEWS = (GLOBAL, GAIN, NEW)

#: Stream purposes (beside ``streams.CLIENT``...): the choice of the held-out clients, and the
#: new clients' local steps at an evaluation
HOLDOUT, NEWCOMER = 51, 52


def held_out(seed: int, num_clients: int, fraction: float) -> tuple[int, ...]:
    """The clients ``holdout_clients=fraction`` keeps out of training, ascending.

    ``round(fraction · N)`` clients (at least one when ``fraction > 0``, at most N − 1, so
    that someone trains), drawn without replacement from the run's own stream
    (``seed``, :data:`HOLDOUT`): the same clients on every resume and every process.
    """
    if fraction <= 0 or num_clients < 2:
        return ()
    k = min(max(1, int(round(fraction * num_clients))), num_clients - 1)
    gen = np.random.default_rng(streams.derive_seed(seed, HOLDOUT))
    return tuple(np.sort(gen.choice(num_clients, size=k, replace=False)).tolist())


def with_gains(rows: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
    """Each client's row with ``gain/<m>`` for every ``<m>`` that has a ``global/<m>``.

    ``gain/<m> = <m> − global/<m>``, or ``global/<m> − <m>`` for a metric whose lower values
    are better (``loss``), so that a positive gain always means personalisation helped that
    client. NaN where either is NaN (AUC of a one-class test split).
    """
    out = []
    for row in rows:
        new = dict(row)
        for key, value in row.items():
            if not key.startswith(GLOBAL):
                continue
            name = key.removeprefix(GLOBAL)
            own = row.get(name, math.nan)
            gain = value - own if lower_is_better(name) else own - value
            new[f"{GAIN}{name}"] = gain
        out.append(new)
    return out
