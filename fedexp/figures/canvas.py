"""The matplotlib figures of a run: curves.png, clients.png, client_models_pca.png.

What to draw is :mod:`fedexp.figures.plots`'s (the data, the clients shown, the PCA); this
module draws it, in the one thread or the helper process that draws a process's figures
(:mod:`fedexp.figures.drawer`): matplotlib's shared state is not thread-safe, and the runs of a
stacked sweep are threads of one process (its fonts are cached per thread: one drawing thread
loads them once). It takes plain data (lists, NumPy arrays) and imports no torch: the helper
imports it alone. Drawn on :class:`matplotlib.figure.Figure` objects, never pyplot's global
figure manager. Margins are fixed in inches and titles placed (``tight_layout`` and the
automatic title placement would measure every label's text: a third of a run's output time).

A figure of a given layout is built once and kept (:func:`_kept`): each run refills its lines
and texts and rescales its axes, and the PNG is the one a fresh figure would give, byte for
byte (tests/test_tracking_series.py). Building the axes, ticks and labels was more than half of
a figure's time, paid by every run of a sweep.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import matplotlib
import numpy as np
import PIL.Image
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.collections import PathCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Annotation
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator
from PIL.PngImagePlugin import PngInfo

if TYPE_CHECKING:  # (what to draw is chosen there; everything arrives as arguments)
    from fedexp.figures.pca import ModelPCA

#: Built figures by layout, most recently used last (touched by the drawing thread only).
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


def _figure(width: float, height: float, dpi: int) -> Figure:
    """A figure of ``width`` × ``height`` inches drawn at ``dpi``, on its own Agg canvas.

    Saved at its own dpi (:func:`_save`), a kept figure draws on the same canvas and renderer
    every time, so matplotlib's cache of text extents (keyed by the renderer) holds across
    runs; a figure without a canvas of its own got a new one at every ``savefig``, and measured
    every label again. The PNG is the same, byte for byte.
    """
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path) -> None:
    """``fig`` as a PNG at its own dpi, what ``fig.savefig(path)`` draws, without alpha.

    The figures' backgrounds are opaque, so the alpha channel that ``savefig`` writes is 255
    everywhere: without it there is a quarter less to encode, and at zlib's fastest level (1)
    the file is about the size ``savefig``'s default level made (a curves.png: 116 against
    119 KB). The encoding was about a quarter of a figure's time (24 ms of curves.png's 94;
    now 12). A figure with any transparent pixel keeps its alpha channel.
    """
    canvas = fig.canvas
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    opaque = bool(rgba[..., 3].min() == 255)
    image = PIL.Image.fromarray(np.ascontiguousarray(rgba[..., :3]) if opaque else rgba)
    info = PngInfo()
    info.add_text(
        "Software", f"Matplotlib version{matplotlib.__version__}, https://matplotlib.org/"
    )
    image.save(path, format="png", dpi=(fig.dpi, fig.dpi), pnginfo=info, compress_level=1)


def _rescale(axes: list[Axes]) -> None:
    """Limits from the lines' new data, as if they had been drawn on fresh axes.

    Axes that share their x and y axes are scaled once: ``autoscale_view`` of one sets the
    limits of all its siblings from all their data (clients.png's panels: once, not once a
    panel over every panel).
    """
    for ax in axes:
        ax.relim()
    scaled = set()
    for ax in axes:
        shared = tuple(
            frozenset(map(id, group.get_siblings(ax)))
            for group in (ax.get_shared_x_axes(), ax.get_shared_y_axes())
        )
        if shared not in scaled:
            scaled.add(shared)
            ax.autoscale_view()


def _whole_rounds(ax: Axes) -> None:
    """Ticks at whole rounds only on ``ax``'s x axis (a 2-round run showed round 0.5, 1.5).

    Axes that share their x axis share its locator: set once, it holds for every panel.
    """
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


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
    fig = _figure(13, 3.6, dpi=110)
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
    for ax in axes:
        _whole_rounds(ax)
    _margins(fig, left=0.75, right=0.2, bottom=0.55, top=0.35, wspace=0.3)
    return _RoundsFigure(fig, axes, curves, loss, wire)


def draw_rounds(history: list[dict[str, float]], path: Path, metric: str) -> Path:
    """curves.png (:func:`fedexp.figures.plots.plot_rounds`)."""
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
    _save(drawn.fig, path)
    return path


@dataclass
class _ModelsFigure:
    """client_models_pca.png's figure for n clients, its points, edges and labels unplaced."""

    fig: Figure
    ax: Axes
    edges: LineCollection
    points: PathCollection
    #: each client's number beside its point (up to 30 clients; none beyond)
    labels: list[Annotation]


def _models_axes() -> tuple[Figure, Axes]:
    """client_models_pca.png's figure and axes: its size, title and margins."""
    fig = _figure(5.2, 4.6, dpi=110)
    ax = fig.subplots()
    ax.set_title("clients' evaluated models (PCA)", y=1.0)
    _margins(fig, left=0.8, right=0.2, bottom=0.6, top=0.35)
    return fig, ax


def _models_figure(n: int) -> _ModelsFigure:
    fig, ax = _models_axes()
    edges = ax.add_collection(LineCollection([], colors="0.75", linewidths=0.8, zorder=1))
    points = ax.scatter(np.zeros(n), np.zeros(n), c=range(n), cmap="viridis", zorder=2)
    labels = [
        ax.annotate(str(i), (0.0, 0.0), textcoords="offset points", xytext=(4, 4), fontsize=8)
        for i in range(n if n <= 30 else 0)
    ]
    return _ModelsFigure(fig, ax, edges, points, labels)


