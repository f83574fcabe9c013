"""``fedexp report``: mean ± std tables across seeds from the MLflow records of a sweep.

    fedexp report --experiment fedexp/multirun_2026-11-22_10-00-00 \
        --rows choice.algorithm --cols partition.delta --metric acc/weighted

Each run contributes its last logged value of ``--metric`` (the final round); runs are grouped
by the ``--rows`` and ``--cols`` params (any logged param: ``choice.<group>`` holds the config
option chosen for each group, e.g. ``choice.algorithm = pfednet``).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import numpy as np

from fedexp.errors import FedexpError


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


def _sort_key(v: str) -> tuple[int, float | str]:
    try:
        return (0, float(v))
    except ValueError:
        return (1, v)


def table(
    groups: dict[tuple[str, ...], list[float]],
    n_rows: int,
    row_name: str,
    col_name: str,
    scale: float = 100.0,
) -> str:
    """A markdown table of mean ± std (× ``scale``) with the number of runs per cell."""
    rows = sorted({k[:n_rows] for k in groups}, key=lambda r: [_sort_key(v) for v in r])
    cols = sorted({k[n_rows:] for k in groups}, key=lambda c: [_sort_key(v) for v in c])
    head = [row_name] + [f"{col_name}={'/'.join(c)}" if c else "value" for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for c in cols:
            v = groups.get(r + c)
            if not v:
                cells.append("")
                continue
            arr = np.asarray(v) * scale
            cells.append(f"{arr.mean():.2f} ± {arr.std():.2f} (n={len(arr)})")
        lines.append("| " + " | ".join(["/".join(r), *cells]) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Parse arguments and print the table."""
    parser = argparse.ArgumentParser(prog="fedexp report", description=__doc__.split("\n")[0])
    parser.add_argument("--experiment", "-e", nargs="+", required=True)
    parser.add_argument("--uri", default=None, help="tracking URI (default: MLflow's default)")
    parser.add_argument("--rows", nargs="+", default=["choice.algorithm"])
    parser.add_argument("--cols", nargs="*", default=[])
    parser.add_argument("--metric", default="acc/weighted")
    parser.add_argument("--scale", type=float, default=100.0, help="multiply values (100: %%)")
    args = parser.parse_args(argv)
    try:
        groups = collect(args.uri, args.experiment, args.metric, args.rows + args.cols)
    except FedexpError as exc:
        print(f"fedexp: error: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"{args.metric} (final round, × {args.scale:g}), mean ± std over runs\n")
    print(table(groups, len(args.rows), ",".join(args.rows), ",".join(args.cols)))
