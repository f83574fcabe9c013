"""The report's tables as Markdown, LaTeX (booktabs) or CSV, with readable labels.

One scale per table (:func:`default_scale`: percent for fractions such as ``acc/mean`` and
``val/acc/mean``, units otherwise). numpy is imported inside the functions.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedexp.report.collect import UNSET
from fedexp.report.collect import sort_key

#: Display names of the algorithms (``choice.algorithm``, conf/algorithm/<name>.yaml).
ALGORITHM_LABELS = {
    "apfl": "APFL",
    "ditto": "Ditto",
    "fedala": "FedALA",
    "fedamp": "FedAMP",
    "fedavg": "FedAvg",
    "fedavg_ft": "FedAvg-FT",
    "fedbabu": "FedBABU",
    "fedbn": "FedBN",
    "feddwa": "FedDWA",
    "feddyn": "FedDyn",
    "fednova": "FedNova",
    "fedper": "FedPer",
    "fedprox": "FedProx",
    "fedprox_ft": "FedProx-FT",
    "fedrep": "FedRep",
    "fedrod": "FedRoD",
    "fpfc": "FPFC",
    "ifca": "IFCA",
    "l2gd": "L2GD",
    "local": "Local",
    "moon": "MOON",
    "perfedavg": "Per-FedAvg (FO)",
    "perfedavg_hf": "Per-FedAvg (HF)",
    "pfedme": "pFedMe",
    "pfednet": "pFedNet",
    "pfedsop": "pFedSOP",
    "scaffold": "SCAFFOLD",
    "superfed": "SuPerFed",
    "tdpfed": "TDPFed",
}

#: Header names of params; ``choice.<group>`` shows as ``<group>``.
HEADER_NAMES = {
    "choice.algorithm": "algorithm",
    "partition.delta": "δ",
    "partition.alpha": "α",
    "algorithm.mu": "μ",
    "algorithm.lam": "λ",
    "privacy.target_epsilon": "target ε",
    "privacy.noise_multiplier": "z",
    "privacy.clip": "C",
}

#: Values of a key shown otherwise in rows, columns and CSV: a run of ``privacy=none`` has no
#: ``privacy.target_epsilon`` (it spends ε = ∞); ``null`` (logged ``None``) sets no target.
KEY_VALUES = {"privacy.target_epsilon": {UNSET: "∞", "None": "none"}}

#: Metrics that are fractions in [0, 1], reported in percent by default.
FRACTIONS = ("acc", "bal_acc", "auc", "iou", "label_iou", "dice", "dice_wt", "dice_tc", "dice_et")


def default_scale(metric: str) -> float:
    """The default ``--scale`` of ``metric``: 100 (percent) for fractions, else 1.

    Fractions are ``acc/mean``, ``auc/best_mean``, ... and their validation twins
    (``val/acc/mean``) and views (``global/acc/mean``, ``gain/acc/p10``, ``new/acc/mean``);
    bytes, times and losses keep their units, so that bytes are never shown × 100.
    """
    name = metric.removeprefix("val/")
    for view in ("global/", "gain/", "new/"):  # the views of a metric (--views)
        name = name.removeprefix(view)
    return 100.0 if name.split("/", 1)[0] in FRACTIONS else 1.0


def default_labels(keys: Sequence[str]) -> dict[str, str]:
    """Display names of the values of ``keys``: the algorithms' when ``choice.algorithm`` is one."""
    return dict(ALGORITHM_LABELS) if "choice.algorithm" in keys else {}


def short(keys: Sequence[str]) -> str:
    """Header name of params: ``choice.algorithm`` -> algorithm, ``partition.delta`` -> δ."""
    return ",".join(HEADER_NAMES.get(k, k.removeprefix("choice.")) for k in keys)


def key_value(key: str, value: str) -> str:
    """The value of ``key`` a table groups by: ``value``, or its :data:`KEY_VALUES` name."""
    return KEY_VALUES.get(key, {}).get(value, value)


def epsilon_text(eps: float) -> str:
    """ε for a cell: 3 significant digits (``3``, ``2.88``, ``0.62``), whole from 100, ``∞``."""
    if math.isinf(eps):
        return "∞"
    return f"{eps:.0f}" if eps >= 100 else f"{eps:.3g}"


def value_text(v: str) -> str:
    """A param value for a header: ``2.0`` -> ``2``, anything else as it is."""
    try:
        return f"{float(v):g}"
    except ValueError:
        return v


def order_rows(rows: set[tuple[str, ...]], order: Sequence[str] | None) -> list[tuple[str, ...]]:
    """Rows named in ``order`` first, in that order, then the others sorted (case-insensitive)."""
    rest = sorted(rows, key=lambda r: [sort_key(v) for v in r])
    where = {name.lower(): i for i, name in enumerate(order or [])}
    first = sorted(
        (r for r in rest if "/".join(r).lower() in where), key=lambda r: where["/".join(r).lower()]
    )
    return first + [r for r in rest if r not in first]


