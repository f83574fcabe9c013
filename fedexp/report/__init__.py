r"""``fedexp report``: tables across seeds from the MLflow records of runs and sweeps.

    fedexp report --experiment fedexp/pfednet_tables \
        --rows choice.algorithm --cols partition.delta --metric acc/mean

Each run contributes one value of ``--metric`` (``--agg``: its final value, the best over
rounds or the mean of its last K values); cells are mean ± sample standard deviation
(ddof = 1) over their n runs. Runs are grouped by the ``--rows`` and ``--cols`` params or tags
(``choice.<group>`` holds the config option chosen for each group). Only the latest run of
each configuration counts; a cell that would pool runs of different configurations is
refused; ``--select-by val/acc/mean`` picks the best configuration per cell on validation;
``--paired REF`` adds per-seed differences against a reference row. Reference with examples:
docs/report.md.

Modules: :mod:`~fedexp.report.collect` (runs from MLflow, filters, names, the latest run per
configuration, aggregation over rounds), :mod:`~fedexp.report.stats` (sample std, pooling
conflicts, paired differences, selection), :mod:`~fedexp.report.render` (Markdown, LaTeX,
CSV, labels), :mod:`~fedexp.report.reach` (bytes to reach a target),
:mod:`~fedexp.report.options` (the argument parser), :mod:`~fedexp.report.pipeline` (runs to
the cells of a table), :mod:`~fedexp.report.output` (a report as Markdown, LaTeX or CSV),
:mod:`~fedexp.report.cli` (the command). None imports numpy, mlflow or torch at import time:
``fedexp report --help`` stays light.
"""

from __future__ import annotations

from fedexp.report.cli import main
from fedexp.report.collect import Agg
from fedexp.report.collect import Run
from fedexp.report.collect import client_for
from fedexp.report.collect import fetch
from fedexp.report.collect import latest_per_config
from fedexp.report.collect import values_of
from fedexp.report.reach import reach
from fedexp.report.reach import reach_plot
from fedexp.report.reach import reach_runs
from fedexp.report.reach import reach_table
from fedexp.report.render import ALGORITHM_LABELS
from fedexp.report.render import default_scale
from fedexp.report.render import table
from fedexp.report.stats import paired_differences
from fedexp.report.stats import pooling_conflicts
from fedexp.report.stats import sample_std
from fedexp.report.stats import select

__all__ = [
    "ALGORITHM_LABELS",
    "Agg",
    "Run",
    "client_for",
    "collect",
    "default_scale",
    "fetch",
    "latest_per_config",
    "main",
    "paired_differences",
    "pooling_conflicts",
    "reach",
    "reach_plot",
    "reach_runs",
    "reach_table",
    "sample_std",
    "select",
    "table",
    "values_of",
]


def collect(
    uri: str | None, experiments: list[str], metric: str, keys: list[str]
) -> dict[tuple[str, ...], list[float]]:
    """Final ``metric`` of the latest finished run of each configuration, grouped by ``keys``.

    A convenience for scripts and notebooks (no pooling check, no name check).
    """
    from collections import defaultdict

    from fedexp.errors import FedexpError

    client = client_for(uri)
    runs, _ = latest_per_config([r for r in fetch(client, experiments) if metric in r.metrics])
    groups: dict[tuple[str, ...], list[float]] = defaultdict(list)
    for run in runs:
        groups[tuple(run.get(k) for k in keys)].append(float(run.metrics[metric]))
    if not groups:
        raise FedexpError(f"no finished run in {experiments} has the metric {metric!r}")
    return dict(groups)
