"""Hardening (issue 12, part C): a diverged run can be rescued with a smaller lr (recorded),
finite blow-ups are stopped, an unreachable tracking server fails in seconds, and tabular
runs import no MONAI."""

from __future__ import annotations

import http.server
import shlex
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from omegaconf import open_dict

from fedexp.cli.output import describe_stop as _describe_stop
from fedexp.config.schema import validate
from fedexp.engine.files import checkpoint
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.errors import DivergenceError
from fedexp.errors import TrackerError
from fedexp.tracking.base import NullTracker
from fedexp.tracking.mlflow_tracker import check_reachable
from helpers import ROOT
from helpers import compose_config
from helpers import mlflow_db
from helpers import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["progress=none", "tracker=none", "device=cpu"]


def _one_clean_line(proc, *needles):
    """Exit ≠ 0, no traceback, one line on stderr holding every needle; returns it."""
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- 1. a diverged run can be rescued ---------------------------------------------------------


@pytest.mark.slow
def test_diverged_run_prints_the_rescue_command_and_the_rescue_finishes(tmp_path):
    # a healthy start, checkpointed every round ...
    first = compose_config(*FAST, "rounds=2", "checkpoint_every=1", output_dir=tmp_path / "a")
    run(first)
    ckpt = tmp_path / "a" / "checkpoints"
    # ... then continued with an absurd lr: round 3 diverges (NaN) through the CLI
    args = [*FAST, "rounds=4", "checkpoint_every=1", "lr=1e38", f"resume={ckpt}"]
    proc = run_cli("run", *args, cwd=tmp_path)
    line = _one_clean_line(proc, "diverged", "in round 3", "checkpoint kept", "lr=0.1")
    command = shlex.split(line[line.index("fedexp run") :])
    assert command[:2] == ["fedexp", "run"] and f"resume={ckpt}" in command
    # replaces lr=1e38: the config's default lr, as lr=1e38 is above it (issue 44 item 7)
    assert [a for a in command if a.startswith("lr=")] == ["lr=0.1"]
    assert checkpoint.load(ckpt)[1]["round"] == 2  # the last good checkpoint is kept
    # the printed command, with another lr (so that the change is recorded), finishes the run
    rescue = [a if not a.startswith("lr=") else "lr=0.05" for a in command[2:]]
    tracker = NullTracker()
    res = run(compose_config(*rescue, output_dir=tmp_path / "b"), tracker=tracker)
    assert res.metrics["round"] == 4.0 and sorted(tracker.steps) == [0, 1, 2, 3, 4]
    assert tracker.tags["fedexp.resume.2.lr"] == "0.1 -> 0.05"
    assert tracker.tags["fedexp.resume.2.rounds"] == "2 -> 4"
    _, meta = checkpoint.load(ckpt)
    assert meta["round"] == 4 and OmegaConf.create(meta["config"]).lr == 0.05
    assert {"round": 2, "key": "lr", "from": "0.1", "to": "0.05"} in meta["changes"]


@pytest.mark.slow
def test_lr_change_on_resume_is_recorded_in_mlflow_and_the_checkpoint(small_cfg, tmp_path):
    cfg = small_cfg("rounds=2", "checkpoint_every=1")
    with open_dict(cfg):
        cfg.tracker.uri = mlflow_db(tmp_path / "mlflow.db")
    first = run(cfg)
    with open_dict(cfg):
        cfg.resume = str(tmp_path / "out" / "checkpoints")
        cfg.rounds, cfg.lr, cfg.local_steps = 3, 0.05, 2
    again = run(cfg)
    with open_dict(cfg):  # a second rescue: compared with the settings of the first
        cfg.rounds, cfg.lr = 4, 0.02
    third = run(cfg)
    assert first.run_id == again.run_id == third.run_id  # the same MLflow run throughout
    got = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(first.run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params["lr"] == "0.1"  # params are immutable: the first value stays
    tags = {k: v for k, v in got.data.tags.items() if k.startswith("fedexp.resume.")}
    assert tags == {
        "fedexp.resume.2.lr": "0.1 -> 0.05",
        "fedexp.resume.2.local_steps": "5 -> 2",
        "fedexp.resume.2.rounds": "2 -> 3",
        "fedexp.resume.3.lr": "0.05 -> 0.02",
        "fedexp.resume.3.rounds": "3 -> 4",
    }
    _, meta = checkpoint.load(tmp_path / "out" / "checkpoints")
    assert sorted((c["round"], c["key"]) for c in meta["changes"]) == [
        (2, "local_steps"),
        (2, "lr"),
        (2, "rounds"),
        (3, "lr"),
        (3, "rounds"),
    ]


def test_settings_that_define_the_experiment_still_cannot_change(small_cfg, tmp_path):
    cfg = small_cfg("rounds=1", "checkpoint_every=1", "tracker=none")
    run(cfg)
    with open_dict(cfg):
        cfg.resume = str(tmp_path / "out" / "checkpoints")
        cfg.batch_size, cfg.lr = 16, 0.01
    with pytest.raises(ConfigError, match="different batch_size;.*lr and local_steps"):
        run(cfg)


def test_divergence_before_any_checkpoint_suggests_a_fresh_run_with_a_smaller_lr(tmp_path):
    hc = SimpleNamespace(overrides=SimpleNamespace(task=["lr=3", "rounds=9", "seed=1"]))
    cfg = OmegaConf.create({"resume": None, "output_dir": str(tmp_path), "lr": 3.0})
    exc = DivergenceError("client 2: training loss is nan in round 1: the run diverged")
    text = _describe_stop(exc, cfg, hc)
    assert text.endswith(  # 3 is above the config's default lr: the default (issue 44 item 7)
        "no checkpoint yet: run it again with a smaller lr: fedexp run rounds=9 seed=1 lr=0.1"
    ), text
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / checkpoint.FILENAME).write_bytes(b"")
    text = _describe_stop(exc, cfg, hc)
    assert text.endswith(f"fedexp run rounds=9 seed=1 resume={tmp_path}/checkpoints lr=0.1")


