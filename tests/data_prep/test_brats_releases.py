"""BraTS 2018-2023 and FeTS 2022 as downloaded, and sites as clients (issue 42, items 1-2).

Every release is written by ``data_prep.synthetic`` in its exact folder layout, file names
and label values, on tiny 16x16x6 volumes, from the same studies: ``--layout auto`` must find
each one and give the arrays of the BraTS 2017 layout. FeTS partitioning CSVs
(``Subject_ID,Partition_ID``) record sites; LUNA16's ``subset*`` folders are its sites.
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from data_prep import brats
from data_prep import luna16
from data_prep import synthetic
from data_prep.brats import BratsOptions
from data_prep.synthetic.brats import to_2023_labels
from data_prep.synthetic.mri import make_mri
from fedexp.data import partitions as P
from fedexp.data.imaging import brats as load_brats
from fedexp.data.imaging import luna16 as load_luna16
from fedexp.engine.runner import build_engine
from fedexp.errors import DataError
from helpers import compose_config

SHAPE = (16, 16, 6)

#: Release -> (folder the download unpacks to, what --layout auto must report).
RELEASES = {
    "brats2018": ("MICCAI_BraTS_2018_Data_Training", "brats2017"),
    "brats2019": ("MICCAI_BraTS_2019_Data_Training", "brats2017"),
    "brats2020": ("MICCAI_BraTS2020_TrainingData", "brats2020"),
    "brats2021": ("RSNA_ASNR_MICCAI_BraTS2021_TrainingData_16July2021", "brats2021"),
    "fets2022": ("MICCAI_FeTS2022_TrainingData", "brats2021"),
    "brats2023": ("ASNR-MICCAI-BraTS2023-GLI-Challenge-TrainingData", "brats2023"),
}


@pytest.fixture(scope="module")
def studies() -> list[synthetic.MRIStudy]:
    return synthetic.make_mri_studies(n_studies=3, seed=5, shape=SHAPE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, studies: list) -> dict[str, np.ndarray]:
    """The BraTS 2017 layout's arrays of the same studies (regions masks)."""
    tmp = tmp_path_factory.mktemp("ref")
    synthetic.write_brats(tmp / "raw", "brats2017", studies=studies)
    brats.convert(tmp / "raw", tmp / "out", BratsOptions(labels="regions"))
    return _arrays(tmp / "out")


def _arrays(out: Path) -> dict[str, np.ndarray]:
    manifest = pd.read_csv(out / "manifest.csv")
    return {
        "images": np.load(out / "images.npy"),
        "masks": np.load(out / "masks.npy"),
        "table": manifest[["slice", "row0", "col0", "has_tumour"]].to_numpy(),
    }


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """Run ``data_prep.brats`` as the interpreter would: (exit status, stderr)."""
    try:
        code = brats.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    if isinstance(code, str):
        err, code = err + code + "\n", 1
    assert "Traceback" not in err
    return int(code or 0), err


def _args(root: Path, out: Path, *extra: str) -> list[str]:
    return ["--root", str(root), "--out", str(out), "--quiet", *extra]


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("release", list(RELEASES))
def test_every_release_is_detected_and_gives_the_2017_arrays(
    tmp_path: Path, studies: list, reference: dict, release: str
) -> None:
    folder, layout = RELEASES[release]
    download = tmp_path / "download"  # the folder the archive was unpacked into
    synthetic.write_brats(download / folder, release, studies=studies)
    summary = brats.convert(download, tmp_path / "out", BratsOptions(labels="regions"))
    assert summary["layout"] == layout and Path(summary["layout_folder"]).name == folder
    assert summary["n_patients"] == 3 and summary["n_skipped"] == 0
    assert summary["channels"] == ["flair", "t1", "t1ce", "t2"]
    got = _arrays(tmp_path / "out")
    np.testing.assert_allclose(got["images"], reference["images"], atol=1e-6)
    np.testing.assert_array_equal(got["masks"], reference["masks"])
    np.testing.assert_array_equal(got["table"], reference["table"])
    manifest = pd.read_csv(tmp_path / "out" / "manifest.csv")
    assert manifest["patient"].unique().tolist() == [s.release_name(release) for s in studies]