@dataclass
class _EqualModelsFigure:
    """client_models_pca.png when the models are equal: a line of text, not a projection."""

    fig: Figure
    text: Text


def _equal_models_figure() -> _EqualModelsFigure:
    fig, ax = _models_axes()
    text = ax.text(0.5, 0.5, "", transform=ax.transAxes, ha="center", va="center")
    ax.set(xticks=[], yticks=[], xlabel="PC1", ylabel="PC2")
    return _EqualModelsFigure(fig, text)


def draw_client_models(
    pca: ModelPCA, n: int, path: Path, edges: list | None, tolerance: float
) -> Path:
    """client_models_pca.png (:func:`fedexp.figures.plots.plot_client_models`).

    ``tolerance``: the relative spread below which the models are said to be equal (then the
    figure is a line of text). Both figures are kept (:func:`_kept`): n clients' points, and
    the line.
    """
    if pca.equal:
        said = _kept(("models", "equal"), _equal_models_figure)
        said.text.set_text(
            f"all {n} client models equal\n(relative spread {pca.spread:.2g}, "
            f"below the tolerance {tolerance:g})"
        )
        _save(said.fig, path)
        return path
    drawn = _kept(("models", n), lambda: _models_figure(n))
    coords = np.asarray(pca.coords, dtype=float)
    drawn.edges.set_segments([coords[[i, j]] for i, j in edges] if edges is not None else [])
    drawn.points.set_offsets(coords)
    for label, xy in zip(drawn.labels, coords.tolist(), strict=False):
        label.xy = (xy[0], xy[1])
    drawn.ax.set(xlabel=f"PC1 ({pca.explained[0]:.0%})", ylabel=f"PC2 ({pca.explained[1]:.0%})")
    drawn.ax.relim()  # (the points' extent, whether or not relim reads collections)
    drawn.ax.update_datalim(coords)
    drawn.ax.autoscale_view()
    _save(drawn.fig, path)
    return path


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
    fig = _figure(width, height, dpi=90)
    axes = np.atleast_2d(fig.subplots(nrows, ncols, sharex=True, sharey=True))
    _margins(fig, left=0.55, right=0.15, bottom=0.6, top=0.8, wspace=0.15, hspace=0.45)
    shown = []
    for ax in axes.flat[:panels]:
        (mean,) = ax.plot([], [], color="0.7", lw=1.0)
        (client,) = ax.plot([], [], ".-", lw=1.2, ms=3)
        shown.append((mean, client, ax.set_title("", fontsize=8, y=1.0)))
        ax.tick_params(labelsize=7)
        for axis in (ax.xaxis, ax.yaxis):  # (no label: no placement pass around the ticks)
            axis.set_label_coords(0.5, 0.5)
    for i, ax in enumerate(axes.flat):
        if i >= panels:
            ax.set_visible(False)
            if i >= ncols:
                axes.flat[i - ncols].xaxis.set_tick_params(labelbottom=True)  # the one above
    _whole_rounds(axes.flat[0])  # (the panels share their x axis)
    title = fig.suptitle("", fontsize=9, y=1 - 0.08 / height, va="top")
    fig.supxlabel("round", fontsize=9)
    return _ClientsFigure(fig, list(axes.flat[:panels]), shown, title)


def draw_clients(
    series: dict[int, list[tuple[float, float]]],
    per_round: dict[float, list[float]],
    chosen: list[tuple[int, str]],
    said: str,
    path: Path,
    metric: str,
    ncols: int,
) -> Path:
    """clients.png (:func:`fedexp.figures.plots.plot_clients`), ``ncols`` panels a row."""
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
    _save(drawn.fig, path)
    return path


def warm() -> None:
    """Draw each figure once on made-up data, to nowhere: what a process's first figures pay.

    matplotlib's first figure imports and builds more than matplotlib's import itself (the
    axes' tick machinery, legends, the mathtext parser of an axis's offset text, the fonts):
    about half a second on this project's 2-core machine. The figures' helper
    (:mod:`fedexp.figures.drawer`) pays it while the run trains. The figures stay kept
    (:data:`_KEPT`): a run's curves.png of accuracy, the default metric, refills the one drawn
    here (the PNG a fresh figure gives, as any kept figure's), which saves the run's end the
    75 ms of building it.
    """
    import io
    from types import SimpleNamespace

    rounds = [
        {
            "round": float(t),
            "acc/mean": 0.5,
            "acc/worst": 0.4,
            "train/train_loss": 1.0 / (1 + t),
            "bytes/up_cum": 1e6 * t,
            "bytes/down_cum": 1e6 * t,
        }
        for t in range(3)
    ]
    draw_rounds(rounds, io.BytesIO(), "acc")  # type: ignore[arg-type]
    series = {c: [(0.0, 0.5), (1.0, 0.6)] for c in range(2)}
    per_round = {0.0: [0.5], 1.0: [0.6]}
    draw_clients(series, per_round, [(0, ""), (1, "")], "", io.BytesIO(), "acc", 2)  # type: ignore[arg-type]
    coords = np.array([[0.0, 1.0], [1.0, 0.0]])
    pca = SimpleNamespace(coords=coords, explained=[0.6, 0.4], spread=1.0, equal=False)
    draw_client_models(pca, 2, io.BytesIO(), [[0, 1]], 1e-10)  # type: ignore[arg-type]
