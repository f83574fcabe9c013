"""Refusals that leave nothing behind and say it in one line (issue 70, item 11).

A refused run given ``hydra.run.dir`` left that folder with ``.hydra/`` and ``cli.log``; a
refused resume appended to the resumed run's ``cli.log``; a refused DP resume ended with
"checkpoint kept:" and the refused command itself; ``fedexp report`` named
``MLFLOW_TRACKING_URI`` when it was not set; ``--sites nosuch.csv`` printed one path three
times; ``fedexp report --reach acc/mean=2`` printed argparse's 10-line usage.
"""

from __future__ import annotations

import pytest

from fedexp.errors import FedexpError
from helpers import SMALL
from helpers import run_cli


def _one_error(proc) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    return lines[0]


def test_a_refused_run_removes_the_folder_it_named_and_keeps_one_that_existed(tmp_path):
    bad = ["algorithm=pfednet", "algorithm.k=50", "num_clients=10", "tracker=none"]
    given = tmp_path / "runs" / "mine"
    proc = run_cli("run", *SMALL, *bad, f"hydra.run.dir={given}", cwd=tmp_path)
    assert _one_error(proc).startswith("fedexp: error: algorithm.k=50: expected < num_clients")
    assert not (tmp_path / "runs").exists()  # the folder and the parent made for it
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine\n")
    run_cli("run", *SMALL, *bad, f"hydra.run.dir={tmp_path / 'kept'}", cwd=tmp_path)
    assert (tmp_path / "kept" / "notes.txt").read_text() == "mine\n"


def test_a_refused_resume_leaves_the_runs_log_and_says_no_resume_command(tmp_path):
    first = run_cli(
        "run", *SMALL, "rounds=1", "privacy=central", "checkpoint_every=1", "tracker=none",
        "hydra.run.dir=run", cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    log = (tmp_path / "run" / "cli.log").read_text()
    proc = run_cli(
        "run", *SMALL, "rounds=2", "privacy=none", "tracker=none", "resume=run", cwd=tmp_path
    )
    line = _one_error(proc)
    assert "privacy.mode=none but the checkpoint's run has privacy.mode=central" in line
    assert "checkpoint kept" not in line and line.endswith("resume with privacy.mode=central")
    assert (tmp_path / "run" / "cli.log").read_text() == log  # nothing appended
    assert not list((tmp_path / "run" / ".hydra").glob("resume-*"))


def test_the_report_names_mlflows_default_store_when_no_uri_was_set(tmp_path, monkeypatch):
    from fedexp.report.collect import client_for

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(FedexpError) as err:
        client_for(None)
    assert "MLFLOW_TRACKING_URI=" not in str(err.value)
    assert "(no --uri, MLFLOW_TRACKING_URI not set): no MLflow store there" in str(err.value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/x.db")
    with pytest.raises(FedexpError, match=r"^MLFLOW_TRACKING_URI=sqlite:///"):
        client_for(None)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--reach", "acc/mean=2"], "argument --reach: invalid float value: 'acc/mean=2'"),
        ([], "the following arguments are required: --experiment/-e"),
    ],
)
def test_a_report_option_error_is_one_line(argv, said, capsys):
    from fedexp.report.cli import main

    with pytest.raises(SystemExit) as out:
        main(argv)
    err = capsys.readouterr().err
    assert out.value.code == 2 and err == (
        f"fedexp report: error: {said} (fedexp report --help lists the options)\n"
    )


def test_a_missing_sites_file_names_each_place_looked_in_once(tmp_path):
    from data_prep import brats
    from data_prep import synthetic

    root = tmp_path / "raw"
    synthetic.write_brats(root, "brats2021", n_studies=2, seed=5)
    with pytest.raises(SystemExit) as err:
        brats.main(["--root", str(root), "--out", str(tmp_path / "o"), "--sites", "nosuch.csv"])
    message = str(err.value.code)
    assert message.startswith("error: --sites nosuch.csv: file not found (looked for ")
    assert message.count(str(root / "nosuch.csv")) == 1
