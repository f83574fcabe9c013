"""Tabular clinical data: scikit-learn's breast-cancer table, generic CSVs, synthetic data.

The pFedNet paper (§VI, tabular tasks) fills missing values with 0 and scales every feature to
[-1, 1]; the CSV loader does the same.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import numpy as np

from fedexp.config.ranges import NonNegative
from fedexp.config.ranges import NonNegativeInt
from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.data.dataset import ArrayDataset
from fedexp.errors import DataError

if TYPE_CHECKING:  # pandas loads when a CSV is read: half a second a start
    import pandas as pd

#: Classes of a synthetic classification table (one class would leave nothing to learn).
NumClasses = Annotated[int, Range(ge=2, note="a classification needs two classes")]


def scale_to_unit_interval(x: np.ndarray) -> np.ndarray:
    """Scale each column to [-1, 1] (constant columns become 0)."""
    return _scale_columns(x, x.min(axis=0), x.max(axis=0))


def _scale_columns(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Map each column of ``x`` from [lo, hi] to [-1, 1]; columns with ``hi == lo`` become 0.

    Every operation is elementwise, so scaling a block of rows with the whole table's ``lo`` and
    ``hi`` gives exactly the rows that scaling the whole table gives.
    """
    span = np.where(hi > lo, hi - lo, 1.0)
    return (2.0 * (x - lo) / span - 1.0) * (hi > lo)


def breast_cancer() -> ArrayDataset:
    """The Wisconsin diagnostic breast-cancer table shipped with scikit-learn.

    569 patients, 30 numeric features, label 1 = malignant (212) and 0 = benign (357): real
    clinical data that needs no download. Features are scaled to [-1, 1].
    """
    x, y, names = _breast_cancer()
    return ArrayDataset("breast_cancer", x.copy(), y.copy(), 2, feature_names=list(names))


#: The Wisconsin table's columns: the mean, the standard error and the worst of ten measures.
_MEASURES = (
    "radius", "texture", "perimeter", "area", "smoothness", "compactness", "concavity",
    "concave points", "symmetry", "fractal dimension",
)  # fmt: skip
BREAST_CANCER_FEATURES = (
    *(f"mean {m}" for m in _MEASURES),
    *(f"{m} error" for m in _MEASURES),
    *(f"worst {m}" for m in _MEASURES),
)


