"""Issue "Hardening, round two", item 8: data files that escape ``--root`` or hold nothing.

* A LUNA16 ``.mhd`` whose ``ElementDataFile`` (``../x.raw``, an absolute path, a symlink, a
  LIST line, a ``%d`` pattern, ``~/x.raw``) really lies outside ``--root`` is refused in one
  line naming the header, the value and the root; a header ITK would read differently from
  a plain ``Key = Value`` reading (a repeated ``ElementDataFile``, ``:`` as separator, a
  carriage return inside a line) is refused too. Legitimate relative, LIST, pattern and
  LOCAL headers still load.
* A file that parses but holds zero samples (an IDX count of 0, an empty CIFAR batch, a Tiny
  ImageNet class folder without JPEGs, prepared LUNA16/BraTS arrays without patches) is a
  DataError naming it, not a later "client 0 only 0 samples".
* The numeric arguments of the data set builders declare their ranges.

Every file is written in its official format in ``tmp_path``.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import SimpleITK as sitk

from data_prep import luna16 as luna_prep
from data_prep import synthetic
from data_prep import synthetic_images as images
from data_prep.luna16.volumes import load_volume
from data_prep.mhd import mhd_problem
from fedexp.config.instantiate import instantiate_checked
from fedexp.data.dataset import ArrayDataset
from fedexp.data.images import cifar10
from fedexp.data.images import cifar100
from fedexp.data.images import mnist
from fedexp.data.images import tiny_imagenet
from fedexp.data.imaging import brats
from fedexp.data.imaging import luna16
from fedexp.errors import ConfigError
from fedexp.errors import DataError
from helpers import compose_config


# ----------------------------------------------------------------------------- .mhd escapes
def _luna(tmp_path: Path, n: int = 2) -> tuple[Path, list[synthetic.LunaStudy]]:
    root = tmp_path / "raw"
    return root, synthetic.write_luna16(root, n_studies=n, seed=8, n_negatives=2)


def _set_data_file(header: Path, value: str, tail: bytes = b"") -> None:
    """Rewrite the header's ElementDataFile line (and what follows it) as ``value``."""
    text = header.read_text()
    head = text[: text.index("ElementDataFile")]
    header.write_bytes(f"{head}ElementDataFile = {value}\n".encode() + tail)


def _volume(header: Path) -> np.ndarray:
    """The volume as the converter reads it (LPS-oriented), (z, y, x)."""
    return sitk.GetArrayFromImage(load_volume(header))


def _flat_root(tmp_path: Path) -> tuple[Path, list[synthetic.LunaStudy]]:
    """A raw folder with the headers directly in it (no subset*/): ``../`` leaves it."""
    root, studies = _luna(tmp_path)
    for study in studies:
        for file in (study.path, study.path.with_suffix(".raw")):
            file.rename(root / file.name)
    for folder in root.glob("subset*"):
        folder.rmdir()
    return root, [dataclasses.replace(s, path=root / s.path.name) for s in studies]


def _escaped(problem: DataError | None, header: Path, value: str, root: Path) -> str:
    assert problem is not None
    message = str(problem)
    assert "\n" not in message
    assert message.startswith(f"{header}: data file outside root: ElementDataFile {value!r}")
    assert f"the data file must lie under --root {root}" in message
    return message


