"""Raw medical-imaging releases -> compact arrays for ``fedexp`` (never partitions data).

Sub-modules, each a standalone command (``python -m data_prep.<name> --help``):

* :mod:`data_prep.luna16`    LUNA16 ``subset*/<uid>.mhd`` + candidates -> 32x32 patches;
* :mod:`data_prep.brats`     BraTS 2017-2023 / FeTS 2022 / MSD Task01 NIfTI -> 64x64
  patches + tumour masks (``--sites``: FeTS partitioning CSV -> one site per patient);
* :mod:`data_prep.synthetic` small synthetic studies in exactly those raw layouts.

The patch sizes and the dataset-level ratio δ follow pFedNet §VI-A/§VI-B.
"""

__all__ = ["brats", "luna16", "synthetic"]
