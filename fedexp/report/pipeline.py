"""The pipeline of ``fedexp report``: from MLflow runs to the cells of a table (:func:`build`).

The FINISHED runs of the experiments; ``--sweep`` and ``--where`` filters; the runs that log
``--metric`` (and ``--select-by``); the latest run of each configuration
(:func:`fedexp.report.collect.latest_per_config`, the number dropped on stderr); cells by the
``--rows`` and ``--cols`` values; per cell either the configuration chosen on ``--select-by``
or the pooling check; values aggregated over rounds by ``--agg``; the paired differences
(``--paired``); with ``--epsilon`` the ε each shown run spent. The result, a :class:`Report`,
is written by :mod:`fedexp.report.output`.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from fedexp.errors import FedexpError
from fedexp.report import render
from fedexp.report.collect import Run
from fedexp.report.collect import by_sweep
from fedexp.report.collect import check_keys
from fedexp.report.collect import check_metric
from fedexp.report.collect import epsilon_of
from fedexp.report.collect import fetch
from fedexp.report.collect import latest_per_config
from fedexp.report.collect import parse_where
from fedexp.report.collect import sort_key
from fedexp.report.collect import values_of
from fedexp.report.collect import where
from fedexp.report.options import _direction
from fedexp.report.options import _order
from fedexp.report.stats import Choice
from fedexp.report.stats import describe_values
from fedexp.report.stats import paired_differences
from fedexp.report.stats import pooling_conflicts
from fedexp.report.stats import select

Key = tuple[str, ...]


@dataclass
class Report:
    """What :func:`build` found, ready to be written in any format."""

    args: argparse.Namespace
    runs: list[Run]
    cells: dict[Key, list[Run]]
    values: dict[str, float]
    labels: dict[str, str]
    scale: float
    rows: list[Key] = field(default_factory=list)
    cols: list[Key] = field(default_factory=list)
    ref: Key | None = None
    diffs: dict[Key, list[float]] = field(default_factory=dict)
    choices: dict[Key, Choice] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: ``--epsilon``: the ε each shown run spent, by run id (``inf``: no DP)
    epsilons: dict[str, float] = field(default_factory=dict)


def select_runs(client: Any, args: argparse.Namespace) -> list[Run]:
    """The runs the report reads: finished, filtered, with the metrics, latest per config."""
    runs = fetch(client, args.experiment)
    if not runs:
        raise FedexpError(f"--experiment {' '.join(args.experiment)}: no FINISHED run")
    # names are checked against every run of the experiments (a misspelling), not the ones
    # left by the filters (a row key no filtered run has shows as "-")
    check_metric(runs, args.metric, "--metric")
    if args.select_by:
        check_metric(runs, args.select_by, "--select-by")
    check_keys(runs, args.rows, "--rows")
    check_keys(runs, args.cols, "--cols")
    if args.sweep:
        runs = by_sweep(runs, args.sweep)
    if args.where:
        runs = where(runs, parse_where(args.where))
    needed = [args.metric] + ([args.select_by] if args.select_by else [])
    runs = [r for r in runs if all(m in r.metrics for m in needed)]
    if not runs:
        raise FedexpError(f"no run left by the filters logs {' and '.join(needed)}")
    runs, dropped = latest_per_config(runs)
    if dropped:
        print(
            f"fedexp report: {dropped} older run(s) dropped: they repeat the configuration of a "
            f"later run (kept {len(runs)} runs: the latest of each configuration)",
            file=sys.stderr,
        )
    return runs


def build(client: Any, args: argparse.Namespace, labels: dict[str, str]) -> Report:
    """Runs -> cells -> values, selections, pooling check and paired differences.

    Raises:
        FedexpError: a bad name, no run left, a refused pooling, an unknown ``--paired`` row.
    """
    runs = select_runs(client, args)
    keys = args.rows + args.cols
    n_rows = len(args.rows)
    exempt = {*keys, "seed"}
    cells: dict[Key, list[Run]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: (sort_key(r.get("seed")), r.start_time)):
        cells[tuple(render.key_value(k, r.get(k)) for k in keys)].append(r)
    scale = args.scale if args.scale is not None else render.default_scale(args.metric)
    rep = Report(args, runs, dict(cells), {}, labels, scale)
    if args.select_by:
        if not args.select_by.startswith("val/"):
            rep.warnings.append(
                f"--select-by {args.select_by} is not a validation metric (val/...): choosing "
                "on it and reporting test numbers leaks the test set (runs with val_fraction > 0 "
                "log val/acc/mean, ...)"
            )
        scores = values_of(client, runs, args.select_by, args.agg, not _direction(args))
        rep.choices = {k: select(v, scores, exempt, _direction(args)) for k, v in rep.cells.items()}
        rep.cells = {k: c.runs for k, c in rep.choices.items()}
    else:
        differing, bad = pooling_conflicts(rep.cells, exempt)
        if differing:
            first, values = next(iter(differing.items()))
            example = ", ".join(
                f"{render.short([k])}={v}" for k, v in zip(keys, bad[0], strict=True)
            )
            what = (
                f"{len(bad)} of {len(rep.cells)} cells pool runs that differ in "
                f"{describe_values(differing)} (e.g. the cell {example or 'of all runs'})"
            )
            if not args.allow_pooling:
                raise FedexpError(
                    f"{what}: add {'it' if len(differing) == 1 else 'them'} to --rows/--cols, "
                    f"keep one value (--where {first}={values[0]}, or --sweep ID), or pass "
                    "--allow-pooling"
                )
            rep.warnings.append(f"{what}: pooled, as --allow-pooling asks")
    short: list[str] = []
    shown = [r for v in rep.cells.values() for r in v]
    rep.values = values_of(client, shown, args.metric, args.agg, args.lower_is_better, short)
    if getattr(args, "epsilon", False):
        rep.epsilons = {r.run_id: epsilon_of(r) for r in shown}
    if short:
        rep.warnings.append(
            f"--agg {args.agg}: {len(short)} of {len(shown)} runs have fewer than "
            f"{args.agg.k} values of {args.metric} after round 0 (evaluated every eval_every "
            "rounds), so their mean includes the initial model's value or fewer values"
        )
    rep.rows = render.order_rows({k[:n_rows] for k in rep.cells}, _order(args))
    rep.cols = sorted({k[n_rows:] for k in rep.cells}, key=lambda c: [sort_key(v) for v in c])
    if args.paired:
        rep.ref = render.find_row(rep.rows, args.paired, labels)
        if rep.ref is None:
            names = ", ".join(render.label_of(r, labels) for r in rep.rows)
            raise FedexpError(f"--paired {args.paired!r}: no such row; rows: {names}")
        pairs = {
            k: [(r.get("seed"), rep.values[r.run_id]) for r in v] for k, v in rep.cells.items()
        }
        rep.diffs = paired_differences(pairs, n_rows, rep.ref)
    return rep