def test_relative_escape_is_skipped_not_read(tmp_path: Path, capsys: pytest.CaptureFixture):
    root, studies = _flat_root(tmp_path)
    escaping = studies[0]
    outside = tmp_path / "outside.raw"  # a valid volume: ITK would read it without a word
    shutil.copy(escaping.path.with_suffix(".raw"), outside)
    escaping.path.with_suffix(".raw").unlink()
    _set_data_file(escaping.path, "../outside.raw")

    message = _escaped(mhd_problem(escaping.path, root), escaping.path, "../outside.raw", root)
    assert f"resolves to {outside}" in message
    assert sitk.ReadImage(str(escaping.path)).GetSize() == (48, 48, 40)  # what ITK would do

    out = tmp_path / "out"
    assert luna_prep.main(["--root", str(root), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"skipped {escaping.path}: data file outside root: ElementDataFile" in err
    assert "skipped 1 (1 data file outside root)" in err
    skipped = pd.read_csv(out / "skipped.csv", dtype=str)
    assert skipped["path"].tolist() == [str(escaping.path)]
    manifest = pd.read_csv(out / "manifest.csv", dtype=str)
    assert set(manifest["seriesuid"]) == {studies[1].seriesuid}


def test_absolute_escape_and_nothing_left(tmp_path: Path, capsys: pytest.CaptureFixture):
    root, studies = _luna(tmp_path, n=1)
    outside = tmp_path / "elsewhere" / "volume.raw"
    outside.parent.mkdir()
    shutil.move(studies[0].path.with_suffix(".raw"), outside)
    _set_data_file(studies[0].path, str(outside))
    _escaped(mhd_problem(studies[0].path, root), studies[0].path, str(outside), root)

    with pytest.raises(SystemExit) as info:
        luna_prep.main(["--root", str(root), "--out", str(tmp_path / "out"), "--quiet"])
    line = str(info.value)
    assert line.startswith("error: nothing to convert") and "\n" not in line
    assert f"first: {studies[0].path}: data file outside root: ElementDataFile" in line


def test_symlink_inside_root_pointing_outside(tmp_path: Path):
    root, studies = _luna(tmp_path)
    raw = studies[0].path.with_suffix(".raw")
    outside = tmp_path / "outside" / raw.name
    outside.parent.mkdir()
    shutil.move(raw, outside)
    raw.symlink_to(outside)  # the header is untouched: ElementDataFile = <uid>.raw
    message = _escaped(mhd_problem(studies[0].path, root), studies[0].path, raw.name, root)
    assert f"resolves to {outside}" in message

    header_link = root / "subset1" / "linked.mhd"  # a header that is itself a link out
    shutil.copy(studies[1].path, tmp_path / "outside" / "x.mhd")
    header_link.symlink_to(tmp_path / "outside" / "x.mhd")
    problem = mhd_problem(header_link, root)
    assert problem is not None and "header outside root" in str(problem)
    assert f"it must lie under --root {root}" in str(problem)

    summary = luna_prep.convert(root, tmp_path / "out")
    assert summary["skipped_by_reason"] == {"data file outside root": 1}
    assert summary["volumes_on_disk"] == 3  # linked.mhd has no candidates: never opened


def test_legitimate_relative_paths_still_load(tmp_path: Path):
    root, studies = _luna(tmp_path)
    expected = _volume(studies[0].path)
    baseline = luna_prep.convert(root, tmp_path / "before")
    raw = studies[0].path.with_suffix(".raw")
    target = root / "data" / raw.name
    target.parent.mkdir()
    shutil.move(raw, target)
    _set_data_file(studies[0].path, f"../data/{raw.name}")  # up, but not out of root
    assert mhd_problem(studies[0].path, root) is None
    assert np.array_equal(_volume(studies[0].path), expected)
    (studies[1].path.parent / "inside.raw").symlink_to(studies[1].path.with_suffix(".raw"))
    _set_data_file(studies[1].path, "inside.raw")  # a symlink that stays inside is fine
    assert mhd_problem(studies[1].path, root) is None

    after = luna_prep.convert(root, tmp_path / "after")
    assert after["n_skipped"] == 0 and after["n_samples"] == baseline["n_samples"]
    assert np.array_equal(
        np.load(tmp_path / "after" / "images.npy"), np.load(tmp_path / "before" / "images.npy")
    )


def test_cached_study_is_checked_again(tmp_path: Path):
    root, studies = _luna(tmp_path)
    out = tmp_path / "out"
    assert luna_prep.convert(root, out)["studies_converted"] == 2
    outside = tmp_path / "outside.raw"
    shutil.move(studies[0].path.with_suffix(".raw"), outside)
    _set_data_file(studies[0].path, "../../outside.raw")
    summary = luna_prep.convert(root, out)
    assert summary["skipped_by_reason"] == {"data file outside root": 1}
    assert summary["studies_reused"] == 1


def test_headers_itk_reads_differently_are_refused(tmp_path: Path):
    """MetaIO reads the FIRST ElementDataFile, takes ':' as a separator and ends a key at a
    carriage return: each header below makes ITK open ../../outside.raw."""
    root, studies = _luna(tmp_path, n=1)
    header = studies[0].path
    outside = tmp_path / "outside.raw"
    shutil.copy(header.with_suffix(".raw"), outside)
    legit = header.with_suffix(".raw").name
    head = header.read_text()[: header.read_text().index("ElementDataFile")]
    cases = {
        "ElementDataFile = ../../outside.raw\nElementDataFile = X\n": "data file outside root",
        "ElementDataFile: ../../outside.raw\nElementDataFile = X\n": "is not a 'Key = Value' line",
        "ElementDataFile\r= ../../outside.raw\nElementDataFile = X\n": "holds control characters",
        "Note = a\x0bElementDataFile = X\n": "holds control characters",
        "ElementDataFile = X\u00e9\n": "unsupported ElementDataFile",
    }
    for tail, needle in cases.items():
        header.write_text(head + tail.replace("X", legit), newline="")
        problem = mhd_problem(header, root)
        assert problem is not None and needle in str(problem), (tail, problem)
        assert str(problem).startswith(f"{header}: ") and "\n" not in str(problem)
    header.write_bytes(b"\x00\xff" * 40)
    assert "unreadable header: line 1" in str(mhd_problem(header, root))


def _slices(tmp_path: Path) -> tuple[Path, synthetic.LunaStudy, np.ndarray]:
    """A study whose 40 axial slices are also written as slices/s001.raw .. s040.raw."""
    root, studies = _luna(tmp_path, n=1)
    volume = sitk.GetArrayFromImage(sitk.ReadImage(str(studies[0].path)))  # as stored
    (root / "slices").mkdir()
    for z, plane in enumerate(volume, start=1):
        plane.astype("<i2").tofile(root / "slices" / f"s{z:03d}.raw")
    return root, studies[0], _volume(studies[0].path)


def test_list_and_pattern_forms(tmp_path: Path):
    root, study, volume = _slices(tmp_path)
    header = study.path
    last_line = header.read_text().count("\n") + 40  # the LIST lines follow the header
    names = "".join(f"../slices/s{z:03d}.raw\n" for z in range(1, 41))
    _set_data_file(header, "LIST", names.encode())
    assert mhd_problem(header, root) is None
    assert np.array_equal(_volume(header), volume)

    outside = tmp_path / "s040.raw"
    shutil.copy(root / "slices" / "s040.raw", outside)
    _set_data_file(header, "LIST", names.replace("../slices/s040.raw", str(outside)).encode())
    message = str(mhd_problem(header, root))
    assert (
        f"data file outside root: ElementDataFile 'LIST', line {last_line} '{outside}'" in message
    )
    _set_data_file(header, "LIST", names.replace("../slices/s040.raw\n", "").encode())
    assert "LIST names 39 file(s) after the header, DimSize 48 48 40 needs 40" in str(
        mhd_problem(header, root)
    )

    for pattern in ("../slices/s%03d.raw", "../slices/s%03d.raw 1", "../slices/s%03d.raw 1 40 1"):
        _set_data_file(header, pattern)
        assert mhd_problem(header, root) is None, pattern
        assert np.array_equal(_volume(header), volume)
    _set_data_file(header, "../../s%03d.raw")  # s001.raw .. s040.raw next to the raw folder
    assert "data file outside root" in str(mhd_problem(header, root))
    for pattern, why in [
        ("../slices/s%s.raw", "exactly one %d conversion"),
        ("../slices/s%03d_%d.raw", "exactly one %d conversion"),
        ("../slices/s%03d.raw 1 40", "step 0"),  # MetaIO: step (40 - 1) / 40 = 0
        ("../slices/s%03d.raw -1", "not whole numbers"),
        ("../slices/s%03d.raw 1 20 1", "names 20 files for the 40 slices"),
    ]:
        _set_data_file(header, pattern)
        problem = str(mhd_problem(header, root))
        assert f"unsupported ElementDataFile: {pattern!r}" in problem and why in problem, problem


def test_tilde_is_the_current_folder_not_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root, studies = _luna(tmp_path, n=1)
    monkeypatch.chdir(tmp_path)  # MetaIO opens "~/x.raw" relative to the current folder
    (tmp_path / "~").mkdir()
    shutil.move(studies[0].path.with_suffix(".raw"), tmp_path / "~" / "x.raw")
    _set_data_file(studies[0].path, "~/x.raw")
    message = str(mhd_problem(studies[0].path, root))
    assert f"resolves to {tmp_path / '~' / 'x.raw'}" in message


def test_local_data_after_the_header_loads(tmp_path: Path):
    root, studies = _luna(tmp_path, n=1)
    raw = studies[0].path.with_suffix(".raw")
    expected = _volume(studies[0].path)
    _set_data_file(studies[0].path, "LOCAL", raw.read_bytes())
    raw.unlink()
    assert mhd_problem(studies[0].path, root) is None
    summary = luna_prep.convert(root, tmp_path / "out")
    assert summary["n_skipped"] == 0 and summary["n_samples"] > 0
    assert np.array_equal(_volume(studies[0].path), expected)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--delta", "nan"], "--delta nan: must be positive and finite"),
        (["--delta", "0"], "--delta 0.0: must be positive"),
        (["--seed", "-1"], "--seed -1: must be ≥ 0"),
        (["--hu-window", "-1000", "inf"], "--hu-window"),
    ],
)
def test_luna16_command_refuses_bad_numbers(tmp_path: Path, argv: list[str], needle: str):
    with pytest.raises(SystemExit) as info:
        luna_prep.main(["--root", str(tmp_path), "--out", str(tmp_path / "out"), *argv])
    assert str(info.value).startswith("error: ") and needle in str(info.value)


