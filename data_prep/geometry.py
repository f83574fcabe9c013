"""A patch's geometry, shared by the converters.

2-D slice patches or 3-D cubes, their side (``--dims``, ``--patch``: parsed, checked,
recorded) and windows cut from a volume or a plane, padded where they leave it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np

DIMS = (2, 3)
"""Patch dimensionalities the converters write: 2-D slice patches or 3-D cubes."""
MIN_PATCH = 8
"""Smallest accepted patch side (voxels); sides must also be even, so the centre is defined."""


def _patch_error(value: object) -> SystemExit:
    """The one-line error of a bad ``--patch`` value."""
    return SystemExit(f"error: --patch {value}: expected an even number of voxels >= {MIN_PATCH}")


def is_patch_size(patch: object) -> bool:
    """Whether ``patch`` can be a patch side: an even integer >= :data:`MIN_PATCH` (not a bool)."""
    if isinstance(patch, bool) or not isinstance(patch, int | np.integer):
        return False
    return patch >= MIN_PATCH and patch % 2 == 0


def parse_patch(text: str | None) -> int | None:
    """Read ``--patch N`` from the command line (``None`` when the option was not given).

    Raises:
        SystemExit: One line naming ``--patch`` when ``text`` is not an even integer >= 8.
    """
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or not is_patch_size(value):
        raise _patch_error(text)
    return value


def add_geometry_options(parser: argparse.ArgumentParser, cubes: str, default: int) -> None:
    """Add ``--dims {2,3}`` and ``--patch N`` (read with :func:`parse_patch`) to a converter.

    Args:
        parser: the converter's parser.
        cubes: what ``--dims 3`` cuts, for the help text.
        default: the converter's default patch side.
    """
    parser.add_argument(
        "--dims",
        type=int,
        choices=list(DIMS),
        default=2,
        help=f"2: axial slice patches (default); 3: {cubes}",
    )
    parser.add_argument(
        "--patch",
        default=None,
        metavar="N",
        help=f"patch side in voxels, even and >= {MIN_PATCH} (default {default})",
    )


def resolve_geometry(dims: object, patch: object, default: int) -> tuple[int, int]:
    """Check ``dims``/``patch`` options and return ``(dims, side)`` with the default filled in.

    Args:
        dims: 2 (slice patches) or 3 (cubes).
        patch: Patch side in voxels, or ``None`` for ``default``.
        default: The converter's default side.

    Returns:
        The dimensionality and the side actually used.

    Raises:
        SystemExit: One line naming ``--dims`` or ``--patch`` on a bad value.
    """
    if isinstance(dims, bool) or dims not in DIMS:
        raise SystemExit(f"error: --dims {dims}: expected 2 or 3")
    side = default if patch is None else patch
    if not is_patch_size(side):
        raise _patch_error(patch)
    return int(dims), int(side)  # type: ignore[call-overload]


def geometry_params(dims: int, patch: int, default: int) -> dict[str, int]:
    """Cache parameters for a patch geometry: empty for the default 2-D one, else dims and side.

    Leaving the default out keeps the fingerprints (hence the resume caches) of output folders
    written before 3-D patches existed valid, while a 3-D or other-size run never reuses them.
    """
    if (dims, patch) == (2, default):
        return {}
    return {"dims": dims, "patch": patch}


def extract_window(array: np.ndarray, starts: Sequence[int], size: int, fill: float) -> np.ndarray:
    """Cut a window of side ``size`` over the last ``len(starts)`` axes of ``array``, padding.

    Leading axes (e.g. channels) are kept whole. Parts of the window that fall outside
    ``array`` are filled with ``fill``.

    Args:
        array: Array whose last ``len(starts)`` axes are spatial.
        starts: First index of the window along each of those axes (may be negative or beyond
            the array).
        size: Window side length, the same on every windowed axis.
        fill: Padding value.

    Returns:
        Shape ``(*array.shape[:-len(starts)], size, ..., size)``, same dtype as ``array``.
    """
    n = len(starts)
    lead = array.shape[: array.ndim - n]
    window = np.full((*lead, *([size] * n)), fill, dtype=array.dtype)
    source, target = [], []
    for start, extent in zip(starts, array.shape[array.ndim - n :], strict=True):
        low, high = max(int(start), 0), min(int(start) + size, extent)
        if low >= high:
            return window
        source.append(slice(low, high))
        target.append(slice(low - int(start), high - int(start)))
    window[(..., *target)] = array[(..., *source)]
    return window


def extract_patch(plane: np.ndarray, row0: int, col0: int, size: int, fill: float) -> np.ndarray:
    """Cut a ``size``×``size`` window out of a 2-D (or channels-first 3-D) array, padding.

    Parts of the window that fall outside ``plane`` are filled with ``fill``
    (:func:`extract_window` over the last two axes).

    Args:
        plane: Array of shape ``(H, W)`` or ``(C, H, W)``.
        row0: Top row of the window (may be negative).
        col0: Left column of the window (may be negative).
        size: Window side length.
        fill: Padding value.

    Returns:
        The window, shape ``(size, size)`` or ``(C, size, size)``, same dtype as ``plane``.
    """
    return extract_window(plane, (row0, col0), size, fill)
