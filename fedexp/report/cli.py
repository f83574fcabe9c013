"""The ``fedexp report`` command: options, the pipeline from MLflow runs to tables, output.

The pipeline (:func:`build`): the FINISHED runs of the experiments; ``--sweep`` and
``--where`` filters; the runs that log ``--metric`` (and ``--select-by``); the latest run of
each configuration (:func:`fedexp.report.collect.latest_per_config`, the number dropped on
stderr); cells by the ``--rows`` and ``--cols`` values; per cell either the configuration
chosen on ``--select-by`` or the pooling check; values aggregated over rounds by ``--agg``;
the table, the paired differences (``--paired``) and the selections, in ``--format``.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedexp.errors import FedexpError
from fedexp.report import render
from fedexp.report.collect import (
    IGNORED_KEYS,
    IGNORED_PREFIXES,
    Agg,
    Run,
    by_sweep,
    check_keys,
    check_metric,
    client_for,
    fetch,
    latest_per_config,
    parse_where,
    sort_key,
    values_of,
    where,
)
from fedexp.report.stats import (
    Choice,
    describe_values,
    paired_differences,
    pooling_conflicts,
    select,
    summary,
)

Key = tuple[str, ...]

DESCRIPTION = textwrap.fill(
    "Tables of a metric across seeds from the MLflow records of runs and sweeps: a row per "
    "value of --rows, a column per value of --cols; each cell is the mean ± sample standard "
    "deviation (ddof = 1) over its n runs, n shown. Runs are FINISHED MLflow runs; among runs "
    "of the same configuration (every param equal except "
    + ", ".join([*IGNORED_KEYS, *(p + "*" for p in IGNORED_PREFIXES)])
    + ") only the latest counts, so re-running a sweep does not double n. A cell that would "
    "pool runs differing in a param that is neither a row, a column nor the seed is refused "
    "(add the param to --rows/--cols, filter with --where/--sweep, or --allow-pooling); with "
    "--select-by, such runs are the candidates of the cell and the best on validation is "
    "shown. Keys are MLflow params (the resolved config: lr, seed, algorithm.mu, "
    "partition.delta, ...) or tags (choice.<group> = the option chosen for a config group, "
    "e.g. choice.algorithm=ditto; sweep = the sweep id).",
    width=79,
    break_on_hyphens=False,
)


EPILOG = """\
examples:
  # pFedNet's Tables II-VII: a row per method, a column per δ, best bold, pFedNet's rank
  fedexp report -e fedexp/pfednet_tables --cols partition.delta --best --rank-of pfednet

  # tuned on validation, test numbers of the chosen lr per method, differences to FedAvg
  fedexp report -e fedexp/tuning --select-by val/acc/mean --paired fedavg

  # mean of the last 5 evaluated rounds, as a LaTeX table written to a file
  fedexp report -e fedexp/pfednet_tables --cols partition.delta --agg last:5 \\
      --format latex --out table.tex