def test_release_file_names_and_labels_are_the_official_ones(tmp_path: Path, studies: list) -> None:
    s = studies[0]
    synthetic.write_brats(tmp_path / "b19", "brats2019", studies=studies)
    name = "BraTS19_TCIA01_101_1"
    assert sorted(p.name for p in (tmp_path / "b19" / "HGG" / name).iterdir()) == sorted(
        f"{name}_{kind}.nii.gz" for kind in ("flair", "t1", "t1ce", "t2", "seg")
    )
    synthetic.write_brats(tmp_path / "b21", "brats2021", studies=studies)
    seg21 = nib.load(tmp_path / "b21" / "BraTS2021_00000" / "BraTS2021_00000_seg.nii.gz")
    assert set(np.unique(np.asarray(seg21.dataobj)).tolist()) == {0, 1, 2, 4}
    synthetic.write_brats(tmp_path / "b23", "brats2023", studies=studies)
    folder = tmp_path / "b23" / "BraTS-GLI-00000-000"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"BraTS-GLI-00000-000-{kind}.nii.gz" for kind in ("t2f", "t1n", "t1c", "t2w", "seg")
    )
    seg23 = np.asarray(nib.load(folder / "BraTS-GLI-00000-000-seg.nii.gz").dataobj)
    assert set(np.unique(seg23).tolist()) == {0, 1, 2, 3}
    canonical = nib.as_closest_canonical(nib.load(folder / "BraTS-GLI-00000-000-t1c.nii.gz"))
    np.testing.assert_array_equal(canonical.get_fdata(), s.images[..., 2])  # t1c = T1ce


def test_brats2023_enhancing_label_3_gives_the_regions_of_label_4(
    tmp_path: Path, studies: list
) -> None:
    synthetic.write_brats(tmp_path / "raw", "brats2023", studies=studies)
    summary = brats.convert(tmp_path / "raw", tmp_path / "out", BratsOptions(labels="regions"))
    assert summary["release_labels"] == {"0": 0, "1": 1, "2": 2, "3": 4}
    masks = np.load(tmp_path / "out" / "masks.npy")
    manifest = pd.read_csv(tmp_path / "out" / "manifest.csv")
    for study in studies:
        rows = manifest.index[manifest["patient"] == study.release_name("brats2023")]
        seg23 = to_2023_labels(study.seg)
        expected = [(seg23 > 0).sum(), np.isin(seg23, [1, 3]).sum(), (seg23 == 3).sum()]
        assert masks[rows].sum(axis=(0, 2, 3)).tolist() == expected


def test_brats2020_case_355_odd_seg_name_and_csv_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The Kaggle copy: two folders deep, uncompressed ``.nii``, case 355's odd seg name."""
    rng = np.random.default_rng(2)
    cases = [make_mri(i, rng, SHAPE) for i in (0, 354)]
    data = tmp_path / "archive" / "BraTS2020_TrainingData" / "MICCAI_BraTS2020_TrainingData"
    synthetic.write_brats(data, "brats2020", studies=cases, suffix=".nii")
    odd = data / "BraTS20_Training_355" / "W39_1998.09.19_Segm.nii"
    assert odd.is_file() and not list(odd.parent.glob("*_seg.nii*"))
    assert (data / "name_mapping.csv").is_file() and (data / "survival_info.csv").is_file()
    out = tmp_path / "out"
    code, err = _run(["--root", str(tmp_path / "archive"), "--out", str(out), "--quiet"], capsys)
    assert code == 0 and err == ""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"] == "brats2020" and summary["n_patients"] == 2
    manifest = pd.read_csv(out / "manifest.csv")
    assert manifest["patient"].unique().tolist() == ["BraTS20_Training_001", "BraTS20_Training_355"]

    odd.unlink()  # a partial download: one line naming the file and both names
    code, err = _run(["--root", str(data), "--out", str(tmp_path / "o2"), "--quiet"], capsys)
    assert code == 0
    reasons = pd.read_csv(tmp_path / "o2" / "skipped.csv")
    assert reasons["path"].tolist() == [str(odd.parent / "BraTS20_Training_355_seg.nii.gz")]
    assert reasons["reason"].iloc[0] == (
        "missing file (expected the segmentation BraTS20_Training_355_seg.nii.gz "
        "or W39_1998.09.19_Segm.nii[.gz])"
    )


