"""Cutting one patient's samples.

2-D axial patches (every tumour slice plus a share of tumour-free ones) or one 3-D crop
centred on the tumour, each with its three mask regions.
"""

from __future__ import annotations

import zlib

import numpy as np

from data_prep.brats.labels import regions_from_labels
from data_prep.geometry import extract_patch
from data_prep.geometry import extract_window

PATCH = 64
"""Default patch side length in voxels (paper §VI-A), for 2-D patches and 3-D crops."""


def _centre(mask2d: np.ndarray) -> tuple[int, int]:
    """Centre of the bounding box of a 2-D mask, as (row, col)."""
    rows = np.flatnonzero(mask2d.any(axis=1))
    cols = np.flatnonzero(mask2d.any(axis=0))
    return (rows[0] + rows[-1] + 1) // 2, (cols[0] + cols[-1] + 1) // 2


def bbox_centre(mask: np.ndarray) -> tuple[int, ...]:
    """Centre of the bounding box of a non-empty N-D mask, one index per axis.

    Per axis ``(first + last + 1) // 2`` of the indices holding a voxel of the mask, as
    :func:`_centre` does per slice.
    """
    centre = []
    for axis in range(mask.ndim):
        others = tuple(a for a in range(mask.ndim) if a != axis)
        hits = np.flatnonzero(mask.any(axis=others))
        centre.append(int(hits[0] + hits[-1] + 1) // 2)
    return tuple(centre)


def n_negatives(n_tumour: int, share: float) -> int:
    """Number of tumour-free patches so that they are ``share`` of a patient's patches."""
    return int(round(n_tumour * share / (1.0 - share)))


def choose_slices(
    images: np.ndarray, regions: np.ndarray, share: float, seed: int, patch: int = PATCH
) -> list[tuple[int, int, int, bool]]:
    """Pick the axial slices and patch corners of one patient.

    Every slice with tumour gives a patch centred on the bounding box of the whole tumour in
    that slice. ``n_negatives(n_tumour, share)`` tumour-free slices that contain brain are
    drawn at random, each centred on a random brain voxel. The draw depends only on ``seed``
    and the segmentation's content, so the same study gives the same patches in any layout
    or orientation.

    Args:
        images: ``(4, X, Y, Z)``.
        regions: ``(3, X, Y, Z)``; channel 0 is the whole tumour.
        share: Target share of tumour-free patches, in [0, 1).
        seed: Random seed.
        patch: Patch side length (the corner is the centre minus half of it).

    Returns:
        ``(slice, row0, col0, has_tumour)`` tuples sorted by slice.
    """
    half = patch // 2
    whole = regions[0]
    picks = []
    for k in np.flatnonzero(whole.any(axis=(0, 1))):
        row, col = _centre(whole[:, :, k])
        picks.append((int(k), row - half, col - half, True))
    brain = (images != 0).any(axis=0)
    free = np.flatnonzero(brain.any(axis=(0, 1)) & ~whole.any(axis=(0, 1)))
    rng = np.random.default_rng([seed, zlib.crc32(np.ascontiguousarray(whole).tobytes())])
    n_free = min(len(free), n_negatives(len(picks), share))
    for k in sorted(rng.choice(free, size=n_free, replace=False).tolist()):
        rows, cols = np.nonzero(brain[:, :, k])
        i = rng.integers(len(rows))
        picks.append((int(k), int(rows[i]) - half, int(cols[i]) - half, False))
    return sorted(picks)


def patient_patches(
    images: np.ndarray, labels: np.ndarray, share: float, seed: int, patch: int = PATCH
) -> dict[str, np.ndarray]:
    """Cut the 2-D slice patches of one patient (zero-padded where they leave the slice).

    Args:
        images: Canonical z-scored images ``(4, X, Y, Z)``.
        labels: Common-convention labels ``(X, Y, Z)``.
        share: Target share of tumour-free patches.
        seed: Random seed.
        patch: Patch side length (default 64).

    Returns:
        ``images`` float32 ``(n, 4, patch, patch)``, ``regions`` uint8 ``(n, 3, patch, patch)``
        and the int64 vectors ``slice``, ``row0``, ``col0``, ``has_tumour``.
    """
    regions = regions_from_labels(labels)
    picks = choose_slices(images, regions, share, seed, patch)
    out_images = np.zeros((len(picks), 4, patch, patch), np.float32)
    out_regions = np.zeros((len(picks), 3, patch, patch), np.uint8)
    for n, (k, row0, col0, _) in enumerate(picks):
        out_images[n] = extract_patch(images[:, :, :, k], row0, col0, patch, 0.0)
        out_regions[n] = extract_patch(regions[:, :, :, k], row0, col0, patch, 0)
    table = np.array([p[:3] + (int(p[3]),) for p in picks], np.int64).reshape(-1, 4)
    return _patient_record(out_images, out_regions, table)


def _patient_record(
    images: np.ndarray, regions: np.ndarray, table: np.ndarray
) -> dict[str, np.ndarray]:
    """A patient's cache entry: patches, regions and the manifest's int64 vectors.

    ``table`` rows are ``(slice, row0, col0, has_tumour)``, one per patch.
    """
    return {
        "images": images,
        "regions": regions,
        "slice": table[:, 0],
        "row0": table[:, 1],
        "col0": table[:, 2],
        "has_tumour": table[:, 3],
    }


def crop_start(images: np.ndarray, regions: np.ndarray, patch: int) -> tuple[tuple[int, ...], bool]:
    """First voxel (along X, Y, Z) of a patient's 3-D crop, and whether it is tumour-centred.

    The crop is centred on the centre of the 3-D bounding box of the whole tumour; a patient
    without tumour is centred on the bounding box of the brain (non-zero voxels of any
    channel).

    Args:
        images: ``(4, X, Y, Z)``.
        regions: ``(3, X, Y, Z)``; channel 0 is the whole tumour.
        patch: Crop side length.

    Returns:
        ``((x0, y0, z0), has_tumour)``; the corner is ``()`` when the patient has neither
        tumour nor brain (no crop).
    """
    whole = regions[0] != 0
    has_tumour = bool(whole.any())
    mask = whole if has_tumour else (images != 0).any(axis=0)
    if not mask.any():
        return (), False
    return tuple(c - patch // 2 for c in bbox_centre(mask)), has_tumour


def patient_crop(
    images: np.ndarray, labels: np.ndarray, patch: int = PATCH
) -> dict[str, np.ndarray]:
    """Cut the one 3-D crop of a patient (zero-padded where it leaves the volume).

    Args:
        images: Canonical z-scored images ``(4, X, Y, Z)``.
        labels: Common-convention labels ``(X, Y, Z)``.
        patch: Crop side length (default 64).

    Returns:
        ``images`` float32 ``(n, 4, patch, patch, patch)``, ``regions`` uint8
        ``(n, 3, patch, patch, patch)`` (axes X, Y, Z) and the int64 vectors ``slice`` (first
        Z index), ``row0`` (first X index), ``col0`` (first Y index) and ``has_tumour``, with
        ``n`` = 1, or 0 for a volume without tumour and brain.
    """
    regions = regions_from_labels(labels)
    start, has_tumour = crop_start(images, regions, patch)
    n = 1 if start else 0
    out_images = np.zeros((n, 4, patch, patch, patch), np.float32)
    out_regions = np.zeros((n, 3, patch, patch, patch), np.uint8)
    if n:
        out_images[0] = extract_window(images, start, patch, 0.0)
        out_regions[0] = extract_window(regions, start, patch, 0)
    x0, y0, z0 = start if n else (0, 0, 0)
    table = np.array([[z0, x0, y0, int(has_tumour)]][:n], np.int64).reshape(-1, 4)
    return _patient_record(out_images, out_regions, table)
