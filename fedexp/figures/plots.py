"""Figures saved next to a run's results and logged to MLflow as artifacts: what they show.

Each public function takes a run's data, chooses what to draw (the clients shown, the models'
PCA) and has it drawn by :mod:`fedexp.figures.canvas`, in this process's drawing thread or in a
helper process where the run leaves a core idle (:mod:`fedexp.figures.drawer`). This module
imports neither torch nor matplotlib at its top: a run whose figures a helper draws never
imports matplotlib (0.4 s); the models' PCA is :mod:`fedexp.figures.pca`'s.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from fedexp.figures.drawer import draw
from fedexp.figures.pca import MODEL_SPREAD_TOL
from fedexp.figures.pca import client_model_pca

if TYPE_CHECKING:
    import torch

#: Up to this many clients, every client gets a panel in clients.png.
MAX_CLIENT_PANELS = 64
#: Beyond :data:`MAX_CLIENT_PANELS`: this many worst, median and best clients get one each.
CLIENTS_PER_GROUP = 8


def plot_rounds(history: list[dict[str, float]], path: Path, metric: str = "acc") -> Path | None:
    """A test metric across clients, training loss and cumulative bytes per round.

    The metric's curves: mean over clients, weighted by test samples, worst client, and the
    mean of each client's best so far.

    Args:
        history: the per-round metrics.
        path: the PNG to write.
        metric: the test metric of the first panel (``acc``; ``iou`` for segmentation).
    """
    if not history:
        return None
    return draw("draw_rounds", history, path, metric)


def plot_client_models(
    models: torch.Tensor, path: Path, edges: torch.Tensor | None = None
) -> Path | None:
    """PCA scatter of the clients' evaluated models (pFedNet Figure 2), with the graph's edges.

    Models that differ by less than :data:`MODEL_SPREAD_TOL` (relative) are not projected: the
    figure says they are equal, with their spread, instead of plotting rounding noise.

    Args:
        models: ``(N, d)`` one evaluated model per client.
        path: the PNG to write.
        edges: optional ``(M, 2)`` similarity-network edges drawn between the points.
    """
    if models.shape[0] < 2:
        return None
    pca = client_model_pca(models)
    pairs = None if edges is None else edges.cpu().tolist()
    return draw("draw_client_models", pca, models.shape[0], path, pairs, MODEL_SPREAD_TOL)


def pick_clients(
    final: dict[int, float], lower_is_better: bool
) -> tuple[list[tuple[int, str]], str]:
    """The clients to draw, each with its group's label, and what the title says of them.

    Every client up to :data:`MAX_CLIENT_PANELS`; beyond, the :data:`CLIENTS_PER_GROUP`
    worst, median and best by final value (clients without a finite one are left out).
    """
    clients = sorted(final)
    if len(clients) <= MAX_CLIENT_PANELS:
        return [(n, "") for n in clients], f"all {len(clients)} clients"
    ranked = sorted(
        (n for n in clients if math.isfinite(final[n])),
        key=lambda n: (-final[n] if lower_is_better else final[n], n),
    )  # worst first
    k = CLIENTS_PER_GROUP
    mid = max(0, (len(ranked) - k) // 2)
    chosen: dict[int, str] = {}
    for label, group in (("worst", ranked[:k]), ("median", ranked[mid : mid + k])):
        for n in group:
            chosen.setdefault(n, label)
    for n in ranked[-k:]:
        chosen.setdefault(n, "best")
    said = f"the {k} worst, {k} median and {k} best of {len(clients)} clients by final value"
    return list(chosen.items()), said


def plot_clients(
    client_history: list[dict[str, float]], path: Path, metric: str = "acc"
) -> Path | None:
    """Each client's test ``metric`` over the evaluated rounds, one small panel per client.

    Up to :data:`MAX_CLIENT_PANELS` clients, one panel each; with more, the
    :data:`CLIENTS_PER_GROUP` worst, median and best clients by their last evaluated value
    (one row per group; the figure's title and each panel's title say which). Every panel
    shows, in grey, the mean over the clients evaluated in each round, for reference; axes
    are shared.

    Args:
        client_history: rows of clients_rounds.csv (``round``, ``client``, the metrics).
        path: the PNG to write.
        metric: the per-client metric (``acc``; ``iou`` for segmentation).

    Returns:
        ``path``, or None when no row holds ``metric`` (or, beyond :data:`MAX_CLIENT_PANELS`
        clients, no finite value of it).
    """
    series: dict[int, list[tuple[float, float]]] = {}
    per_round: dict[float, list[float]] = {}
    for row in client_history:
        if metric in row:
            series.setdefault(int(row["client"]), []).append((row["round"], row[metric]))
            if math.isfinite(row[metric]):
                per_round.setdefault(row["round"], []).append(row[metric])
    if not series:
        return None
    final = {}
    for n, points in series.items():
        finite = [v for _, v in points if math.isfinite(v)]
        final[n] = finite[-1] if finite else math.nan
    from fedexp.metrics import LOWER_IS_BETTER  # (with torch: not in the helper's import)

    chosen, said = pick_clients(final, metric in LOWER_IS_BETTER)
    if not chosen:  # more clients than panels, and not one with a finite value
        return None
    if len(series) > MAX_CLIENT_PANELS:
        ncols = CLIENTS_PER_GROUP  # a row a group
    else:
        ncols = min(8, math.ceil(math.sqrt(len(chosen))))
    return draw("draw_clients", series, per_round, chosen, said, path, metric, ncols)
