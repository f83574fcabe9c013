"""The report's statistics: sample std, pooling conflicts, paired differences, selection.

Cells are mean ± sample standard deviation with ddof = 1 (the unbiased variance's square root)
over the n runs of the cell; one run gives std 0 here (the tables show its value alone, the
CSV leaves its std empty). numpy is imported inside the functions.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fedexp.report.collect import UNSET
from fedexp.report.collect import Run
from fedexp.report.collect import ignored
from fedexp.report.collect import sort_key

Key = tuple[str, ...]


def sample_std(values: Sequence[float]) -> float:
    """Standard deviation over runs with ddof = 1 (sample std); 0 for a single run."""
    import numpy as np

    return float(np.std(np.asarray(values, dtype=float), ddof=1)) if len(values) > 1 else 0.0


def summary(values: Sequence[float]) -> tuple[float, float, int]:
    """``(mean, sample std (ddof = 1), n)`` of ``values``."""
    import numpy as np

    if not len(values):
        return math.nan, math.nan, 0
    return float(np.mean(np.asarray(values, dtype=float))), sample_std(values), len(values)


def free_params(runs: Iterable[Run], exempt: set[str]) -> dict[str, list[str]]:
    """The params (not ignored, not ``exempt``) whose values differ among ``runs``.

    A ``choice.<group>`` tag that differs stands for the params under ``<group>.`` it
    explains (those constant among the runs of each of its values): ``choice.compressor
    (none, topk)`` rather than every ``compressor.*`` key of the two options.

    Returns:
        ``{key: sorted distinct values}``, the choice tags first; a run without the param
        counts as ``-``.
    """
    runs = list(runs)
    keys = {k for r in runs for k in r.params if not ignored(k) and k not in exempt}
    out = {}
    for key in sorted(keys):
        seen = {r.params.get(key, UNSET) for r in runs}
        if len(seen) > 1:
            out[key] = sorted(seen, key=sort_key)
    choices = {}
    tags = {t for r in runs for t in r.tags if t.startswith("choice.") and t not in exempt}
    for tag in sorted(tags):
        seen = {r.tags.get(tag, UNSET) for r in runs}
        group = tag.removeprefix("choice.") + "."
        explained = [
            k
            for k in out
            if k.startswith(group)
            and all(
                len({r.params.get(k, UNSET) for r in runs if r.tags.get(tag, UNSET) == v}) == 1
                for v in seen
            )
        ]
        if len(seen) > 1 and explained:
            choices[tag] = sorted(seen, key=sort_key)
            for k in explained:
                del out[k]
    return {**choices, **out}


def pooling_conflicts(
    cells: dict[Key, list[Run]], exempt: set[str]
) -> tuple[dict[str, list[str]], list[Key]]:
    """What cells would pool runs of different configurations.

    Args:
        cells: the runs of each cell.
        exempt: the row and column keys and ``seed`` (a cell is meant to pool seeds).

    Returns:
        ``({param: its values in the offending cells}, [offending cells])``.
    """
    differing: dict[str, set[str]] = defaultdict(set)
    bad = []
    for key, runs in cells.items():
        free = free_params(runs, exempt)
        if free:
            bad.append(key)
            for param, values in free.items():
                differing[param].update(values)
    return {k: sorted(v, key=sort_key) for k, v in sorted(differing.items())}, bad


def describe_values(differing: dict[str, list[str]], limit: int = 6) -> str:
    """``lr (0.01, 0.1), algorithm.mu (0.01, 0.1)``: at most ``limit`` values per param."""
    parts = []
    for key, values in differing.items():
        shown = values[:limit] + (["…"] if len(values) > limit else [])
        parts.append(f"{key} ({', '.join(shown)})")
    return ", ".join(parts)


def paired_differences(
    cells: dict[Key, list[tuple[str, float]]], n_rows: int, ref: Key
) -> dict[Key, list[float]]:
    """Per-seed differences (row − ``ref``) in each column, over the seeds both have.

    Runs share the data partition, the client train/test split, the initial model and every
    random stream per seed, so the difference of two methods at one seed removes that
    variation. Several runs of one seed in a cell (``--allow-pooling``) are averaged first.

    Args:
        cells: ``[(seed, value), ...]`` per cell key (row values then column values).
        n_rows: how many leading key values name the row.
        ref: the row values of the reference.

    Returns:
        The differences per cell of every row but ``ref``, in seed order; a cell with no
        seed in common has an empty list.
    """
    by_seed: dict[Key, dict[str, float]] = {}
    for key, pairs in cells.items():
        per: dict[str, list[float]] = defaultdict(list)
        for seed, value in pairs:
            per[seed].append(value)
        by_seed[key] = {s: sum(v) / len(v) for s, v in per.items()}
    out: dict[Key, list[float]] = {}
    for key, mine in by_seed.items():
        row, col = key[:n_rows], key[n_rows:]
        if row == ref:
            continue
        theirs = by_seed.get(ref + col, {})
        common = sorted(set(mine) & set(theirs), key=sort_key)
        out[key] = [mine[s] - theirs[s] for s in common]
    return out


@dataclass(frozen=True)
class Choice:
    """The configuration chosen in one cell by ``--select-by``.

    Attributes:
        runs: the chosen configuration's runs (its seeds).
        setting: the chosen values of the params that differ among the cell's candidates.
        score: ``(mean, sample std, n)`` of the selection metric over its runs.
        candidates: how many configurations the cell held.
    """

    runs: list[Run]
    setting: dict[str, str]
    score: tuple[float, float, int]
    candidates: int


def select(
    runs: list[Run], scores: dict[str, float], exempt: set[str], maximize: bool = True
) -> Choice:
    """The candidate configuration of a cell with the best mean selection score.

    Candidates are the cell's runs grouped by every param except ``exempt`` (the row and
    column keys and ``seed``) and the ignored ones; each is scored by the mean of its runs'
    ``scores`` (NaN scores left out); ties go to the candidate with more runs, then to the
    first in sorted order.
    """
    groups: dict[tuple[tuple[str, str], ...], list[Run]] = defaultdict(list)
    for r in runs:
        groups[tuple((k, v) for k, v in r.config() if k not in exempt)].append(r)
    free = free_params(runs, exempt)
    best: tuple | None = None
    for config in sorted(groups):
        members = groups[config]
        vals = [scores[r.run_id] for r in members if not math.isnan(scores[r.run_id])]
        stats = summary(vals)
        if not vals:
            continue
        rank = ((1 if maximize else -1) * stats[0], len(members))
        if best is None or rank > best[0]:
            best = (rank, config, stats)
    if best is None:
        members = runs
        config = next(iter(sorted(groups)))
        stats = (math.nan, math.nan, 0)
    else:
        _, config, stats = best
        members = groups[config]
    setting = {k: members[0].get(k) for k in free}
    return Choice(members, setting, stats, len(groups))
