"""Sizes no volume can hold (issue 70, item 7): ``--patch 998`` was accepted silently (80x80
slices padded into a 924 MB ``images.npy``; with ``--dims 3`` about 95 GB allocated on a
23 GiB machine). A given patch larger than every volume is refused, a patch longer than some
sides says what it pads, and an output the disk or the memory cannot hold is refused with
both figures, before anything is written. The machine's readings are injected
(``data_prep.sizes.free_disk``, ``available_memory``): the tests do not depend on it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_prep import brats
from data_prep import luna16
from data_prep import sizes
from data_prep import synthetic
from data_prep.brats import BratsOptions


@pytest.fixture
def brats_root(tmp_path: Path, mri_studies: list) -> Path:
    root = tmp_path / "raw"
    synthetic.write_brats(root, "brats2021", studies=mri_studies)  # 80 x 80 x 24 volumes
    return root


def _refused(main, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = str(info.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


@pytest.mark.parametrize("dims", ["2", "3"])
def test_a_patch_larger_than_every_volume_is_refused_before_the_output_folder(
    tmp_path: Path, brats_root: Path, dims: str
) -> None:
    out = tmp_path / "out"
    argv = ["--root", str(brats_root), "--out", str(out), "--patch", "998", "--dims", dims]
    message = _refused(brats.main, argv)
    shape = "80 x 80" if dims == "2" else "80 x 80 x 24"
    assert message.startswith("error: --patch 998: larger than every side of the volumes")
    assert f"is {shape})" in message and "expected --patch 80 or less" in message
    assert "99." in message  # the share of zero padding
    assert not out.exists()
    luna = tmp_path / "luna"
    synthetic.write_luna16(luna, n_studies=2, seed=3)  # 48 x 48 slices, 40 of them
    message = _refused(luna16.main, ["--root", str(luna), "--out", str(out), "--patch", "998"])
    assert "larger than every side" in message and "expected --patch 48 or less" in message
    assert not (out / "images.npy").exists()


def test_a_patch_longer_than_some_sides_says_what_it_pads(
    tmp_path: Path, brats_root: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    assert brats.main(["--root", str(brats_root), "--out", str(out), "--dims", "3"]) == 0
    err = capsys.readouterr().err
    note = "note: --patch 64 is longer than the volumes along Z (24 voxels): patches are "
    assert note + "zero-padded there" in err  # one line, not wrapped
    assert np.load(out / "images.npy").shape[1:] == (4, 64, 64, 64)


def test_the_default_patch_on_smaller_volumes_is_noted_not_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "luna"
    synthetic.write_luna16(root, n_studies=2, seed=3)  # 48 x 48 x 40: the default cube is 32
    assert luna16.main(["--root", str(root), "--out", str(tmp_path / "o"), "--dims", "3"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert sizes.padding_note(64, [(40, 48, 48)], "zyx") is not None
    message = sizes.patch_problem(64, [(40, 48, 48), (30, 20, 20)], "a.mhd")
    assert message is not None and "(the largest, a.mhd, is 40 x 48 x 48)" in message


def test_an_output_the_disk_cannot_hold_is_refused_naming_both_figures(
    tmp_path: Path, brats_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(sizes, "free_disk", lambda path: 10_000_000)  # 10 MB free
    argv = ["--root", str(brats_root), "--out", str(out), "--dims", "3", "--patch", "48"]
    message = _refused(brats.main, argv)
    # 3 patients x (16 + 1 + 19) bytes a voxel x 48^3 voxels = 11.9 MB
    assert message == (
        "error: --dims 3 --patch 48: the output needs about 12 MB (images.npy, masks.npy and "
        f"the studies/ cache of 3 patients), but the file system of {out} has 10 MB free"
    )
    assert not out.exists()
    # 2-D: the patches' count is known once the slices are chosen; refused before the arrays
    monkeypatch.setattr(sizes, "free_disk", lambda path: 1000)
    message = _refused(brats.main, ["--root", str(brats_root), "--out", str(out)])
    assert message.startswith("error: --patch 64: the output needs about ")
    assert "(images.npy and masks.npy)" in message and "has 1.0 kB free" in message
    assert not (out / "images.npy").exists() and not (out / "masks.npy").exists()


def test_a_study_the_memory_cannot_hold_is_refused(
    tmp_path: Path, brats_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sizes, "available_memory", lambda: 10_000_000)
    out = tmp_path / "out"
    argv = ["--root", str(brats_root), "--out", str(out), "--dims", "3", "--patch", "80"]
    message = _refused(brats.main, argv)
    assert message.startswith("error: --dims 3 --patch 80: each patient's arrays need about ")
    assert message.endswith("of memory, but 10 MB is available") and not out.exists()
    luna = tmp_path / "luna"
    synthetic.write_luna16(luna, n_studies=2, seed=3)
    monkeypatch.setattr(sizes, "available_memory", lambda: 1000)
    message = _refused(luna16.main, ["--root", str(luna), "--out", str(out), "--dims", "3"])
    assert "each volume's arrays need about " in message and "1.0 kB is available" in message
    assert not (out / "images.npy").exists()


def test_the_disk_estimate_is_what_a_3d_conversion_writes(
    tmp_path: Path, brats_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The estimate is the bytes written (arrays and cache), within their headers."""
    asked = []
    real = sizes.check_room
    monkeypatch.setattr(sizes, "check_room", lambda *a: asked.append(a) or real(*a))
    out = tmp_path / "out"
    brats.convert(brats_root, out, BratsOptions(dims=3, patch=32))
    written = sum(p.stat().st_size for p in [out / "images.npy", out / "masks.npy"])
    written += sum(p.stat().st_size for p in (out / "studies").glob("*.npz"))
    estimate = asked[0][1]
    assert estimate <= written <= estimate * 1.02
