"""``fedexp report --reach``: wire bytes until a metric first reaches a target value.

The table and the plot name rows as the report's tables do (the algorithms' display names,
``--labels``: :func:`fedexp.report.render.label_of`). The plot's byte axis is logarithmic
past the first round's bytes and linear below them, so that round 0 (0 bytes) shows; its ticks
are powers of ten (with 2 and 5 between them over a short range) written as numbers
(:func:`kib_ticks`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from fedexp.errors import FedexpError
from fedexp.report.collect import Run
from fedexp.report.collect import client_for
from fedexp.report.collect import fetch
from fedexp.report.collect import history
from fedexp.report.collect import latest_per_config
from fedexp.report.collect import sort_key
from fedexp.report.render import key_value
from fedexp.report.render import label_of
from fedexp.report.stats import sample_std


def reach_runs(
    client: Any,
    runs: list[Run],
    metric: str,
    target: float,
    keys: list[str],
    lower: bool = False,
) -> dict[tuple[str, ...], list[dict]]:
    """Per run: wire bytes (up, down) when ``metric`` first reaches ``target``, final value.

    A run on a simulated clock (``system`` group, ``clock/cum_s``) also gives the round and
    the simulated seconds at which it got there (``round``, ``time``; NaN without a clock or
    where the target is never reached) and ``curve_time``.

    Reaching is ``metric ≥ target``, or ``metric ≤ target`` where ``lower`` (a loss:
    ``--lower-is-better``). Returns, per group of ``keys`` values, one dict per run with
    ``up``, ``down`` (NaN if the target is never reached), ``final`` and the run's curve
    (``curve_bytes``, ``curve_metric``: cumulative uplink bytes and the metric at each
    evaluated round). The cumulative byte counts are read at the round the metric was logged,
    or the last round before it.
    """
    out: dict[tuple[str, ...], list[dict]] = defaultdict(list)
    for run in runs:
        curve = dict(history(client, run.run_id, metric))
        if not curve:
            continue
        up = history(client, run.run_id, "bytes/up_cum")
        down = history(client, run.run_id, "bytes/down_cum")
        clock = history(client, run.run_id, "clock/cum_s")
        steps = sorted(curve)
        reached = [t for t in steps if (curve[t] <= target if lower else curve[t] >= target)]
        hit = reached[0] if reached else None
        row = {
            "up": _at(up, hit) if hit is not None else float("nan"),
            "down": _at(down, hit) if hit is not None else float("nan"),
            "final": curve[steps[-1]],
            "curve_bytes": [_at(up, t) for t in steps],
            "curve_metric": [curve[t] for t in steps],
        }
        if clock:  # simulated seconds (round 0 at 0 s) and rounds to the target
            row["time"] = _at(clock, hit) if hit is not None else float("nan")
            row["round"] = float(hit) if hit is not None else float("nan")
            row["curve_time"] = [_at(clock, t) for t in steps]
        out[tuple(key_value(k, run.get(k)) for k in keys)].append(row)
    if not out:
        raise FedexpError(f"--metric {metric!r}: no finished run has a history of it")
    return out


def _at(series: list[tuple[int, float]], step: int) -> float:
    """The value of a cumulative series at ``step``: the last logged at or before it, else 0."""
    value = 0.0
    for t, v in series:
        if t > step:
            break
        value = v
    return value


def reach(
    uri: str | None,
    experiments: list[str],
    metric: str,
    target: float,
    keys: list[str],
    lower: bool = False,
) -> dict[tuple[str, ...], list[dict]]:
    """:func:`reach_runs` of the finished runs of ``experiments`` (the latest per config)."""
    client = client_for(uri)
    runs, _ = latest_per_config(fetch(client, experiments))
    return reach_runs(client, runs, metric, target, keys, lower)


def reach_table(
    groups: dict[tuple[str, ...], list[dict]],
    key_name: str,
    target: float,
    metric: str,
    labels: Mapping[str, str] | None = None,
    lower: bool = False,
) -> str:
    """Markdown: mean bytes up/down to reach ``target`` (runs that reached it), final metric.

    Rows are named by ``labels`` (display names; raw values without). The final metric is the
    mean ± sample std over the group's runs, a single run's value alone. ``lower``: the
    target is reached from above (:func:`reach_runs`). Where runs were timed on a simulated
    clock (``system`` group), the mean rounds and simulated seconds to reach it come beside
    the bytes.
    """
    import numpy as np

    timed = any("time" in r for rows in groups.values() for r in rows)
    extra = " rounds to reach | simulated s to reach |" if timed else ""
    lines = [
        f"| {key_name} | runs reaching {metric} {'≤' if lower else '≥'} {target:g} | "
        "KiB up to reach | "
        f"KiB down to reach |{extra} final {metric} |",
        "|---|---|---|---|---|" + ("---|---|" if timed else ""),
    ]
    for g in sorted(groups, key=lambda r: [sort_key(v) for v in r]):
        rows = groups[g]
        hit = [r for r in rows if not np.isnan(r["up"])]
        up = np.mean([r["up"] for r in hit]) / 1024 if hit else float("nan")
        down = np.mean([r["down"] for r in hit]) / 1024 if hit else float("nan")
        fin = np.asarray([r["final"] for r in rows])
        final = f"{fin.mean():.4f}"
        if len(fin) > 1:
            final += f" ± {sample_std(fin):.4f}"
        clock = ""
        if timed:
            rounds = np.mean([r.get("round", np.nan) for r in hit]) if hit else float("nan")
            time = np.mean([r.get("time", np.nan) for r in hit]) if hit else float("nan")
            clock = f" {rounds:.1f} | {time:.1f} |"
        lines.append(
            f"| {label_of(g, labels or {})} | {len(hit)}/{len(rows)} | {up:.1f} | {down:.1f} |"
            f"{clock} {final} |"
        )
    return "\n".join(lines)


def kib_text(value: float) -> str:
    """A tick label in KiB: ``0``, ``0.5``, ``20``, ``1,000``, ``200,000``."""
    if value >= 1:
        return f"{value:,.0f}"
    return f"{value:g}"


def kib_ticks(values: Sequence[float]) -> tuple[str, float | None, list[float], list[str]]:
    """The byte axis of the reach plot: scale, linear threshold, ticks and their labels.

    Over less than a decade of positive values (or none), a linear axis with
    matplotlib's own ticks (``("linear", None, [], [])``). Otherwise ``symlog``, linear below
    the power of ten at or under the smallest positive value (so 0, round 0's bytes, shows),
    with a tick at 0 and at every power of ten up to the largest value (every other one past
    eight decades), and at 2 and 5 times them when the values span at most two decades; none
    past the largest value.
    """
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive or max(positive) / min(positive) < 10:
        return "linear", None, [], []
    low = math.floor(math.log10(min(positive)))
    high = math.ceil(math.log10(max(positive)))
    step = 1 if high - low <= 8 else 2
    ticks = [10.0**k for k in range(low, high + 1, step)]
    if math.log10(max(positive) / min(positive)) <= 2:
        ticks = sorted({t * m for t in ticks for m in (1, 2, 5)})
    # none past the largest value (set_xticks would widen the axis to show it)
    ticks = [0.0, *(t for t in ticks if t <= max(positive) * (1 + 1e-9))]
    return "symlog", 10.0**low, ticks, [kib_text(t) for t in ticks]


def reach_plot(
    groups: dict[tuple[str, ...], list[dict]],
    path: str,
    metric: str,
    labels: Mapping[str, str] | None = None,
    key_name: str = "",
) -> dict[str, Any]:
    """Metric against cumulative uplink bytes, one line per group (mean over its runs).

    Where every run was timed on a simulated clock (``system`` group), a second panel draws
    the metric against the simulated seconds.

    Args:
        groups: :func:`reach_runs`' groups.
        path: the PNG to write.
        metric: the metric on the y axis.
        labels: display names of the groups' values (the tables' labels).
        key_name: the legend's title (the row keys' header).

    Returns:
        What the figure shows: ``lines`` (legend text -> (KiB, metric) points), ``xscale``,
        ``xticks`` and ``xticklabels`` (read back from the axes); with a clock,
        ``time_lines`` (legend text -> (seconds, metric) points).
    """
    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    timed = all("curve_time" in r for rows in groups.values() for r in rows)
    fig = Figure(figsize=(12.0 if timed else 6.4, 4.4))  # (no pyplot: docs/design.md)
    ax, clock_ax = fig.subplots(1, 2) if timed else (fig.subplots(), None)
    lines: dict[str, tuple[list[float], list[float]]] = {}
    time_lines: dict[str, tuple[list[float], list[float]]] = {}
    for g in sorted(groups, key=lambda r: [sort_key(v) for v in r]):
        rows = groups[g]
        n = min(len(r["curve_metric"]) for r in rows)
        xb = np.mean([r["curve_bytes"][:n] for r in rows], axis=0) / 1024
        ym = np.mean([r["curve_metric"][:n] for r in rows], axis=0)
        name = label_of(g, labels or {})
        ax.plot(xb, ym, marker=".", label=name)
        lines[name] = (xb.tolist(), ym.tolist())
        if clock_ax is not None:
            xs = np.mean([r["curve_time"][:n] for r in rows], axis=0)
            clock_ax.plot(xs, ym, marker=".", label=name)
            time_lines[name] = (xs.tolist(), ym.tolist())
    scale, linthresh, ticks, names = kib_ticks([x for xs, _ in lines.values() for x in xs])
    if scale == "symlog":
        ax.set_xscale("symlog", linthresh=linthresh, linscale=0.5)
        ax.set_xticks(ticks, names)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(left=0)
    ax.set(
        xlabel="cumulative uplink KiB",
        ylabel=metric,
        title=f"{metric} against bytes on the wire",
    )
    ax.legend(fontsize=7, title=key_name or None, title_fontsize=7)
    if clock_ax is not None:
        clock_ax.set(
            xlabel="simulated seconds",
            ylabel=metric,
            title=f"{metric} against simulated time",
        )
        clock_ax.legend(fontsize=7, title=key_name or None, title_fontsize=7)
    fig.tight_layout()
    shown = {
        "lines": lines,
        "xscale": ax.get_xscale(),
        "xticks": [float(t) for t in ax.get_xticks()],
        "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
    }
    if clock_ax is not None:
        shown["time_lines"] = time_lines
    fig.savefig(path, dpi=110)
    return shown
