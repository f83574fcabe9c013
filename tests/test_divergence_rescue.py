"""A diverged run's rescue resumes from its last healthy checkpoint (``good.safetensors``), not
from one taken while the loss was already blowing up (issue "Hardening, round two", item 7)."""

from __future__ import annotations

import math
import os
import shlex
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from omegaconf import open_dict

from fedexp.cli.output import default_lr
from fedexp.cli.output import describe_stop as _describe_stop
from fedexp.engine.files import checkpoint
from fedexp.engine.runner import _healthy
from fedexp.engine.runner import run
from fedexp.errors import DivergenceError
from fedexp.tracking.base import NullTracker
from helpers import compose_config
from helpers import deterministic
from helpers import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["progress=none", "tracker=none", "device=cpu"]
#: Ditto at lr=100 from a healthy round 2: its global model blows up (test loss ×5e5 in round
#: 3, ×1e19 in round 6) while the personal training losses stay small, until a client's loss
#: is inf in round 7. The checkpoints of rounds 3-6 passed the stop rule, none is healthy.
DITTO = [*FAST, "algorithm=ditto", "checkpoint_every=1"]


def _hc(*overrides: str) -> SimpleNamespace:
    return SimpleNamespace(overrides=SimpleNamespace(task=list(overrides)))


def _paths(folder):
    return folder / checkpoint.FILENAME, folder / checkpoint.GOOD_FILENAME


def _healthy_then_blown(tmp_path):
    """Two healthy rounds, then lr=100 until the run diverges; returns the error and config."""
    run(compose_config(*DITTO, "rounds=2", output_dir=tmp_path / "a"), tracker=NullTracker())
    folder = tmp_path / "a" / "checkpoints"
    cfg = compose_config(*DITTO, "rounds=8", "lr=100", f"resume={folder}", output_dir=tmp_path)
    with pytest.raises(DivergenceError, match="in round 7") as err:
        run(cfg, tracker=NullTracker())
    return err.value, cfg, folder


# --- the good checkpoint ----------------------------------------------------------------------


def test_a_healthy_run_keeps_its_last_checkpoint_as_the_good_one_without_a_second_write(
    small_cfg, tmp_path
):
    run(small_cfg("rounds=3", "checkpoint_every=1", "tracker=none"))
    last, good = _paths(tmp_path / "out" / "checkpoints")
    assert os.path.samefile(last, good)  # a hard link: no byte written twice
    assert checkpoint.peek(last)["good_round"] == 3
    (_, meta_last), (_, meta_good) = checkpoint.load(last), checkpoint.load(good)
    assert meta_good == meta_last and meta_good["round"] == 3
    assert not list(last.parent.glob(".*tmp-*"))  # no temporary file left behind


def test_resume_from_the_good_file_continues_in_its_folder_exactly(tmp_path):
    full = NullTracker()
    run(compose_config(*FAST, "rounds=4", output_dir=tmp_path / "full"), tracker=full)
    part = NullTracker()
    run(compose_config(*FAST, "rounds=2", "checkpoint_every=1", output_dir=tmp_path / "a"))
    last, good = _paths(tmp_path / "a" / "checkpoints")
    cfg = compose_config(
        *FAST, "rounds=4", "checkpoint_every=1", f"resume={good}", output_dir=tmp_path / "b"
    )
    run(cfg, tracker=part)
    assert checkpoint.load(last)[1]["round"] == 4 and os.path.samefile(last, good)
    replayed = deterministic(part.metrics)
    for key, steps in deterministic(full.metrics).items():
        assert replayed[key] == steps, key


def test_a_checkpoint_taken_as_the_loss_blows_up_is_not_the_good_one(tmp_path):
    exc, _, folder = _healthy_then_blown(tmp_path)
    last, good = _paths(folder)
    meta = checkpoint.peek(last)
    assert (meta["round"], meta["good_round"]) == (6, 2)  # rounds 3-6 passed the stop rule
    assert meta["history"][-1]["loss/mean"] > 1e10  # ... with the test loss already huge
    _, kept = checkpoint.load(good)
    assert kept["round"] == 2 and kept["history"][-1]["loss/mean"] < kept["history"][0]["loss/mean"]
    point = checkpoint.rescue_point(folder)
    assert (point.kind, point.resume, point.round, point.last_round) == ("good", good, 2, 6)


