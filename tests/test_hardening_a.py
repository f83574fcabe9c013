"""Hardening (issue 12, part A): a folder of its own for every run, no code from configs,
checkpoint integrity, resume across trackers, nothing left RUNNING or half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf
from omegaconf import open_dict

from fedexp.config.instantiate import check_node
from fedexp.config.instantiate import fresh_dir
from fedexp.config.instantiate import instantiate_checked
from fedexp.engine.files import checkpoint
from fedexp.engine.runner import run
from fedexp.errors import CheckpointError
from fedexp.errors import ConfigError
from fedexp.errors import Terminated
from fedexp.tracking.base import NullTracker
from helpers import CONF
from helpers import mlflow_db
from helpers import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

CLI = [sys.executable, "-c", "from fedexp.cli import entry; entry()", "run"]
FAST = ["rounds=1", "progress=none", "device=cpu", "checkpoint_every=0"]


def _one_clean_line(proc, *needles):
    """Exit ≠ 0, no traceback, one line on stderr holding every needle."""
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """One SQLite MLflow store for the module (creating one costs seconds)."""
    uri = mlflow_db(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    MlflowClient(uri).search_experiments()  # create it now, not inside a timed test
    return uri


@pytest.fixture
def store(db, request):
    """``(uri, experiment)``: the module's store, an experiment of this test's own."""
    return db, request.node.name


def _cfg(small_cfg, *overrides, store=None):
    cfg = small_cfg(*overrides)
    if store is not None:
        with open_dict(cfg):
            cfg.tracker.uri, cfg.tracker.experiment = store
    return cfg


def _runs(store):
    client = MlflowClient(store[0])
    exp = client.get_experiment_by_name(store[1])
    return client.search_runs([exp.experiment_id]) if exp else []


def _steps(client, run_id, key="acc/weighted"):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


# --- 1. every run gets a folder of its own ---------------------------------------------------


def test_fresh_dir_never_reuses_a_folder(tmp_path):
    (tmp_path / "taken").mkdir()
    got = [fresh_dir(tmp_path / "taken") for _ in range(3)]
    assert got == [f"{tmp_path}/taken-{n}" for n in (1, 2, 3)]
    assert fresh_dir(tmp_path / "new" / "t") == f"{tmp_path}/new/t"


def test_config_run_and_sweep_dirs_claim_a_fresh_folder():
    hydra = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["hydra"]
    assert hydra["sweep"]["dir"].startswith("${fedexp.fresh_dir:"), hydra["sweep"]["dir"]
    # a run's: fresh_dir unless it resumes a run's checkpoints (then that run's folder)
    assert hydra["run"]["dir"].startswith("${fedexp.run_dir:${resume},"), hydra["run"]["dir"]


@pytest.mark.slow
def test_runs_started_together_get_their_own_folders(tmp_path):
    # same base folder, started at once: each claims its own and writes its results there (a
    # refused run would remove its folder again: one short round each)
    args = [f"hydra.run.dir=${{fedexp.fresh_dir:{tmp_path}/run}}", "rounds=1", "tracker=none",
            "progress=none", "checkpoint_every=0", "threads=1"]  # fmt: skip
    procs = [
        subprocess.Popen([*CLI, *args], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run-1"]
    assert all((tmp_path / name / "rounds.csv").is_file() for name in ("run", "run-1"))


def test_runner_fallback_folder_is_never_shared(small_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    real = time.strftime
    frozen = "2000-01-01/00-00-00"  # both runs "in the same second"
    monkeypatch.setattr(
        time, "strftime", lambda fmt, *a: frozen if fmt == "%Y-%m-%d/%H-%M-%S" else real(fmt, *a)
    )
    cfg = _cfg(small_cfg, "rounds=1", "tracker=none")
    with open_dict(cfg):
        cfg.output_dir = None
    first, second = run(cfg), run(cfg)
    assert first.output_dir != second.output_dir
    assert {first.output_dir.name, second.output_dir.name} == {"00-00-00", "00-00-00-1"}
    assert all((r.output_dir / "rounds.csv").is_file() for r in (first, second))


# --- 2. only fedexp's own classes can be configured -------------------------------------------


@pytest.mark.parametrize(
    "node,key",
    [
        ({"_target_": "pandas.read_pickle", "_args_": ["x.pkl"]}, "algorithm._target_"),
        ({"_target_": "builtins.open", "file": "mlflow.db", "mode": "w"}, "algorithm._target_"),
        ({"_target_": "os.system", "command": "true"}, "algorithm._target_"),
        ({"_target_": "this.d"}, "algorithm._target_"),  # `this` prints on import
        (
            {
                "_target_": "fedexp.algorithms.fedavg.FedAvg",
                "x": {"y": [{"_target_": "subprocess.run"}]},
            },
            "algorithm.x.y[0]._target_",
        ),
        (
            {"_target_": "fedexp.engine.files.checkpoint.save_file"},
            "algorithm._target_",
        ),  # imported
        ({"_target_": "fedexp.engine.files.checkpoint.os.system"}, "algorithm._target_"),
        ({"_target_": "fedexp.engine.runner.__builtins__"}, "algorithm._target_"),
        ({"_target_": "fedexp.algorithms.fedavg.FedAvg", "_args_": [1.0]}, "algorithm._args_"),
    ],
    ids=[
        "read_pickle-args",
        "open",
        "os.system",
        "not-imported",
        "nested",
        "re-exported",
        "attribute-walk",
        "dunder",
        "args-on-own-class",
    ],
)
def test_foreign_targets_are_refused_before_import(node, key):
    cfg = OmegaConf.create(node)
    with pytest.raises(ConfigError) as err:
        instantiate_checked(cfg, "algorithm")
    assert str(err.value).startswith(key), err.value
    assert "this" not in sys.modules


def test_own_targets_still_build():
    node = OmegaConf.create({"_target_": "fedexp.algorithms.fedavg.FedAvg"})
    check_node(node, "algorithm")
    assert type(instantiate_checked(node, "algorithm")).__name__ == "FedAvg"


@pytest.mark.parametrize(
    "args,needles",
    [
        (
            ["algorithm._target_=pandas.read_pickle", "+algorithm._args_=[victim.pkl]"],
            ["algorithm._target_='pandas.read_pickle'", "fedexp.*"],
        ),
        (
            ["tracker._target_=builtins.open", "+tracker.file=mlflow.db", "+tracker.mode=w"],
            ["tracker._target_='builtins.open'"],
        ),
        (
            ["+algorithm.hook={_target_:subprocess.run,args:[touch,sentinel]}"],
            ["algorithm.hook._target_='subprocess.run'"],
        ),
    ],
    ids=["read_pickle", "open-truncating-mlflow.db", "nested-subprocess"],
)
def test_cli_refuses_foreign_targets_touching_nothing(tmp_path, args, needles):
    (tmp_path / "mlflow.db").write_bytes(b"precious")
    proc = run_cli("run", *FAST, f"hydra.run.dir={tmp_path}/out", *args, cwd=tmp_path)
    _one_clean_line(proc, *needles)
    assert (tmp_path / "mlflow.db").read_bytes() == b"precious"
    assert not (tmp_path / "sentinel").exists()
    # the folder hydra.run.dir named, made by this refused command, is gone (issue 70, item 11)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


@pytest.mark.parametrize(
    "arg",
    [
        "+hydra.callbacks.x={_target_:subprocess.run,args:[touch,sentinel]}",
        "hydra.launcher._target_=os.system",
        "++hydra.job_logging.handlers.h={class:os.system}",
    ],
    ids=["callback", "launcher", "logging-class"],
)
def test_cli_refuses_hydra_settings_that_name_code(tmp_path, arg):
    proc = run_cli("run", *FAST, arg, cwd=tmp_path)
    _one_clean_line(proc, arg.split("=")[0].lstrip("+"), "cannot be overridden")
    assert list(tmp_path.iterdir()) == []


# --- 3. checkpoint integrity ------------------------------------------------------------------


def test_corrupted_checkpoint_is_refused_and_nothing_appended(small_cfg, tmp_path, store):
    cfg = _cfg(small_cfg, "rounds=2", "checkpoint_every=1", store=store)
    first = run(cfg)
    out = tmp_path / "out"
    ckpt = out / "checkpoints" / checkpoint.FILENAME
    before = {p: p.read_bytes() for p in out.iterdir() if p.is_file()}
    data = bytearray(ckpt.read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])  # the last tensor's bytes, after the header
    ckpt.write_bytes(bytes(data))
    with open_dict(cfg):
        cfg.resume = str(ckpt.parent)
        cfg.rounds = 4
    with pytest.raises(CheckpointError, match="corrupted") as err:
        run(cfg)
    assert str(ckpt) in str(err.value) and "\n" not in str(err.value)
    assert {p: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    client = MlflowClient(store[0])
    assert _steps(client, first.run_id) == [0, 1, 2]
    assert [r.info.status for r in _runs(store)] == ["FINISHED"]


def test_checkpoint_checksum_roundtrip_and_legacy_files(tmp_path, caplog):
    import torch
    from safetensors.torch import save_file

    tree = {"server": {"x": torch.arange(5.0)}, "client": {"0": {"m": torch.tensor(True)}}}
    path = checkpoint.save(tmp_path / "a", tree, {"round": 1})
    loaded, meta = checkpoint.load(path)
    assert torch.equal(loaded["server"]["x"], tree["server"]["x"]) and meta == {"round": 1}
    save_file(checkpoint.flatten_state(tree), str(tmp_path / "old.safetensors"),
              metadata={"fedexp": '{"round": 1}'})  # fmt: skip
    with pytest.raises(CheckpointError, match="has no seal.*resume_unsealed=true"):
        checkpoint.load(tmp_path / "old.safetensors")  # unsealed: refused
    with caplog.at_level("WARNING", logger="fedexp"):
        checkpoint.load(tmp_path / "old.safetensors", allow_unsealed=True)
    assert "no seal" in caplog.text


def test_cli_says_corrupted_without_a_resume_hint():
    from fedexp.cli.output import describe_stop as _describe_stop

    cfg = OmegaConf.create({"resume": "/x/checkpoints", "output_dir": "/y"})
    text = _describe_stop(CheckpointError("resume=/x: /x/last.safetensors is corrupted"), cfg, None)
    assert text == "error: resume=/x: /x/last.safetensors is corrupted"


# --- 4. the tracker may change on resume ------------------------------------------------------


@pytest.mark.slow
def test_resume_from_tracker_none_into_mlflow(small_cfg, tmp_path, store):
    run(_cfg(small_cfg, "rounds=2", "checkpoint_every=1", "tracker=none"))
    ckpts = str(tmp_path / "out" / "checkpoints")
    res = run(_cfg(small_cfg, "rounds=4", "checkpoint_every=1", f"resume={ckpts}", store=store))
    client = MlflowClient(store[0])
    r = client.get_run(res.run_id)
    assert r.info.status == "FINISHED" and r.data.tags["fedexp.resumed_from"] == "null-run"
    assert _steps(client, res.run_id) == [0, 1, 2, 3, 4]  # the first rounds replayed
    assert checkpoint.load(tmp_path / "out" / "checkpoints")[1]["run_id"] == res.run_id


@pytest.mark.slow
def test_resume_from_mlflow_with_tracker_none_and_back(small_cfg, tmp_path, store):
    first = run(_cfg(small_cfg, "rounds=2", "checkpoint_every=1", store=store))
    ckpts = str(tmp_path / "out" / "checkpoints")
    cfg = _cfg(small_cfg, "rounds=4", "checkpoint_every=1", "tracker=none", f"resume={ckpts}")
    res = run(cfg)
    assert isinstance(res.tracker, NullTracker)
    assert sorted(res.tracker.metrics["acc/weighted"]) == [0, 1, 2, 3, 4]
    # back to MLflow: the same run, with the rounds run under tracker=none filled in
    again = run(_cfg(small_cfg, "rounds=5", "checkpoint_every=1", f"resume={ckpts}", store=store))
    client = MlflowClient(store[0])
    assert again.run_id == first.run_id
    assert _steps(client, first.run_id) == [0, 1, 2, 3, 4, 5]
    assert client.get_run(first.run_id).info.status == "FINISHED"


# --- 5. no run left RUNNING, no temporary file left behind ------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_checkpoint_temp_files_are_removed_on_resume(small_cfg, tmp_path):
    cfg = _cfg(small_cfg, "rounds=1", "checkpoint_every=1", "tracker=none")
    run(cfg)
    folder = tmp_path / "out" / "checkpoints"
    stale = [folder / f".{checkpoint.FILENAME}.tmp-{pid}" for pid in (_dead_pid(), os.getpid())]
    live = folder / f".{checkpoint.FILENAME}.tmp-1"  # pid 1 is alive: a writer at work
    for path in (*stale, live):
        path.write_bytes(b"torn")
    with open_dict(cfg):
        cfg.resume = str(folder)
        cfg.rounds = 2
    run(cfg)
    assert not any(p.exists() for p in stale) and live.exists()


def test_failed_checkpoint_write_leaves_no_temp_file(tmp_path, monkeypatch):
    import torch

    def torn(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", torn)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, {"x": torch.zeros(3)}, {"round": 1})
    assert list(tmp_path.iterdir()) == []


def test_run_raising_in_the_round_loop_ends_failed(small_cfg, store):

    def boom(engine, metrics):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run(_cfg(small_cfg, "rounds=3", store=store), callbacks=[boom])
    (r,) = _runs(store)
    assert r.info.status == "FAILED" and r.data.tags["error"] == "RuntimeError: boom"


def test_run_left_open_is_ended_killed_at_exit(store, monkeypatch):
    from types import SimpleNamespace

    from fedexp.tracking.mlflow_tracker import MLflowTracker

    hooks = []
    fake = SimpleNamespace(register=hooks.append, unregister=hooks.remove)
    monkeypatch.setattr("fedexp.tracking.mlflow_tracker.atexit", fake)
    tracker = MLflowTracker(*store)
    tracker.start("open", {}, {})
    assert hooks == [tracker._end_at_exit]
    hooks[0]()  # what the interpreter does at exit with the run still open
    assert [r.info.status for r in _runs(store)] == ["KILLED"] and hooks == []


def test_sigterm_before_the_first_checkpoint_ends_killed(small_cfg, store):
    # the CLI's SIGTERM handler, in this process: the signal arrives during round 1
    from fedexp.cli.job import _raise_terminated
    from fedexp.cli.output import describe_stop as _describe_stop

    def term(engine, metrics):
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with pytest.raises(Terminated) as err:
            run(_cfg(small_cfg, "rounds=3", "checkpoint_every=0", store=store), callbacks=[term])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [r.info.status for r in _runs(store)] == ["KILLED"]
    cfg = OmegaConf.create({"resume": None, "output_dir": str(store[0])})
    assert _describe_stop(err.value, cfg, None) == "terminated (SIGTERM)"


# --- checkpoints sealed whole (issue 24, item 5) -----------------------------------------------


def _edit_header(path, old: bytes, new: bytes) -> None:
    """Replace the first ``old`` by ``new`` (same length) inside the file's JSON header."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = bytes(data[8 : 8 + size])
    assert len(old) == len(new) and old in header, (old, header[:200])
    data[8 : 8 + size] = header.replace(old, new, 1)
    path.write_bytes(bytes(data))


