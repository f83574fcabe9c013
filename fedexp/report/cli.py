"""The ``fedexp report`` command: parse the options, build the report, write it out.

:func:`main` reads the options (:mod:`fedexp.report.options`), runs the pipeline from MLflow
runs to tables (:func:`fedexp.report.pipeline.build`) and writes the table, the paired
differences and the selections in ``--format`` (:mod:`fedexp.report.output`), or with
``--reach`` the bytes-to-target table (:mod:`fedexp.report.reach`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedexp.errors import FedexpError
from fedexp.report.collect import client_for
from fedexp.report.options import _labels
from fedexp.report.options import parser
from fedexp.report.output import write_csv
from fedexp.report.output import write_text
from fedexp.report.pipeline import build
from fedexp.report.pipeline import select_runs


def main(argv: list[str]) -> None:
    """``fedexp report ARGS``: print (or ``--out``) the table; errors as one line, exit 1."""
    p = parser()
    args = p.parse_args(argv)
    labels = _labels(args, p)
    _check_reach(p, args)
    _check_views(p, args)
    if args.out:
        _check_out(p, args.out)
    try:
        client = client_for(args.uri)
        if args.reach is not None:
            text = _reach(client, args, labels)
        elif args.views:
            text = _views(client, args, labels)
        else:
            rep = build(client, args, labels)
            for w in rep.warnings:
                print(f"fedexp report: warning: {w}", file=sys.stderr)
            text = write_csv(rep) if args.format == "csv" else write_text(rep, args.format)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text, encoding="utf-8")
            print(f"fedexp report: wrote {args.out}", file=sys.stderr)
        else:
            print(text, end="")
    except (FedexpError, OSError) as exc:
        print(f"fedexp: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception as exc:
        from mlflow.exceptions import MlflowException

        if not isinstance(exc, MlflowException):
            raise
        print(f"fedexp: error: MLflow at {args.uri or 'the default URI'}: {exc}", file=sys.stderr)
        sys.exit(1)


#: The table's options that ``--reach`` (a table of its own) has no use for: dest -> why.
_TABLE_ONLY = {
    "epsilon": "it annotates the table of --metric",
    "paired": "it adds per-seed differences to the table of --metric",
    "select_by": "it chooses each cell's configuration in the table of --metric",
    "best": "it marks the best cells of the table of --metric",
    "rank_of": "it ranks a row of the table of --metric",
    "order": "its rows are sorted by their keys' values",
    "scale": "it shows KiB and the metric as logged",
    "allow_pooling": "it takes every run of a row's keys, with no pooling check",
}


def _check_reach(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, with one line, an option the output asked for does not use.

    ``--plot`` draws ``--reach``'s curves only; ``--reach`` writes its own Markdown table, so
    the options that shape the table of ``--metric`` would be silently ignored with it.
    """
    if args.reach is None:
        if args.plot:
            p.error("--plot: only with --reach VALUE (it draws the metric against KiB sent)")
        return
    flags = {a.dest: a.option_strings[-1] for a in p._actions if a.option_strings}
    for dest, why in _TABLE_ONLY.items():
        if getattr(args, dest) not in (None, False):
            p.error(f"{flags[dest]}: not with --reach ({why})")
    if args.agg != p.get_default("agg"):
        p.error(f"--agg {args.agg}: not with --reach (it reads each run's whole history)")
    if args.format != "markdown":
        p.error(f"--format {args.format}: not with --reach (its table is Markdown)")


#: The options ``--views`` (a column per view) does not combine with: dest -> why.
_NOT_WITH_VIEWS = {
    "reach": "it is a table of its own",
    "paired": "its differences are of one metric",
    "epsilon": "it annotates the table of one metric",
}


def _check_views(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, with one line, an option ``--views`` would silently ignore."""
    if not args.views:
        return
    flags = {a.dest: a.option_strings[-1] for a in p._actions if a.option_strings}
    for dest, why in _NOT_WITH_VIEWS.items():
        if getattr(args, dest) not in (None, False):
            p.error(f"{flags[dest]}: not with --views ({why})")
    if len(set(args.views)) != len(args.views):
        p.error(f"--views {' '.join(args.views)}: a view named twice")


def _views(client: Any, args: argparse.Namespace, labels: dict[str, str]) -> str:
    """``--views``: the table of ``--metric`` under each view (:mod:`fedexp.report.views`)."""
    from fedexp.report.views import build_views
    from fedexp.report.views import write_views

    reports, skipped = build_views(client, args, labels)
    for w in [*skipped, *(w for _, rep in reports for w in rep.warnings)]:
        print(f"fedexp report: warning: {w}", file=sys.stderr)
    return write_views(reports, args.format)


def _check_out(p: argparse.ArgumentParser, out: str) -> None:
    """``--out``: refuse (before any work) a path under a file or an existing folder."""
    path = Path(out)
    if path.is_dir():
        p.error(f"--out {out}: is a folder; expected a file name")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                p.error(f"--out {out}: {parent} is a file, not a folder")
            break


def _reach(client: Any, args: argparse.Namespace, labels: dict[str, str]) -> str:
    """``--reach``: the bytes-to-target table (Markdown) and the optional plot.

    Rows named as in the other tables (display names, ``--labels``), headed by the keys' short
    names (``choice.algorithm`` -> algorithm).
    """
    from fedexp.report.reach import reach_plot
    from fedexp.report.reach import reach_runs
    from fedexp.report.reach import reach_table
    from fedexp.report.render import short

    runs = select_runs(client, args)
    keys = args.rows + args.cols
    lower = args.lower_is_better
    groups = reach_runs(client, runs, args.metric, args.reach, keys, lower)
    text = reach_table(groups, short(keys), args.reach, args.metric, labels, lower) + "\n"
    if args.plot:
        reach_plot(groups, args.plot, args.metric, labels, short(keys))
        text += f"\nplot: {args.plot}\n"
    return text