# ----------------------------------------------------------------------------- zero samples
def _idx(magic: int, array: np.ndarray) -> bytes:
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_mnist_with_zero_images_names_the_file(tmp_path: Path, gz: bool):
    folder = images.write_mnist(tmp_path / "mnist", n_train=10, n_test=5, gz=gz)
    empty = {
        "train-images-idx3-ubyte": _idx(0x803, np.zeros((0, 28, 28))),
        "train-labels-idx1-ubyte": _idx(0x801, np.zeros(0)),
    }
    for name, data in empty.items():
        if gz:
            with gzip.open(folder / f"{name}.gz", "wb") as stream:
                stream.write(data)
        else:
            (folder / name).write_bytes(data)
    with pytest.raises(DataError) as info:
        mnist(str(folder))
    file = folder / ("train-images-idx3-ubyte" + (".gz" if gz else ""))
    assert str(info.value).startswith(f"{file}: holds no samples (its IDX header counts 0 images)")


def test_mnist_count_mismatch_names_both_files(tmp_path: Path):
    folder = images.write_mnist(tmp_path / "mnist", n_train=10, n_test=5)
    (folder / "t10k-labels-idx1-ubyte").write_bytes(_idx(0x801, np.zeros(4)))
    with pytest.raises(DataError) as info:
        mnist(str(folder))
    message = str(info.value)
    assert str(folder / "t10k-labels-idx1-ubyte") in message and "4 labels" in message
    assert f"{folder / 't10k-images-idx3-ubyte'} holds 5 images" in message