def test_a_changed_digit_in_the_header_is_refused(small_cfg, tmp_path):
    """The seal covers the metadata (history, ledger, config), not only the tensors: one digit
    changed in the header, the file still well-formed, is refused with the file named."""
    run(_cfg(small_cfg, "rounds=2", "checkpoint_every=1", "tracker=none"))
    ckpt = tmp_path / "out" / "checkpoints" / checkpoint.FILENAME
    loaded, meta = checkpoint.load(ckpt)
    assert meta["round"] == 2
    _edit_header(ckpt, b'\\"round\\": 2', b'\\"round\\": 1')
    with pytest.raises(CheckpointError, match="header .* does not match the seal") as err:
        checkpoint.load(ckpt)
    assert str(ckpt) in str(err.value)
    cfg = _cfg(small_cfg, "rounds=4", "tracker=none", f"resume={ckpt.parent}")
    with pytest.raises(CheckpointError, match="does not match the seal"):
        run(cfg)


def test_an_unsealed_checkpoint_resumes_only_when_asked(small_cfg, tmp_path):
    """A checkpoint whose seal is gone (an older fedexp's) is refused on resume, and resumes,
    unverified, with resume_unsealed=true."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from safetensors.torch import save_file

    run(_cfg(small_cfg, "rounds=2", "checkpoint_every=1", "tracker=none"))
    ckpt = tmp_path / "out" / "checkpoints" / checkpoint.FILENAME
    with safe_open(str(ckpt), framework="pt") as fh:
        metadata = dict(fh.metadata())
    del metadata["seal"]
    save_file(load_file(str(ckpt)), str(ckpt), metadata=metadata)
    with pytest.raises(CheckpointError, match="has no seal"):
        run(_cfg(small_cfg, "rounds=3", "tracker=none", f"resume={ckpt.parent}"))
    res = run(
        _cfg(small_cfg, "rounds=3", "tracker=none", f"resume={ckpt.parent}", "resume_unsealed=true")
    )
    assert res.metrics["round"] == 3.0


def test_a_sealed_checkpoint_lacking_a_key_is_refused_in_one_line(small_cfg, tmp_path):
    """A well-formed, sealed file whose metadata lacks what a resume reads (``ledger``): one
    line naming the missing key, not a KeyError."""
    import torch

    folder = tmp_path / "ckpt"
    checkpoint.save(folder, {"server": {"x": torch.zeros(3)}}, {"round": 1, "config": "{}"})
    with pytest.raises(CheckpointError, match="metadata lacks ledger, run_id, history") as err:
        run(_cfg(small_cfg, "rounds=2", "tracker=none", f"resume={folder}"))
    assert "\n" not in str(err.value)
