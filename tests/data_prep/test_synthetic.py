"""The synthetic generator writes the official layouts, deterministically and quickly."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import SimpleITK as sitk

from data_prep import synthetic
from data_prep.synthetic.brats import BRATS_MODALITIES
from data_prep.synthetic.brats import to_msd_labels
from data_prep.synthetic.luna16 import LUNA_SIZE_XYZ
from data_prep.synthetic.luna16 import direction_matrix
from data_prep.synthetic.mri import MRI_SHAPE


def test_luna16_layout_and_geometry(tmp_path: Path) -> None:
    studies = synthetic.write_luna16(tmp_path, n_studies=4, seed=0, direction="oblique")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "annotations.csv",
        "candidates.csv",
        "candidates_V2.csv",
        "subset0",
        "subset1",
    ]
    for study in studies:
        assert study.path.parent.name in ("subset0", "subset1")
        assert study.path.with_suffix(".raw").is_file()
        header = study.path.read_text()
        assert "ElementDataFile = " + study.path.with_suffix(".raw").name in header
        image = sitk.ReadImage(str(study.path))
        assert image.GetSize() == LUNA_SIZE_XYZ
        assert len(set(image.GetSpacing())) == 3 and np.abs(image.GetOrigin()).min() > 100
        assert not np.allclose(np.reshape(image.GetDirection(), (3, 3)), np.eye(3))
        volume = sitk.GetArrayFromImage(image)  # (z, y, x)
        for nodule in study.nodules:
            x, y, z = image.TransformPhysicalPointToIndex(tuple(nodule))
            assert volume[z, y, x] > 0  # nodule HU, lung is about -850
        assert volume.min() < -700
    candidates = pd.read_csv(tmp_path / "candidates.csv")
    assert list(candidates.columns) == ["seriesuid", "coordX", "coordY", "coordZ", "class"]
    assert candidates["class"].sum() == sum(len(s.nodules) for s in studies)
    annotations = pd.read_csv(tmp_path / "annotations.csv")
    assert list(annotations.columns) == ["seriesuid", "coordX", "coordY", "coordZ", "diameter_mm"]
    assert len(annotations) == candidates["class"].sum()


@pytest.mark.parametrize("kind", ["identity", "flipped", "permuted", "oblique"])
def test_direction_matrices_are_orthonormal(kind: str) -> None:
    matrix = direction_matrix(kind)
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(3), atol=1e-12)


def test_luna16_is_deterministic(tmp_path: Path) -> None:
    synthetic.write_luna16(tmp_path / "a", n_studies=2, seed=9)
    synthetic.write_luna16(tmp_path / "b", n_studies=2, seed=9)
    synthetic.write_luna16(tmp_path / "c", n_studies=2, seed=10)
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.*"))
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()
    assert (tmp_path / "a" / "candidates.csv").read_bytes() != (
        tmp_path / "c" / "candidates.csv"
    ).read_bytes()


def test_generators_write_small_studies(tmp_path: Path) -> None:
    """Tests and the demo make studies by the dozen: each stays small (a few hundred KB), so
    that writing them is quick on any machine (a property of what is written; their speed is
    no test's business: timing asserts fail on a loaded machine)."""
    synthetic.write_luna16(tmp_path / "luna", n_studies=4)
    studies = synthetic.make_mri_studies(n_studies=3)
    synthetic.write_brats(tmp_path / "b17", "brats2017", studies=studies)
    synthetic.write_brats(tmp_path / "msd", "msd", studies=studies)
    for name, count in (("luna", 4), ("b17", 3), ("msd", 3)):
        written = sum(p.stat().st_size for p in (tmp_path / name).rglob("*") if p.is_file())
        assert 0 < written < count * 400_000, (name, written)


def test_brats_layouts_hold_the_same_study(tmp_path: Path) -> None:
    studies = synthetic.make_mri_studies(n_studies=2, seed=4)
    synthetic.write_brats(tmp_path / "b17", "brats2017", studies=studies)
    synthetic.write_brats(tmp_path / "msd", "msd", studies=studies)
    assert (tmp_path / "msd" / "dataset.json").is_file()
    for study in studies:
        assert set(np.unique(study.seg)) == {0, 1, 2, 4}
        folder = tmp_path / "b17" / study.grade / study.brats_name
        for channel, modality in enumerate(BRATS_MODALITIES):
            image = nib.load(folder / f"{study.brats_name}_{modality}.nii.gz")
            assert nib.aff2axcodes(image.affine) == ("L", "P", "S")
            canonical = nib.as_closest_canonical(image).get_fdata()
            np.testing.assert_array_equal(canonical, study.images[..., channel])
        seg = nib.as_closest_canonical(nib.load(folder / f"{study.brats_name}_seg.nii.gz"))
        np.testing.assert_array_equal(seg.get_fdata(), study.seg)
        np.testing.assert_allclose(seg.affine, study.affine, atol=1e-4)
        msd = nib.load(tmp_path / "msd" / "imagesTr" / f"{study.msd_name}.nii.gz")
        assert msd.shape == (*MRI_SHAPE, 4)
        np.testing.assert_array_equal(msd.get_fdata(), study.images)
        labels = nib.load(tmp_path / "msd" / "labelsTr" / f"{study.msd_name}.nii.gz").get_fdata()
        np.testing.assert_array_equal(labels, to_msd_labels(study.seg))
        assert set(np.unique(labels)) == {0, 1, 2, 3}


def test_mri_is_deterministic() -> None:
    a, b = synthetic.make_mri_studies(2, seed=1), synthetic.make_mri_studies(2, seed=1)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.images, y.images)
        np.testing.assert_array_equal(x.seg, y.seg)
    other = synthetic.make_mri_studies(1, seed=2)[0]
    assert not np.array_equal(other.images, a[0].images)


def test_cli(tmp_path: Path) -> None:
    assert synthetic.main(["luna16", "--out", str(tmp_path / "l"), "--n-studies", "2"]) == 0
    assert len(list((tmp_path / "l").rglob("*.mhd"))) == 2
    assert (
        synthetic.main(
            ["brats", "--out", str(tmp_path / "b"), "--n-studies", "2", "--layout", "both"]
        )
        == 0
    )
    assert len(list((tmp_path / "b" / "brats2017").rglob("*_seg.nii.gz"))) == 2
    assert len(list((tmp_path / "b" / "msd" / "imagesTr").glob("*.nii.gz"))) == 2
    with pytest.raises(SystemExit):
        synthetic.main(["brats", "--out", str(tmp_path / "x"), "--n-studies", "0"])


def test_luna16_subsets_are_the_natural_sites_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--subsets K`` spreads the studies over subset0 to subset{K-1}, as the release's ten."""
    studies = synthetic.write_luna16(tmp_path / "ten", n_studies=12, seed=0, subsets=10)
    folders = sorted(p.name for p in (tmp_path / "ten").iterdir() if p.is_dir())
    assert folders == [f"subset{k}" for k in range(10)]
    assert [s.path.parent.name for s in studies] == [f"subset{i % 10}" for i in range(12)]
    with pytest.raises(ValueError, match="subsets=11"):
        synthetic.write_luna16(tmp_path / "eleven", n_studies=2, subsets=11)
    with pytest.raises(SystemExit):
        synthetic.main(["luna16", "--out", str(tmp_path / "none"), "--subsets", "0"])
    assert "--subsets: invalid choice: 0" in capsys.readouterr().err
    assert not (tmp_path / "eleven").exists() and not (tmp_path / "none").exists()
