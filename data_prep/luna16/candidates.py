"""The candidate list of LUNA16.

``candidates_V2.csv`` (or ``candidates.csv``) located, read with its malformed rows left out
and recorded, and the negatives subsampled to the dataset-level ratio δ.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console

from data_prep.common import RunLog
from data_prep.common import id_problem
from data_prep.common import one_line

CANDIDATE_COLUMNS = ("seriesuid", "coordX", "coordY", "coordZ", "class")
CANDIDATE_FILES = ("candidates_V2.csv", "candidates.csv")


def find_candidates_csv(root: Path, given: Path | None) -> Path:
    """Locate the candidate list.

    Args:
        root: Raw LUNA16 folder.
        given: Path from ``--candidates`` (absolute, relative to the cwd, or relative to
            ``root``), or ``None`` to search ``root`` for the official file names.

    Returns:
        Path of the CSV.

    Raises:
        SystemExit: If no candidate file can be found.
    """
    if given is not None:
        for path in (given, root / given):
            if path.is_file():
                return path
        raise SystemExit(f"error: candidate file {given} not found (also tried {root / given})")
    for name in CANDIDATE_FILES:
        hits = sorted(root.rglob(name))
        if hits:
            return hits[0]
    raise SystemExit(f"error: no {' or '.join(CANDIDATE_FILES)} found under {root}")


def _row_problem(line: int, uid: str | None, values: dict[str, str], bad: list[str]) -> str:
    """One-line reason for a malformed candidate row (its kind before the first colon)."""
    if uid is not None:
        return f"bad seriesuid: line {line}, column seriesuid: {uid} (expected a series UID)"
    column = bad[0]
    if column == "class":
        return f"bad class: line {line}, column class: {values[column]!r} (expected 0 or 1)"
    return (
        f"bad coordinate: line {line}, column {column}: {values[column]!r} "
        "(expected a finite number of mm)"
    )


def read_candidates(
    path: Path, log: RunLog | None = None, console: Console | None = None
) -> pd.DataFrame:
    """Read ``candidates(_V2).csv`` and keep its row number as ``candidate_index``.

    Malformed rows (a series UID that is empty or looks like a path, a coordinate that is not
    a finite number, a class other than 0/1) are left out and recorded in ``log`` with their
    line and column; the number of rows in the file is kept in ``frame.attrs["rows_in_file"]``.

    Args:
        path: The CSV.
        log: Receives the malformed rows (they are dropped silently when ``None``).
        console: Where skip messages are echoed.

    Returns:
        The usable rows: ``seriesuid`` (str), ``coordX/Y/Z`` (float64), ``class`` and
        ``candidate_index`` (int64, 0-based data row of the file).

    Raises:
        SystemExit: If the file cannot be parsed or a required column is missing.
    """
    expected = ",".join(CANDIDATE_COLUMNS)
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # pandas errors are ValueErrors
        raise SystemExit(
            f"error: cannot read candidate file {path}: {one_line(exc)} "
            f"(expected a CSV with columns {expected})"
        ) from exc
    frame.columns = [str(c).strip() for c in frame.columns]
    missing = [c for c in CANDIDATE_COLUMNS if c not in frame.columns]
    if missing:
        hint = "; annotations.csv is not a candidate list" if "annotation" in path.name else ""
        raise SystemExit(
            f"error: candidate file {path} lacks column(s) {', '.join(missing)} "
            f"(expected {expected}{hint})"
        )
    text = frame.loc[:, list(CANDIDATE_COLUMNS)].astype(str)
    uids = text["seriesuid"].str.strip()
    numbers = {
        c: pd.to_numeric(text[c].str.strip(), errors="coerce") for c in CANDIDATE_COLUMNS[1:]
    }
    bad_uid = {u: id_problem(u) for u in uids.unique()}
    bad = pd.DataFrame({c: ~np.isfinite(numbers[c].to_numpy(np.float64)) for c in numbers})
    bad["class"] |= ~numbers["class"].isin([0, 1]).to_numpy()
    bad["seriesuid"] = uids.map(bad_uid).notna().to_numpy()
    ok = ~bad.any(axis=1).to_numpy()
    for i in np.flatnonzero(~ok):
        columns = [c for c in CANDIDATE_COLUMNS if bad.at[i, c]]
        uid_problem = bad_uid[uids.iat[i]]
        reason = _row_problem(int(i) + 2, uid_problem, text.iloc[i].to_dict(), columns)
        if log is not None:
            log.skip(path, reason, console)
    clean = pd.DataFrame(
        {
            "seriesuid": uids[ok].to_numpy(),
            **{c: numbers[c][ok].to_numpy(np.float64) for c in CANDIDATE_COLUMNS[1:4]},
            "class": numbers["class"][ok].to_numpy().astype(np.int64),
            "candidate_index": np.flatnonzero(ok).astype(np.int64),
        }
    )
    clean.attrs["rows_in_file"] = len(frame)
    return clean


def subsample_negatives(frame: pd.DataFrame, delta: float | None, seed: int) -> pd.DataFrame:
    """Keep all positives and at most ``round(delta * n_positive)`` random negatives.

    This is the dataset-level imbalance δ = n_negative / n_positive of the paper (§VI-B1,
    δ ∈ {1, 2, 4, 7}). The draw depends only on ``seed`` and the rows given, and applying the
    function twice with the same arguments is a no-op.

    Args:
        frame: Candidates with a ``class`` column (1 nodule, 0 not).
        delta: Target ratio, or ``None`` to keep everything.
        seed: Random seed.

    Returns:
        The kept rows, in their original order.
    """
    if delta is None:
        return frame
    negatives = np.flatnonzero(frame["class"].to_numpy() == 0)
    n_keep = min(len(negatives), int(round(delta * int((frame["class"] == 1).sum()))))
    if n_keep == len(negatives):
        return frame
    chosen = np.random.default_rng(seed).choice(negatives, size=n_keep, replace=False)
    keep = np.ones(len(frame), dtype=bool)
    keep[negatives] = False
    keep[chosen] = True
    return frame.loc[keep]