def label_of(r: tuple[str, ...], labels: Mapping[str, str]) -> str:
    """The display label of a row (or column): by its whole raw label, else value by value."""
    raw = "/".join(r)
    return labels.get(raw, "/".join(labels.get(v, v) for v in r))


def find_row(
    rows: Sequence[tuple[str, ...]], name: str, labels: Mapping[str, str]
) -> tuple[str, ...] | None:
    """The row whose raw or display label is ``name`` (case-insensitive), or None."""
    want = name.lower()
    return next(
        (r for r in rows if want in ("/".join(r).lower(), label_of(r, labels).lower())), None
    )


def number_format(scale: float) -> str:
    """Two decimals for percent, four significant digits otherwise."""
    return ".2f" if scale == 100.0 else ".4g"


@dataclass
class Cell:
    """One shown cell: mean and std as text, the number of runs, bold or not, a note.

    ``note`` goes after ``n=`` in the parentheses (``--epsilon``: ``ε=3``); empty: none.
    """

    mean: str
    std: str
    n: int
    bold: bool = False
    note: str = ""


@dataclass
class Grid:
    """A table before it is written out: header, rows of cells, the optional rank row."""

    head: list[str]
    rows: list[tuple[str, list[Cell | None]]]
    rank: list[str] | None = None


def grid(
    groups: Mapping[tuple[str, ...], Sequence[float]],
    n_rows: int,
    row_name: str,
    col_name: str,
    scale: float = 100.0,
    *,
    best: bool = False,
    lower_is_better: bool = False,
    rank_of: str | None = None,
    order: Sequence[str] | None = None,
    labels: Mapping[str, str] | None = None,
    notes: Mapping[tuple[str, ...], str] | None = None,
) -> Grid:
    """The cells of :func:`table` (its arguments), before formatting."""
    import numpy as np

    from fedexp.report.stats import sample_std

    rows = order_rows({k[:n_rows] for k in groups}, order)
    cols = sorted({k[n_rows:] for k in groups}, key=lambda c: [sort_key(v) for v in c])
    fmt = number_format(scale)
    labels = labels or {}
    sign = -1.0 if lower_is_better else 1.0
    shown: dict[tuple[str, ...], Cell] = {}
    score: dict[tuple[str, ...], float] = {}  # sign × the mean as shown, for best and rank
    for key, v in groups.items():
        if not len(v):
            continue
        arr = np.asarray(v, dtype=float) * scale
        note = (notes or {}).get(key, "")
        shown[key] = Cell(f"{arr.mean():{fmt}}", f"{sample_std(arr):{fmt}}", len(arr), note=note)
        if not np.isnan(arr.mean()):
            score[key] = sign * float(f"{arr.mean():{fmt}}")
    top = {c: max((score[r + c] for r in rows if r + c in score), default=None) for c in cols}
    head = [row_name] + [
        f"{col_name}={'/'.join(value_text(label_of((v,), labels)) for v in c)}"
        if col_name
        else label_of(c, labels) or "value"
        for c in cols
    ]
    out = Grid(head, [])
    for r in rows:
        cells: list[Cell | None] = []
        for c in cols:
            cell = shown.get(r + c)
            if cell is not None and best and top[c] is not None and score.get(r + c) == top[c]:
                cell.bold = True
            cells.append(cell)
        out.rows.append((label_of(r, labels), cells))
    ranked = find_row(rows, rank_of, labels) if rank_of else None
    if ranked is not None:
        out.rank = []
        for c in cols:
            mine = score.get(ranked + c)
            if mine is None:
                out.rank.append("")
                continue
            out.rank.append(f"top {1 + sum(score.get(o + c, -np.inf) > mine for o in rows)}")
    return out


def table(
    groups: Mapping[tuple[str, ...], Sequence[float]],
    n_rows: int,
    row_name: str,
    col_name: str,
    scale: float = 100.0,
    *,
    best: bool = False,
    lower_is_better: bool = False,
    rank_of: str | None = None,
    order: Sequence[str] | None = None,
    labels: Mapping[str, str] | None = None,
    fmt: str = "markdown",
    notes: Mapping[tuple[str, ...], str] | None = None,
) -> str:
    r"""A table of mean ± sample std (ddof = 1, × ``scale``) with the number of runs per cell.

    The layout of pFedNet's Tables II-VII: one row per method, one column per setting.

    Args:
        groups: runs' values per key (row values then column values).
        n_rows: how many leading key values name the row.
        row_name: header of the label column.
        col_name: header prefix of each column (``δ`` gives ``δ=1``); empty: no prefix.
        scale: multiply every value (100: percent, shown with 2 decimals; else 4 digits).
        best: bold the cell(s) with the best mean in each column; every cell tied at the
            shown precision is bold.
        lower_is_better: the best mean is the smallest (losses); also flips `rank_of`.
        rank_of: append the paper's last row ``rank``: per column ``top k`` for the row whose
            label (raw or relabelled, case-insensitive) is this name, k = 1 + the number of rows
            with a strictly better mean at the shown precision (pFedNet's ties with the best
            are ``top 1``, as in Table V, δ=1). No row when no row has this label.
        order: raw row labels (case-insensitive) first, in this order; the rest follow, sorted.
        labels: display names of rows and column values (``{"fedavg": "FedAvg"}``), by whole
            label or by value.
        fmt: ``markdown`` (bold ``**…**``) or ``latex`` (booktabs tabular, ``\textbf``).
        notes: a note per key, shown after ``n=`` (``--epsilon``: ``(n=3, ε=3)``).
    """
    g = grid(
        groups,
        n_rows,
        row_name,
        col_name,
        scale,
        best=best,
        lower_is_better=lower_is_better,
        rank_of=rank_of,
        order=order,
        labels=labels,
        notes=notes,
    )
    return latex_grid(g) if fmt == "latex" else markdown_grid(g)


