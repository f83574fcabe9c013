"""The output of ``fedexp report``: a :class:`~fedexp.report.pipeline.Report` as text or CSV.

Markdown or LaTeX (:func:`write_text`): the statement line, the table, the paired differences
and the chosen configurations, each table under a line saying what it shows; CSV
(:func:`write_csv`): a row per cell with the runs' values, seeds and ids. With ``--epsilon``
each cell of the table also says the ε its runs spent (``(n=3, ε=3)``; CSV: ``epsilon``).
"""

from __future__ import annotations

import math

from fedexp.report import render
from fedexp.report.collect import sort_key
from fedexp.report.options import _direction
from fedexp.report.options import _order
from fedexp.report.pipeline import Key
from fedexp.report.pipeline import Report
from fedexp.report.stats import summary


def groups_of(rep: Report) -> dict[Key, list[float]]:
    """The values of each cell's runs."""
    return {k: [rep.values[r.run_id] for r in v] for k, v in rep.cells.items()}


def epsilon_notes(rep: Report) -> dict[Key, str]:
    """``--epsilon``: ``ε=…`` of each cell, the mean of its runs' ε (∞ if one has no DP)."""
    if not rep.epsilons:
        return {}
    out = {}
    for key, runs in rep.cells.items():
        if runs:
            eps = [rep.epsilons[r.run_id] for r in runs]
            out[key] = f"ε={render.epsilon_text(sum(eps) / len(eps))}"
    return out


def epsilon_statement(rep: Report) -> str:
    """The statement's words on ``--epsilon``'s ε, with the δ of the runs it was read at."""
    private = [r for v in rep.cells.values() for r in v if math.isfinite(rep.epsilons[r.run_id])]
    deltas = sorted({r.params.get("privacy.delta", "?") for r in private}, key=sort_key)
    at = f" at δ={'/'.join(render.value_text(d) for d in deltas)}" if deltas else ""
    return (
        f"; ε: the privacy the runs of a cell spent, their final privacy/epsilon{at}, mean "
        "over the runs (∞: no differential privacy: privacy=none, or no noise)"
    )


def statement(rep: Report) -> str:
    """The header line: metric, aggregation, scale, the statistics and where the runs are."""
    a = rep.args
    agg = a.agg.describe(a.lower_is_better)
    chosen = (
        f" of the configuration chosen on {a.select_by} in each cell (see below)"
        if a.select_by
        else ""
    )
    single = any(len(v) == 1 for v in rep.cells.values())
    return (
        f"{a.metric}{chosen}: {agg}, × {rep.scale:g}; each cell: mean ± sample std "
        f"(ddof = 1) over n runs (n=… in the cell)"
        + ("; a cell of one run shows its value alone (n=1: no spread)" if single else "")
        + (epsilon_statement(rep) if rep.epsilons else "")
        + f"; from {len(rep.runs)} runs of {', '.join(a.experiment)}"
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
            score = (
                render.cell_text(f"{mean * sscale:{fmt}}", f"{std * sscale:{fmt}}", n)
                if n
                else "(none)"
            )
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
            notes=epsilon_notes(rep),
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

    Numbers are in the table's unit (× ``scale``, also a column), at full precision; the std
    of a single value (n = 1) is empty: a sample std (ddof = 1) of one run is undefined.
    """
    a = rep.args
    head = ["row", *a.rows, *a.cols, "metric", "agg", "scale", "mean", "std", "n", "values"]
    head += ["seeds", "run_ids"]
    if rep.epsilons:
        head += ["epsilon", "epsilons"]
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
            line += [f"{rep.scale:g}", render.number(mean), _std(std, n), n]
            line += [" ".join(render.number(v) for v in vals)]
            line += [" ".join(x.get("seed") for x in runs), " ".join(x.run_id for x in runs)]
            if rep.epsilons:
                eps = [rep.epsilons[x.run_id] for x in runs]
                line += [render.number(sum(eps) / len(eps)), " ".join(map(render.number, eps))]
            if rep.ref is not None:
                diffs = [d * rep.scale for d in rep.diffs.get(r + c, [])]
                dm, ds, dn = summary(diffs)
                ref = "/".join(rep.ref)
                line += (
                    [ref, "", "", ""]
                    if r == rep.ref
                    else [ref, render.number(dm), _std(ds, dn), dn]
                )
            if rep.choices:
                choice = rep.choices[r + c]
                sm, ss, sn = choice.score
                sscale = render.default_scale(a.select_by)
                setting = " ".join(f"{k}={v}" for k, v in choice.setting.items())
                line += [a.select_by, render.number(sm * sscale), _std(ss * sscale, sn), sn]
                line += [setting, choice.candidates]
            lines.append(line)
    return render.csv_text(head, lines)


def _std(std: float, n: int) -> str:
    """A std for CSV: empty for a single value (n = 1), whose sample std is undefined."""
    return "" if n == 1 else render.number(std)