def test_explicit_release_names_and_a_foreign_label(
    tmp_path: Path, studies: list, capsys: pytest.CaptureFixture
) -> None:
    synthetic.write_brats(tmp_path / "b19", "brats2019", studies=studies[:1])
    code, _ = _run(_args(tmp_path / "b19", tmp_path / "o", "--layout", "brats2019"), capsys)
    assert code == 0
    synthetic.write_brats(tmp_path / "fets", "fets2022", studies=studies[:1])
    code, err = _run(_args(tmp_path / "fets", tmp_path / "o", "--layout", "brats2023"), capsys)
    assert code == 1 and "<id>/<id>-t2f.nii.gz (BraTS 2023)" in _error_line(err)
    # a 2023-style label 3 in a 2021 layout is not silently read as label 1 or 4
    seg = tmp_path / "fets" / "FeTS2022_00000" / "FeTS2022_00000_seg.nii.gz"
    image = nib.load(seg)
    nib.save(nib.Nifti1Image(to_2023_labels(np.asarray(image.dataobj)), image.affine), seg)
    code, err = _run(["--root", str(tmp_path / "fets"), "--out", str(tmp_path / "o3")], capsys)
    line = _error_line(err)
    assert code == 1 and str(seg) in line
    assert "unexpected label values [3] (expected 0, 1, 2, 4 for the brats2021 layout)" in line


# --------------------------------------------------------------------------- sites


@pytest.mark.parametrize("csv_name,n_sites", [("partitioning_1.csv", 2), ("partitioning_2.csv", 3)])
def test_fets_sites_make_one_client_per_site(
    tmp_path: Path, studies: list, capsys: pytest.CaptureFixture, csv_name: str, n_sites: int
) -> None:
    root = tmp_path / "MICCAI_FeTS2022_TrainingData"
    synthetic.write_brats(root, "fets2022", studies=studies)
    out = tmp_path / "out"
    code, err = _run(["--root", str(root), "--out", str(out), "--sites", csv_name], capsys)
    assert code == 0, err
    table = pd.read_csv(root / csv_name, dtype=str)
    assert list(table.columns) == ["Subject_ID", "Partition_ID"]
    sites = dict(zip(table["Subject_ID"], table["Partition_ID"], strict=True))
    manifest = pd.read_csv(out / "manifest.csv", dtype={"site": str})
    assert manifest["site"].tolist() == manifest["patient"].map(sites).tolist()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_sites"] == n_sites and summary["sites_file"] == str(root / csv_name)

    data = load_brats(str(out))  # group=auto: the site
    assert list(data.groups) == manifest["site"].tolist()
    parts = P.natural(data.labels, n_sites, seed=0, groups=data.groups)
    assert sorted(len({data.groups[i] for i in part}) for part in parts) == [1] * n_sites
    by_patient = load_brats(str(out), group="patient")
    assert list(by_patient.groups) == manifest["patient"].tolist()


def test_natural_partition_of_a_site_split_run(tmp_path: Path, studies: list) -> None:
    """``fedexp run dataset=brats partition=natural num_clients=<sites>``: one site per client."""
    root = tmp_path / "MICCAI_FeTS2022_TrainingData"
    synthetic.write_brats(root, "fets2022", studies=studies)
    brats.convert(root, tmp_path / "out", BratsOptions(sites=Path("partitioning_2.csv")))
    cfg = compose_config(
        "dataset=brats",
        f"dataset.path={tmp_path / 'out'}",
        "model=unet",
        "model.channels=[8,16]",
        "model.strides=[2]",
        "partition=natural",
        "num_clients=3",
        "batch_size=2",
        "device=cpu",
        output_dir=tmp_path / "run",
    )
    clients = build_engine(cfg).clients
    manifest = pd.read_csv(tmp_path / "out" / "manifest.csv")
    sizes = sorted(manifest["site"].value_counts().tolist())
    assert sorted(len(c.x_train) + len(c.x_test) for c in clients) == sizes


