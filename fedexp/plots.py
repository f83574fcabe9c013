"""Figures saved next to a run's results and logged to MLflow as artifacts.

Drawn on :class:`matplotlib.figure.Figure` objects, never pyplot's global figure manager,
one figure at a time and always in one thread (:data:`_DRAWER`): the runs of a stacked sweep
are threads of one process, each writing its own figures, and matplotlib's shared state is
not thread-safe (its fonts are cached per thread: one drawing thread loads them once).
Margins are fixed in inches and titles placed (``tight_layout`` and the automatic title
placement would measure every label's text: a third of a run's output time).

A figure of a given layout is built once and kept (:func:`_kept`): each run refills its lines
and texts and rescales its axes, and the PNG is the one a fresh figure would give, byte for
byte (tests/test_tracking_series.py). Building the axes, ticks and labels was more than half of
a figure's time, paid by every run of a sweep.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Text

from fedexp.metrics import LOWER_IS_BETTER

#: The thread every figure is drawn and saved in.
_DRAWER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedexp-figures")

#: Built figures by layout, most recently used last (touched in :data:`_DRAWER` only).
_KEPT: OrderedDict[tuple, object] = OrderedDict()
#: Layouts :data:`_KEPT` holds at most.
KEEP_FIGURES = 8

_Built = TypeVar("_Built")


def _kept(key: tuple, build: Callable[[], _Built]) -> _Built:
    """The figure of layout ``key``: ``build()`` the first time, then the same one again."""
    if key in _KEPT:
        _KEPT.move_to_end(key)
    else:
        _KEPT[key] = build()
        while len(_KEPT) > KEEP_FIGURES:
            _KEPT.popitem(last=False)
    return _KEPT[key]  # type: ignore[return-value]


def _rescale(axes: list[Axes]) -> None:
    """Limits from the lines' new data, as if they had been drawn on fresh axes."""
    for ax in axes:
        ax.relim()
    for ax in axes:
        ax.autoscale_view()


def _margins(fig: Figure, left: float, right: float, bottom: float, top: float, **space) -> None:
    """Fixed margins of ``fig``, in inches from each edge (``space``: wspace, hspace)."""
    width, height = fig.get_size_inches()
    fig.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        bottom=bottom / height,
        top=1 - top / height,
        **space,
    )


#: Up to this many clients, every client gets a panel in clients.png.
MAX_CLIENT_PANELS = 64
#: Beyond :data:`MAX_CLIENT_PANELS`: this many worst, median and best clients get one each.
CLIENTS_PER_GROUP = 8
#: Client models whose relative spread (their total variance about the mean model over their
#: mean squared norm) is below this are shown as equal, not as a PCA of rounding noise: a
#: relative RMS difference of 1e-5, some 100 float32 ulps (FedAvg's clients all evaluate one
#: global model; pFedNet at a small λ leaves differences of 1e-8).
MODEL_SPREAD_TOL = 1e-10


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
    return _DRAWER.submit(_plot_rounds, history, path, metric).result()


#: The metric's curves of curves.png's first panel: (suffix, line style).
_CURVES = (("mean", "-"), ("weighted", "--"), ("worst", ":"), ("best_mean", "-."))


@dataclass
class _RoundsFigure:
    """curves.png's figure for one metric, its lines empty until filled."""

    fig: Figure
    axes: list[Axes]
    curves: list[Line2D]
    loss: Line2D
    wire: dict[str, Line2D]


