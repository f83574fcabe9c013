"""A resumed run continues in its own folder: rounds 0..R in one rounds.csv, its summary and
plots rewritten there, Hydra's record of the first command kept (issue 43, item 7); and each
start logs its torch threads (item 2)."""

from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fedexp.config.instantiate import hydra_subdir
from fedexp.config.instantiate import resumed_run_dir
from fedexp.config.instantiate import run_dir
from helpers import SMALL
from helpers import without_hydra_logging


def test_a_checkpoint_folder_names_its_run_folder(tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "good.safetensors").touch()
    for resume in (ckpt, f"{ckpt}/", ckpt / "good.safetensors"):
        assert resumed_run_dir(str(resume)) == str(tmp_path / "run")
    copied = tmp_path / "backup"
    copied.mkdir()
    assert resumed_run_dir(str(copied)) is None  # not a run's checkpoints folder
    assert resumed_run_dir(str(tmp_path / "gone" / "checkpoints")) is None
    assert resumed_run_dir(None) is None
    assert run_dir(str(ckpt), str(tmp_path / "new")) == str(tmp_path / "run")
    assert not (tmp_path / "new").exists()  # no fresh folder claimed for a resume
    assert run_dir(None, str(tmp_path / "new")) == str(tmp_path / "new")
    assert hydra_subdir(None, "t") == ".hydra"
    assert hydra_subdir(str(ckpt), "t") == ".hydra/resume-t"
    assert hydra_subdir(str(ckpt), "t") == ".hydra/resume-t-1"  # two resumes in one second
    assert (tmp_path / "run" / ".hydra" / "resume-t-1").is_dir()


@pytest.fixture
def fedexp_run(tmp_path, monkeypatch):
    """``fedexp run ARGS`` in this process, from tmp_path (plots recorded, not drawn)."""
    from fedexp import cli
    from fedexp.figures import plots

    drawn: list[tuple[Path, list[int]]] = []

    def plot_rounds(history, path, *args, **kwargs):
        drawn.append((Path(path), [int(h["round"]) for h in history]))

    monkeypatch.setattr(plots, "plot_rounds", plot_rounds)
    for name in ("plot_clients", "plot_client_models"):
        monkeypatch.setattr(plots, name, lambda *a, **k: None)
    without_hydra_logging(monkeypatch)
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> list[tuple[Path, list[int]]]:
        monkeypatch.setattr(sys, "argv", ["fedexp", "run", *SMALL, "tracker=none", *args])
        cli.main()
        return drawn

    return run


def _rounds(path: Path) -> list[int]:
    with open(path, newline="") as fh:
        return [int(row["round"]) for row in csv.DictReader(fh)]


def test_resuming_2_rounds_to_4_completes_the_runs_own_folder(fedexp_run, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fedexp"):
        torch.set_num_threads(2)
        fedexp_run("rounds=2", "checkpoint_every=1", "threads=1")
        (run,) = (tmp_path / "outputs").glob("*/*")
        resume = f"resume={run}/checkpoints"
        drawn = fedexp_run("rounds=4", "checkpoint_every=1", "threads=1", resume)
    assert list((tmp_path / "outputs").glob("*/*")) == [run]  # no second folder
    assert _rounds(run / "rounds.csv") == [0, 1, 2, 3, 4]  # each round once
    assert sorted({int(r) for r in _rounds(run / "clients_rounds.csv")}) == [0, 1, 2, 3, 4]
    assert drawn[-1] == (run / "curves.png", [0, 1, 2, 3, 4])  # the plot of the 4 rounds
    assert OmegaConf.load(run / "config.yaml").rounds == 4
    with open(run / "clients.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 5  # the summary of the last round's clients
    # the first command's record is kept, the resume's beside it
    assert "resume=" not in " ".join(OmegaConf.load(run / ".hydra" / "overrides.yaml"))
    (resumed,) = (run / ".hydra").glob("resume-*/overrides.yaml")
    assert len(list((run / ".hydra").glob("resume-*"))) == 1  # one record a resume
    assert f"resume={run}/checkpoints" in list(OmegaConf.load(resumed))
    assert "resuming after round 2 with changed settings: rounds 2 -> 4" in caplog.messages
    # issue 43, item 2: each start logs its threads once (here set: threads=1), applies
    # them and records them in the run's config
    lines = [m for m in caplog.messages if m.startswith("threads: ")]
    assert len(lines) == 2 and all(m.startswith("threads: 1 (threads=1; ") for m in lines)
    assert torch.get_num_threads() == 1
    assert OmegaConf.load(run / "config.yaml").threads == 1
    with pytest.raises(SystemExit) as refused:  # a changed batch size: refused, nothing left
        fedexp_run("rounds=6", "batch_size=16", resume)
    assert refused.value.code == 2 and len(list((run / ".hydra").glob("resume-*"))) == 1
    assert _rounds(run / "rounds.csv") == [0, 1, 2, 3, 4]


def test_resume_names_a_checkpoint_or_says_where_none_is(tmp_path):
    """Issue 70, items 2 and 3: ``resume=`` is checked before Hydra makes a folder, and a run's
    folder (which holds ``checkpoints/``) stands for its checkpoints."""
    from fedexp.engine.files import checkpoint
    from fedexp.engine.files.resume import LAST_CHECKPOINT
    from fedexp.engine.files.resume import resume_target
    from fedexp.errors import CheckpointError
    from fedexp.errors import ConfigError

    assert LAST_CHECKPOINT == checkpoint.FILENAME  # (resume.py imports no torch)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"checkpoints holds no checkpoint \(last\.safetensors"):
        resume_target(str(run))  # stopped before its first checkpoint
    (run / "checkpoints" / LAST_CHECKPOINT).touch()
    assert resume_target(str(run)) == f"{run}/checkpoints"
    assert resume_target(f"{run}/") == f"{run}/checkpoints"
    assert resume_target(f"{run}/checkpoints") == f"{run}/checkpoints"
    assert resume_target(f"{run}/checkpoints/{LAST_CHECKPOINT}").endswith(LAST_CHECKPOINT)
    with pytest.raises(ConfigError, match=r"^resume=\S+/gone: no such file or folder; expected"):
        resume_target(str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match=r"no checkpoint found \(expected \S+/last\.safetensors"):
        resume_target(str(tmp_path))
    # the API (runner.run, no CLI): the folder's own message points at its checkpoints/
    with pytest.raises(CheckpointError, match=rf"holds the run's: resume={run}/checkpoints$"):
        checkpoint.load(run)


def test_a_run_resumed_from_its_folder_continues_there(fedexp_run, tmp_path):
    """``resume=outputs/<date>/<time>`` said "no checkpoint found" (issue 70, item 3)."""
    fedexp_run("rounds=2", "checkpoint_every=1", "threads=1")
    (run,) = (tmp_path / "outputs").glob("*/*")
    fedexp_run("rounds=3", "checkpoint_every=1", "threads=1", f"resume={run.relative_to(tmp_path)}")
    assert list((tmp_path / "outputs").glob("*/*")) == [run]  # no second folder
    assert _rounds(run / "rounds.csv") == [0, 1, 2, 3]
    (resumed,) = (run / ".hydra").glob("resume-*/overrides.yaml")
    assert f"resume={run.relative_to(tmp_path)}/checkpoints" in list(OmegaConf.load(resumed))
