"""The imaging data sets of pFedNet §VI-A, loaded from the arrays ``data_prep`` writes.

* LUNA16 lung-nodule candidates: 32x32 CT patches, label 1 = nodule (classification).
* BraTS brain tumours (any release 2017-2023, FeTS 2022, MSD Task01): 64x64 four-channel
  MRI patches (FLAIR, T1, T1ce, T2) with their tumour mask (segmentation).

The raw releases are converted once by ``python -m data_prep.luna16`` / ``data_prep.brats``
(``docs/data_prep.md``); these loaders only read ``images.npy``, ``labels.npy`` or
``masks.npy`` and ``manifest.csv``. ``groups`` (what ``partition=natural`` deals out, one
client per group) is a manifest column chosen by ``dataset.group``: by default the site,
i.e. LUNA16's ``subset0``-``subset9`` folder or the BraTS site recorded with
``data_prep.brats --sites partitioning_1.csv`` (FeTS), else the CT series or the patient;
either way one patient's patches never straddle clients.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import numpy as np
import pandas as pd

from fedexp.config.ranges import NonNegativeInt
from fedexp.config.ranges import Positive
from fedexp.config.ranges import Range
from fedexp.data.dataset import ArrayDataset
from fedexp.errors import DataError

#: Mask channels of ``data_prep.brats --labels regions`` (BraTS evaluation regions).
BRATS_REGIONS = ("whole", "core", "enhancing")


def _folder(path: str, what: str, command: str) -> Path:
    """The prepared folder, or a DataError saying which ``data_prep`` command makes it."""
    folder = Path(path).expanduser()
    if not (folder / "images.npy").is_file():
        state = "does not exist" if not folder.exists() else "has no images.npy"
        raise DataError(
            f"dataset.path={path!r}: {folder} {state}; the prepared {what} arrays are made by "
            f"`{command.format(out=folder)}` (see docs/data_prep.md)"
        )
    return folder


def _load(folder: Path, name: str, command: str) -> np.ndarray:
    file = folder / name
    if not file.is_file():
        raise DataError(
            f"{file} is missing; run `{command.format(out=folder)}` again (see docs/data_prep.md)"
        )
    try:
        return np.load(file, mmap_mode="r")
    except (OSError, ValueError) as exc:
        raise DataError(f"{file}: cannot be read as a NumPy array ({exc})") from None


def _manifest(folder: Path, column: str, n: int) -> np.ndarray:
    file = folder / "manifest.csv"
    if not file.is_file():
        raise DataError(f"{file} is missing (expected one row per patch with a '{column}' column)")
    frame = pd.read_csv(file, dtype={column: str}, keep_default_na=False)
    if column not in frame.columns:
        raise DataError(f"{file}: no '{column}' column (columns are: {', '.join(frame.columns)})")
    if len(frame) != n:
        raise DataError(f"{file}: {len(frame)} rows for {n} patches in images.npy")
    return frame[column].to_numpy(dtype=str)


#: ``dataset.group`` values per data set: ``auto`` takes the first column when the manifest
#: has it (for every row), else the second.
GROUP_COLUMNS = {"luna16": ("subset", "seriesuid"), "brats": ("site", "patient")}


def _groups(folder: Path, dataset: str, group: str, n: int, command: str) -> np.ndarray:
    """The manifest column that ``partition=natural`` deals out, one value per patch.

    Args:
        folder: Prepared folder.
        dataset: ``luna16`` or ``brats`` (see :data:`GROUP_COLUMNS`).
        group: ``auto`` or one of the data set's group columns.
        n: Number of patches.
        command: The ``data_prep`` command that writes the folder (for messages).

    Raises:
        DataError: An unknown ``group``, or a group column the manifest lacks or leaves empty.
    """
    site, fallback = GROUP_COLUMNS[dataset]
    if group not in ("auto", site, fallback):
        raise DataError(f"dataset.group={group!r}: expected auto, {site} or {fallback}")
    file = folder / "manifest.csv"
    header = pd.read_csv(file, nrows=0).columns if file.is_file() else []
    if group == "auto":
        if site in header:
            values = _manifest(folder, site, n)
            if (values != "").all():
                return values
        return _manifest(folder, fallback, n)
    if group == site and site not in header:
        hint = " --sites partitioning_1.csv" if dataset == "brats" else ""
        raise DataError(
            f"dataset.group={group}: {file} has no '{site}' column; prepare the data again with "
            f"`{command.format(out=folder)}{hint}` (see docs/data_prep.md)"
        )
    values = _manifest(folder, group, n)
    empty = np.flatnonzero(values == "")
    if len(empty):
        raise DataError(
            f"dataset.group={group}: {file}: line {int(empty[0]) + 2} has no {group} "
            f"({len(empty)} of {n} rows; expected every patch to have one)"
        )
    return values


def _check_shape(folder: Path, name: str, array: np.ndarray, expected: str, ok: bool) -> None:
    if not ok:
        raise DataError(
            f"{folder / name}: shape {list(array.shape)} and dtype {array.dtype}, expected "
            f"{expected}"
        )


#: ``dataset.dims`` values: 2-D patches (the papers') or 3-D cubes (``data_prep --dims 3``).
DIMS = (2, 3)

#: ``dataset.dims``: 2 or 3 spatial axes.
Dims = Annotated[int, Range(ge=2, le=3, note="2: patches, 3: cubes")]


def _check_dims(folder: Path, x: np.ndarray, dims: int, channels: str, command: str) -> None:
    """``images.npy`` holds ``dims``-D patches (``(N, C, H, W)`` or ``(N, C, D, H, W)``).

    Raises:
        DataError: ``dims`` is not 2 or 3, or the prepared patches have the other number of
            spatial axes (naming the ``data_prep`` command that writes the asked ones).
    """
    if dims not in DIMS:
        raise DataError(f"dataset.dims={dims}: expected 2 (patches) or 3 (cubes)")
    held = x.ndim - 2
    if held != dims:
        what = {2: "2-D patches", 3: "3-D cubes"}.get(held, f"{held}-D arrays")
        flag = " --dims 3" if dims == 3 else ""
        raise DataError(
            f"dataset.dims={dims}: {folder / 'images.npy'} holds {what} (shape "
            f"{list(x.shape)}, expected {channels}); prepare {dims}-D ones with "
            f"`{command.format(out=folder)}{flag}` into another folder (see docs/data_prep.md)"
        )


def _check_not_empty(folder: Path, x: np.ndarray, command: str) -> None:
    """A prepared folder without patches is an empty data set: say so, naming the file."""
    if len(x) == 0:
        raise DataError(
            f"{folder / 'images.npy'}: holds no samples (0 patches), the data set is empty; "
            f"prepare it again with `{command.format(out=folder)}` from a raw folder with cases"
        )


def luna16(
    path: str,
    delta: Positive | None = None,
    seed: NonNegativeInt = 0,
    group: str = "auto",
    dims: Dims = 2,
) -> ArrayDataset:
    """LUNA16 nodule candidates as 32x32 patches (pFedNet §VI-A, lung nodule classification).

    Args:
        path: folder written by ``python -m data_prep.luna16 --root RAW --out PATH``.
        delta: optional dataset-level label imbalance δ = n_negative / n_positive (pFedNet
            §VI-B uses δ ∈ {1, 2, 4, 7}): all nodules are kept and ``round(δ·n_pos)``
            non-nodules are drawn at random, the same rule as ``data_prep.luna16 --delta``;
            null keeps every prepared candidate. (Per-client imbalance is
            ``partition=label_imbalance``.)
        seed: seed of the δ draw, ≥ 0.
        group: what ``partition=natural`` deals out: ``subset`` (the release's
            ``subset0``-``subset9`` folder of the volume, ten sites), ``seriesuid`` (the CT
            series) or ``auto``: ``subset`` when the manifest records one for every patch
            (folders prepared before subsets were recorded have none), else ``seriesuid``.
        dims: 2 (axial patches, the paper's) or 3 (cubes around the candidates, prepared with
            ``data_prep.luna16 --dims 3``).

    Returns:
        Classification data: x float32 (n, 1, 32, 32) in [0, 1] ((n, 1, P, P, P) cubes with
        ``dims=3``), y int64 (n,) with 1 = nodule, groups = the subset or CT series UID of each
        candidate.

    Raises:
        DataError: the prepared arrays are missing, inconsistent or hold no patch, δ is not a
            positive finite number, δ is set but there is no nodule to balance against, or
            ``group`` names a column the manifest lacks.
    """
    command = "python -m data_prep.luna16 --root RAW --out {out}"
    folder = _folder(path, "LUNA16", command)
    x = _load(folder, "images.npy", command)
    y = _load(folder, "labels.npy", command)
    expected = "(N, 1, H, W)" if dims == 2 else "(N, 1, D, H, W)"
    _check_dims(folder, x, dims, expected, command)
    _check_shape(folder, "images.npy", x, f"{expected} float32", x.shape[1] == 1)
    _check_not_empty(folder, x, command)
    _check_shape(folder, "labels.npy", y, f"({len(x)},) integers", y.shape == (len(x),))
    groups = _groups(folder, "luna16", group, len(x), command)
    keep = np.arange(len(x))
    if seed < 0:
        raise DataError(f"dataset.seed={seed}: expected ≥ 0")
    if delta is not None:
        if not (math.isfinite(delta) and delta > 0):
            raise DataError(f"dataset.delta={delta}: expected δ > 0 (or null for all candidates)")
        pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y != 1)
        if len(pos) == 0:
            raise DataError(
                f"dataset.delta={delta}: {folder / 'labels.npy'} holds no nodule (label 1), so "
                "δ = n_negative / n_positive would keep no sample; set dataset.delta=null"
            )
        n_neg = min(len(neg), int(round(delta * len(pos))))
        drawn = np.random.default_rng([seed, 31]).choice(neg, size=n_neg, replace=False)
        keep = np.sort(np.concatenate([pos, drawn]))
    return ArrayDataset(
        "luna16",
        np.asarray(x[keep], dtype=np.float32),
        np.asarray(y[keep], dtype=np.int64),
        2,
        groups[keep],
        task="classification",
    )


def brats(path: str, region: str = "whole", group: str = "auto", dims: Dims = 2) -> ArrayDataset:
    """BraTS tumour patches, 64x64 with four MRI channels (pFedNet §VI-A, segmentation).

    Args:
        path: folder written by ``python -m data_prep.brats --root RAW --out PATH``.
        region: the target: ``whole`` tumour (the default and the only one of ``--labels
            whole`` masks), ``core`` or ``enhancing`` (binary, from ``--labels regions``
            masks), or ``all``: the three regions at once as three target channels (the
            BraTS challenges' scoring, ``--labels regions`` masks), trained with one sigmoid
            channel each and scored by Dice per region (:class:`~fedexp.models.task.RegionsTask`).
        group: what ``partition=natural`` deals out: ``site`` (recorded by ``data_prep.brats
            --sites partitioning_1.csv``, FeTS's institutions), ``patient``, or ``auto``:
            ``site`` when the manifest has one, else ``patient``.
        dims: 2 (axial slice patches, the paper's) or 3 (one crop around each patient's
            tumour, prepared with ``data_prep.brats --dims 3``).

    Returns:
        Segmentation data: x float32 (n, 4, 64, 64), channels FLAIR, T1, T1ce, T2 (z-scored per
        patient); y int64 (n, 64, 64) in {0, 1} (``region=all``: (n, 3, 64, 64), whole tumour,
        tumour core, enhancing tumour; task ``regions``); with ``dims=3`` one more spatial axis
        on x and y (cubes); groups = the site or patient of each patch.
        Its ``labels`` (one per sample, for partitions and the stratified 80/20 split) say
        whether the patch holds tumour.

    Raises:
        DataError: the prepared arrays are missing, inconsistent or hold no patch, the
            region is not in the masks, or ``group`` names a column the manifest lacks.
    """
    command = "python -m data_prep.brats --root RAW --out {out}"
    folder = _folder(path, "BraTS", command)
    x = _load(folder, "images.npy", command)
    masks = _load(folder, "masks.npy", command)
    expected = "(N, 4, H, W)" if dims == 2 else "(N, 4, D, H, W)"
    _check_dims(folder, x, dims, expected, command)
    _check_shape(folder, "images.npy", x, f"{expected} float32", x.shape[1] == 4)
    _check_not_empty(folder, x, command)
    if region not in (*BRATS_REGIONS, "all"):
        raise DataError(
            f"dataset.region={region!r}: expected one of {', '.join(BRATS_REGIONS)} or all"
        )
    whole_only = masks.ndim == x.ndim - 1  # (N, *spatial), not (N, 3, *spatial)
    if whole_only and region != "whole":
        raise DataError(
            f"dataset.region={region!r}: {folder / 'masks.npy'} holds whole-tumour masks only; "
            f"prepare with `python -m data_prep.brats --root RAW --out {folder} --labels regions`"
        )
    shape_ok = masks.shape[0] == len(x) and (
        (whole_only and masks.shape[1:] == x.shape[2:])
        or (masks.ndim == x.ndim and masks.shape[1] == 3 and masks.shape[2:] == x.shape[2:])
    )
    spatial = ", ".join(str(s) for s in x.shape[2:])
    said = f"({len(x)}, {spatial}) or ({len(x)}, 3, {spatial})"
    _check_shape(folder, "masks.npy", masks, said, shape_ok)
    groups = _groups(folder, "brats", group, len(x), command)
    if region == "all":
        y, classes, task = masks, len(BRATS_REGIONS), "regions"
    else:
        y = masks if whole_only else masks[:, BRATS_REGIONS.index(region)]
        classes, task = 2, "segmentation"
    return ArrayDataset(
        "brats",
        np.array(x, dtype=np.float32),
        (np.asarray(y) > 0).astype(np.int64),
        classes,
        groups,
        task=task,
    )
