"""Partitions: pure functions (labels, number of clients, parameters, seed) -> index arrays.

Every partition uses each sample at most once (all of them, except ``dirichlet`` which also
uses all) and is deterministic given the seed. Configure one with ``_partial_: true``; the
engine calls it with ``labels``, ``num_clients``, ``seed`` and ``groups``.

A partition returns either a plain list of index arrays (one per client) or a
:class:`ClientSplit`, which adds per-client input changes that
:func:`fedexp.data.federated.federate` applies (e.g. the missing MRI channel of
:func:`missing_channel`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Annotated

import numpy as np

from fedexp.config.ranges import NonNegativeInt
from fedexp.config.ranges import Positive
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.errors import DataError

#: Label imbalance δ: the majority class is δ times the minority one (1: balanced).
Imbalance = Annotated[float, Range(ge=1, note="1: balanced")]


@dataclass(frozen=True)
class ClientSplit:
    """Index arrays per client plus per-client input channels to zero.

    Attributes:
        parts: one index array per client, as the plain partitions return.
        zero_channels: client -> input channels set to 0 in its train *and* test inputs
            (pFedNet §VI "lack #c"); clients not listed keep every channel.
    """

    parts: list[np.ndarray]
    zero_channels: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, result: ClientSplit | Sequence[np.ndarray]) -> ClientSplit:
        """Wrap a plain partition's list of index arrays (a ``ClientSplit`` is returned as is)."""
        if isinstance(result, ClientSplit):
            return result
        return cls([np.asarray(p) for p in result])


def _split_by_fractions(idx: np.ndarray, fractions: np.ndarray) -> list[np.ndarray]:
    """Split ``idx`` into consecutive parts of the given fractions (summing to 1)."""
    bounds = np.floor(np.cumsum(fractions) * len(idx) + 1e-9).astype(int)
    bounds[-1] = len(idx)
    return np.split(idx, bounds[:-1])


def _check_nonempty(parts: list[np.ndarray], what: str) -> list[np.ndarray]:
    for n, part in enumerate(parts):
        if len(part) < 2:
            raise DataError(
                f"partition {what} gives client {n} only {len(part)} sample(s); every client "
                "needs at least 2 (one to train, one to test): use fewer clients or change "
                "the partition parameter"
            )
    return parts