def test_sites_file_problems_are_one_line(
    tmp_path: Path, studies: list, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "raw"
    synthetic.write_brats(root, "brats2021", studies=studies)
    out = tmp_path / "out"
    names = [s.release_name("brats2021") for s in studies]

    def run(text: str) -> tuple[int, str]:
        (tmp_path / "sites.csv").write_text(text)
        return _run(_args(root, out, "--sites", str(tmp_path / "sites.csv")), capsys)

    code, err = run(f"Subject_ID,Partition_ID\n{names[0]},1\n{names[2]},2\n")
    line = _error_line(err)
    assert code == 1 and f"subject {names[1]} ({root / names[1]}) has no row" in line
    assert "1 of 3 subjects missing" in line and not out.exists()
    code, err = run("Subject,Site\nx,1\n")
    assert code == 1 and "expected the header Subject_ID,Partition_ID" in _error_line(err)
    code, err = run(f"Subject_ID,Partition_ID\n{names[0]},1\n{names[0]},2\n")
    assert code == 1 and "line 3: subject" in _error_line(err)
    code, err = run(f"Subject_ID,Partition_ID\n{names[0]},\n")
    assert code == 1 and "line 2, column Partition_ID is empty" in _error_line(err)
    code, err = _run(["--root", str(root), "--out", str(out), "--sites", "nowhere.csv"], capsys)
    assert code == 1 and "nowhere.csv: file not found" in _error_line(err)
    # Windows line ends, a byte-order mark, extra rows and columns are fine
    rows = "".join(f"{n},{k % 2 + 1},x\r\n" for k, n in enumerate(names))
    code, err = run("\ufeffSubject_ID,Partition_ID,Note\r\n" + rows + "BraTS2021_99999,7,x\r\n")
    assert code == 0, err
    assert pd.read_csv(out / "manifest.csv")["site"].nunique() == 2


def test_group_site_needs_a_recorded_site(tmp_path: Path, studies: list) -> None:
    synthetic.write_brats(tmp_path / "raw", "brats2021", studies=studies[:1])
    brats.convert(tmp_path / "raw", tmp_path / "out")
    assert "site" not in pd.read_csv(tmp_path / "out" / "manifest.csv").columns
    assert set(load_brats(str(tmp_path / "out")).groups) == {"BraTS2021_00000"}
    with pytest.raises(DataError, match=r"no 'site' column.*--sites partitioning_1\.csv"):
        load_brats(str(tmp_path / "out"), group="site")
    with pytest.raises(DataError, match="expected auto, site or patient"):
        load_brats(str(tmp_path / "out"), group="hospital")


# --------------------------------------------------------------------------- LUNA16 subsets


def test_luna16_subsets_are_its_sites(tmp_path: Path) -> None:
    root = tmp_path / "raw"
    found = synthetic.write_luna16(root, n_studies=4, seed=3, n_negatives=1)
    summary = luna16.convert(root, tmp_path / "out")
    manifest = pd.read_csv(tmp_path / "out" / "manifest.csv", dtype=str)
    subsets = {s.seriesuid: s.path.parent.name for s in found}
    assert manifest["subset"].tolist() == manifest["seriesuid"].map(subsets).tolist()
    assert set(summary["patches_per_subset"]) == {"subset0", "subset1"}
    data = load_luna16(str(tmp_path / "out"))
    assert list(data.groups) == manifest["subset"].tolist()
    parts = P.natural(data.labels, 2, seed=0, groups=data.groups)
    assert sorted({data.groups[i] for i in part}.pop() for part in parts) == ["subset0", "subset1"]
    series = load_luna16(str(tmp_path / "out"), group="seriesuid")
    assert list(series.groups) == manifest["seriesuid"].tolist()
    # a folder prepared before subsets were recorded: auto falls back to the series
    manifest.drop(columns="subset").to_csv(tmp_path / "out" / "manifest.csv", index=False)
    assert list(load_luna16(str(tmp_path / "out")).groups) == manifest["seriesuid"].tolist()
    with pytest.raises(DataError, match="no 'subset' column"):
        load_luna16(str(tmp_path / "out"), group="subset")