def cell_text(mean: str, std: str, n: int, pm: str = "±", note: str = "") -> str:
    """``mean ± std (n=3)``; a single run's value alone, ``0.81 (n=1)``: it has no spread.

    A ``note`` follows ``n``: ``mean ± std (n=3, ε=3)``.
    """
    inside = f"n={n}, {note}" if note else f"n={n}"
    return f"{mean} ({inside})" if n == 1 else f"{mean} {pm} {std} ({inside})"


def _md_cell(cell: Cell | None) -> str:
    if cell is None:
        return ""
    text = cell_text(cell.mean, cell.std, cell.n, note=cell.note)
    return f"**{text}**" if cell.bold else text


def markdown_rows(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table of text cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def markdown_grid(g: Grid) -> str:
    """A :class:`Grid` as a Markdown table (``**bold**``)."""
    rows = [[label, *(_md_cell(c) for c in cells)] for label, cells in g.rows]
    if g.rank is not None:
        rows.append(["rank", *g.rank])
    return markdown_rows(g.head, rows)


#: Characters LaTeX treats specially, and their escapes.
_TEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}
#: Unicode symbols of labels and headers, in LaTeX.
_TEX_SYMBOLS = {
    "α": r"$\alpha$",
    "β": r"$\beta$",
    "γ": r"$\gamma$",
    "δ": r"$\delta$",
    "η": r"$\eta$",
    "θ": r"$\theta$",
    "λ": r"$\lambda$",
    "μ": r"$\mu$",
    "ν": r"$\nu$",
    "ρ": r"$\rho$",
    "σ": r"$\sigma$",
    "τ": r"$\tau$",
    "±": r"$\pm$",
    "ε": r"$\varepsilon$",
    "∞": r"$\infty$",
    "−": r"$-$",
    "≥": r"$\geq$",
    "≤": r"$\leq$",
    "×": r"$\times$",
    "…": r"\ldots{}",
}


def tex(text: str) -> str:
    """``text`` as LaTeX: special characters escaped, Greek letters and ± in math mode."""
    return "".join(_TEX_SYMBOLS.get(ch, _TEX_ESCAPES.get(ch, ch)) for ch in text)


def _tex_cell(cell: Cell | None) -> str:
    if cell is None:
        return ""
    text = cell_text(tex(cell.mean), tex(cell.std), cell.n, pm="$\\pm$", note=tex(cell.note))
    return f"\\textbf{{{text}}}" if cell.bold else text


def latex_rows(
    head: Sequence[str], rows: Sequence[Sequence[str]], last: Sequence[str] | None = None
) -> str:
    """A booktabs tabular.

    ``head`` and ``last`` (a row after a rule) are text, escaped here; ``rows`` are LaTeX.
    """
    lines = [
        "\\begin{tabular}{l" + "c" * (len(head) - 1) + "}",
        "\\toprule",
        " & ".join(tex(h) for h in head) + " \\\\",
        "\\midrule",
    ]
    lines += [" & ".join(r) + " \\\\" for r in rows]
    if last is not None:
        lines += ["\\midrule", " & ".join(tex(x) for x in last) + " \\\\"]
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines)


def latex_grid(g: Grid) -> str:
    r"""A :class:`Grid` as a booktabs tabular (``\textbf`` for the best)."""
    rows = [[tex(label), *(_tex_cell(c) for c in cells)] for label, cells in g.rows]
    return latex_rows(g.head, rows, None if g.rank is None else ["rank", *g.rank])


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]], fmt: str) -> str:
    """A table of plain text cells in ``fmt`` (markdown or latex)."""
    if fmt == "latex":
        return latex_rows(head, [[tex(c) for c in r] for r in rows])
    return markdown_rows(head, rows)


def comment(text: str, fmt: str) -> str:
    """A statement line above a table: as it is in Markdown, ``% …`` in LaTeX."""
    if fmt == "latex":
        return "\n".join(f"% {line}" for line in text.splitlines())
    return text


def number(x: float) -> str:
    """A float for CSV: full precision, empty for NaN."""
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else repr(float(x))


def csv_text(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """CSV (the csv module's excel dialect) of ``header`` and ``rows``."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()
