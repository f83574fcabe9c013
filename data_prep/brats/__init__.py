"""Convert BraTS 2017-2023, FeTS 2022 or MSD Task01 releases into 64x64 axial tumour patches.

With ``--dims 3`` it cuts one 3-D crop per patient instead; ``--patch N`` sets the side.

pFedNet (§VI-A, "BraTS2017") segments gliomas from 4-channel 64x64 MRI patches with a U-Net
(§VI-B2). This module reads every BraTS training release as downloaded (``--layout auto``
finds which one ``--root`` holds):

* ``brats2017`` (BraTS 2017, 2018, 2019):
  ``{HGG,LGG}/<id>/<id>_{flair,t1,t1ce,t2,seg}.nii.gz``, labels 0, 1, 2, 4;
* ``brats2020``: ``BraTS20_Training_NNN/BraTS20_Training_NNN_{flair,t1,t1ce,t2,seg}.nii.gz``
  (``.nii`` in the Kaggle copy); the release names case 355's segmentation
  ``W39_1998.09.19_Segm.nii``, which is accepted for that case; ``name_mapping.csv`` and
  ``survival_info.csv`` next to the case folders are ignored;
* ``brats2021`` (BraTS 2021 and FeTS 2022): ``<id>/<id>_{flair,t1,t1ce,t2,seg}.nii.gz``
  (``BraTS2021_NNNNN``, ``FeTS2022_NNNNN``), labels 0, 1, 2, 4;
* ``brats2023`` (BraTS 2023 GLI): ``BraTS-GLI-NNNNN-NNN/BraTS-GLI-NNNNN-NNN-{t2f,t1n,t1c,t2w,seg}
  .nii.gz``, labels 0, 1, 2, 3 (3 = enhancing tumour);
* ``msd`` (MSD Task01): ``imagesTr/BRATS_XXX.nii.gz`` (4-D: FLAIR, T1w, t1gd, T2w) +
  ``labelsTr/BRATS_XXX.nii.gz``, labels 1 edema, 2 non-enhancing, 3 enhancing.

Every release gives the same channels (FLAIR, T1, T1ce, T2 = 2023's t2f, t1n, t1c, t2w) and
the same labels (BraTS 2017-2021's 0, 1, 2, 4), hence the same regions. It brings every volume
to the closest canonical (RAS) orientation, z-scores each modality over its non-zero (brain)
voxels and cuts one patch per tumour-bearing axial slice plus a share of tumour-free slices.
With ``--sites CSV`` (FeTS's ``partitioning_1.csv`` or ``partitioning_2.csv``:
``Subject_ID,Partition_ID``) each patient's site is recorded in the manifest, so that
``partition=natural`` makes one client per site. Output in ``OUT``:

* ``images.npy``   float32 ``(N, 4, 64, 64)``, channels FLAIR, T1, T1ce, T2;
* ``masks.npy``    uint8 ``(N, 64, 64)`` whole tumour, or ``(N, 3, 64, 64)`` with
  ``--labels regions`` (whole tumour, tumour core, enhancing tumour);
* ``manifest.csv`` patient, slice, grade, row0, col0, has_tumour (and site with ``--sites``);
* with ``--dims 3``: one ``P``³ crop per patient centred on the whole tumour's 3-D bounding
  box (the brain's when there is no tumour), ``images.npy`` ``(N, 4, P, P, P)``, masks
  ``(N, P, P, P)`` or ``(N, 3, P, P, P)``, axes X, Y, Z of the canonical arrays; the manifest's
  ``row0``, ``col0``, ``slice`` are then the crop's first index along X, Y, Z;
* ``summary.json`` counts, skipped files with reasons and the options used;
* ``skipped.csv``  what was skipped and why (only when something was).

A patient with a missing, unreadable or inconsistent file (modalities on different grids,
unknown label values) is skipped with one line naming the file and what was expected; the
run stops with one ``error:`` line and exit status 1 only when no patient is usable, or when
a patient has no row in the ``--sites`` file.

Usage::

    python -m data_prep.brats --root RAW --out OUT
        [--layout auto|brats2017|brats2018|brats2019|brats2020|brats2021|fets2022|brats2023|msd]
        [--sites partitioning_1.csv] [--labels whole|regions] [--negative-share 0.2] [--seed 0]
        [--dims 2|3] [--patch 64]

Modules: :mod:`~data_prep.brats.layouts` (releases and their files),
:mod:`~data_prep.brats.volumes` (reading a patient), :mod:`~data_prep.brats.labels` (labels and
regions), :mod:`~data_prep.brats.patches` (patches and crops), :mod:`~data_prep.brats.sites`
(FeTS sites), :mod:`~data_prep.brats.conversion` (the whole run),
:mod:`~data_prep.brats.outputs` (the files written), :mod:`~data_prep.brats.cli`.
"""

from data_prep.brats.cli import build_parser
from data_prep.brats.cli import main
from data_prep.brats.conversion import convert
from data_prep.brats.layouts import Case
from data_prep.brats.layouts import detect_layout
from data_prep.brats.layouts import find_cases
from data_prep.brats.options import BratsOptions
from data_prep.brats.outputs import MANIFEST_COLUMNS
from data_prep.brats.outputs import OUTPUT_NAMES
from data_prep.brats.patches import PATCH
from data_prep.brats.volumes import load_case

__all__ = [
    "MANIFEST_COLUMNS",
    "OUTPUT_NAMES",
    "PATCH",
    "BratsOptions",
    "Case",
    "build_parser",
    "convert",
    "detect_layout",
    "find_cases",
    "load_case",
    "main",
]