def _rounds_figure(metric: str) -> _RoundsFigure:
    fig = Figure(figsize=(13, 3.6))
    axes = list(fig.subplots(1, 3))
    curves = [
        axes[0].plot([], [], style, label=f"{metric}/{suffix}")[0] for suffix, style in _CURVES
    ]
    axes[0].set(xlabel="round", ylabel=f"test {metric}")
    axes[0].set_title(f"{metric} across clients", y=1.0)  # (a set y: no title placement pass)
    axes[0].legend()
    (loss,) = axes[1].plot([], [])
    axes[1].set(xlabel="round", ylabel="loss")
    axes[1].set_title("mean local training loss", y=1.0)
    wire = {d: axes[2].plot([], [], label=f"{d}link")[0] for d in ("up", "down")}
    axes[2].set(xlabel="round", ylabel="bytes")
    axes[2].set_title("cumulative bytes on the wire", y=1.0)
    axes[2].legend()
    _margins(fig, left=0.75, right=0.2, bottom=0.55, top=0.35, wspace=0.3)
    return _RoundsFigure(fig, axes, curves, loss, wire)


def _plot_rounds(history: list[dict[str, float]], path: Path, metric: str) -> Path:
    drawn = _kept(("rounds", metric), lambda: _rounds_figure(metric))
    evals = [h for h in history if f"{metric}/mean" in h]
    for line, (suffix, _) in zip(drawn.curves, _CURVES, strict=True):
        line.set_data([h["round"] for h in evals], [h.get(f"{metric}/{suffix}") for h in evals])
    train = [h for h in history if "train/train_loss" in h]
    drawn.loss.set_data([h["round"] for h in train], [h["train/train_loss"] for h in train])
    for d, line in drawn.wire.items():
        rows = [h for h in history if f"bytes/{d}_cum" in h]
        line.set_data([h["round"] for h in rows], [h[f"bytes/{d}_cum"] for h in rows])
    _rescale(drawn.axes)
    drawn.fig.savefig(path, dpi=110)
    return path


@dataclass
class ModelPCA:
    """The clients' models in PCA coordinates, as :func:`plot_client_models` draws them.

    Attributes:
        coords: ``(N, 2)`` the first two principal coordinates (zeros when ``equal``).
        explained: the share of the total variance of PC1 and PC2 (zeros when ``equal``).
        spread: the relative spread: total variance about the mean model over the mean
            squared norm of the models (0 for all-zero models).
    """

    coords: torch.Tensor
    explained: list[float]
    spread: float

    @property
    def equal(self) -> bool:
        """The models differ by less than :data:`MODEL_SPREAD_TOL`: nothing to project."""
        return self.spread < MODEL_SPREAD_TOL


def client_model_pca(models: torch.Tensor) -> ModelPCA:
    """PCA of ``(N, d)`` client models, or, below :data:`MODEL_SPREAD_TOL`, none."""
    x = models.detach().double().cpu()
    n = x.shape[0]
    centred = x - x.mean(dim=0, keepdim=True)
    scale = float((x**2).sum(dim=1).mean())
    spread = float((centred**2).sum(dim=1).mean()) / scale if scale > 0 else 0.0
    coords = torch.zeros(n, 2, dtype=torch.float64)
    if spread < MODEL_SPREAD_TOL:
        return ModelPCA(coords, [0.0, 0.0], spread)
    u, s, _ = torch.linalg.svd(centred, full_matrices=False)
    k = min(2, s.numel())
    coords[:, :k] = u[:, :k] * s[:k]
    var = (s**2) / (s**2).sum()
    return ModelPCA(coords, [float(var[i]) if i < k else 0.0 for i in range(2)], spread)


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
    return _DRAWER.submit(_plot_client_models, pca, models.shape[0], path, edges).result()