docs/report.md has the reference and more examples."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option's help; description and epilog kept as written.

    A help text that states its default itself (``default: ...``: the options whose default
    is None, off or a list) is left as it is.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _agg(text: str) -> Agg:
    try:
        return Agg.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--agg {text!r}: ")) from None


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``fedexp report`` (imports nothing heavy)."""
    p = argparse.ArgumentParser(
        prog="fedexp report", description=DESCRIPTION, epilog=EPILOG, formatter_class=_Formatter
    )
    what = p.add_argument_group("which runs")
    what.add_argument(
        "--experiment",
        "-e",
        nargs="+",
        required=True,
        metavar="NAME",
        help="MLflow experiment(s) to read (a sweep's: fedexp/<sweep> unless "
        "tracker.experiment named it) (default: none, required)",
    )
    what.add_argument(
        "--uri",
        default=None,
        help="tracking URI (default: $MLFLOW_TRACKING_URI, else MLflow's default "
        "sqlite:///mlflow.db)",
    )
    what.add_argument(
        "--sweep",
        default=None,
        metavar="ID",
        help="only the runs tagged sweep=ID, one sweep of an experiment (default: all)",
    )
    what.add_argument(
        "--where",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="only the runs whose param or tag KEY is VALUE, numbers compared as numbers "
        "(default: no filter)",
    )
    layout = p.add_argument_group("table")
    layout.add_argument(
        "--rows",
        nargs="+",
        default=["choice.algorithm"],
        metavar="KEY",
        help="a row per value (of these together) (default: choice.algorithm)",
    )
    layout.add_argument(
        "--cols",
        nargs="*",
        default=[],
        metavar="KEY",
        help="a column per value (default: none, one column)",
    )
    layout.add_argument(
        "--metric",
        default="acc/mean",
        help="the metric shown; acc/mean is the unweighted mean over clients of each client's "
        "test accuracy (the papers' headline)",
    )
    layout.add_argument(
        "--agg",
        type=_agg,
        default=Agg("final"),
        metavar="final|best|last:K",
        help="a run's value: its final value, the best over its logged rounds (max, or min "
        "with --lower-is-better), or the mean of its last K logged values",
    )
    layout.add_argument(
        "--scale",
        type=float,
        default=None,
        help="multiply every value of the table (default: 100, percent, for accuracies, AUC, "
        "IoU, Dice, also val/...; 1 for anything else)",
    )
    layout.add_argument(
        "--allow-pooling",
        action="store_true",
        help="pool runs of a cell that differ in a param other than rows, cols and seed, with "
        "a warning (default: off, refuse with one line)",
    )
    tuning = p.add_argument_group("comparisons and tuning")
    tuning.add_argument(
        "--paired",
        default=None,
        metavar="REF",
        help="add the per-seed differences (row - REF) of every other row: runs matched by "
        "seed within a column; REF: a row's raw name or label (default: none)",
    )
    tuning.add_argument(
        "--select-by",
        default=None,
        metavar="METRIC",
        help="in each cell, the configuration with the best mean of METRIC over its seeds "
        "(e.g. val/acc/mean, logged by runs with val_fraction > 0); the cell shows its --metric "
        "(default: none, every run of a cell pooled after the pooling check)",
    )
    tuning.add_argument(
        "--select-direction",
        choices=("auto", "max", "min"),
        default="auto",
        help="best of --select-by: auto is min for a metric named *loss*, else max",
    )
    look = p.add_argument_group("presentation")
    look.add_argument(
        "--format",
        choices=("markdown", "latex", "csv"),
        default="markdown",
        help="markdown; latex (booktabs tabular, best in \\textbf); csv (a row per cell: "
        "mean, std, n, the runs' values, seeds and run ids)",
    )
    look.add_argument(
        "--out", default=None, metavar="FILE", help="write the output there (default: stdout)"
    )
    look.add_argument(
        "--best", action="store_true", help="bold the best mean of each column (default: off)"
    )
    look.add_argument(
        "--lower-is-better",
        action="store_true",
        help="best = smallest (losses); flips --best, --rank-of and --agg best (default: off, "
        "largest)",
    )
    look.add_argument(
        "--rank-of",
        default=None,
        metavar="NAME",
        help="add a last row 'rank': top k of row NAME in each column, as pFedNet's tables "
        "(default: none)",
    )
    look.add_argument(
        "--order",
        default=None,
        metavar="A,B,C",
        help="these rows first, in this order (default: all rows sorted)",
    )
    look.add_argument(
        "--labels",
        default=None,
        metavar="a=A,b=B",
        help="display names of rows/values, over the defaults (fedavg=FedAvg, "
        "pfednet=pFedNet, ...; headers: partition.delta is δ) (default: the defaults only)",
    )
    bytes_ = p.add_argument_group("bytes to reach a target")
    bytes_.add_argument(
        "--reach",
        type=float,
        default=None,
        metavar="VALUE",
        help="instead of the table: KiB up/down until --metric first reaches VALUE (default: off)",
    )
    bytes_.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="with --reach: a plot of the metric against KiB (default: none)",
    )
    return p


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


def _labels(args: argparse.Namespace, p: argparse.ArgumentParser) -> dict[str, str]:
    labels = render.default_labels(args.rows + args.cols)
    for item in (args.labels or "").split(","):
        if item.strip():
            raw, eq, shown = item.partition("=")
            if not eq or not raw.strip():
                p.error(f"--labels: {item!r} is not raw=Shown")
            labels[raw.strip()] = shown.strip()
    return labels


def _direction(args: argparse.Namespace) -> bool:
    """Whether --select-by is maximised."""
    if args.select_direction == "auto":
        return "loss" not in args.select_by
    return args.select_direction == "max"


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
        cells[tuple(r.get(k) for k in keys)].append(r)
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


def _order(args: argparse.Namespace) -> list[str]:
    return [n.strip() for n in (args.order or "").split(",") if n.strip()]


def groups_of(rep: Report) -> dict[Key, list[float]]:
    """The values of each cell's runs."""
    return {k: [rep.values[r.run_id] for r in v] for k, v in rep.cells.items()}