@functools.cache
def _breast_cancer() -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """scikit-learn's table, read once a process (a sweep's runs in one process share it).

    Read from the CSV scikit-learn ships, as its ``load_breast_cancer`` reads it, without
    importing scikit-learn (1.5 s of a run's start on this machine); its loader where the file
    is not where scikit-learn keeps it, or not as it writes it.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # (finds the package; runs none of it)
    data, target = None, None
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "datasets" / "data" / "breast_cancer.csv"
        try:
            with open(path) as fh:
                head = fh.readline().strip().split(",")
                table = np.loadtxt(fh, delimiter=",", dtype=np.float64, ndmin=2)
            if head[:2] == ["569", "30"] and table.shape == (569, 31):
                data, target = table[:, :30], table[:, 30].astype(np.int64)
        except (OSError, ValueError):
            pass
    if data is None or target is None:
        from sklearn.datasets import load_breast_cancer

        bunch = load_breast_cancer()
        data, target = bunch.data, bunch.target
    # scikit-learn codes malignant as 0; make the disease the positive class.
    y = (target == 0).astype(np.int64)
    x = scale_to_unit_interval(data.astype(np.float64)).astype(np.float32)
    return x, y, BREAST_CANCER_FEATURES


#: Feature values above this magnitude are refused: scaling to [-1, 1] in float32 would
#: flatten every other value of their column (and beyond ~3e38 they overflow float32).
MAX_MAGNITUDE = 1e30


def _not_utf8(file: Path) -> str:
    """The message for a file that is not UTF-8: where the first bad byte is."""
    raw = file.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        where = f" (byte 0x{raw[exc.start]:02x} at offset {exc.start}, line {line})"
    else:  # pandas failed on a chunk boundary or another codec
        where = ""
    return f"{file}: not UTF-8 text{where}; expected UTF-8 text (re-save the file as UTF-8)"


def _check_magnitudes(file: Path, frame: pd.DataFrame) -> None:
    """Refuse infinite and huge feature values, naming the column and the row."""
    for column in frame.columns:
        values = frame[column].to_numpy(dtype=np.float64, na_value=np.nan)
        for bad, what in (
            (np.isinf(values), "an infinite value"),
            (np.abs(values) > MAX_MAGNITUDE, f"a value of magnitude above {MAX_MAGNITUDE:g}"),
        ):
            if bad.any():
                row = int(np.argmax(bad))
                raise DataError(
                    f"{file}: feature column '{column}' has {what} ({values[row]:g}) in data "
                    f"row {row + 1} (line {row + 2} of the file); expected finite numbers of "
                    f"magnitude ≤ {MAX_MAGNITUDE:g}"
                )


def csv_table(path: str, label: str, group: str | None = None) -> ArrayDataset:
    """Load a CHD/Covid-style CSV: one label column, every other column numeric.

    Missing values are filled with 0 and every feature is scaled to [-1, 1] (pFedNet §VI).
    Labels may be numbers or strings; they are mapped to 0..C-1 in sorted order.

    Args:
        path: the CSV file.
        label: name of the label column.
        group: optional column with the site of each row (for the ``natural`` partition).

    Raises:
        DataError: naming the file and the column or row: the path is missing or a folder, the
            file is empty, not UTF-8 text or not CSV, has a header but no rows, no such
            label/group column, a feature column that is not numeric, an infinite value or
            one of magnitude above 1e30.
    """
    file = Path(path).expanduser()
    if file.is_dir():
        raise DataError(f"dataset.path={file}: is a folder; expected a CSV file")
    if not file.is_file():
        raise DataError(f"dataset.path: CSV file not found: {file}")
    import pandas as pd

    try:
        frame = pd.read_csv(file)
    except UnicodeDecodeError:
        raise DataError(_not_utf8(file)) from None
    except pd.errors.EmptyDataError:
        raise DataError(f"{file}: the file is empty; expected a header line and rows") from None
    except Exception as exc:  # noqa: BLE001 - pandas raises many kinds
        raise DataError(f"{file}: cannot be read as CSV ({exc})") from None
    if len(frame) == 0:
        raise DataError(f"{file}: a header but no data rows; expected one row per sample")
    if group is not None and group == label:
        raise DataError(f"{file}: dataset.group and dataset.label are both '{label}'")
    for column, role in ((label, "label"), (group, "group")):
        if column is not None and column not in frame.columns:
            cols = ", ".join(map(str, frame.columns))
            raise DataError(f"{file}: no {role} column '{column}' (columns are: {cols})")
    y_raw = frame.pop(label)
    if y_raw.isna().any():
        raise DataError(f"{file}: label column '{label}' has missing values")
    groups = frame.pop(group).astype(str).to_numpy() if group is not None else None
    for column in frame.columns:
        if not pd.api.types.is_numeric_dtype(frame[column]):
            bad = frame[column][pd.to_numeric(frame[column], errors="coerce").isna()]
            bad = bad[bad.notna()]
            example = bad.iloc[0] if len(bad) else "?"
            raise DataError(
                f"{file}: feature column '{column}' is not numeric (value {example!r}); "
                "expected numbers in every column but the label"
            )
    if frame.shape[1] == 0:
        raise DataError(f"{file}: no feature columns besides the label '{label}'")
    _check_magnitudes(file, frame)
    classes, y = np.unique(y_raw.to_numpy(), return_inverse=True)
    if len(classes) < 2:
        raise DataError(f"{file}: label column '{label}' has a single class {classes[0]!r}")
    x = frame.fillna(0.0).to_numpy(dtype=np.float64)
    x = scale_to_unit_interval(x).astype(np.float32)
    return ArrayDataset(
        file.stem, x, y.astype(np.int64), len(classes), groups, [str(c) for c in frame.columns]
    )


#: Rows of ``x`` that :func:`synthetic_tabular` draws, and holds in float64, at a time.
SYNTHETIC_CHUNK_ROWS = 2**16

#: Bytes a block's per-row site models (rows × features × classes float64) may take at most;
#: wide tables with many classes get blocks of fewer than :data:`SYNTHETIC_CHUNK_ROWS` rows.
SYNTHETIC_CHUNK_BYTES = 2**25


def synthetic_tabular(
    num_samples: PositiveInt = 2000,
    num_features: PositiveInt = 20,
    num_classes: NumClasses = 2,
    num_sites: PositiveInt = 10,
    heterogeneity: NonNegative = 1.0,
    seed: NonNegativeInt = 0,
) -> ArrayDataset:
    """Heterogeneous synthetic tabular data for scale tests.

    Each site has its own linear model ``W_s = W + heterogeneity * E_s`` and its own input
    shift; labels are the argmax of the site's logits plus Gumbel noise. ``groups`` holds the
    site, so the ``natural`` partition gives each client one site's data.

    The table is built in blocks of rows, so memory stays near the float32 output
    (``num_samples * num_features * 4`` bytes) plus the logits (``num_samples * num_classes * 8``)
    and a block: the raw float64 inputs are drawn twice from the same generator state, once for
    the logits and the columns' ranges and once to scale them into the output. A generator's
    normal and Gumbel draws in consecutive blocks equal one draw of the whole, and every step is
    row-wise (or an exact min/max), so the arrays are bit for bit those of a one-shot build.

    Args:
        num_samples: rows n ≥ 1.
        num_features: feature columns ≥ 1.
        num_classes: classes C ≥ 2.
        num_sites: sites ≥ 1 (each row's site is drawn uniformly).
        heterogeneity: scale ≥ 0 of the sites' model and input differences (0: one model).
        seed: seed ≥ 0 of the generator.
    """
    n, f, c = num_samples, num_features, num_classes
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(f, c))
    sites = rng.integers(0, num_sites, size=n)
    shift = rng.normal(scale=heterogeneity, size=(num_sites, f))
    w_site = w[None] + heterogeneity * rng.normal(size=(num_sites, f, c))
    # The raw inputs come next in the stream; a copy of the generator replays them later.
    replay = np.random.Generator(np.random.PCG64())
    replay.bit_generator.state = rng.bit_generator.state
    step = max(1, min(SYNTHETIC_CHUNK_ROWS, SYNTHETIC_CHUNK_BYTES // (8 * f * c)))
    blocks = [slice(i, min(i + step, n)) for i in range(0, n, step)]

    logits = np.empty((n, c))
    lo = np.full(f, np.inf)
    hi = np.full(f, -np.inf)
    for rows in blocks:
        site = sites[rows]
        x = rng.normal(size=(rows.stop - rows.start, f)) + shift[site]
        logits[rows] = np.einsum("nf,nfc->nc", x, w_site[site])
        np.minimum(lo, x.min(axis=0), out=lo)
        np.maximum(hi, x.max(axis=0), out=hi)
    y = np.empty(n, dtype=np.int64)
    for rows in blocks:
        y[rows] = (logits[rows] + rng.gumbel(size=(rows.stop - rows.start, c))).argmax(axis=1)
    del logits

    out = np.empty((n, f), dtype=np.float32)
    for rows in blocks:
        x = replay.normal(size=(rows.stop - rows.start, f)) + shift[sites[rows]]
        out[rows] = _scale_columns(x, lo, hi).astype(np.float32)
    return ArrayDataset(
        "synthetic", out, y, num_classes, sites.astype(f"<U{len(str(num_sites - 1))}")
    )  # (no wider than the ids)
