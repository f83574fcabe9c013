"""3-D patches (``--dims 3``) and other patch sides (``--patch N``) of both converters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import SimpleITK as sitk

from data_prep import brats
from data_prep import luna16
from data_prep import synthetic
from data_prep.brats import BratsOptions
from data_prep.geometry import extract_patch
from data_prep.geometry import extract_window
from data_prep.geometry import geometry_params
from data_prep.luna16 import LunaOptions

WINDOW = luna16.HU_WINDOW


def _luna(out: Path) -> tuple[np.ndarray, np.ndarray, pd.DataFrame, dict]:
    images = np.load(out / "images.npy")
    labels = np.load(out / "labels.npy")
    manifest = pd.read_csv(out / "manifest.csv", dtype={"seriesuid": str, "subset": str})
    return images, labels, manifest, json.loads((out / "summary.json").read_text())


def _brats(out: Path) -> tuple[np.ndarray, np.ndarray, pd.DataFrame, dict]:
    images = np.load(out / "images.npy")
    masks = np.load(out / "masks.npy")
    manifest = pd.read_csv(out / "manifest.csv")
    return images, masks, manifest, json.loads((out / "summary.json").read_text())


def _scaled(hu: np.ndarray) -> np.ndarray:
    low, high = WINDOW
    return np.clip((hu.astype(np.float64) - low) / (high - low), 0.0, 1.0)


def _padded_window(array: np.ndarray, starts: tuple[int, ...], size: int) -> np.ndarray:
    """Window of the last ``len(starts)`` axes by zero-padding then slicing (reference)."""
    lead = array.ndim - len(starts)
    pad = size + max(abs(s) for s in starts)
    padded = np.pad(array, [(0, 0)] * lead + [(pad, pad)] * len(starts))
    index = tuple(slice(s + pad, s + pad + size) for s in starts)
    return padded[(..., *index)]


# --------------------------------------------------------------------------- common


def test_extract_window_matches_padding_and_extract_patch() -> None:
    rng = np.random.default_rng(0)
    volume = rng.normal(size=(2, 7, 9, 5)).astype(np.float32)
    for starts in [(0, 0, 0), (-3, 4, 2), (5, -6, -4), (20, 0, 0), (-12, 1, 1), (1, 2, 3)]:
        window = extract_window(volume, starts, 6, 0.0)
        assert window.shape == (2, 6, 6, 6) and window.dtype == np.float32
        np.testing.assert_array_equal(window, _padded_window(volume, starts, 6))
    plane = rng.integers(0, 9, size=(3, 10, 12)).astype(np.uint8)
    for row0, col0 in [(-4, 3), (7, 9), (0, 0), (30, 2)]:
        np.testing.assert_array_equal(
            extract_patch(plane, row0, col0, 8, 0), _padded_window(plane, (row0, col0), 8)
        )
    assert geometry_params(2, 32, 32) == {}  # old 2-D caches keep their fingerprint
    assert geometry_params(3, 32, 32) == {"dims": 3, "patch": 32}


# --------------------------------------------------------------------------- LUNA16


def test_luna16_cubes(tmp_path: Path) -> None:
    root = tmp_path / "raw"
    studies = synthetic.write_luna16(root, n_studies=2, seed=5, n_negatives=3)
    summary = luna16.convert(root, tmp_path / "o3", LunaOptions(dims=3, patch=16))
    luna16.convert(root, tmp_path / "o2", LunaOptions(dims=2, patch=16))
    luna16.convert(root, tmp_path / "o32", LunaOptions())
    cubes, labels, manifest, _ = _luna(tmp_path / "o3")
    flat, labels2, manifest2, summary2 = _luna(tmp_path / "o2")
    default = _luna(tmp_path / "o32")[0]
    n = sum(len(s.nodules) + len(s.negatives) + 1 for s in studies)
    assert cubes.dtype == np.float32 and cubes.shape == (n, 1, 16, 16, 16)
    assert flat.shape == (n, 1, 16, 16) and default.shape == (n, 1, 32, 32)
    assert (summary["dims"], summary["patch_size"]) == (3, 16)
    assert (summary2["dims"], summary2["patch_size"]) == (2, 16)
    pd.testing.assert_frame_equal(manifest, manifest2)
    np.testing.assert_array_equal(labels, labels2)
    np.testing.assert_array_equal(cubes[:, :, 8], flat)  # central axial slice = 2-D patch
    np.testing.assert_array_equal(flat, default[..., 8:24, 8:24])  # same centre, smaller side
    paths = {s.seriesuid: s.path for s in studies}
    for row in manifest.itertuples():
        image = sitk.ReadImage(str(paths[row.seriesuid]))  # identity direction: no re-orienting
        hu = sitk.GetArrayFromImage(image)  # (z, y, x)
        x, y, z = image.TransformPhysicalPointToIndex((row.coordX, row.coordY, row.coordZ))
        assert (x, y, z) == (row.voxel_x, row.voxel_y, row.voxel_z)
        cube = cubes[row.Index, 0]
        assert cube[8, 8, 8] == pytest.approx(_scaled(hu[z, y, x]), abs=1e-6)
        expected = _padded_window(_scaled(hu), (z - 8, y - 8, x - 8), 16)
        np.testing.assert_allclose(cube, expected, atol=1e-6)  # padding with 0 included
    assert (cubes == 0).any()  # the corner candidate's cube leaves the volume


# --------------------------------------------------------------------------- BraTS


def _tumour_free(study: synthetic.MRIStudy) -> synthetic.MRIStudy:
    return synthetic.MRIStudy(
        study.index + 10,
        study.grade,
        study.images,
        np.zeros_like(study.seg),
        study.affine,
        study.centre,
    )


def _bbox_start(mask: np.ndarray, size: int) -> tuple[int, ...]:
    hits = np.argwhere(mask)
    lows, highs = hits.min(axis=0), hits.max(axis=0)
    return tuple(int(lo + hi + 1) // 2 - size // 2 for lo, hi in zip(lows, highs, strict=True))


def test_brats_crops(tmp_path: Path, mri_studies: list) -> None:
    studies = [*mri_studies, _tumour_free(mri_studies[0])]
    root = tmp_path / "raw"
    synthetic.write_brats(root, "msd", studies=studies)
    options = BratsOptions(dims=3, patch=32, labels="regions")
    summary = brats.convert(root, tmp_path / "reg", options)
    brats.convert(root, tmp_path / "whole", BratsOptions(dims=3, patch=32))
    images, regions, manifest, _ = _brats(tmp_path / "reg")
    _, whole, manifest_w, _ = _brats(tmp_path / "whole")
    n = len(studies)
    assert images.dtype == np.float32 and images.shape == (n, 4, 32, 32, 32)
    assert regions.dtype == np.uint8 and regions.shape == (n, 3, 32, 32, 32)
    assert whole.dtype == np.uint8 and whole.shape == (n, 32, 32, 32)
    assert summary["n_samples"] == summary["n_patients"] == n == manifest["patient"].nunique()
    assert (summary["dims"], summary["patch_size"]) == (3, 32)
    assert list(manifest.columns) == brats.MANIFEST_COLUMNS
    pd.testing.assert_frame_equal(manifest, manifest_w)
    np.testing.assert_array_equal(whole, regions[:, 0])
    assert np.all(regions[:, 2] <= regions[:, 1]) and np.all(regions[:, 1] <= regions[:, 0])

    cases = {case.patient: case for case in brats.find_cases(root, "msd")}
    by_name = {s.msd_name: s for s in studies}
    for row in manifest.itertuples():
        study = by_name[row.patient]
        start = (row.row0, row.col0, row.slice)  # X, Y, Z
        canon, labels = brats.load_case(cases[row.patient], (0, 1, 2, 3))
        tumour = labels > 0
        if study.seg.any():
            assert row.has_tumour == 1 and regions[row.Index, 0].any()
            assert start == _bbox_start(tumour, 32)
            i, j, k = (c - s for c, s in zip(study.centre, start, strict=True))
            assert regions[row.Index, :, i, j, k].tolist() == [1, 1, 0]  # necrotic core
        else:
            assert row.has_tumour == 0 and not regions[row.Index].any()
            assert start == _bbox_start((canon != 0).any(axis=0), 32)
        expected = np.stack([tumour, np.isin(labels, [1, 4]), labels == 4]).astype(np.uint8)
        np.testing.assert_array_equal(regions[row.Index], _padded_window(expected, start, 32))
        np.testing.assert_array_equal(images[row.Index], _padded_window(canon, start, 32))


def test_brats_2d_other_side(tmp_path: Path, mri_studies: list) -> None:
    synthetic.write_brats(tmp_path / "raw", "msd", studies=mri_studies)
    summary = brats.convert(tmp_path / "raw", tmp_path / "p32", BratsOptions(patch=32))
    brats.convert(tmp_path / "raw", tmp_path / "p64", BratsOptions())
    small, small_masks, manifest, _ = _brats(tmp_path / "p32")
    big, big_masks, manifest64, _ = _brats(tmp_path / "p64")
    assert small.shape == (len(manifest), 4, 32, 32) and small_masks.shape[1:] == (32, 32)
    assert (summary["dims"], summary["patch_size"]) == (2, 32)
    pd.testing.assert_frame_equal(manifest[["patient", "slice"]], manifest64[["patient", "slice"]])
    tumour = manifest["has_tumour"].to_numpy() == 1  # same centres: the inner 32x32 of 64x64
    np.testing.assert_array_equal(manifest["row0"][tumour], manifest64["row0"][tumour] + 16)
    np.testing.assert_array_equal(small[tumour], big[tumour][..., 16:48, 16:48])
    np.testing.assert_array_equal(small_masks[tumour], big_masks[tumour][..., 16:48, 16:48])


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize("value", ["7", "0", "-2", "33", "abc", "16.5"])
@pytest.mark.parametrize("module", [luna16, brats])
def test_bad_patch_is_refused(tmp_path: Path, module: object, value: str) -> None:
    argv = ["--root", str(tmp_path), "--out", str(tmp_path / "out"), "--patch", value]
    with pytest.raises(SystemExit) as info:
        module.main(argv)  # type: ignore[attr-defined]
    message = str(info.value.code)
    assert message.startswith("error: --patch") and value in message and "\n" not in message
    assert "even number of voxels >= 8" in message
    assert not (tmp_path / "out").exists()


def test_bad_options_in_process(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--patch 6"):
        luna16.convert(tmp_path, tmp_path / "o", LunaOptions(dims=3, patch=6))
    with pytest.raises(SystemExit, match="--patch 9"):
        brats.convert(tmp_path, tmp_path / "o", BratsOptions(patch=9))
    with pytest.raises(SystemExit, match="--dims 4"):
        brats.convert(tmp_path, tmp_path / "o", BratsOptions(dims=4))
    with pytest.raises(SystemExit, match="--dims 1"):
        luna16.convert(tmp_path, tmp_path / "o", LunaOptions(dims=1))


# --------------------------------------------------------------------------- resume cache


def test_luna16_cache_keeps_2d_and_3d_apart(tmp_path: Path) -> None:
    root, out = tmp_path / "raw", tmp_path / "out"
    studies = synthetic.write_luna16(root, n_studies=2, seed=6, n_negatives=2)
    first = luna16.convert(root, out)
    cubes = luna16.convert(root, out, LunaOptions(dims=3))
    assert first["studies_converted"] == cubes["studies_converted"] == len(studies)
    assert cubes["studies_reused"] == 0
    assert np.load(out / "images.npy").shape[1:] == (1, 32, 32, 32)
    again = luna16.convert(root, out, LunaOptions(dims=3))
    assert again["studies_reused"] == len(studies)
    smaller = luna16.convert(root, out, LunaOptions(dims=3, patch=16))
    assert smaller["studies_converted"] == len(studies)
    assert np.load(out / "images.npy").shape[1:] == (1, 16, 16, 16)
    flat = luna16.convert(root, out)
    assert flat["studies_converted"] == len(studies)
    assert np.load(out / "images.npy").shape[1:] == (1, 32, 32)


def test_brats_cache_keeps_2d_and_3d_apart(tmp_path: Path, mri_studies: list) -> None:
    root, out = tmp_path / "raw", tmp_path / "out"
    synthetic.write_brats(root, "msd", studies=mri_studies)
    first = brats.convert(root, out)
    n_flat = first["n_samples"]
    crops = brats.convert(root, out, BratsOptions(dims=3, patch=16))
    assert crops["studies_converted"] == 3 and crops["studies_reused"] == 0
    images, masks, manifest, _ = _brats(out)
    assert images.shape == (3, 4, 16, 16, 16) and masks.shape == (3, 16, 16, 16)
    assert len(manifest) == 3 < n_flat
    assert brats.convert(root, out, BratsOptions(dims=3, patch=16))["studies_reused"] == 3
    other = brats.convert(root, out, BratsOptions(dims=2, patch=16))
    assert other["studies_converted"] == 3
    assert np.load(out / "images.npy").shape[1:] == (4, 16, 16)
    back = brats.convert(root, out)
    assert back["studies_converted"] == 3 and back["n_samples"] == n_flat
