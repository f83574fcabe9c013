"""BraTS2017 / MSD converter on synthetic releases in both official layouts."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from data_prep import brats
from data_prep import synthetic
from data_prep.brats import BratsOptions
from data_prep.brats import conversion
from data_prep.brats.patches import n_negatives
from data_prep.synthetic.brats import write_msd_study
from data_prep.synthetic.mri import MRI_AFFINE
from data_prep.synthetic.mri import make_mri


def _load(out: Path) -> tuple[np.ndarray, np.ndarray, pd.DataFrame, dict]:
    images = np.load(out / "images.npy")
    masks = np.load(out / "masks.npy")
    manifest = pd.read_csv(out / "manifest.csv")
    summary = json.loads((out / "summary.json").read_text())
    return images, masks, manifest, summary


def _zscore(volume: np.ndarray) -> np.ndarray:
    brain = volume != 0
    values = volume[brain].astype(np.float64)
    out = np.zeros(volume.shape, np.float64)
    out[brain] = (values - values.mean()) / values.std()
    return out


@pytest.mark.parametrize("labels", ["whole", "regions"])
def test_both_layouts_give_same_arrays(tmp_path: Path, mri_studies: list, labels: str) -> None:
    synthetic.write_brats(tmp_path / "b17", "brats2017", studies=mri_studies)
    synthetic.write_brats(tmp_path / "msd", "msd", studies=mri_studies)
    options = BratsOptions(labels=labels)
    s17 = brats.convert(tmp_path / "b17", tmp_path / "o17", options)
    smsd = brats.convert(tmp_path / "msd", tmp_path / "omsd", options)
    assert (s17["layout"], smsd["layout"]) == ("brats2017", "msd")
    img17, mask17, man17, _ = _load(tmp_path / "o17")
    imgmsd, maskmsd, manmsd, _ = _load(tmp_path / "omsd")
    np.testing.assert_allclose(img17, imgmsd, atol=1e-6)
    np.testing.assert_array_equal(mask17, maskmsd)
    cols = ["slice", "row0", "col0", "has_tumour"]
    pd.testing.assert_frame_equal(man17[cols], manmsd[cols])
    assert set(man17["grade"]) == {"HGG", "LGG"} and set(manmsd["grade"]) == {"unknown"}


def test_output_format_and_regions(tmp_path: Path, mri_studies: list) -> None:
    synthetic.write_brats(tmp_path / "raw", "msd", studies=mri_studies)
    assert (
        brats.main(["--root", str(tmp_path / "raw"), "--out", str(tmp_path / "w"), "--quiet"]) == 0
    )
    brats.convert(tmp_path / "raw", tmp_path / "r", BratsOptions(labels="regions"))
    images, whole, manifest, summary = _load(tmp_path / "w")
    _, regions, _, summary_r = _load(tmp_path / "r")
    n = len(manifest)
    assert images.dtype == np.float32 and images.shape == (n, 4, 64, 64)
    assert whole.dtype == np.uint8 and whole.shape == (n, 64, 64)
    assert regions.dtype == np.uint8 and regions.shape == (n, 3, 64, 64)
    assert list(manifest.columns[:5]) == ["patient", "slice", "grade", "row0", "col0"]
    np.testing.assert_array_equal(regions[:, 0], whole)
    assert np.all(regions[:, 1] <= regions[:, 0]) and np.all(regions[:, 2] <= regions[:, 1])
    assert summary["channels"] == ["flair", "t1", "t1ce", "t2"]
    assert summary_r["mask_channels"] == ["whole_tumour", "tumour_core", "enhancing_tumour"]
    # Every tumour voxel of every tumour slice fits in the patch here: totals must match.
    for k, study in enumerate(mri_studies):
        rows = manifest.index[manifest["patient"] == study.msd_name]
        seg = study.seg
        expected = [(seg > 0).sum(), np.isin(seg, [1, 4]).sum(), (seg == 4).sum()]
        assert regions[rows].sum(axis=(0, 2, 3)).tolist() == expected, k


@pytest.mark.parametrize("axcodes", [("L", "P", "S"), ("A", "L", "I"), ("S", "R", "P")])
def test_orientation_is_canonicalised(tmp_path: Path, axcodes: tuple[str, str, str]) -> None:
    study = make_mri(0, np.random.default_rng(8), centre=(30, 47, 11))
    synthetic.write_brats(tmp_path / "ras", "msd", studies=[study], axcodes=("R", "A", "S"))
    synthetic.write_brats(tmp_path / "odd", "msd", studies=[study], axcodes=axcodes)
    header = nib.load(tmp_path / "odd" / "imagesTr" / f"{study.msd_name}.nii.gz")
    assert nib.aff2axcodes(header.affine) == axcodes
    brats.convert(tmp_path / "ras", tmp_path / "o_ras", BratsOptions(labels="regions"))
    brats.convert(tmp_path / "odd", tmp_path / "o_odd", BratsOptions(labels="regions"))
    images, masks, manifest, _ = _load(tmp_path / "o_odd")
    ref_images, ref_masks, ref_manifest, _ = _load(tmp_path / "o_ras")
    np.testing.assert_allclose(images, ref_images, atol=1e-6)
    np.testing.assert_array_equal(masks, ref_masks)
    pd.testing.assert_frame_equal(manifest, ref_manifest)
    # The centre voxel (necrotic core: WT and TC, not ET) sits at the patch centre.
    i, j, k = study.centre
    row = manifest.index[(manifest["slice"] == k)].item()
    assert (
        abs(manifest.at[row, "row0"] + 32 - i) <= 1 and abs(manifest.at[row, "col0"] + 32 - j) <= 1
    )
    di, dj = i - manifest.at[row, "row0"], j - manifest.at[row, "col0"]
    assert masks[row, :, di, dj].tolist() == [1, 1, 0]
    flair = _zscore(study.images[..., 0].astype(np.float64))
    assert images[row, 0, di, dj] == pytest.approx(flair[i, j, k], abs=1e-5)


def test_tumour_near_edge_gives_padded_patch(tmp_path: Path) -> None:
    study = make_mri(0, np.random.default_rng(1), centre=(12, 40, 12))
    synthetic.write_brats(tmp_path / "raw", "brats2017", studies=[study])
    brats.convert(tmp_path / "raw", tmp_path / "out", BratsOptions(negative_share=0.0))
    images, masks, manifest, _ = _load(tmp_path / "out")
    assert (manifest["row0"] < 0).all()
    for n, row0 in enumerate(manifest["row0"]):
        assert np.all(images[n, :, :-row0] == 0) and np.all(masks[n, :-row0] == 0)
        assert masks[n].any()


@pytest.mark.parametrize("share", [0.0, 0.2, 0.5])
def test_negative_share(tmp_path: Path, mri_studies: list, share: float) -> None:
    synthetic.write_brats(tmp_path / "raw", "brats2017", studies=mri_studies)
    summary = brats.convert(tmp_path / "raw", tmp_path / "out", BratsOptions(negative_share=share))
    _, masks, manifest, _ = _load(tmp_path / "out")
    for _, rows in manifest.groupby("patient"):
        n_tumour = int(rows["has_tumour"].sum())
        assert len(rows) - n_tumour == n_negatives(n_tumour, share)
    negatives = manifest["has_tumour"].to_numpy() == 0
    assert not masks[negatives].any() and masks[~negatives].any(axis=(1, 2)).all()
    assert summary["n_negative"] == int(negatives.sum())
    if share > 0:
        assert abs(summary["n_negative"] / summary["n_samples"] - share) < 0.05


def test_missing_and_corrupt_files_are_skipped(tmp_path: Path) -> None:
    studies = synthetic.make_mri_studies(n_studies=5, seed=2)
    root = tmp_path / "raw"
    synthetic.write_brats(root, "brats2017", studies=studies)
    folders = {s.index: root / s.grade / s.brats_name for s in studies}
    missing = folders[0] / f"{studies[0].brats_name}_t1ce.nii.gz"
    missing.unlink()
    garbage = folders[1] / f"{studies[1].brats_name}_seg.nii.gz"
    garbage.write_bytes(b"not a nifti at all" * 10)
    truncated = folders[2] / f"{studies[2].brats_name}_flair.nii.gz"
    truncated.write_bytes(truncated.read_bytes()[:2000])
    summary = brats.convert(root, tmp_path / "out")
    assert summary["n_skipped"] == 3 and summary["n_patients"] == 2
    paths = {s["path"]: s["reason"] for s in summary["skipped"]}
    assert paths[str(missing)] == "missing file"
    assert paths[str(garbage)].startswith("unreadable NIfTI")
    assert paths[str(truncated)].startswith("unreadable NIfTI")
    manifest = _load(tmp_path / "out")[2]
    assert set(manifest["patient"]) == {studies[3].brats_name, studies[4].brats_name}


def test_msd_missing_label_and_bad_shape(tmp_path: Path, mri_studies: list) -> None:
    root = tmp_path / "raw"
    synthetic.write_brats(root, "msd", studies=mri_studies)
    (root / "labelsTr" / f"{mri_studies[0].msd_name}.nii.gz").unlink()
    image_3d = nib.Nifti1Image(np.zeros((80, 80, 24), np.float32), MRI_AFFINE)
    nib.save(image_3d, root / "imagesTr" / f"{mri_studies[1].msd_name}.nii.gz")
    (root / "imagesTr" / f"._{mri_studies[2].msd_name}.nii.gz").write_bytes(b"macOS junk")
    summary = brats.convert(root, tmp_path / "out")
    assert summary["n_skipped"] == 2 and summary["n_patients"] == 1
    reasons = sorted(s["reason"] for s in summary["skipped"])
    assert reasons[0].startswith("expected 4-D data") and reasons[1] == "missing file"


def test_msd_channel_order_from_dataset_json(tmp_path: Path, mri_studies: list) -> None:
    synthetic.write_brats(tmp_path / "ref", "msd", studies=mri_studies)
    root = tmp_path / "perm"
    order = [3, 0, 2, 1]  # file channel c holds our modality order[c]
    for study in mri_studies:
        permuted = synthetic.MRIStudy(
            study.index,
            study.grade,
            study.images[..., order],
            study.seg,
            study.affine,
            study.centre,
        )
        write_msd_study(root, permuted)
    names = ["FLAIR", "T1w", "t1gd", "T2w"]
    meta = {"modality": {str(c): names[m] for c, m in enumerate(order)}}
    (root / "dataset.json").write_text(json.dumps(meta))
    brats.convert(tmp_path / "ref", tmp_path / "o_ref")
    brats.convert(root, tmp_path / "o_perm")
    np.testing.assert_array_equal(
        np.load(tmp_path / "o_ref" / "images.npy"), np.load(tmp_path / "o_perm" / "images.npy")
    )


def test_resume_skips_converted_patients(
    tmp_path: Path, mri_studies: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, out = tmp_path / "raw", tmp_path / "out"
    synthetic.write_brats(root, "brats2017", studies=mri_studies)
    first = brats.convert(root, out)
    before = {n: (out / n).read_bytes() for n in ("images.npy", "masks.npy", "manifest.csv")}

    def fail(*args: object) -> None:
        raise AssertionError("re-read a converted patient")

    monkeypatch.setattr(conversion, "load_case", fail)
    second = brats.convert(root, out)
    assert first["studies_converted"] == 3 and second["studies_converted"] == 0
    assert second["studies_reused"] == 3
    for name, data in before.items():
        assert (out / name).read_bytes() == data
    whole = np.load(out / "masks.npy")
    regions = brats.convert(root, out, BratsOptions(labels="regions"))  # masks only: reused
    assert regions["studies_reused"] == 3
    np.testing.assert_array_equal(np.load(out / "masks.npy")[:, 0], whole)
    monkeypatch.undo()
    reshuffled = brats.convert(root, out, BratsOptions(seed=1))
    assert reshuffled["studies_converted"] == 3


def test_layout_detection_and_errors(tmp_path: Path, mri_studies: list, tree) -> None:
    parent = tmp_path / "download"
    synthetic.write_brats(parent / "Task01_BrainTumour", "msd", studies=mri_studies[:1])
    snapshot = tree(parent)
    summary = brats.convert(parent, tmp_path / "out")
    assert summary["layout"] == "msd" and summary["layout_folder"].endswith("Task01_BrainTumour")
    assert tree(parent) == snapshot
    assert not list((tmp_path / "out").rglob(".partial-*"))
    with pytest.raises(SystemExit, match="HGG/ or LGG/"):
        brats.convert(parent, tmp_path / "o2", BratsOptions(layout="brats2017"))
    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit, match=str(missing)):
        brats.main(["--root", str(missing), "--out", str(tmp_path / "o3")])
    with pytest.raises(SystemExit, match="negative-share"):
        brats.convert(parent, tmp_path / "o4", BratsOptions(negative_share=1.0))
    with pytest.raises(SystemExit, match="inside the raw folder"):
        brats.convert(parent, parent / "out")