def statement(rep: Report) -> str:
    """The header line: metric, aggregation, scale, the statistics and where the runs are."""
    a = rep.args
    agg = a.agg.describe(a.lower_is_better)
    chosen = (
        f" of the configuration chosen on {a.select_by} in each cell (see below)"
        if a.select_by
        else ""
    )
    return (
        f"{a.metric}{chosen}: {agg}, × {rep.scale:g}; each cell: mean ± sample std "
        f"(ddof = 1) over n runs (n=… in the cell); from {len(rep.runs)} runs of "
        f"{', '.join(a.experiment)}"
        + (f", sweep {a.sweep}" if a.sweep else "")
        + (f", where {' '.join(a.where)}" if a.where else "")
    )


def paired_statement(rep: Report) -> str:
    """The line above the paired differences."""
    ref = render.label_of(rep.ref, rep.labels)
    return (
        f"Paired differences (row − {ref}) of {rep.args.metric}, × {rep.scale:g}: in each "
        f"column, a row's runs and {ref}'s are matched by seed; mean ± sample std (ddof = 1) "
        f"of the per-seed differences over the n seeds both have. Runs with the same seed "
        "share the data partition, the train/test split, the client sampling and (with the "
        "same model settings) the initial model, so the pairing removes that variation."
    )


def selection_rows(rep: Report) -> tuple[list[str], list[list[str]], str]:
    """Header, rows and the line above the table of chosen configurations."""
    a = rep.args
    sscale = render.default_scale(a.select_by)
    fmt = render.number_format(sscale)
    head = [render.short(a.rows)] + ([render.short(a.cols)] if a.cols else [])
    head += ["chosen", f"{a.select_by} (× {sscale:g})", "candidates"]
    body = []
    for r in rep.rows:
        for c in rep.cols:
            choice = rep.choices.get(r + c)
            if choice is None:
                continue
            mean, std, n = choice.score
            setting = ", ".join(f"{k}={v}" for k, v in choice.setting.items()) or "(only one)"
            score = f"{mean * sscale:{fmt}} ± {std * sscale:{fmt}} (n={n})" if n else "(none)"
            cell = [render.label_of(r, rep.labels)]
            if a.cols:
                cell.append("/".join(render.value_text(v) for v in c))
            body.append([*cell, setting, score, str(choice.candidates)])
    direction = "max" if _direction(a) else "min"
    line = (
        f"Chosen on {a.select_by}, {a.agg.describe(not _direction(a))}, the {direction} of "
        f"the mean over seeds, among the configurations of each cell (runs differing in params "
        f"other than rows, cols and seed); the table above shows the chosen one's {a.metric}."
    )
    return head, body, line


