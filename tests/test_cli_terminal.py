"""The CLI on the terminal (issue 13): `fedexp --help` reads as help, a single run's name, the
progress bar at 80 columns, the job id on a sweep job's lines, SLURM off a cluster."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import MISSING
from dataclasses import fields
from dataclasses import is_dataclass

import pytest
import yaml
from mlflow.tracking import MlflowClient
from rich.console import Console

from fedexp.cli.help import setting_docs
from fedexp.config.schema import RunConfig
from fedexp.engine.files.progress import RoundProgress
from fedexp.engine.files.progress import job_label
from fedexp.engine.files.progress import job_line
from fedexp.sweep import NO_SLURM
from helpers import CONF
from helpers import ROOT
from helpers import mlflow_db
from helpers import run_cli

CLI = [sys.executable, "-c", "from fedexp.cli import entry; entry()"]


def _help(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _expected_defaults() -> dict[str, str]:
    """Every RunConfig field and its default as conf/config.yaml composes it."""
    config = yaml.safe_load((CONF / "config.yaml").read_text())
    groups = {k: v for d in config["defaults"] if isinstance(d, dict) for k, v in d.items()}
    out = {}
    for f in fields(RunConfig):
        if is_dataclass(f.default_factory):  # distributed: its keys, distributed.nproc=1, ...
            for g in fields(f.default_factory):
                value = (config.get(f.name) or {}).get(g.name, g.default)
                out[f"{f.name}.{g.name}"] = (
                    str(value).lower() if isinstance(value, bool) else str(value)
                )
            continue
        value = groups[f.name] if f.default is MISSING else config.get(f.name, f.default)
        if value is None:
            value = "null"
        elif isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, float):
            value = f"{value:g}"
        out[f.name] = str(value)
    return out


def test_help_lists_every_setting_with_its_default_and_meaning():
    proc = _help("--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for name, default in _expected_defaults().items():
        assert re.search(rf"^  {re.escape(name)}={re.escape(default)} ", out, re.M), name
    # spot checks, written out: the defaults a user reads
    for shown in ("rounds=50", "lr=0.1", "local_epochs=null", "divergence_factor=10000"):
        assert f"  {shown} " in out
    flat = " ".join(out.split())
    docs = setting_docs()
    assert set(docs) >= {
        f.name
        for f in fields(RunConfig)
        if f.default is not MISSING and not is_dataclass(f.default_factory)
    }
    for name, meaning in docs.items():
        assert " ".join(meaning.split()) in flat, name
    assert "algorithm.lam=0.1" in out and "fedavg*" in out and "+experiment" in out
    for group in ("algorithm", "dataset", "model", "partition", "compressor", "tracker"):
        options = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        line = re.search(rf"^  {group} +(.*)$", out, re.M).group(1)
        assert line.split()[0].rstrip("*") == options[0], group
    assert re.search(r"^  hydra/launcher +parallel slurm$", out, re.M)
    assert "fedexp run -m" in out and "fedexp report" in out and "--hydra-help" in out


def test_run_help_is_ours_and_hydra_help_is_hydras():
    ours = _help("--help").stdout
    assert _help("run", "--help").stdout == ours
    assert _help("run", "-h", "seed=1").stdout == ours
    hydra = _help("run", "--hydra-help")
    assert hydra.returncode == 0 and "Hydra (1." in hydra.stdout and "rounds=50" not in hydra.stdout


def test_run_help_imports_nothing_heavy():
    code = (
        "import sys; from fedexp.cli import main; sys.argv = ['fedexp', 'run', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('LOADED', *sorted({m.split('.')[0] for m in sys.modules}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    loaded = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOADED")).split()
    assert not {"hydra", "omegaconf", "torch", "mlflow"} & set(loaded)


def test_slurm_launcher_off_a_cluster_is_one_line(tmp_path):
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p)
    if shutil.which("sbatch", path=path):
        pytest.skip("this machine has SLURM")
    proc = subprocess.run(
        [*CLI, "run", "-m", "hydra/launcher=slurm", "seed=0,1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr == f"fedexp: error: {NO_SLURM}\n"
    assert NO_SLURM.startswith("hydra/launcher=slurm: no SLURM here (sbatch not found on PATH)")
    assert list(tmp_path.iterdir()) == []  # nothing ran, no folder made


@pytest.mark.slow
def test_single_run_is_named_by_what_its_command_line_changes(tmp_path):
    uri = mlflow_db(tmp_path / "m.db")
    args = ["rounds=1", "num_clients=3", "progress=none", "device=cpu", "checkpoint_every=0"]
    proc = run_cli(
        "run",
        *args,
        "algorithm=local",
        "seed=3",
        f"tracker.uri={uri}",
        f"hydra.run.dir={tmp_path}/run",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Per-client results" in proc.stdout  # a single run keeps its table
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("fedexp").experiment_id])
    # algorithm first, then the settings that change results, the seed last (not progress,
    # device, checkpoint_every, tracker.uri, hydra.*); the default run keeps its long name
    assert [r.info.run_name for r in runs] == ["local rounds=1 N=3 s3"]
    assert "mlflow.parentRunId" not in runs[0].data.tags


LONG = {
    "acc/mean": 0.61363,
    "train/train_loss": 0.72021,
    "pfednet/spread": 0.1234,
    "bytes/up_cum": 3720000,
    "bytes/down_cum": 3720000,
}


@pytest.mark.parametrize("label", [None, "job 12"])
def test_progress_bar_keeps_round_bar_and_eta_at_80_columns(label):
    console = Console(width=80, record=True)
    with job_label(label) if label else nullcontext():
        with RoundProgress(50, mode="bar", console=console) as progress:
            for t in (1, 2, 3):
                progress.update(t, LONG)
    lines = [ln for ln in console.export_text().splitlines() if ln.strip()]
    assert lines and all(len(ln) <= 80 for ln in lines), lines
    last = lines[-1]
    prefix = "[job 12] " if label else ""
    assert re.match(rf"^{re.escape(prefix)}round +3/50 ━", last), last
    assert re.search(r" (\d+:\d\d:\d\d|-:--:--) acc/mean=0\.6136 ", last), last  # the ETA
    assert last.endswith("…"), last  # the metrics text is what gets cut


def test_parallel_job_logs_progress_with_its_job_id(caplog):
    caplog.set_level(logging.INFO, logger="fedexp")
    terminal = Console(force_terminal=True)
    with job_label("job 3", parallel=True):
        with RoundProgress(2, mode="auto", console=terminal) as progress:
            assert progress.mode == "log"  # no bar from parallel jobs, even on a terminal
            progress.update(1, {"acc/mean": 0.5})
        logging.getLogger("fedexp").warning("something else")
    logging.getLogger("fedexp").warning("after the job")
    assert "[job 3] round 1/2 acc/mean=0.5" in caplog.text
    assert "[job 3] something else" in caplog.text
    assert "after the job" in caplog.text and "[job 3] after the job" not in caplog.text
    assert RoundProgress(2, mode="auto", console=terminal).mode == "bar"


class _Writes:
    """A stream that keeps every ``write`` call apart, as an unbuffered pipe passes them on."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("err", [False, True])
