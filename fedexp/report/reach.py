"""``fedexp report --reach``: wire bytes until a metric first reaches a target value."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from fedexp.errors import FedexpError
from fedexp.report.collect import (
    Run,
    client_for,
    fetch,
    history,
    latest_per_config,
    sort_key,
)
from fedexp.report.stats import sample_std


def reach_runs(
    client: Any, runs: list[Run], metric: str, target: float, keys: list[str]
) -> dict[tuple[str, ...], list[dict]]:
    """Per run: wire bytes (up, down) when ``metric`` first reaches ``target``, final value.

    Returns, per group of ``keys`` values, one dict per run with ``up``, ``down`` (NaN if the
    target is never reached), ``final`` and the run's curve (``curve_bytes``, ``curve_metric``:
    cumulative uplink bytes and the metric at each evaluated round). The cumulative byte
    counts are read at the round the metric was logged, or the last round before it.
    """
    out: dict[tuple[str, ...], list[dict]] = defaultdict(list)
    for run in runs:
        curve = dict(history(client, run.run_id, metric))
        if not curve:
            continue
        up = history(client, run.run_id, "bytes/up_cum")
        down = history(client, run.run_id, "bytes/down_cum")
        steps = sorted(curve)
        hit = next((t for t in steps if curve[t] >= target), None)
        row = {
            "up": _at(up, hit) if hit is not None else float("nan"),
            "down": _at(down, hit) if hit is not None else float("nan"),
            "final": curve[steps[-1]],
            "curve_bytes": [_at(up, t) for t in steps],
            "curve_metric": [curve[t] for t in steps],
        }
        out[tuple(run.get(k) for k in keys)].append(row)
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
    uri: str | None, experiments: list[str], metric: str, target: float, keys: list[str]
) -> dict[tuple[str, ...], list[dict]]:
    """:func:`reach_runs` of the finished runs of ``experiments`` (the latest per config)."""
    client = client_for(uri)
    runs, _ = latest_per_config(fetch(client, experiments))
    return reach_runs(client, runs, metric, target, keys)


def reach_table(
    groups: dict[tuple[str, ...], list[dict]], key_name: str, target: float, metric: str
) -> str:
    """Markdown: mean bytes up/down to reach ``target`` (runs that reached it), final metric."""
    import numpy as np

    lines = [
        f"| {key_name} | runs reaching {metric} ≥ {target:g} | KiB up to reach | "
        f"KiB down to reach | final {metric} |",
        "|---|---|---|---|---|",
    ]
    for g in sorted(groups, key=lambda r: [sort_key(v) for v in r]):
        rows = groups[g]
        hit = [r for r in rows if not np.isnan(r["up"])]
        up = np.mean([r["up"] for r in hit]) / 1024 if hit else float("nan")
        down = np.mean([r["down"] for r in hit]) / 1024 if hit else float("nan")
        fin = np.asarray([r["final"] for r in rows])
        lines.append(
            f"| {'/'.join(g)} | {len(hit)}/{len(rows)} | {up:.1f} | {down:.1f} | "
            f"{fin.mean():.4f} ± {sample_std(fin):.4f} |"
        )
    return "\n".join(lines)


def reach_plot(groups: dict[tuple[str, ...], list[dict]], path: str, metric: str) -> None:
    """Metric against cumulative uplink bytes, one line per group (mean over its runs)."""
    import numpy as np

    from fedexp.plots import plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for g in sorted(groups, key=lambda r: [sort_key(v) for v in r]):
        rows = groups[g]
        n = min(len(r["curve_metric"]) for r in rows)
        xb = np.mean([r["curve_bytes"][:n] for r in rows], axis=0) / 1024
        ym = np.mean([r["curve_metric"][:n] for r in rows], axis=0)
        ax.plot(xb, ym, marker=".", label="/".join(g))
    ax.set(
        xscale="symlog",
        xlabel="cumulative uplink KiB",
        ylabel=metric,
        title=f"{metric} against bytes on the wire",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
