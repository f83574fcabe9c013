"""Small synthetic studies written in the *official* LUNA16, BraTS 2017-2023 and MSD file layouts.

Nobody can download LUNA16 or BraTS on the development machines, so the converters of
pFedNet's §VI-A datasets are tested on these look-alikes. They are deterministic for a seed,
take well under a second for a handful of studies, and record where every nodule/tumour was
planted so tests can check that the converters find it.

Usage::

    python -m data_prep.synthetic luna16 --out DIR [--n-studies K] [--seed S]
        [--direction identity|flipped|permuted|oblique]
    python -m data_prep.synthetic brats --out DIR [--n-studies K] [--seed S]
        [--layout brats2017|brats2018|brats2019|brats2020|brats2021|fets2022|brats2023|msd|both]
        [--shape X Y Z]

Modules: :mod:`~data_prep.synthetic.luna16` (CT studies, LUNA16 layout),
:mod:`~data_prep.synthetic.mri` (brain MRI studies), :mod:`~data_prep.synthetic.brats` (their
BraTS, FeTS and MSD layouts), :mod:`~data_prep.synthetic.cli`.
"""

from data_prep.synthetic.brats import BRATS_RELEASES
from data_prep.synthetic.brats import write_brats
from data_prep.synthetic.cli import build_parser
from data_prep.synthetic.cli import main
from data_prep.synthetic.luna16 import LunaStudy
from data_prep.synthetic.luna16 import write_luna16
from data_prep.synthetic.mri import MRIStudy
from data_prep.synthetic.mri import make_mri_studies

__all__ = [
    "BRATS_RELEASES",
    "LunaStudy",
    "MRIStudy",
    "build_parser",
    "main",
    "make_mri_studies",
    "write_brats",
    "write_luna16",
]
