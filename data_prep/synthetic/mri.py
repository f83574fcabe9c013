"""Synthetic brain MRI studies.

Four modalities (FLAIR, T1, T1ce, T2) of an ellipsoid brain holding a tumour (edema,
enhancing rim, necrotic core) with its BraTS labels, in canonical (RAS) voxel order; each
study knows its subject id in every BraTS release.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MRI_SHAPE = (80, 80, 24)
"""Canonical (RAS) voxel grid of a synthetic MRI."""
MRI_AFFINE = np.array(
    [[0.94, 0.0, 0.0, -37.5], [0.0, 1.06, 0.0, -42.0], [0.0, 0.0, 2.2, -25.0], [0, 0, 0, 1.0]]
)
"""Canonical RAS affine (anisotropic voxels, shifted origin)."""


_BRAIN_INTENSITY = (300.0, 500.0, 450.0, 400.0)
_LABEL_INTENSITY = {  # label -> intensity per modality (FLAIR, T1, T1ce, T2)
    2: (700.0, 420.0, 430.0, 800.0),
    4: (600.0, 450.0, 1000.0, 650.0),
    1: (500.0, 200.0, 250.0, 900.0),
}


@dataclass(frozen=True)
class MRIStudy:
    """One synthetic brain MRI in canonical (RAS) voxel order.

    Attributes:
        index: Study number (names the files).
        grade: ``HGG`` or ``LGG`` (BraTS2017 folder).
        images: int16 ``(X, Y, Z, 4)``, channels FLAIR, T1, T1ce, T2; zero outside the brain.
        seg: uint8 ``(X, Y, Z)`` in BraTS labels {0, 1, 2, 4}.
        affine: 4x4 RAS affine.
        centre: Voxel (i, j, k) of the tumour centre.
    """

    index: int
    grade: str
    images: np.ndarray
    seg: np.ndarray
    affine: np.ndarray
    centre: tuple[int, int, int]

    @property
    def brats_name(self) -> str:
        """Patient folder name in the BraTS2017 layout."""
        return f"Brats17_SYN_{self.index:03d}_1"

    @property
    def msd_name(self) -> str:
        """Case name in the MSD layout (file stem)."""
        return f"BRATS_{self.index + 1:03d}"

    def release_name(self, release: str) -> str:
        """Subject id of this study in a BraTS release, spelled as the release spells it.

        Args:
            release: One of :data:`~data_prep.synthetic.brats.BRATS_RELEASES` but ``msd``.

        Returns:
            E.g. ``Brats18_TCIA01_101_1``, ``BraTS20_Training_001``, ``BraTS2021_00000``,
            ``FeTS2022_00000`` or ``BraTS-GLI-00000-000``.
        """
        names = {
            "brats2017": self.brats_name,
            "brats2018": f"Brats18_TCIA01_{101 + self.index}_1",
            "brats2019": f"BraTS19_TCIA01_{101 + self.index}_1",
            "brats2020": f"BraTS20_Training_{self.index + 1:03d}",
            "brats2021": f"BraTS2021_{self.index:05d}",
            "fets2022": f"FeTS2022_{self.index:05d}",
            "brats2023": f"BraTS-GLI-{self.index:05d}-000",
        }
        if release not in names:
            raise ValueError(f"unknown BraTS release {release!r}")
        return names[release]


def _ellipsoid(shape: Sequence[int], centre: Sequence[float], radii: Sequence[float]) -> np.ndarray:
    axes = [(np.arange(n) - c) / r for n, c, r in zip(shape, centre, radii, strict=True)]
    grid = np.meshgrid(*axes, indexing="ij")
    return sum(g**2 for g in grid) <= 1.0


def make_mri(
    index: int,
    rng: np.random.Generator,
    shape: Sequence[int] = MRI_SHAPE,
    centre: Sequence[int] | None = None,
) -> MRIStudy:
    """Build a 4-modality brain MRI with a tumour (edema, enhancing rim, necrotic core).

    Args:
        index: Study number.
        rng: Random generator (tumour position, size and noise).
        shape: Canonical voxel grid.
        centre: Tumour centre voxel; random inside the brain when ``None``.

    Returns:
        The study.
    """
    shape = tuple(int(n) for n in shape)
    mid = [n / 2 - 0.5 for n in shape]
    brain = _ellipsoid(shape, mid, [0.42 * shape[0], 0.45 * shape[1], 0.45 * shape[2]])
    if centre is None:
        centre = [
            int(round(m + rng.uniform(-0.15, 0.15) * n)) for m, n in zip(mid, shape, strict=True)
        ]
    centre = tuple(int(c) for c in centre)
    scale = rng.uniform(0.8, 1.2)
    seg = np.zeros(shape, np.uint8)
    for label, radii in ((2, (10, 9, 4)), (4, (6, 6, 2.5)), (1, (3.5, 3.5, 1.5))):
        seg[_ellipsoid(shape, centre, [scale * r for r in radii]) & brain] = label
    images = np.zeros((*shape, 4), np.float64)
    for channel in range(4):
        values = np.full(shape, _BRAIN_INTENSITY[channel])
        for label, intensity in _LABEL_INTENSITY.items():
            values[seg == label] = intensity[channel]
        noisy = values + rng.normal(0.0, 20.0, size=shape)
        images[..., channel] = np.where(brain, np.maximum(noisy, 1.0), 0.0)
    grade = "HGG" if index % 2 == 0 else "LGG"
    return MRIStudy(index, grade, np.round(images).astype(np.int16), seg, MRI_AFFINE.copy(), centre)


def make_mri_studies(
    n_studies: int = 3, seed: int = 0, shape: Sequence[int] = MRI_SHAPE
) -> list[MRIStudy]:
    """Build ``n_studies`` deterministic MRI studies (alternating HGG/LGG) on a ``shape`` grid."""
    rng = np.random.default_rng(seed)
    return [make_mri(i, rng, shape) for i in range(n_studies)]
