"""Bad inputs to ``data_prep.luna16`` / ``data_prep.brats``: one line each, never a traceback.

One test per class of input (issue 12): no usable study, an unreadable volume, a header that
disagrees with its data, malformed candidate files, and output folders or ids that would make
a converter write outside ``--out``. Every run goes through the command-line entry
(``main(argv)``, once a real subprocess): a study-level problem is skipped, named in one line
and listed in ``OUT/skipped.csv`` (exit 0); only when nothing usable remains is the exit
status non-zero, with one ``error:`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from data_prep import brats
from data_prep import luna16
from data_prep import synthetic
from data_prep.common import atomic_path
from data_prep.common import safe_id

Main = Callable[[Sequence[str] | None], int]


def _run(main: Main, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """Run a CLI entry like the interpreter would: (exit status, everything on stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    if isinstance(code, str):  # SystemExit("error: ...") prints the text and exits 1
        err, code = err + code + "\n", 1
    assert "Traceback" not in err
    return int(code or 0), err


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def _skipped(out: Path) -> pd.DataFrame:
    return pd.read_csv(out / "skipped.csv", dtype=str)


def _luna(tmp_path: Path, n: int = 2) -> tuple[Path, list[synthetic.LunaStudy]]:
    root = tmp_path / "raw"
    return root, synthetic.write_luna16(root, n_studies=n, seed=8, n_negatives=2)


def _args(root: Path, out: Path, *extra: str) -> list[str]:
    return ["--root", str(root), "--out", str(out), *extra]


# --------------------------------------------------------------------------- no usable study


def test_no_usable_study(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty, out = tmp_path / "empty", tmp_path / "out"
    empty.mkdir()
    (empty / "._junk.mhd").write_bytes(b"macOS")
    code, err = _run(luna16.main, _args(empty, out), capsys)
    assert code == 1 and str(empty) in _error_line(err) and "subset*/<uid>.mhd" in err
    code, err = _run(brats.main, _args(empty, out), capsys)
    assert code == 1 and "HGG/ or LGG/" in _error_line(err)
    assert not out.exists()

    (empty / "HGG").mkdir()  # a layout without patients
    code, err = _run(brats.main, _args(empty, out), capsys)
    assert code == 1 and "no brats2017 patients" in _error_line(err)

    root, studies = _luna(tmp_path)  # every study unreadable: nothing usable remains
    for study in studies:
        raw = study.path.with_suffix(".raw")
        raw.write_bytes(raw.read_bytes()[:100])
    code, err = _run(luna16.main, _args(root, out, "--quiet"), capsys)
    line = _error_line(err)
    assert code == 1 and "nothing to convert" in line and "truncated data file" in line
    assert str(out / "skipped.csv") in line
    assert len(_skipped(out)) == 2 and not (out / "images.npy").exists()


def test_subprocess_exit_status_and_one_line(tmp_path: Path) -> None:
    root, studies = _luna(tmp_path, n=1)
    studies[0].path.with_suffix(".raw").unlink()
    run = subprocess.run(
        [sys.executable, "-m", "data_prep.luna16", *_args(root, tmp_path / "out"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: nothing to convert")
    assert "missing data file" in run.stderr


# --------------------------------------------------------------------------- unreadable volumes


def test_unreadable_volume_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root, studies = _luna(tmp_path, n=3)
    truncated = studies[0].path.with_suffix(".raw")
    truncated.write_bytes(truncated.read_bytes()[:5000])
    studies[1].path.write_bytes(b"\x00\xff" * 40)  # header that is not text
    out = tmp_path / "out"
    code, err = _run(luna16.main, _args(root, out), capsys)
    assert code == 0
    assert f"skipped {truncated}: truncated data file" in err
    assert "skipped 2 (" in err and "1 truncated data file" in err and "1 unreadable header" in err
    table = _skipped(out)
    assert set(table["path"]) == {str(truncated), str(studies[1].path)}
    assert set(pd.read_csv(out / "manifest.csv", dtype=str)["seriesuid"]) == {studies[2].seriesuid}

    code, err = _run(luna16.main, _args(root, out, "--quiet"), capsys)  # re-run: same skips
    assert code == 0 and "skipped 2 (" in err and len(_skipped(out)) == 2
    truncated.unlink()
    studies[0].path.unlink()
    studies[1].path.unlink()
    code, err = _run(luna16.main, _args(root, out, "--quiet"), capsys)
    assert code == 0 and "2 unknown seriesuid" in err  # the CSV names the deleted volumes
    csv = pd.read_csv(root / "candidates_V2.csv", dtype=str)
    csv[csv["seriesuid"] == studies[2].seriesuid].to_csv(root / "candidates_V2.csv", index=False)
    code, err = _run(luna16.main, _args(root, out, "--quiet"), capsys)
    assert code == 0 and err == "" and not (out / "skipped.csv").exists()  # none left stale


def test_corrupt_nifti_is_skipped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "raw"
    studies = synthetic.write_brats(root, "msd", n_studies=2, seed=4)
    corrupt = root / "imagesTr" / f"{studies[0].msd_name}.nii.gz"
    corrupt.write_bytes(corrupt.read_bytes()[:3000])
    code, err = _run(brats.main, _args(root, tmp_path / "out", "--quiet"), capsys)
    assert code == 0 and "skipped 1 (1 unreadable NIfTI)" in err
    table = _skipped(tmp_path / "out")
    assert table["path"].tolist() == [str(corrupt)]
    assert table["reason"][0].startswith("unreadable NIfTI:") and "\n" not in table["reason"][0]

    other = root / "imagesTr" / f"{studies[1].msd_name}.nii.gz"
    other.write_bytes(b"\x1f\x8b garbage")  # now no patient is usable
    code, err = _run(brats.main, _args(root, tmp_path / "out", "--quiet"), capsys)
    line = _error_line(err)
    assert code == 1 and "all 2 msd patients" in line and "unreadable NIfTI" in line


# --------------------------------------------------------------------------- header vs data


def test_mhd_header_disagrees_with_data(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root, studies = _luna(tmp_path, n=3)
    small = studies[0].path  # DimSize smaller than the .raw: ITK would read a wrong volume
    small.write_text(small.read_text().replace("DimSize = 48 48 40", "DimSize = 48 48 20"))
    ndims = studies[1].path
    ndims.write_text(ndims.read_text().replace("NDims = 3", "NDims = 2"))
    code, err = _run(luna16.main, _args(root, tmp_path / "out", "--quiet"), capsys)
    assert code == 0
    reasons = dict(zip(*_skipped(tmp_path / "out").to_dict("list").values(), strict=True))
    raw = small.with_suffix(".raw")
    assert reasons[str(raw)].startswith("header disagrees with data:")
    assert "DimSize 48 48 20 x MET_SHORT = 92160 bytes" in reasons[str(raw)]
    assert "184320" in reasons[str(raw)]
    assert reasons[str(ndims)].startswith("header disagrees with itself: NDims 2")


def test_nifti_modalities_disagree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root = tmp_path / "raw"
    studies = synthetic.write_brats(root, "brats2017", n_studies=2, seed=4)
    folder = root / studies[0].grade / studies[0].brats_name
    t1 = folder / f"{studies[0].brats_name}_t1.nii.gz"
    image = nib.load(t1)
    nib.save(nib.Nifti1Image(np.asarray(image.dataobj)[:, :70], image.affine), t1)
    code, err = _run(brats.main, _args(root, tmp_path / "out", "--quiet"), capsys)
    assert code == 0 and "skipped 1 (1 shape mismatch)" in err
    reason = _skipped(tmp_path / "out")["reason"][0]
    assert "_seg.nii.gz has (80, 80, 24)" in reason and "one voxel grid" in reason


# --------------------------------------------------------------------------- candidate files


def test_malformed_candidate_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root, studies = _luna(tmp_path)
    csv = root / "candidates_V2.csv"
    good = pd.read_csv(csv, dtype=str)
    uid = studies[0].seriesuid
    bad = pd.DataFrame(
        [
            [uid, "abc", "0", "0", "0"],  # non-numeric coordinate
            [uid, "1", "inf", "0", "0"],  # not finite
            [uid, "1", "2", "3", "7"],  # class other than 0/1
            ["../../evil", "1", "2", "3", "1"],  # a path, not a series UID
            ["1.2.840.999", "1", "2", "3", "1"],  # no such volume
        ],
        columns=good.columns,
    )
    pd.concat([good, bad]).to_csv(csv, index=False)
    first_line = len(good) + 2
    out = tmp_path / "out"
    code, err = _run(luna16.main, _args(root, out, "--quiet"), capsys)
    assert code == 0
    assert "skipped 5 (2 bad coordinate, 1 bad class, 1 bad seriesuid, 1 unknown seriesuid)" in err
    reasons = _skipped(out)["reason"].tolist()
    assert f"bad coordinate: line {first_line}, column coordX: 'abc'" in reasons[0]
    assert f"line {first_line + 1}, column coordY: 'inf'" in reasons[1]
    assert reasons[2].startswith(f"bad class: line {first_line + 2}, column class: '7'")
    assert "'../../evil' contains a path separator" in reasons[3]
    assert "unknown seriesuid: 1.2.840.999 (1 rows" in reasons[4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_samples"] == len(good) and summary["candidates_malformed"] == 4
    assert not list(tmp_path.glob("**/evil*"))


def test_malformed_candidate_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root, _ = _luna(tmp_path)
    out = tmp_path / "out"
    annotations = root / "annotations.csv"
    code, err = _run(luna16.main, _args(root, out, "--candidates", str(annotations)), capsys)
    line = _error_line(err)
    assert code == 1 and str(annotations) in line and "lacks column(s) class" in line
    assert "annotations.csv is not a candidate list" in line

    csv = root / "candidates_V2.csv"
    for content, needle in [
        (b"", "cannot read candidate file"),  # empty file
        (b"\xff\xfe\x00garbage\x00\n\x81\x82", "cannot read candidate file"),  # not UTF-8
        (b"seriesuid,coordX,coordY,coordZ,class\n", "no usable candidate row"),  # header only
        (b"seriesuid,coordX,coordY,coordZ,class\nx/y,a,b,c,d\n", "no usable candidate row"),
    ]:
        csv.write_bytes(content)
        code, err = _run(luna16.main, _args(root, out, "--candidates", str(csv)), capsys)
        line = _error_line(err)
        assert code == 1 and needle in line and str(csv) in line, (content, line)

    uids = pd.read_csv(root / "candidates.csv", dtype=str)
    uids["seriesuid"] = "1.2.3"  # no row names a volume on disk
    uids.to_csv(csv, index=False)
    code, err = _run(luna16.main, _args(root, out, "--candidates", str(csv)), capsys)
    assert code == 1 and "no seriesuid of" in _error_line(err)


# --------------------------------------------------------------------------- never outside --out


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_out_symlinks_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root, _ = _luna(tmp_path, n=1)
    outside = tmp_path / "outside"
    outside.mkdir()
    link = tmp_path / "link"
    link.symlink_to(outside, target_is_directory=True)
    code, err = _run(luna16.main, _args(root, link), capsys)
    line = _error_line(err)
    assert code == 1 and "is a symlink" in line and str(outside) in line

    out = tmp_path / "out"
    out.mkdir()
    (out / "studies").symlink_to(outside, target_is_directory=True)
    code, err = _run(luna16.main, _args(root, out), capsys)
    assert code == 1 and f"{out / 'studies'} is a symlink" in _error_line(err)
    (out / "studies").unlink()
    (out / "summary.json").symlink_to(outside / "summary.json")
    synthetic.write_brats(tmp_path / "brats", "msd", n_studies=1, seed=1)
    code, err = _run(brats.main, _args(tmp_path / "brats", out), capsys)
    assert code == 1 and f"{out / 'summary.json'} is a symlink" in _error_line(err)
    (out / "summary.json").unlink()

    file_out = tmp_path / "a_file"
    file_out.write_text("x")
    code, err = _run(luna16.main, _args(root, file_out), capsys)
    assert code == 1 and "is not a directory" in _error_line(err)
    assert _files(outside) == [] and _files(out) == []


def test_study_ids_never_leave_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    root, studies = _luna(tmp_path)
    odd = studies[0].path.with_name("a..b.mhd")  # a volume file whose stem holds '..'
    studies[0].path.rename(odd)
    csv = pd.read_csv(root / "candidates_V2.csv", dtype=str)
    csv.loc[csv["seriesuid"] == studies[0].seriesuid, "seriesuid"] = "a..b"
    csv.to_csv(root / "candidates_V2.csv", index=False)
    out = tmp_path / "out"
    before = {p for p in _files(tmp_path) if not p.startswith("out")}
    code, err = _run(luna16.main, _args(root, out, "--quiet"), capsys)
    assert code == 0 and " bad seriesuid" in err
    assert f"{odd}" in _skipped(out)["path"].tolist()
    assert {p for p in _files(tmp_path) if not p.startswith("out")} == before
    assert sorted(p.name for p in (out / "studies").iterdir()) == [f"{studies[1].seriesuid}.npz"]

    assert safe_id("a b") != safe_id("a_b") and "/" not in safe_id("../../evil")
    assert (
        not safe_id("..").startswith(".") and safe_id(studies[1].seriesuid) == studies[1].seriesuid
    )
    target = out / "x.json"  # a planted temporary name is replaced, never written through
    planted = target.with_name(f".partial-{os.getpid()}-x.json")
    planted.symlink_to(tmp_path / "outside.json")
    with atomic_path(target) as tmp:
        tmp.write_text("{}")
    assert target.read_text() == "{}" and not (tmp_path / "outside.json").exists()