def write_text(rep: Report, fmt: str) -> str:
    """The report as Markdown or LaTeX: statement, table, paired differences, selections."""
    a = rep.args
    n_rows = len(a.rows)
    common = dict(
        n_rows=n_rows,
        row_name=render.short(a.rows),
        col_name=render.short(a.cols),
        scale=rep.scale,
        order=_order(a),
        labels=rep.labels,
        fmt=fmt,
    )
    parts = [
        render.comment(statement(rep), fmt),
        render.table(
            groups_of(rep),
            best=a.best,
            lower_is_better=a.lower_is_better,
            rank_of=a.rank_of,
            **common,
        ),
    ]
    if rep.ref is not None:
        parts += [render.comment(paired_statement(rep), fmt), render.table(rep.diffs, **common)]
    if rep.choices:
        head, body, line = selection_rows(rep)
        parts += [render.comment(line, fmt), render.text_table(head, body, fmt)]
    return "\n\n".join(parts) + "\n"


def write_csv(rep: Report) -> str:
    """The report as CSV: a row per cell with mean, std, n, the runs' values, seeds, ids.

    Numbers are in the table's unit (× ``scale``, also a column), at full precision.
    """
    a = rep.args
    head = ["row", *a.rows, *a.cols, "metric", "agg", "scale", "mean", "std", "n", "values"]
    head += ["seeds", "run_ids"]
    if rep.ref is not None:
        head += ["paired_ref", "diff_mean", "diff_std", "diff_n"]
    if rep.choices:
        head += ["select_by", "select_mean", "select_std", "select_n", "chosen", "candidates"]
    lines = []
    for r in rep.rows:
        for c in rep.cols:
            runs = rep.cells.get(r + c)
            if not runs:
                continue
            vals = [rep.values[x.run_id] * rep.scale for x in runs]
            mean, std, n = summary(vals)
            line: list[object] = [render.label_of(r, rep.labels), *r, *c, a.metric, str(a.agg)]
            line += [f"{rep.scale:g}", render.number(mean), render.number(std), n]
            line += [" ".join(render.number(v) for v in vals)]
            line += [" ".join(x.get("seed") for x in runs), " ".join(x.run_id for x in runs)]
            if rep.ref is not None:
                diffs = [d * rep.scale for d in rep.diffs.get(r + c, [])]
                dm, ds, dn = summary(diffs)
                ref = "/".join(rep.ref)
                line += (
                    [ref, "", "", ""] if r == rep.ref else [ref, *map(render.number, (dm, ds)), dn]
                )
            if rep.choices:
                choice = rep.choices[r + c]
                sm, ss, sn = choice.score
                sscale = render.default_scale(a.select_by)
                setting = " ".join(f"{k}={v}" for k, v in choice.setting.items())
                line += [a.select_by, render.number(sm * sscale), render.number(ss * sscale), sn]
                line += [setting, choice.candidates]
            lines.append(line)
    return render.csv_text(head, lines)


def main(argv: list[str]) -> None:
    """``fedexp report ARGS``: print (or ``--out``) the table; errors as one line, exit 1."""
    p = parser()
    args = p.parse_args(argv)
    labels = _labels(args, p)
    try:
        client = client_for(args.uri)
        if args.reach is not None:
            text = _reach(client, args)
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


def _reach(client: Any, args: argparse.Namespace) -> str:
    """``--reach``: the bytes-to-target table (Markdown) and the optional plot."""
    from fedexp.report.reach import reach_plot, reach_runs, reach_table

    runs = select_runs(client, args)
    keys = args.rows + args.cols
    groups = reach_runs(client, runs, args.metric, args.reach, keys)
    text = reach_table(groups, ",".join(keys), args.reach, args.metric) + "\n"
    if args.plot:
        reach_plot(groups, args.plot, args.metric)
        text += f"\nplot: {args.plot}\n"
    return text
