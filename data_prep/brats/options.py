"""The options of a BraTS conversion (what ``python -m data_prep.brats`` takes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BratsOptions:
    """Conversion options.

    Attributes:
        layout: ``auto``, one of :data:`~data_prep.brats.layouts.LAYOUTS` or of
            :data:`~data_prep.brats.layouts.LAYOUT_ALIASES`.
        labels: ``whole`` (binary whole-tumour mask) or ``regions`` (WT, TC, ET channels).
        sites: FeTS partitioning CSV (``Subject_ID,Partition_ID``) giving each patient's site;
            a relative path is tried against the current folder, ``--root`` and the layout
            folder. ``None`` records no site.
        negative_share: Target share of tumour-free patches among a patient's patches (2-D
            only: a 3-D run cuts one crop per patient).
        seed: Seed of the tumour-free slice draw (2-D only).
        quiet: Suppress the progress bar and messages.
        dims: 2 for axial slice patches, 3 for one crop per patient.
        patch: Side length in voxels (even, >= 8); ``None`` means
            :data:`data_prep.brats.patches.PATCH`.
    """

    layout: str = "auto"
    labels: str = "whole"
    sites: Path | None = None
    negative_share: float = 0.2
    seed: int = 0
    quiet: bool = True
    dims: int = 2
    patch: int | None = None