# --- 2. blow-ups are detected, not only NaN/inf -----------------------------------------------


def test_a_finite_blowup_is_stopped_by_divergence_factor(small_cfg, tmp_path):
    # a small MLP with lr=40: the loss goes from about 0.7 to ~1e5 and beyond, still finite
    # (with the check off the run finishes), then its ReLUs die and it settles, useless
    # (seed 3: the blow-up comes in round 2, after a good round was checkpointed)
    overrides = ["model=mlp", "model.hidden=8", "lr=40", "rounds=3", "tracker=none", "seed=3"]
    assert run(small_cfg(*overrides, "divergence_factor=0")).metrics["round"] == 3.0
    tracker = NullTracker()
    with pytest.raises(DivergenceError, match=r"grew from 0\.\d+ to .* by round 2") as err:
        run(small_cfg(*overrides, "checkpoint_every=1"), tracker=tracker)
    assert "lower lr=40" in str(err.value) and "\n" not in str(err.value)
    assert sorted(tracker.steps) == [0, 1]  # the blown-up round is not logged
    assert tracker.status == "FAILED"
    assert checkpoint.load(tmp_path / "out" / "checkpoints")[1]["round"] == 1  # the good one


def test_divergence_factor_is_validated():
    base = compose_config(*FAST)
    for value in (0.0, 10.0):
        cfg = base.copy()
        cfg.divergence_factor = value
        validate(cfg)
    cfg = base.copy()
    cfg.divergence_factor = -1.0
    with pytest.raises(ConfigError, match=r"divergence_factor=-1\.0: expected ≥ 0"):
        validate(cfg)


# --- 3. an unreachable tracking server fails in seconds ---------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_unreachable_tracking_server_fails_fast_in_one_line(tmp_path):
    uri = f"http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    proc = run_cli(
        "run",
        "rounds=1",
        "progress=none",
        "device=cpu",
        f"tracker.uri={uri}",
        cwd=tmp_path,
        timeout=120,
    )
    took = time.monotonic() - started
    _one_clean_line(proc, f"tracker.uri={uri}", "no MLflow server answers", "tracker=none")
    assert took < 60, took  # MLflow's own retries take minutes


def test_check_reachable_accepts_any_http_answer_and_times_out_on_silence():
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's API
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        check_reachable(f"http://127.0.0.1:{port}")  # MLflow's /health
        check_reachable(f"http://127.0.0.1:{port}/prefix/")  # 404: answers all the same
    finally:
        server.shutdown()
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TrackerError, match=r"no answer within 0\.5 s"):
            check_reachable(uri, timeout=0.5)
    check_reachable("sqlite:///nowhere/mlflow.db")  # local stores are not probed


# --- 4. tabular runs import no MONAI ----------------------------------------------------------


@pytest.mark.slow
def test_default_run_imports_no_monai(tmp_path):
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from helpers import compose_config\n"
        "from fedexp.engine.runner import run\n"
        "run(compose_config('rounds=1', 'tracker=none', 'progress=none', 'device=cpu',\n"
        f"                  output_dir={str(tmp_path / 'out')!r}))\n"
        "print('monai' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