def test_a_jobs_line_is_one_write(monkeypatch, err):
    """Jobs ending together under ``PYTHONUNBUFFERED=1`` printed ``[job 0] a[job 1] b`` and an
    empty line (a CI run of tests/test_sweep_readable.py): ``print`` writes the newline apart."""
    out = _Writes()
    monkeypatch.setattr(sys, "stderr" if err else "stdout", out)
    with job_label("job 7"):
        job_line("fedavg s0  acc/mean=0.9000", err=err)
    job_line("after", err=err)
    assert out.calls == ["[job 7] fedavg s0  acc/mean=0.9000\n", "after\n"]


@pytest.mark.parametrize("columns", [60, 80, 100, 200])
def test_help_fits_the_terminal(columns, monkeypatch):
    """``fedexp --help`` keeps to the terminal's width (60-100 columns; wider terminals get
    100), every setting and group still listed (issue 43)."""
    from fedexp.cli.help import help_text

    monkeypatch.setenv("COLUMNS", str(columns))
    out = help_text()
    assert max(len(line) for line in out.splitlines()) == min(columns, 100)
    for name, default in _expected_defaults().items():
        assert re.search(rf"^  {re.escape(name)}={re.escape(default)}\b", out, re.M), name
    assert re.search(r"^  hydra/launcher +parallel slurm$", out, re.M)