def test_empty_cifar_batches_are_named(tmp_path: Path):
    folder = images.write_cifar10(tmp_path / "c10", per_file=2)
    (folder / "data_batch_4.bin").write_bytes(b"")
    with pytest.raises(DataError) as info:
        cifar10(str(folder))
    assert str(info.value).startswith(f"{folder / 'data_batch_4.bin'}: holds no samples (0 bytes)")
    folder = images.write_cifar100(tmp_path / "c100", n_train=3, n_test=2)
    (folder / "test.bin").write_bytes(b"")
    with pytest.raises(DataError, match="holds no samples") as info:
        cifar100(str(folder))
    assert str(folder / "test.bin") in str(info.value) and "2 label byte(s)" in str(info.value)


def test_tiny_imagenet_class_without_images_is_named(tmp_path: Path):
    root = images.write_tiny_imagenet(tmp_path, classes=2, train_per_class=1, val=2)
    wnid = (root / "wnids.txt").read_text().split()[1]
    folder = root / "train" / wnid / "images"
    for jpeg in folder.iterdir():
        jpeg.unlink()
    (folder / "notes.txt").write_text("no images here")
    with pytest.raises(DataError) as info:
        tiny_imagenet(str(root))
    assert str(info.value).startswith(
        f"{folder}: holds no samples (no .JPEG files for class {wnid}"
    )


