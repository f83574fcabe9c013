"""LUNA16 converter on synthetic releases in the official layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import SimpleITK as sitk

from data_prep import luna16
from data_prep import synthetic
from data_prep.luna16 import LunaOptions
from data_prep.luna16 import patches
from data_prep.luna16.patches import scale_hu
from data_prep.luna16.volumes import world_to_voxel
from data_prep.synthetic.luna16 import LUNA_SIZE_XYZ


def _load(out: Path) -> tuple[np.ndarray, np.ndarray, pd.DataFrame, dict]:
    images = np.load(out / "images.npy")
    labels = np.load(out / "labels.npy")
    manifest = pd.read_csv(out / "manifest.csv", dtype={"seriesuid": str})
    summary = json.loads((out / "summary.json").read_text())
    return images, labels, manifest, summary


def _rows_at(manifest: pd.DataFrame, uid: str, point: np.ndarray) -> pd.DataFrame:
    coords = manifest[["coordX", "coordY", "coordZ"]].to_numpy()
    hit = (manifest["seriesuid"] == uid).to_numpy() & np.all(np.isclose(coords, point), axis=1)
    return manifest.loc[hit]


@pytest.mark.parametrize("direction", ["identity", "flipped", "permuted", "oblique"])
def test_nodule_lands_at_patch_centre(tmp_path: Path, direction: str) -> None:
    root = tmp_path / "raw"
    studies = synthetic.write_luna16(root, n_studies=2, seed=11, direction=direction)
    assert not np.allclose(studies[0].geometry.origin, 0)
    summary = luna16.convert(root, tmp_path / "out")
    images, labels, manifest, _ = _load(tmp_path / "out")
    assert summary["n_positive"] == sum(len(s.nodules) for s in studies) == int(labels.sum())
    for study in studies:
        for nodule in study.nodules:
            rows = _rows_at(manifest, study.seriesuid, nodule)
            assert len(rows) == 1 and rows["label"].item() == 1
            patch = images[rows.index[0], 0]
            peak = np.unravel_index(patch.argmax(), patch.shape)
            assert max(abs(peak[0] - 16), abs(peak[1] - 16)) <= 1, (direction, peak)
            bright = np.argwhere(patch > 0.6)
            assert np.all(np.abs(bright.mean(axis=0) - 16) <= 1.0), bright.mean(axis=0)


def test_world_to_voxel_matches_simpleitk(tmp_path: Path) -> None:
    root = tmp_path / "raw"
    studies = synthetic.write_luna16(root, n_studies=1, seed=1, direction="oblique")
    image = sitk.ReadImage(str(studies[0].path))
    points = np.random.default_rng(0).uniform(-200, -100, size=(5, 3))
    expected = [image.TransformPhysicalPointToContinuousIndex(tuple(p)) for p in points]
    np.testing.assert_allclose(world_to_voxel(image, points), expected, atol=1e-6)


def test_outputs_have_documented_format(luna_root: tuple[Path, list], tmp_path: Path) -> None:
    root, studies = luna_root
    out = tmp_path / "out"
    assert luna16.main(["--root", str(root), "--out", str(out), "--quiet"]) == 0
    images, labels, manifest, summary = _load(out)
    n_candidates = sum(len(s.nodules) + len(s.negatives) + 1 for s in studies)
    assert images.dtype == np.float32 and images.shape == (n_candidates, 1, 32, 32)
    assert labels.dtype == np.int64 and labels.shape == (n_candidates,)
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert list(manifest.columns[:8]) == luna16.MANIFEST_COLUMNS[:8]
    np.testing.assert_array_equal(manifest["label"].to_numpy(), labels)
    assert summary["hu_window"] == [-1000.0, 400.0] and summary["delta"] is None
    assert summary["n_skipped"] == 0 and summary["candidates_in_csv"] == n_candidates
    assert sorted(p.name for p in out.iterdir()) == [
        "images.npy",
        "labels.npy",
        "manifest.csv",
        "studies",
        "summary.json",
    ]


def test_hu_window_scaling() -> None:
    hu = np.array([-2000, -1000, -300, 400, 3000], np.int16)
    np.testing.assert_allclose(scale_hu(hu, (-1000, 400)), [0, 0, 0.5, 1, 1], atol=1e-6)


def test_border_candidate_is_padded(luna_root: tuple[Path, list], tmp_path: Path) -> None:
    root, studies = luna_root
    luna16.convert(root, tmp_path / "out")
    images, _, manifest, _ = _load(tmp_path / "out")
    for study in studies:
        rows = _rows_at(manifest, study.seriesuid, study.edge)
        assert len(rows) == 1
        row = rows.iloc[0]
        patch = images[rows.index[0], 0]
        assert patch.shape == (32, 32)
        size_x, size_y = LUNA_SIZE_XYZ[:2]
        cols = row["voxel_x"] - 16 + np.arange(32)
        rws = row["voxel_y"] - 16 + np.arange(32)
        outside = (rws[:, None] < 0) | (rws[:, None] >= size_y)
        outside = outside | (cols[None, :] < 0) | (cols[None, :] >= size_x)
        assert outside.sum() >= 32 * 14
        assert np.all(patch[outside] == 0.0)
        assert np.all(patch[~outside] > 0.0)  # lung (-850 HU) is above the window minimum


def test_candidate_outside_volume_is_dropped(luna_root: tuple[Path, list], tmp_path: Path) -> None:
    root, studies = luna_root
    csv = pd.read_csv(root / "candidates_V2.csv")
    far = {"seriesuid": studies[0].seriesuid, "coordX": 1e4, "coordY": 0, "coordZ": 0, "class": 0}
    pd.concat([csv, pd.DataFrame([far])]).to_csv(root / "candidates_V2.csv", index=False)
    summary = luna16.convert(root, tmp_path / "out")
    assert summary["candidates_outside_volume"] == 1
    assert summary["n_samples"] == len(csv)


@pytest.mark.parametrize("delta", [1, 2, 4])
def test_delta_gives_requested_ratio(tmp_path: Path, delta: int) -> None:
    root = tmp_path / "raw"
    synthetic.write_luna16(root, n_studies=6, seed=2)
    summary = luna16.convert(root, tmp_path / "out", LunaOptions(delta=delta, seed=7))
    _, labels, manifest, _ = _load(tmp_path / "out")
    n_pos = int((labels == 1).sum())
    assert n_pos == 9
    assert int((labels == 0).sum()) == delta * n_pos
    assert summary["ratio_negative_positive"] == delta and summary["delta"] == delta
    again = luna16.convert(root, tmp_path / "again", LunaOptions(delta=delta, seed=7))
    assert again["n_samples"] == summary["n_samples"]
    pd.testing.assert_frame_equal(manifest, _load(tmp_path / "again")[2])


def test_delta_seed_changes_negatives_and_caps(tmp_path: Path) -> None:
    root = tmp_path / "raw"
    synthetic.write_luna16(root, n_studies=6, seed=2)
    luna16.convert(root, tmp_path / "a", LunaOptions(delta=1, seed=0))
    luna16.convert(root, tmp_path / "b", LunaOptions(delta=1, seed=1))
    index_a = set(_load(tmp_path / "a")[2]["candidate_index"])
    index_b = set(_load(tmp_path / "b")[2]["candidate_index"])
    assert index_a != index_b
    capped = luna16.convert(root, tmp_path / "c", LunaOptions(delta=100))
    assert capped["n_negative"] == 6 * 7  # every negative, no more


def test_missing_and_corrupt_files_are_skipped(tmp_path: Path) -> None:
    root = tmp_path / "raw"
    studies = synthetic.write_luna16(root, n_studies=5, seed=4)
    truncated = studies[0].path.with_suffix(".raw")
    truncated.write_bytes(truncated.read_bytes()[:1000])
    missing = studies[1].path.with_suffix(".raw")
    missing.unlink()
    garbage = studies[2].path
    garbage.write_bytes(b"\x00\xff" * 50)
    summary = luna16.convert(root, tmp_path / "out")
    assert summary["n_skipped"] == 3
    reasons = {Path(s["path"]).name: s["reason"] for s in summary["skipped"]}
    assert "truncated" in reasons[truncated.name] and str(truncated) in reasons[truncated.name]
    assert "missing data file" in reasons[missing.name]
    assert garbage.name in reasons
    _, labels, manifest, _ = _load(tmp_path / "out")
    kept = {s.seriesuid for s in studies[3:]}
    assert set(manifest["seriesuid"]) == kept
    assert len(labels) == sum(len(s.nodules) + len(s.negatives) + 1 for s in studies[3:])


def test_resume_skips_converted_studies(
    luna_root: tuple[Path, list], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, studies = luna_root
    out = tmp_path / "out"
    first = luna16.convert(root, out, LunaOptions(delta=2))
    before = {name: (out / name).read_bytes() for name in ("images.npy", "labels.npy")}

    def fail(path: Path) -> None:
        raise AssertionError(f"re-read {path}")

    monkeypatch.setattr(patches, "load_volume", fail)
    second = luna16.convert(root, out, LunaOptions(delta=2))
    assert first["studies_converted"] == len(studies) and second["studies_converted"] == 0
    assert second["studies_reused"] == len(studies) and second["n_skipped"] == 0
    for name, data in before.items():
        assert (out / name).read_bytes() == data
    monkeypatch.undo()
    third = luna16.convert(root, out, LunaOptions(delta=2, window=(-1200.0, 600.0)))
    assert third["studies_converted"] == len(studies)  # other window: recomputed


def test_lung_masks_folder_is_ignored(luna_root: tuple[Path, list], tmp_path: Path) -> None:
    root, studies = luna_root
    masks = root / "seg-lungs-LUNA16"
    masks.mkdir()
    for study in studies:  # official lung masks reuse the series UIDs
        mask = sitk.Image([8, 8, 4], sitk.sitkUInt8)
        sitk.WriteImage(mask, str(masks / study.path.name))
    summary = luna16.convert(root, tmp_path / "out")
    assert summary["n_skipped"] == 0 and summary["volumes_on_disk"] == len(studies)
    assert summary["n_positive"] == sum(len(s.nodules) for s in studies)


def test_writes_only_inside_out(luna_root: tuple[Path, list], tmp_path: Path, tree) -> None:
    root, _ = luna_root
    snapshot = tree(root)
    luna16.convert(root, tmp_path / "out")
    assert tree(root) == snapshot
    assert sorted(p.name for p in tmp_path.iterdir()) == ["luna_raw", "out"]
    assert not list((tmp_path / "out").rglob(".partial-*"))


def test_bad_root_fails_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit, match=str(missing)):
        luna16.main(["--root", str(missing), "--out", str(tmp_path / "out")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no .mhd volumes") as info:
        luna16.convert(empty, tmp_path / "out")
    assert "\n" not in str(info.value) and str(empty) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_missing_candidate_file_fails(luna_root: tuple[Path, list], tmp_path: Path) -> None:
    root, _ = luna_root
    with pytest.raises(SystemExit, match="nope.csv"):
        luna16.convert(root, tmp_path / "out", LunaOptions(candidates=Path("nope.csv")))
    (root / "candidates_V2.csv").unlink()
    summary = luna16.convert(root, tmp_path / "out")
    assert summary["candidates_file"].endswith("candidates.csv")
