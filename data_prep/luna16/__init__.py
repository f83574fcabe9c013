"""Convert the official LUNA16 release into 32x32 axial candidate patches (or 3-D cubes).

pFedNet (§VI-A, "Luna16") classifies lung-nodule candidates from 32x32 patches and varies
the dataset-level negative:positive ratio δ ∈ {1, 2, 4, 7} (§VI-B1). This module turns the raw
release into arrays that the training code can load without SimpleITK:

* ``images.npy``   float32 ``(N, 1, 32, 32)``, HU clipped to a window and scaled to [0, 1]
  (``--dims 3``: ``(N, 1, P, P, P)`` cubes, axes z, y, x; ``--patch P`` sets the side);
* ``labels.npy``   int64 ``(N,)``, the candidate's ``class`` column;
* ``manifest.csv`` one row per patch (series UID, world mm, voxel index, label, and the
  ``subset0``-``subset9`` folder of the volume: the release's ten folds, which
  ``partition=natural`` uses as sites);
* ``summary.json`` counts, skipped files with reasons, window and δ;
* ``skipped.csv``  what was skipped and why (only when something was).

Bad inputs (an unreadable or truncated volume, a header that disagrees with its data, a
malformed candidate row, a series UID without a volume or one that looks like a path, a header
whose ``ElementDataFile`` really lies outside ``--root``) are skipped with one line naming the
file, row and column; the run stops with one ``error:`` line and exit status 1 only when
nothing usable remains. Headers are parsed here, strictly, before ITK sees them
(:func:`data_prep.mhd.mhd_problem`).

Usage::

    python -m data_prep.luna16 --root RAW --out OUT [--candidates candidates_V2.csv]
        [--delta 1] [--seed 0] [--hu-window -1000 400] [--dims 2|3] [--patch 32]

It never partitions the data into clients: that is the job of ``fedexp.data``.

Modules: :mod:`~data_prep.luna16.volumes` (finding and reading the CT volumes),
:mod:`~data_prep.luna16.candidates` (the candidate list and δ),
:mod:`~data_prep.luna16.patches` (one study's patches), :mod:`~data_prep.luna16.conversion`
(the whole run), :mod:`~data_prep.luna16.outputs` (the files written),
:mod:`~data_prep.luna16.cli`.
"""

from data_prep.luna16.cli import build_parser
from data_prep.luna16.cli import main
from data_prep.luna16.conversion import convert
from data_prep.luna16.options import LunaOptions
from data_prep.luna16.outputs import MANIFEST_COLUMNS
from data_prep.luna16.outputs import OUTPUT_NAMES
from data_prep.luna16.patches import HU_WINDOW
from data_prep.luna16.patches import PATCH

__all__ = [
    "HU_WINDOW",
    "MANIFEST_COLUMNS",
    "OUTPUT_NAMES",
    "PATCH",
    "LunaOptions",
    "build_parser",
    "convert",
    "main",
]