def _plot_client_models(pca: ModelPCA, n: int, path: Path, edges: torch.Tensor | None) -> Path:
    fig = Figure(figsize=(5.2, 4.6))
    ax = fig.subplots()
    if pca.equal:
        ax.text(
            0.5,
            0.5,
            f"all {n} client models equal\n(relative spread {pca.spread:.2g}, "
            f"below the tolerance {MODEL_SPREAD_TOL:g})",
            transform=ax.transAxes,
            ha="center",
            va="center",
        )
        ax.set(xticks=[], yticks=[], xlabel="PC1", ylabel="PC2")
    else:
        coords = pca.coords
        if edges is not None:
            for i, j in edges.cpu().tolist():
                ax.plot(coords[[i, j], 0], coords[[i, j], 1], color="0.75", lw=0.8, zorder=1)
        ax.scatter(coords[:, 0], coords[:, 1], c=range(n), cmap="viridis", zorder=2)
        if n <= 30:
            for i, (a, b) in enumerate(coords.tolist()):
                ax.annotate(str(i), (a, b), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(xlabel=f"PC1 ({pca.explained[0]:.0%})", ylabel=f"PC2 ({pca.explained[1]:.0%})")
    ax.set_title("clients' evaluated models (PCA)", y=1.0)
    _margins(fig, left=0.8, right=0.2, bottom=0.6, top=0.35)
    fig.savefig(path, dpi=110)
    return path


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
    chosen, said = pick_clients(final, metric in LOWER_IS_BETTER)
    if not chosen:  # more clients than panels, and not one with a finite value
        return None
    return _DRAWER.submit(_plot_clients, series, per_round, chosen, said, path, metric).result()


@dataclass
class _ClientsFigure:
    """clients.png's figure for a number of panels, their lines and titles empty until filled."""

    fig: Figure
    axes: list[Axes]
    #: per shown panel: (the mean's line, the client's line, the panel's title)
    panels: list[tuple[Line2D, Line2D, Text]]
    title: Text


def _clients_figure(panels: int, ncols: int) -> _ClientsFigure:
    nrows = math.ceil(panels / ncols)
    width, height = max(6.0, 2.1 * ncols), 1.7 * nrows + 0.9
    fig = Figure(figsize=(width, height))
    axes = np.atleast_2d(fig.subplots(nrows, ncols, sharex=True, sharey=True))
    _margins(fig, left=0.55, right=0.15, bottom=0.6, top=0.8, wspace=0.15, hspace=0.45)
    shown = []
    for ax in axes.flat[:panels]:
        (mean,) = ax.plot([], [], color="0.7", lw=1.0)
        (client,) = ax.plot([], [], ".-", lw=1.2, ms=3)
        shown.append((mean, client, ax.set_title("", fontsize=8, y=1.0)))
        ax.tick_params(labelsize=7)
    for i, ax in enumerate(axes.flat):
        if i >= panels:
            ax.set_visible(False)
            if i >= ncols:
                axes.flat[i - ncols].xaxis.set_tick_params(labelbottom=True)  # the one above
    title = fig.suptitle("", fontsize=9, y=1 - 0.08 / height, va="top")
    fig.supxlabel("round", fontsize=9)
    return _ClientsFigure(fig, list(axes.flat[:panels]), shown, title)


def _plot_clients(
    series: dict[int, list[tuple[float, float]]],
    per_round: dict[float, list[float]],
    chosen: list[tuple[int, str]],
    said: str,
    path: Path,
    metric: str,
) -> Path:
    if len(series) > MAX_CLIENT_PANELS:
        ncols = CLIENTS_PER_GROUP
    else:
        ncols = min(8, math.ceil(math.sqrt(len(chosen))))
    drawn = _kept(("clients", len(chosen), ncols), lambda: _clients_figure(len(chosen), ncols))
    rounds = sorted(per_round)
    mean = [sum(per_round[t]) / len(per_round[t]) for t in rounds]
    for (mean_line, line, title), (n, label) in zip(drawn.panels, chosen, strict=True):
        mean_line.set_data(rounds, mean)
        line.set_data(*zip(*sorted(series[n]), strict=True))
        title.set_text(f"client {n}" + (f" ({label})" if label else ""))
    drawn.title.set_text(
        f"test {metric} per client over rounds: {said}\n(grey: the mean over clients)"
    )
    _rescale(drawn.axes)
    drawn.fig.savefig(path, dpi=90)
    return path