# --- the rescue hint --------------------------------------------------------------------------


@pytest.mark.slow
def test_the_rescue_command_resumes_from_the_good_checkpoint_and_finishes(tmp_path):
    run(compose_config(*DITTO, "rounds=2", output_dir=tmp_path / "a"), tracker=NullTracker())
    folder = tmp_path / "a" / "checkpoints"
    proc = run_cli("run", *DITTO, "rounds=8", "lr=100", f"resume={folder}", cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and len(lines) == 1, lines
    line = lines[0]
    for needle in ("in round 7", "(to round 6)", "last healthy one (round 2, 5 rounds before"):
        assert needle in line, line
    command = shlex.split(line[line.index("fedexp run") :])
    assert f"resume={folder / checkpoint.GOOD_FILENAME}" in command and "lr=0.1" in command
    # the command as printed (composed as `fedexp run` composes it, run in-process to keep
    # the test quick): it resumes after round 2 with the default lr=0.1 and finishes
    tracker = NullTracker()
    res = run(compose_config(*command[2:], output_dir=tmp_path / "b"), tracker=tracker)
    assert res.metrics["round"] == 8.0 and sorted(tracker.steps) == list(range(9))
    last, good = _paths(folder)
    meta = checkpoint.load(last)[1]
    assert meta["round"] == 8 and OmegaConf.create(meta["config"]).lr == 0.1
    assert [c for c in meta["changes"] if c["key"] == "lr"] == []  # back to its lr at round 2
    assert [r["round"] for r in meta["history"]] == list(range(9))  # rounds 3-6 replaced
    assert checkpoint.rescue_point(folder).round == meta["good_round"]  # the good one follows


def test_the_hint_names_the_good_file_and_the_round_it_resumes_from(tmp_path):
    exc, cfg, folder = _healthy_then_blown(tmp_path)
    hc = _hc(*DITTO, "rounds=8", "lr=100", f"resume={folder}")
    text = _describe_stop(exc, cfg, hc)
    assert text.startswith(f"error: {exc}; checkpoint kept, but the last ones (to round 6)")
    assert text.endswith(
        "resume the last healthy one (round 2, 5 rounds before the divergence) with a smaller "
        f"lr: fedexp run {shlex.join(DITTO)} rounds=8 resume={folder}/good.safetensors lr=0.1"
    ), text
    # a rescue that diverges again before its first checkpoint: the same good checkpoint
    with open_dict(cfg):
        cfg.resume = str(folder / checkpoint.GOOD_FILENAME)
    again = _describe_stop(DivergenceError("training loss is nan in round 3"), cfg, hc)
    assert again.endswith(f"resume={folder}/good.safetensors lr=0.1") and "(round 2)" in again
    # interrupted (not diverged) after resuming from the good file: that file again
    stop = _describe_stop(KeyboardInterrupt(), cfg, _hc("rounds=8", f"resume={cfg.resume}"))
    assert stop == f"interrupted; checkpoint kept: fedexp run rounds=8 resume={cfg.resume}"


def test_when_the_last_checkpoint_is_healthy_the_hint_resumes_the_folder(small_cfg, tmp_path):
    run(small_cfg("rounds=2", "checkpoint_every=1", "tracker=none"))
    folder = tmp_path / "out" / "checkpoints"
    cfg = OmegaConf.create({"resume": None, "output_dir": str(tmp_path / "out"), "lr": 0.5})
    exc = DivergenceError("client 1: training loss is nan in round 3: the run diverged")
    text = _describe_stop(exc, cfg, _hc("rounds=9", "lr=0.5"))
    assert text.endswith(
        f"; checkpoint kept (round 2), resume it with a smaller lr: "
        f"fedexp run rounds=9 resume={folder} lr=0.1"
    ), text
    far = DivergenceError("training loss grew from 0.7 to 1e5 (×1e5) by round 40: diverged")
    assert "(round 2, 38 rounds before the divergence)" in _describe_stop(far, cfg, _hc())


def test_no_healthy_checkpoint_says_run_it_again(small_cfg, tmp_path):
    # a small MLP at lr=40: round 1's loss is already ×1300 the initial one (checkpointed: it
    # passes the ×1e4 stop rule, not the health check), round 2 diverges
    overrides = ["model=mlp", "model.hidden=8", "lr=40", "rounds=3", "tracker=none", "seed=3"]
    cfg = small_cfg(*overrides, "checkpoint_every=1")
    with pytest.raises(DivergenceError, match="by round 2") as err:
        run(cfg)
    last, good = _paths(tmp_path / "out" / "checkpoints")
    assert checkpoint.peek(last)["good_round"] is None and not good.exists()
    text = _describe_stop(err.value, cfg, _hc("model=mlp", "lr=40", "seed=3"))
    assert text.endswith(
        "; no healthy checkpoint (each was taken after the loss had blown up): "
        "run it again with a smaller lr: fedexp run model=mlp seed=3 lr=0.1"
    ), text


# --- the rescue's lr converges (issue 44, item 7) ---------------------------------------------

#: Runs that diverge in round 1; lr / 10 diverged again in each.
ROUND_ONE = [
    ["lr=1e38"],
    ["lr=1e6"],
    ["model=mlp", "lr=1e4"],
    ["algorithm=pfednet", "lr=1e38"],
]


@pytest.mark.parametrize("case", ROUND_ONE, ids=" ".join)
def test_the_printed_rescue_command_converges(tmp_path, case):
    overrides = [*FAST, "rounds=2", *case]
    cfg = compose_config(*overrides, output_dir=tmp_path / "a")
    with pytest.raises(DivergenceError, match="round 1") as err:
        run(cfg, tracker=NullTracker())
    line = _describe_stop(err.value, cfg, _hc(*overrides))
    assert "no checkpoint yet: run it again with a smaller lr: fedexp run" in line, line
    command = shlex.split(line[line.index("fedexp run") :])
    assert command[-1] == f"lr={default_lr(overrides):g}" and command[2:-1] == overrides[:-1]
    # the command as printed, composed as `fedexp run` composes it: it trains
    res = run(compose_config(*command[2:], output_dir=tmp_path / "b"), tracker=NullTracker())
    assert res.metrics["round"] == 2.0 and math.isfinite(res.metrics["loss/mean"])


@pytest.mark.slow
def test_the_cli_prints_a_rescue_that_runs(tmp_path):
    """End to end, both commands through the CLI: pFedNet at lr=1e38, then what it printed."""
    proc = run_cli("run", *FAST, "rounds=1", "algorithm=pfednet", "lr=1e38", cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and "smaller lr" in lines[0], lines
    command = shlex.split(lines[0][lines[0].index("fedexp run") :])
    again = run_cli(*command[1:], cwd=tmp_path)
    assert again.returncode == 0, again.stderr


def test_the_rescue_lr_is_the_default_above_it_else_a_decade_lower(tmp_path):
    assert default_lr(["rounds=3", "lr=7", "resume=x"]) == 0.1  # conf/config.yaml's
    cfg = OmegaConf.create({"resume": None, "output_dir": str(tmp_path), "lr": 0.1})
    exc = DivergenceError("training loss is nan in round 1: the run diverged")
    assert _describe_stop(exc, cfg, _hc()).endswith("fedexp run lr=0.01")  # the default diverged
    with open_dict(cfg):
        cfg.lr = 0.05
    assert _describe_stop(exc, cfg, _hc("lr=0.05")).endswith("fedexp run lr=0.005")


# --- the health check and the files -----------------------------------------------------------


def test_the_health_check():
    cfg = OmegaConf.create({"divergence_factor": 1e4})
    start = {"round": 0.0, "loss/mean": 0.7, "time/eval_s": 0.1}

    def healthy(row, clients=(), **cfg_over):
        c = OmegaConf.merge(cfg, cfg_over)
        rows = [{"round": 1.0, "client": float(n), "loss": v} for n, v in enumerate(clients)]
        return _healthy(c, [start, {"round": 1.0, **row}], rows)

    assert healthy({"train/train_loss": 6.9})  # up to ×10 the initial loss
    assert not healthy({"train/train_loss": 7.1})  # far below the stop rule's ×1e4
    assert not healthy({"train/train_loss": math.nan})
    assert healthy({"train/train_loss": 3.0}, divergence_factor=0)  # the check off: still ×10
    assert not healthy({"train/train_loss": 3.0}, divergence_factor=4)  # stricter stop rule
    evaluated = {"train/train_loss": 0.5, "time/eval_s": 0.1}
    assert healthy({**evaluated, "loss/mean": 0.6}, clients=[0.5, 0.7, math.nan])  # no test set
    assert not healthy({**evaluated, "loss/mean": 1e9})  # the test loss blew up
    assert not healthy(evaluated)  # evaluated, and no client's test loss was finite
    assert not healthy({**evaluated, "loss/mean": 0.6}, clients=[0.6, math.inf])
    assert healthy({"loss/mean": 1e9})  # not evaluated this round: its train loss alone
    assert healthy({})  # nothing to judge by


def test_promote_copies_where_there_are_no_hard_links(tmp_path, monkeypatch):
    import torch

    folder = tmp_path / "ckpt"
    checkpoint.save(folder, {"x": torch.arange(3.0)}, {"round": 1, "good_round": 1})

    def no_links(src, dst):
        raise OSError("hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    last, good = _paths(folder)
    assert checkpoint.promote(folder) == good
    assert not os.path.samefile(last, good) and good.read_bytes() == last.read_bytes()
    assert checkpoint.load(good)[1]["round"] == 1


def test_rescue_point_of_old_and_odd_folders(tmp_path):
    import torch

    tree = {"x": torch.zeros(2)}
    assert checkpoint.rescue_point(tmp_path / "none").kind == "none"
    old = tmp_path / "old"  # an older fedexp's checkpoint: no good_round, resumed as before
    checkpoint.save(old, tree, {"round": 4})
    assert checkpoint.rescue_point(old) == ("last", old, 4, 4)
    torn = tmp_path / "torn"  # unreadable: resumed as before (the load will say what is wrong)
    torn.mkdir()
    (torn / checkpoint.FILENAME).write_bytes(b"")
    assert checkpoint.rescue_point(torn) == ("last", torn, None, None)
    # a good checkpoint not of this run's past (round ≥ the one being written) is dropped
    new = tmp_path / "new"
    checkpoint.save(new, tree, {"round": 5, "good_round": 5})
    checkpoint.promote(new)
    assert checkpoint.good_round(new, 7) == 5
    assert checkpoint.good_round(new, 5) is None and not (new / checkpoint.GOOD_FILENAME).exists()
    # stale temporary files of the good checkpoint are cleaned like the last one's
    stale = new / f".{checkpoint.GOOD_FILENAME}.tmp-{os.getpid()}"
    stale.write_bytes(b"x")
    assert stale in checkpoint.remove_stale_temps(new) and not stale.exists()


def test_a_rescued_run_records_the_failed_attempt_and_the_rescue_in_mlflow(tmp_path):
    """Issue 70, item 10: after a rescue from the good checkpoint the FINISHED run kept the
    failed attempt's tags (``fedexp.resume.2.lr = 0.1 -> 100.0``, ``error = DivergenceError
    ...``): a reader would take rounds 3-8 for trained at lr 100. The attempt and the rescue
    are recorded instead."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    ml = [*DITTO, "tracker=mlflow", f"tracker.uri={uri}", "tracker.system_metrics=false"]
    ml = [o for o in ml if o != "tracker=none"]
    first = run(compose_config(*ml, "rounds=2", output_dir=tmp_path / "a"))
    folder = tmp_path / "a" / "checkpoints"
    with pytest.raises(DivergenceError, match="in round 7"):
        run(compose_config(*ml, "rounds=8", "lr=100", f"resume={folder}", output_dir=tmp_path))
    client = MlflowClient(uri)
    failed = client.get_run(first.run_id)
    assert failed.info.status == "FAILED" and failed.data.tags["fedexp.resume.2.lr"]
    good = folder / checkpoint.GOOD_FILENAME
    rescue = compose_config(*ml, "rounds=8", "lr=0.1", f"resume={good}", output_dir=tmp_path)
    assert run(rescue).run_id == first.run_id  # the same MLflow run
    tags = client.get_run(first.run_id).data.tags
    assert client.get_run(first.run_id).info.status == "FINISHED"
    assert "error" not in tags and "fedexp.resume.2.lr" not in tags  # the attempt's
    assert tags["fedexp.resume.2.rounds"] == "2 -> 8"  # the rescue's own change stays
    attempt = tags["fedexp.attempt.1"]
    assert attempt.startswith("failed: DivergenceError: ") and "in round 7" in attempt
    assert attempt.endswith("; after round 2: lr 0.1 -> 100.0"), attempt
    assert tags["fedexp.rescue"] == "resumed after round 2 with lr=0.1 (attempt 1 failed)"
