"""``fedexp report --views``: personal, global, gain and new clients as columns of one table.

A personalised-FL paper's table of "local / global / personalised / new-client" accuracy:
the runs log each evaluation's figure under one name per view (docs/protocols.md, "Global,
personal and new clients"): the clients' own models ``acc/mean``, the global model on the
same clients ``global/acc/mean``, the gain of personalisation ``gain/acc/mean`` and the
held-out clients as new clients ``new/acc/mean``. ``--views personal global gain new`` builds
the report of ``--metric`` under each view's name (:func:`fedexp.report.pipeline.build`, every
option as without it) and sets them side by side: a column per view (after the ``--cols``
values). A view no run logs is left out with a warning; a row whose runs lack a view (a
method without a global model, a run without held-out clients) shows "-" there.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from fedexp.errors import FedexpError
from fedexp.report import render
from fedexp.report.options import _order
from fedexp.report.output import groups_of
from fedexp.report.output import statement
from fedexp.report.output import write_csv
from fedexp.report.pipeline import Key
from fedexp.report.pipeline import Report
from fedexp.report.pipeline import build

#: Each view's prefix of a metric's name (``acc/mean`` -> ``global/acc/mean``).
PREFIXES = {"personal": "", "global": "global/", "gain": "gain/", "new": "new/"}


def view_metric(metric: str, view: str) -> str:
    """The name ``view`` logs ``metric`` under (``acc/mean``, "gain" -> ``gain/acc/mean``)."""
    return PREFIXES[view] + metric


def _column(view: str) -> str:
    """The raw column value of ``view``: sorts in the order of :data:`PREFIXES`."""
    return f"view{list(PREFIXES).index(view)}-{view}"


def build_views(
    client: Any, args: argparse.Namespace, labels: dict[str, str]
) -> tuple[list[tuple[str, Report]], list[str]]:
    """The report of each view in ``args.views``, and the warnings of the views left out.

    Raises:
        FedexpError: no view of ``--metric`` is logged by any run.
    """
    reports, skipped = [], []
    for view in args.views:
        view_args = copy.copy(args)
        view_args.metric = view_metric(args.metric, view)
        try:
            reports.append((view, build(client, view_args, labels)))
        except FedexpError as exc:
            skipped.append(f"--views {view}: left out ({exc})")
    if not reports:
        raise FedexpError(f"--views: no run logs any view of {args.metric}: {'; '.join(skipped)}")
    return reports, skipped


def write_views(reports: list[tuple[str, Report]], fmt: str) -> str:
    """The views side by side.

    Markdown or LaTeX: a column per view; CSV: a row per cell and view, its ``metric`` the
    view's name.
    """
    if fmt == "csv":
        texts = [write_csv(rep) for _, rep in reports]
        head, *_ = texts[0].splitlines(keepends=True)
        return head + "".join("".join(t.splitlines(keepends=True)[1:]) for t in texts)
    first = reports[0][1]
    a = first.args
    groups: dict[Key, list[float]] = {}
    for view, rep in reports:
        for key, values in groups_of(rep).items():
            groups[(*key, _column(view))] = values
    labels = {**first.labels, **{_column(v): v for v in PREFIXES}}
    names = ", ".join(f"{v}: {rep.args.metric}" for v, rep in reports)
    line = f"{statement(first)}; a column per view ({names})"
    table = render.table(
        groups,
        n_rows=len(a.rows),
        row_name=render.short(a.rows),
        col_name=render.short(a.cols),
        scale=first.scale,
        best=a.best,
        lower_is_better=a.lower_is_better,
        rank_of=a.rank_of,
        order=_order(a),
        labels=labels,
        fmt=fmt,
    )
    return render.comment(line, fmt) + "\n\n" + table + "\n"