def test_a_piped_table_is_never_wrapped(capsys):
    """Issue 70, item 5: piped to a file, rich took 80 columns and a segmentation run's table
    wrapped its row labels over 2-3 lines; now every row is one line, as wide as it needs."""
    from types import SimpleNamespace

    from fedexp.cli.output import print_table

    keys = ["iou", "label_iou", "dice", "dice_wt", "dice_tc", "dice_et", "acc", "loss"]
    per_client = [{"num_test": 10, **dict.fromkeys(keys, 0.5)} for _ in range(3)]
    metrics = {f"{k}/{s}": 0.5 for k in keys for s in ("mean", "weighted", "worst", "best_mean")}
    tracker = SimpleNamespace(describe=lambda: "metrics were kept in memory only (tracker=none)")
    print_table(
        SimpleNamespace(per_client=per_client, metrics=metrics, output_dir="/r", tracker=tracker)
    )
    out = capsys.readouterr().out  # (not a terminal)
    rows = [ln for ln in out.splitlines() if ln.startswith("│")]
    assert len(rows) == 3 + 4, out  # no row over several lines
    for label in ("mean over clients", "weighted by test n", "worst client", "mean of best rounds"):
        assert any(f"│ {label:>19} │" in row for row in rows), out
    assert "label_iou" in out and "…" not in out and len(rows[0]) > 80


def test_a_stacked_groups_merged_work_keeps_its_info_lines_off_the_terminal():
    """Issue 70, item 5: a stacked group's merged client work runs on the group's own thread
    (in a copy of the arriving job's context), whose ``memory:`` INFO lines passed the job's
    quiet filter (kept to the job's thread) and reached the terminal between the job lines."""
    import contextvars
    import io
    import threading

    stream = io.StringIO()
    console = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(console)
    log = logging.getLogger("fedexp")
    level = log.level
    log.setLevel(logging.INFO)

    def elsewhere(context: contextvars.Context | None) -> None:
        def say() -> None:
            log.info("memory: merged work")
            log.warning("merged work warns")

        thread = threading.Thread(target=(lambda: context.run(say)) if context else say)
        thread.start()
        thread.join()

    try:
        with job_label("job 0", quiet=True, own_thread=True):
            log.info("round 1/2 of job 0")
            elsewhere(contextvars.copy_context())  # as Stack._execute runs the merged work
        elsewhere(None)  # no job's: the terminal's
    finally:
        root.removeHandler(console)
        log.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert lines == ["merged work warns", "memory: merged work", "merged work warns"], lines


def test_a_resumed_runs_table_is_replaced_without_a_download(tmp_path, capfd):
    """Issue 70, item 5: on resume MLflow's ``log_table`` downloaded the run's table (its
    "Downloading artifacts" bar on the terminal) to append to it: rounds 0..R twice."""
    import json

    import pandas as pd

    from fedexp.tracking.mlflow_tracker import MLflowTracker

    uri = mlflow_db(tmp_path / "m.db")
    client = MlflowClient(uri)
    client.create_experiment("tables", artifact_location=(tmp_path / "artifacts").as_uri())
    tracker = MLflowTracker(uri, "tables", system_metrics=False)
    run_id = tracker.start("tabled", {}, {})
    tracker.log_table([{"round": 0, "acc": 0.5}], "clients_rounds.json")
    tracker.log_table([{"round": 0, "acc": 0.5}, {"round": 1, "acc": 0.6}], "clients_rounds.json")
    tracker.end()
    err = capfd.readouterr().err
    assert "Downloading artifacts" not in err, err
    local = client.download_artifacts(run_id, "clients_rounds.json", str(tmp_path))
    assert pd.read_json(local, orient="split")["round"].tolist() == [0, 1]  # the last, whole
    logged = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert logged == [{"path": "clients_rounds.json", "type": "table"}]  # the UI's table view


def test_the_per_client_table_shows_the_headline_metrics_views_where_they_differ():
    """The terminal table keeps the clients' own metrics and, of the evaluation views, the
    headline metric's; FedAvg's global view (its personal model) and its zero gains are left
    to clients.csv; a held-out client's row has only ``new/``."""
    from fedexp.cli.output import _columns

    fedavg = [{"acc": 0.5, "loss": 1.0, "global/acc": 0.5, "global/loss": 1.0, "gain/acc": 0.0,
               "gain/loss": 0.0, "num_test": 3.0}]  # fmt: skip
    assert _columns(fedavg) == ["acc", "loss"]
    ditto = [{**fedavg[0], "gain/acc": 0.1}, {"new/acc": 0.7, "new/loss": 0.9, "num_test": 2.0}]
    assert _columns(ditto) == ["acc", "loss", "global/acc", "gain/acc", "new/acc"]
    assert _columns([{"new/acc": 0.7, "num_test": 2.0}]) == ["new/acc"]