def _prepared(folder: Path, x: np.ndarray, name: str, second: np.ndarray, column: str) -> Path:
    folder.mkdir()
    np.save(folder / "images.npy", x)
    np.save(folder / name, second)
    pd.DataFrame({column: pd.Series([], dtype=str)}).to_csv(folder / "manifest.csv", index=False)
    return folder


def test_prepared_imaging_without_patches_is_named(tmp_path: Path):
    empty = np.zeros((0, 1, 32, 32), np.float32)
    luna = _prepared(tmp_path / "luna", empty, "labels.npy", np.zeros(0, np.int64), "seriesuid")
    with pytest.raises(DataError) as info:
        luna16(str(luna))
    message = str(info.value)
    assert message.startswith(f"{luna / 'images.npy'}: holds no samples (0 patches)")
    assert "python -m data_prep.luna16" in message
    x = np.zeros((0, 4, 64, 64), np.float32)
    folder = _prepared(
        tmp_path / "brats", x, "masks.npy", np.zeros((0, 64, 64), np.uint8), "patient"
    )
    with pytest.raises(DataError, match="holds no samples") as info:
        brats(str(folder))
    assert str(folder / "images.npy") in str(info.value)


def test_luna16_delta_without_nodules(tmp_path: Path):
    folder = tmp_path / "luna"
    folder.mkdir()
    np.save(folder / "images.npy", np.zeros((3, 1, 32, 32), np.float32))
    np.save(folder / "labels.npy", np.zeros(3, np.int64))
    pd.DataFrame({"seriesuid": ["a", "a", "b"]}).to_csv(folder / "manifest.csv", index=False)
    assert len(luna16(str(folder)).y) == 3
    with pytest.raises(DataError) as info:
        luna16(str(folder), delta=2.0)
    assert f"{folder / 'labels.npy'} holds no nodule (label 1)" in str(info.value)
    for bad in (math.nan, math.inf, 0.0):
        with pytest.raises(DataError, match="expected δ > 0"):
            luna16(str(folder), delta=bad)


def test_an_empty_array_dataset_is_refused():
    with pytest.raises(DataError, match="the data set is empty"):
        ArrayDataset("custom", np.zeros((0, 2), np.float32), np.zeros(0, np.int64), 2)


def test_empty_mnist_through_the_config_names_the_file(tmp_path: Path):
    folder = images.write_mnist(tmp_path / "mnist", n_train=10, n_test=5)
    (folder / "t10k-images-idx3-ubyte").write_bytes(_idx(0x803, np.zeros((0, 28, 28))))
    cfg = compose_config("dataset=mnist", f"dataset.path={folder}")
    with pytest.raises(DataError) as info:
        instantiate_checked(cfg.dataset, "dataset")
    assert str(folder / "t10k-images-idx3-ubyte") in str(info.value)
    assert "holds no samples" in str(info.value) and "client" not in str(info.value)


# ----------------------------------------------------------------------------- ranges
@pytest.mark.parametrize(
    "dataset,key,value,expected",
    [
        ("tiny_imagenet", "max_per_class", 0, "expected ≥ 1"),
        ("luna16", "delta", 0.0, "expected > 0"),
        ("luna16", "delta", -1.0, "expected > 0"),
        ("luna16", "delta", math.nan, "expected > 0"),
        ("luna16", "delta", math.inf, "expected > 0"),
        ("luna16", "seed", -1, "expected ≥ 0"),
    ],
)
def test_dataset_ranges_are_declared(tmp_path: Path, dataset, key, value, expected):
    cfg = compose_config(f"dataset={dataset}", f"dataset.path={tmp_path}", f"dataset.{key}={value}")
    with pytest.raises(ConfigError) as info:
        instantiate_checked(cfg.dataset, "dataset")
    assert str(info.value).startswith(f"dataset.{key}=") and expected in str(info.value)


def test_dataset_ranges_accept_the_shipped_and_boundary_values(prepared):
    for override in ("dataset.delta=null", "dataset.delta=1", "dataset.seed=0"):
        cfg = compose_config("dataset=luna16", f"dataset.path={prepared.luna}", override)
        assert len(instantiate_checked(cfg.dataset, "dataset").y) > 0
    cfg = compose_config(
        "dataset=tiny_imagenet", f"dataset.path={prepared.tiny_imagenet}", "dataset.max_per_class=1"
    )
    assert len(instantiate_checked(cfg.dataset, "dataset").y) == 4