def iid(
    labels: np.ndarray,
    num_clients: PositiveInt,
    seed: NonNegativeInt,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Uniformly random equal-size split."""
    del groups
    perm = np.random.default_rng([seed, 11]).permutation(len(labels))
    return _check_nonempty(np.array_split(perm, num_clients), f"iid with {num_clients} clients")


def label_imbalance_fractions(num_clients: int, delta: float) -> np.ndarray:
    """Per-client shares of the (negative pool, positive pool): δ:1, 1:1, 1:δ for any N.

    The first ``N // 2`` clients get ratio δ:1 of pool shares (δs, s), a middle client (N odd)
    is balanced (t, t) with t = 2s/(δ+1), the last ``N // 2`` get 1:δ (s, δs); s makes each
    pool sum to one. For N = 5 and δ = 2 this is the authors' (.30,.15) (.30,.15) (.10,.10)
    (.15,.30) (.15,.30); δ = 1 gives equal shares.

    Returns:
        array (N, 2): column 0 negative-pool shares, column 1 positive-pool shares.
    """
    a, c = num_clients // 2, num_clients % 2
    s = 1.0 / (a * (delta + 1.0) + 2.0 * c / (delta + 1.0))
    t = 2.0 * s / (delta + 1.0)
    rows = [(delta * s, s)] * a + [(t, t)] * c + [(s, delta * s)] * a
    return np.asarray(rows, dtype=np.float64)


def label_imbalance(
    labels: np.ndarray,
    num_clients: PositiveInt,
    seed: NonNegativeInt,
    groups: np.ndarray | None = None,
    delta: Imbalance = 2.0,
) -> list[np.ndarray]:
    """Label imbalance δ (pFedNet §VI): clients with δ:1, 1:1 and 1:δ class mixes.

    Args:
        labels: binary labels (0 = negative, 1 = positive).
        num_clients: number of clients N ≥ 1.
        seed: seed of the shuffles.
        groups: unused.
        delta: imbalance δ ≥ 1.

    Raises:
        DataError: labels are not binary, δ < 1, or a client would get no data.
    """
    del groups
    classes = np.unique(labels)
    if not set(classes.tolist()) <= {0, 1} or len(classes) != 2:
        other = (  # one class (3-D BraTS crops: every one holds a tumour) has no imbalance
            "partition=iid or partition=natural" if len(classes) < 2
            else "partition=dirichlet or partition=shards"
        )  # fmt: skip
        raise DataError(
            f"partition label_imbalance needs a binary label (0/1), the data has classes "
            f"{classes.tolist()}; use {other}"
        )
    if not delta >= 1:  # NaN too; for direct calls (a config's δ is checked by its range)
        raise DataError(f"partition.delta={delta}: expected δ ≥ 1")
    fractions = label_imbalance_fractions(num_clients, delta)
    rng = np.random.default_rng([seed, 12])
    neg = rng.permutation(np.flatnonzero(labels == 0))
    pos = rng.permutation(np.flatnonzero(labels == 1))
    parts = [
        np.sort(np.concatenate([a, b]))
        for a, b in zip(
            _split_by_fractions(neg, fractions[:, 0]),
            _split_by_fractions(pos, fractions[:, 1]),
            strict=True,
        )
    ]
    return _check_nonempty(parts, f"label_imbalance with delta={delta}, {num_clients} clients")


def _cap_full_clients(props: np.ndarray, sizes: np.ndarray, cap: float) -> np.ndarray:
    """FedDWA's balance cap: clients already holding ``cap`` samples get no more.

    ``p_j <- p_j * (|idx_j| < cap)``, renormalised. If the draw put (numerically) all its mass
    on full clients, the class is shared equally among the clients below the cap instead.
    """
    open_ = sizes < cap
    capped = props * open_
    total = capped.sum()
    if total > 0:
        return capped / total
    return open_ / open_.sum()


def dirichlet(
    labels: np.ndarray,
    num_clients: PositiveInt,
    seed: NonNegativeInt,
    groups: np.ndarray | None = None,
    alpha: Positive = 0.5,
    min_size: NonNegativeInt = 2,
    max_tries: PositiveInt = 100,
    balance: bool = False,
) -> list[np.ndarray]:
    """Class proportions per client drawn from Dirichlet(α) (Hsu et al. 2019).

    Each class c in turn is shuffled and dealt by proportions p ~ Dir(α·1_N). Redraws
    (deterministically) until every client has ``min_size`` samples, at most ``max_tries``
    times.

    Args:
        labels: one label per sample.
        num_clients: number of clients N.
        seed: seed of the shuffles and draws.
        groups: unused.
        alpha: concentration α > 0 (small: each class on few clients).
        min_size: the fewest samples any client may get, ≥ 0; the draw is repeated until it
            holds.
        max_tries: draws before giving up with a DataError, ≥ 1.
        balance: the cap of FedDWA's and NIID-Bench's (Li et al. 2022) Dirichlet code: while
            dealing a class, a client that already holds ≥ n/N samples gets proportion 0
            (``p_j <- p_j * (|idx_j| < n/N)``, renormalised), so no client ends with more than
            n/N plus its share of the last class it received. False keeps the plain draw
            (the same partition as before the option existed).

    Raises:
        DataError: α ≤ 0 or not finite, ``max_tries`` < 1, or no draw in ``max_tries`` gives
            every client ``min_size`` samples.
    """
    del groups
    # for direct calls: a config's alpha and max_tries are checked by their declared ranges
    if not 0 < alpha < float("inf"):  # NaN too
        raise DataError(f"partition.alpha={alpha}: expected a finite α > 0")
    if max_tries < 1:
        raise DataError(f"partition.max_tries={max_tries}: expected ≥ 1")
    rng = np.random.default_rng([seed, 13])
    cap = len(labels) / num_clients
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, alpha))
            if balance:
                props = _cap_full_clients(props, sizes, cap)
            for n, chunk in enumerate(_split_by_fractions(idx, props)):
                parts[n].append(chunk)
                sizes[n] += len(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise DataError(
        f"partition dirichlet with alpha={alpha} leaves a client with fewer than {min_size} "
        f"samples in {max_tries} draws for {num_clients} clients and {len(labels)} samples: "
        "raise alpha or use fewer clients"
    )


def shards(
    labels: np.ndarray,
    num_clients: PositiveInt,
    seed: NonNegativeInt,
    groups: np.ndarray | None = None,
    classes_per_client: PositiveInt = 2,
) -> list[np.ndarray]:
    """Pathological non-IID (McMahan et al. 2017): sort by label, N·c shards, c per client.

    Args:
        labels: one label per sample.
        num_clients: number of clients N.
        seed: seed of the shuffles.
        groups: unused.
        classes_per_client: c ≥ 1, at most the data's number of classes.

    Raises:
        DataError: ``classes_per_client`` is more than the data's number of classes.
    """
    del groups
    num_classes = len(np.unique(labels))
    if classes_per_client > num_classes:
        raise DataError(
            f"partition.classes_per_client={classes_per_client}: the data has only "
            f"{num_classes} classes; expected ≤ {num_classes}"
        )
    rng = np.random.default_rng([seed, 14])
    order = np.lexsort((rng.random(len(labels)), labels))
    pieces = np.array_split(order, num_clients * classes_per_client)
    deal = rng.permutation(len(pieces)).reshape(num_clients, classes_per_client)
    parts = [np.sort(np.concatenate([pieces[i] for i in row])) for row in deal]
    return _check_nonempty(
        parts, f"shards with classes_per_client={classes_per_client}, {num_clients} clients"
    )


def natural(
    labels: np.ndarray,
    num_clients: PositiveInt,
    seed: NonNegativeInt,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """One client per natural site/patient group; with fewer clients, sites are dealt by size."""
    if groups is None:
        raise DataError("partition=natural needs a dataset with sites (dataset.group column)")
    names, inverse = np.unique(groups, return_inverse=True)
    if num_clients > len(names):
        raise DataError(
            f"partition=natural: num_clients={num_clients} but the data has {len(names)} sites"
        )
    sizes = np.bincount(inverse)
    owner = np.empty(len(names), dtype=int)
    load = np.zeros(num_clients, dtype=int)
    for g in np.argsort(-sizes, kind="stable"):  # largest site to the least-loaded client
        owner[g] = int(np.argmin(load))
        load[owner[g]] += sizes[g]
    del seed
    parts = [np.flatnonzero(owner[inverse] == n) for n in range(num_clients)]
    return _check_nonempty(parts, f"natural with {num_clients} clients")


def missing_channel(
    labels: np.ndarray,
    num_clients: PositiveInt,
    seed: NonNegativeInt,
    groups: np.ndarray | None = None,
    channel: NonNegativeInt = 0,
    clients: list[int] | tuple[int, ...] = (0, 1),
    base: Callable[..., list[np.ndarray]] | None = None,
) -> ClientSplit:
    """Missing MRI channel "lack #c" (pFedNet §VI-B, Tables III-IV).

    The samples are split by ``base`` (IID by default); the listed clients then have input
    channel ``channel`` (order FLAIR, T1, T1ce, T2 for BraTS) set to zero in their training and
    test inputs. The model keeps all input channels, as in the paper.

    Args:
        labels: one label per sample (passed to ``base``).
        num_clients: number of clients N.
        seed: seed of the base split.
        groups: sites/patients (passed to ``base``, e.g. ``natural``).
        channel: the missing channel c ≥ 0 (checked against the data in ``federate``).
        clients: the clients that lack the channel, each in ``[0, N)``.
        base: the partition giving the index arrays (a partial partition function).

    Returns:
        The base split and, for each listed client, ``(channel,)`` to zero.

    Raises:
        DataError: a client outside ``[0, N)``.
    """
    bad = [c for c in clients if not 0 <= int(c) < num_clients]
    if bad:
        raise DataError(
            f"partition.clients={list(clients)}: client(s) {bad} do not exist with "
            f"num_clients={num_clients} (expected indices in [0, {num_clients}))"
        )
    split = ClientSplit.of(
        (base or iid)(labels=labels, num_clients=num_clients, seed=seed, groups=groups)
    )
    zero = {n: tuple(split.zero_channels.get(n, ())) for n in range(num_clients)}
    for c in clients:
        zero[int(c)] = tuple(sorted({*zero[int(c)], int(channel)}))
    return ClientSplit(split.parts, {n: ch for n, ch in zero.items() if ch})
