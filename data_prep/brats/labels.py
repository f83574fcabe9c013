"""Segmentation labels of the BraTS releases and the regions derived from them.

Each release's labels are mapped to the common BraTS convention (0, 1, 2, 4); the three
evaluation regions are whole tumour, tumour core and enhancing tumour.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from data_prep.common import StudyError

REGIONS = ("whole_tumour", "tumour_core", "enhancing_tumour")
# Common label convention = BraTS 2017-2021: 0 background, 1 necrotic/non-enhancing core,
# 2 edema, 4 enhancing. Label 3 (non-enhancing core in BraTS 2012-2016) is folded into 1 in
# the HGG/LGG layout; BraTS 2023's 3 is the enhancing tumour (-> 4); MSD's order differs.
_BRATS_LABELS = {0: 0, 1: 1, 2: 2, 3: 1, 4: 4}
_BRATS2018_LABELS = {0: 0, 1: 1, 2: 2, 4: 4}
_BRATS2023_LABELS = {0: 0, 1: 1, 2: 2, 3: 4}
_MSD_LABELS = {0: 0, 1: 2, 2: 1, 3: 4}
LABEL_TABLES = {
    "brats2017": _BRATS_LABELS,
    "brats2020": _BRATS2018_LABELS,
    "brats2021": _BRATS2018_LABELS,
    "brats2023": _BRATS2023_LABELS,
    "msd": _MSD_LABELS,
}
"""Per layout: release label -> common label."""


def to_common_labels(seg: np.ndarray, layout: str, path: Path) -> np.ndarray:
    """Map a release's labels to the common BraTS convention {0, 1, 2, 4}.

    * BraTS 2017-2019 (``brats2017``): 1 necrotic/non-enhancing core, 2 edema, 4 enhancing
      (3, the non-enhancing core of BraTS 2012-2016, -> 1);
    * BraTS 2020, 2021, FeTS 2022: 1, 2, 4 as they are;
    * BraTS 2023: 1 necrotic core (NETC), 2 edema (SNFH), 3 enhancing -> 4;
    * MSD: 1 edema -> 2, 2 non-enhancing -> 1, 3 enhancing -> 4.

    Raises:
        StudyError: If the segmentation holds other values.
    """
    table = LABEL_TABLES[layout]
    values = np.rint(seg).astype(np.int64)
    unknown = sorted(set(np.unique(values).tolist()) - set(table))
    if unknown or not np.allclose(values, seg):
        expected = ", ".join(str(v) for v in sorted(table))
        raise StudyError(
            path,
            f"unexpected label values {unknown or 'non-integer'} (expected {expected} "
            f"for the {layout} layout)",
        )
    lut = np.zeros(max(table) + 1, np.uint8)
    for source, target in table.items():
        lut[source] = target
    return lut[values]


def regions_from_labels(seg: np.ndarray) -> np.ndarray:
    """BraTS evaluation regions as uint8 channels: whole tumour, tumour core, enhancing."""
    whole = seg > 0
    core = (seg == 1) | (seg == 4)
    enhancing = seg == 4
    return np.stack([whole, core, enhancing]).astype(np.uint8)
