"""The options of ``fedexp report``: its argument parser and help, and option values parsed.

:func:`parser` builds the parser (description, examples, every option with its default);
``--agg``, ``--labels``, ``--select-direction`` and ``--order`` are turned into what the
pipeline (:mod:`fedexp.report.pipeline`) and the output (:mod:`fedexp.report.output`) use.
Imports nothing heavy (``fedexp report --help`` stays light).
"""

from __future__ import annotations

import argparse
import math
import textwrap
from typing import NoReturn

from fedexp.report import render
from fedexp.report.collect import IGNORED_KEYS
from fedexp.report.collect import IGNORED_PREFIXES
from fedexp.report.collect import Agg

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


def _finite(text: str) -> float:
    """An argparse type: a finite, non-zero number (a scale of nan, inf or 0 is refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
    if not math.isfinite(value) or value == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite, non-zero number")
    return value


def _agg(text: str) -> Agg:
    try:
        return Agg.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--agg {text!r}: ")) from None


class _OneLineErrors(argparse.ArgumentParser):
    """Argparse's errors in one line: its usage (10 lines) is ``--help``'s (issue 70, item 11)."""

    def error(self, message: str) -> NoReturn:
        """``fedexp report: error: <message> (fedexp report --help lists the options)``, exit 2."""
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``fedexp report`` (imports nothing heavy)."""
    p = _OneLineErrors(
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
        "--views",
        nargs="+",
        choices=("personal", "global", "gain", "new"),
        default=None,
        metavar="VIEW",
        help="a column per view of --metric: personal (the clients' own models, acc/mean), "
        "global (the global model on the same clients, global/acc/mean), gain (personal − "
        "global per client, gain/acc/mean) and new (held-out clients tested as new ones, "
        "new/acc/mean); e.g. --views personal global gain new (default: none, --metric alone)",
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
        type=_finite,
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
        help="best = smallest (losses); flips --best, --rank-of and --agg best, and --reach "
        "reaches VALUE from above (default: off, largest)",
    )
    look.add_argument(
        "--rank-of",
        default=None,
        metavar="NAME",
        help="add a last row 'rank': top k of row NAME in each column, as pFedNet's tables "
        "(default: none)",
    )
    look.add_argument(
        "--epsilon",
        action="store_true",
        help="beside each cell, the privacy the cell's runs spent: ε = their final "
        "privacy/epsilon, mean over the runs, '(n=3, ε=3)'; ∞ for runs without differential "
        "privacy (privacy=none); CSV: columns epsilon and epsilons (default: off)",
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
        help="instead of the table: KiB up/down until --metric first reaches VALUE (≥ VALUE; "
        "≤ with --lower-is-better) (default: off)",
    )
    bytes_.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="with --reach: a plot of the metric against KiB (default: none)",
    )
    return p


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


def _order(args: argparse.Namespace) -> list[str]:
    return [n.strip() for n in (args.order or "").split(",") if n.strip()]
