"""Reading one patient's volumes.

NIfTI files brought to the closest canonical (RAS) orientation, checked to share one voxel
grid, z-scored per modality over the brain; labels made common (:mod:`data_prep.brats.labels`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np

from data_prep.brats.labels import to_common_labels
from data_prep.brats.layouts import ODD_SEG_NAMES
from data_prep.brats.layouts import Case
from data_prep.common import StudyError
from data_prep.common import one_line


def load_canonical(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Load a NIfTI file in the closest canonical (RAS) orientation.

    Args:
        path: ``.nii`` or ``.nii.gz`` file.

    Returns:
        The float32 data (axes R, A, S[, channel]) and its canonical affine.

    Raises:
        StudyError: If the file is missing or cannot be decoded.
    """
    if not path.is_file():
        raise StudyError(path, "missing file")
    try:
        image = nib.as_closest_canonical(nib.load(str(path)))
        return image.get_fdata(dtype=np.float32), image.affine
    except Exception as exc:  # nibabel raises many types for corrupt files
        raise StudyError(path, f"unreadable NIfTI: {one_line(exc)}") from exc


def zscore_brain(volume: np.ndarray) -> np.ndarray:
    """Z-score one modality over its non-zero (brain) voxels; background stays 0.

    Args:
        volume: One modality, any shape.

    Returns:
        float32 array of the same shape.
    """
    brain = volume != 0
    out = np.zeros(volume.shape, np.float32)
    if not brain.any():
        return out
    values = volume[brain].astype(np.float64)
    std = values.std()
    out[brain] = (values - values.mean()) / (std if std > 0 else 1.0)
    return out


def _check_same_grid(path: Path, shape: Sequence[int], affine: np.ndarray, ref: tuple) -> None:
    ref_shape, ref_affine, ref_path = ref
    if tuple(shape[:3]) != tuple(ref_shape[:3]):
        raise StudyError(
            path,
            f"shape mismatch: {tuple(shape[:3])} but {ref_path.name} has {tuple(ref_shape[:3])} "
            "(expected every file of a patient on one voxel grid)",
        )
    if not np.allclose(affine, ref_affine, atol=1e-3):
        raise StudyError(
            path,
            f"affine mismatch: differs from {ref_path.name}'s "
            "(expected every file of a patient on one voxel grid)",
        )


def load_case(case: Case, msd_order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Load a patient as canonical, z-scored images and common-convention labels.

    Args:
        case: The patient's files (any layout; channels come out FLAIR, T1, T1ce, T2).
        msd_order: Channel permutation for MSD 4-D images (see
            :func:`~data_prep.brats.layouts.msd_channel_order`).

    Returns:
        Images float32 ``(4, X, Y, Z)`` (FLAIR, T1, T1ce, T2) and labels uint8 ``(X, Y, Z)``.

    Raises:
        StudyError: On a missing, corrupt or inconsistent file.
    """
    odd = ODD_SEG_NAMES.get(case.patient)
    if odd and case.layout != "msd" and not case.seg.is_file():
        raise StudyError(
            case.seg, f"missing file (expected the segmentation {case.seg.name} or {odd}.nii[.gz])"
        )
    seg_raw, seg_affine = load_canonical(case.seg)
    if seg_raw.ndim != 3:
        raise StudyError(case.seg, f"expected a 3-D segmentation, got shape {seg_raw.shape}")
    ref = (seg_raw.shape, seg_affine, case.seg)
    if case.layout == "msd":
        data, affine = load_canonical(case.images[0])
        if data.ndim != 4 or data.shape[3] < 4:
            raise StudyError(case.images[0], f"expected 4-D data with 4 channels, got {data.shape}")
        _check_same_grid(case.images[0], data.shape, affine, ref)
        channels = [data[..., i] for i in msd_order]
    else:
        channels = []
        for path in case.images:
            data, affine = load_canonical(path)
            if data.ndim != 3:
                raise StudyError(path, f"expected a 3-D volume, got shape {data.shape}")
            _check_same_grid(path, data.shape, affine, ref)
            channels.append(data)
    images = np.stack([zscore_brain(c) for c in channels])
    return images, to_common_labels(seg_raw, case.layout, case.seg)
