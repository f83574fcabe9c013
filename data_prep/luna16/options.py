"""The options of a LUNA16 conversion (what ``python -m data_prep.luna16`` takes)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_prep.luna16.patches import HU_WINDOW


@dataclass(frozen=True)
class LunaOptions:
    """Conversion options.

    Attributes:
        candidates: Candidate CSV; ``None`` looks for ``candidates_V2.csv`` then
            ``candidates.csv`` under the raw folder.
        delta: Dataset-level negative:positive ratio; ``None`` keeps every candidate.
        seed: Seed of the negative subsampling.
        window: HU window ``(low, high)`` mapped to [0, 1].
        quiet: Suppress the progress bar and messages.
        dims: 2 for axial patches, 3 for cubes centred on the candidate voxel.
        patch: Side length in voxels (even, >= 8); ``None`` means :data:`PATCH`.
    """

    candidates: Path | None = None
    delta: float | None = None
    seed: int = 0
    window: tuple[float, float] = HU_WINDOW
    quiet: bool = True
    dims: int = 2
    patch: int | None = None
