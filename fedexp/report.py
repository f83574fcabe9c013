"""``fedexp report``: mean ± std tables across seeds from the MLflow records of a sweep.

    fedexp report --experiment fedexp/multirun_2026-11-22_10-00-00 \
        --rows choice.algorithm --cols partition.delta --metric acc/mean

Each run contributes its last logged value of ``--metric`` (the final round; default
``acc/mean``, the unweighted mean over clients of each client's test accuracy, the papers'
headline, pFedNet §VI-B1); cells are mean ± sample standard deviation (ddof = 1); runs are grouped
by the ``--rows`` and ``--cols`` params (any logged param: ``choice.<group>`` holds the config
option chosen for each group, e.g. ``choice.algorithm = pfednet``).

The pFedNet paper's layout (Tables II-VII: a row per method, a column per δ, the best bold, a
last row with pFedNet's rank)::

    fedexp report -e fedexp/pfednet_tables --rows choice.algorithm --cols partition.delta \
        --best --rank-of pfednet --order fedavg,fedprox,ditto --labels pfednet=pFedNet

``--lower-is-better`` for losses.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import TYPE_CHECKING

from fedexp.errors import FedexpError

if TYPE_CHECKING:
    import numpy as np

# numpy (and mlflow, matplotlib) are imported inside the functions: ``fedexp report --help``
# imports none of them.


def sample_std(values: np.ndarray) -> float:
    """Standard deviation over runs with ddof = 1 (MATH §10); 0 for a single run."""
    import numpy as np

    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def collect(
    uri: str | None, experiments: list[str], metric: str, keys: list[str]
) -> dict[tuple[str, ...], list[float]]:
    """Final ``metric`` of every finished run, grouped by the values of the params ``keys``."""
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri or mlflow.get_tracking_uri())
    ids = []
    for name in experiments:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            known = ", ".join(e.name for e in client.search_experiments())
            raise FedexpError(f"--experiment {name!r}: no such experiment (known: {known})")
        ids.append(exp.experiment_id)
    runs = client.search_runs(
        ids, filter_string="attributes.status = 'FINISHED'", max_results=50000
    )
    groups: dict[tuple[str, ...], list[float]] = defaultdict(list)
    for run in runs:
        if metric not in run.data.metrics:
            continue
        values = tuple(run.data.params.get(k, run.data.tags.get(k, "?")) for k in keys)
        groups[values].append(float(run.data.metrics[metric]))
    if not groups:
        raise FedexpError(f"no finished run in {experiments} has the metric {metric!r}")
    return groups


def reach(
    uri: str | None, experiments: list[str], metric: str, target: float, keys: list[str]
) -> dict[tuple[str, ...], list[dict[str, float]]]:
    """Per run: wire bytes (up, down) when ``metric`` first reaches ``target``, final value.

    Returns, per group of ``keys`` values, one dict per run with ``up``, ``down`` (NaN if the
    target is never reached), ``final`` and the run's curve (``curve_bytes``, ``curve_metric``:
    cumulative uplink bytes and the metric at each evaluated round).
    """
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri or mlflow.get_tracking_uri())
    ids = [client.get_experiment_by_name(n) for n in experiments]
    if any(e is None for e in ids):
        raise FedexpError(f"--experiment {experiments}: no such experiment")
    runs = client.search_runs(
        [e.experiment_id for e in ids],
        filter_string="attributes.status = 'FINISHED'",
        max_results=50000,
    )
    out: dict[tuple[str, ...], list[dict]] = defaultdict(list)
    for run in runs:
        hist = {
            k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
            for k in (metric, "bytes/up_cum", "bytes/down_cum")
        }
        if not hist[metric]:
            continue
        steps = sorted(hist[metric])
        hit = next((t for t in steps if hist[metric][t] >= target), None)
        row = {
            "up": hist["bytes/up_cum"].get(hit, 0.0) if hit is not None else float("nan"),
            "down": hist["bytes/down_cum"].get(hit, 0.0) if hit is not None else float("nan"),
            "final": hist[metric][steps[-1]],
            "curve_bytes": [hist["bytes/up_cum"].get(t, 0.0) for t in steps],
            "curve_metric": [hist[metric][t] for t in steps],
        }
        values = tuple(run.data.params.get(k, run.data.tags.get(k, "?")) for k in keys)
        out[values].append(row)
    if not out:
        raise FedexpError(f"no finished run in {experiments} has the metric {metric!r}")
    return out


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
    for g in sorted(groups, key=lambda r: [_sort_key(v) for v in r]):
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
    for g in sorted(groups, key=lambda r: [_sort_key(v) for v in r]):
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


def _sort_key(v: str) -> tuple[int, float | str]:
    try:
        return (0, float(v))
    except ValueError:
        return (1, v)


def _short(keys: list[str]) -> str:
    """Header name of params: ``choice.algorithm`` -> algorithm, ``partition.delta`` -> δ."""
    names = {"choice.algorithm": "algorithm", "partition.delta": "δ"}
    return ",".join(names.get(k, k.removeprefix("choice.")) for k in keys)


def _value(v: str) -> str:
    """A param value for a header: ``2.0`` -> ``2``, anything else as it is."""
    try:
        return f"{float(v):g}"
    except ValueError:
        return v


def _order(rows: set[tuple[str, ...]], order: list[str] | None) -> list[tuple[str, ...]]:
    """Rows named in ``order`` first, in that order, then the others sorted (case-insensitive)."""
    rest = sorted(rows, key=lambda r: [_sort_key(v) for v in r])
    where = {name.lower(): i for i, name in enumerate(order or [])}
    first = sorted(
        (r for r in rest if "/".join(r).lower() in where), key=lambda r: where["/".join(r).lower()]
    )
    return first + [r for r in rest if r not in first]


def table(
    groups: dict[tuple[str, ...], list[float]],
    n_rows: int,
    row_name: str,
    col_name: str,
    scale: float = 100.0,
    *,
    best: bool = False,
    lower_is_better: bool = False,
    rank_of: str | None = None,
    order: list[str] | None = None,
    labels: dict[str, str] | None = None,
) -> str:
    """A markdown table of mean ± sample std (× ``scale``) with the number of runs per cell.

    The layout of pFedNet's Tables II-VII: one row per method, one column per setting.

    Args:
        groups: runs' final values per key (row values then column values), from `collect`.
        n_rows: how many leading key values name the row.
        row_name: header of the label column.
        col_name: header prefix of each column (``δ`` gives ``δ=1``); empty: no prefix.
        scale: multiply every value (100: percent, shown with 2 decimals; else 4 digits).
        best: bold (``**…**``) the cell(s) with the best mean in each column; every cell tied
            at the shown precision is bold.
        lower_is_better: the best mean is the smallest (losses); also flips `rank_of`.
        rank_of: append the paper's last row ``rank``: per column ``top k`` for the row whose
            label (raw or relabelled, case-insensitive) is this name, k = 1 + the number of rows
            with a strictly better mean at the shown precision (pFedNet's ties with the best
            are ``top 1``, as in Table V, δ=1). No row when no row has this label.
        order: raw row labels (case-insensitive) first, in this order; the rest follow, sorted.
        labels: display names of rows (``{"fedavg": "FedAvg"}``), by whole label or by value.
    """
    import numpy as np

    rows = _order({k[:n_rows] for k in groups}, order)
    cols = sorted({k[n_rows:] for k in groups}, key=lambda c: [_sort_key(v) for v in c])
    fmt = ".2f" if scale == 100.0 else ".4g"
    labels = labels or {}
    sign = -1.0 if lower_is_better else 1.0
    shown: dict[tuple[str, ...], str] = {}
    score: dict[tuple[str, ...], float] = {}  # sign × the mean as shown, for best and rank
    for key, v in groups.items():
        if not v:
            continue
        arr = np.asarray(v) * scale
        shown[key] = f"{arr.mean():{fmt}} ± {sample_std(arr):{fmt}} (n={len(arr)})"
        if not np.isnan(arr.mean()):
            score[key] = sign * float(f"{arr.mean():{fmt}}")
    top = {c: max((score[r + c] for r in rows if r + c in score), default=None) for c in cols}

    def label(r: tuple[str, ...]) -> str:
        raw = "/".join(r)
        return labels.get(raw, "/".join(labels.get(v, v) for v in r))

    head = [row_name] + [
        f"{col_name}={'/'.join(_value(v) for v in c)}" if col_name else "/".join(c) or "value"
        for c in cols
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for c in cols:
            text = shown.get(r + c, "")
            if best and top[c] is not None and score.get(r + c) == top[c]:
                text = f"**{text}**"
            cells.append(text)
        lines.append("| " + " | ".join([label(r), *cells]) + " |")
    want = (rank_of or "").lower()
    ranked = [r for r in rows if want and want in ("/".join(r).lower(), label(r).lower())]
    if ranked:
        r = ranked[0]
        cells = []
        for c in cols:
            mine = score.get(r + c)
            if mine is None:
                cells.append("")
                continue
            cells.append(f"top {1 + sum(score.get(o + c, -np.inf) > mine for o in rows)}")
        lines.append("| " + " | ".join(["rank", *cells]) + " |")
    return "\n".join(lines)


#: Metrics that are fractions in [0, 1], reported in percent by default.
FRACTIONS = ("acc", "bal_acc", "auc", "iou", "label_iou", "dice")


def default_scale(metric: str) -> float:
    """The default ``--scale`` of ``metric``: 100 (percent) for fractions, else 1.

    Fractions are ``acc/mean``, ``auc/best_mean``, ...; bytes, times and losses keep their
    units, so that bytes are never shown × 100.
    """
    return 100.0 if metric.split("/", 1)[0] in FRACTIONS else 1.0


def main(argv: list[str]) -> None:
    """Parse arguments and print the table."""
    parser = argparse.ArgumentParser(prog="fedexp report", description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", "-e", nargs="+", required=True)
    parser.add_argument("--uri", default=None, help="tracking URI (default: MLflow's default)")
    parser.add_argument("--rows", nargs="+", default=["choice.algorithm"])
    parser.add_argument("--cols", nargs="*", default=[])
    parser.add_argument(
        "--metric", default="acc/mean", help="default: unweighted mean over clients (papers')"
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply values (default: 100 for accuracies, AUC, IoU, Dice: percent; else 1)",
    )
    parser.add_argument(
        "--reach",
        type=float,
        default=None,
        help="report bytes up/down to first reach this value of --metric",
    )
    parser.add_argument("--plot", default=None, help="with --reach: PNG of metric vs bytes")
    parser.add_argument("--best", action="store_true", help="bold the best mean per column")
    parser.add_argument(
        "--lower-is-better", action="store_true", help="best = smallest (losses); flips --rank-of"
    )
    parser.add_argument(
        "--rank-of", default=None, metavar="NAME", help="add a row 'rank': top k of row NAME"
    )
    parser.add_argument(
        "--order", default=None, metavar="A,B,C", help="these rows first; the rest sorted"
    )
    parser.add_argument("--labels", default=None, metavar="a=A,b=B", help="display names of rows")
    args = parser.parse_args(argv)
    labels = {}
    for item in (args.labels or "").split(","):
        if item.strip():
            raw, eq, shown = item.partition("=")
            if not eq or not raw.strip():
                parser.error(f"--labels: {item!r} is not raw=Shown")
            labels[raw.strip()] = shown.strip()
    order = [n.strip() for n in (args.order or "").split(",") if n.strip()]
    try:
        if args.reach is not None:
            keys = args.rows + args.cols
            groups = reach(args.uri, args.experiment, args.metric, args.reach, keys)
            print(reach_table(groups, ",".join(keys), args.reach, args.metric))
            if args.plot:
                reach_plot(groups, args.plot, args.metric)
                print(f"\nplot: {args.plot}")
            return
        groups = collect(args.uri, args.experiment, args.metric, args.rows + args.cols)
    except FedexpError as exc:
        print(f"fedexp: error: {exc}", file=sys.stderr)
        sys.exit(1)
    if args.scale is None:
        args.scale = default_scale(args.metric)
    print(f"{args.metric} (final round, × {args.scale:g}), mean ± sample std over runs\n")
    text = table(
        groups,
        len(args.rows),
        _short(args.rows),
        _short(args.cols),
        args.scale,
        best=args.best,
        lower_is_better=args.lower_is_better,
        rank_of=args.rank_of,
        order=order,
        labels=labels,
    )
    print(text)
