"""Sites of FeTS patients.

The ``--sites`` partitioning CSV located, read and checked against the patients found, and the
per-site counts of the summary.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from data_prep.brats.layouts import Case
from data_prep.common import one_line

SITE_COLUMNS = ("Subject_ID", "Partition_ID")
"""Header of a FeTS partitioning CSV (``partitioning_1.csv``, ``partitioning_2.csv``)."""


def find_sites_file(given: Path, root: Path, base: Path) -> Path:
    """Locate ``--sites``: as given (absolute or relative to the cwd), then in ``root``, ``base``.

    Raises:
        SystemExit: If no such file exists.
    """
    tried = {path.absolute(): path for path in (base / given, root / given, given)}
    for path in reversed(tried.values()):
        if path.is_file():
            return path
    where = ", ".join(str(p) for p in reversed(tried))  # each place once (root may be base)
    raise SystemExit(
        f"error: --sites {given}: file not found (looked for {where}); expected a FeTS "
        "partitioning CSV such as partitioning_1.csv"
    )


def read_sites(path: Path) -> dict[str, str]:
    """Read a FeTS partitioning CSV: subject id -> site (partition id, as text).

    Both FeTS partitionings have the header ``Subject_ID,Partition_ID`` and one row per
    subject (``partitioning_1.csv``: the institution; ``partitioning_2.csv``: the largest
    institutions further split). A UTF-8 byte-order mark, surrounding blanks, blank lines and
    extra columns are tolerated.

    Args:
        path: The CSV.

    Returns:
        Subject id -> partition id.

    Raises:
        SystemExit: One line naming the file (and line) when it cannot be read, lacks a
            column, has an empty value or gives one subject two sites.
    """
    header = ",".join(SITE_COLUMNS)
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise SystemExit(
            f"error: --sites {path}: cannot be read as a CSV: {one_line(exc)} "
            f"(expected the header {header})"
        ) from None
    rows = [[cell.strip() for cell in row] for row in rows]
    numbered = [(n, row) for n, row in enumerate(rows, 1) if any(row)]
    if not numbered or not set(SITE_COLUMNS) <= set(numbered[0][1]):
        where = f"line {numbered[0][0]} is {','.join(numbered[0][1])!r}" if numbered else "empty"
        raise SystemExit(f"error: --sites {path}: {where}, expected the header {header}")
    columns = [numbered[0][1].index(name) for name in SITE_COLUMNS]
    sites: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, row in numbered[1:]:
        values = [row[i] if i < len(row) else "" for i in columns]
        for name, value in zip(SITE_COLUMNS, values, strict=True):
            if not value:
                raise SystemExit(
                    f"error: --sites {path}: line {number}, column {name} is empty "
                    "(expected a subject id and its partition id)"
                )
        subject, site = values
        if subject in sites and sites[subject] != site:
            raise SystemExit(
                f"error: --sites {path}: line {number}: subject {subject} has site {site} but "
                f"site {sites[subject]} on line {lines[subject]} (expected one site per subject)"
            )
        sites[subject], lines[subject] = site, number
    if not sites:
        raise SystemExit(f"error: --sites {path}: no subject rows below the header {header}")
    return sites


def check_sites(cases: Sequence[Case], sites: dict[str, str], path: Path) -> None:
    """Refuse a patient without a row in the sites file, naming it.

    Raises:
        SystemExit: One line naming the first missing patient, its folder and how many are
            missing.
    """
    missing = [case for case in cases if case.patient not in sites]
    if not missing:
        return
    first = missing[0]
    others = ", ".join(case.patient for case in missing[1:6])
    more = f"; also {others}{', ...' if len(missing) > 6 else ''}" if others else ""
    raise SystemExit(
        f"error: --sites {path}: subject {first.patient} ({first.location}) has no row "
        f"(expected a line '{first.patient},<Partition_ID>' under the header "
        f"{','.join(SITE_COLUMNS)}); {len(missing)} of {len(cases)} subjects missing{more}"
    )


def site_summary(
    path: Path | None, sites: dict[str, str] | None, manifest: pd.DataFrame
) -> dict[str, Any]:
    """Summary fields of the sites: the file, patients per site, rows without a patient."""
    if path is None or sites is None:
        return {"sites_file": None, "n_sites": None}
    patients = manifest.drop_duplicates("patient")
    per_site = patients["site"].value_counts().sort_index()
    return {
        "sites_file": str(path),
        "n_sites": int(len(per_site)),
        "patients_per_site": {str(k): int(v) for k, v in per_site.items()},
        "sites_rows_without_patient": len(set(sites) - set(patients["patient"])),
    }
