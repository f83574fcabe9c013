"""What results say: tables and labels that say what they show (one run's cell, n = 1, the
end-of-run table, tuning trials, the edge of a search range), figures that do not plot noise,
and no noise on the terminal or in files."""

from __future__ import annotations

import csv
import io
import logging
import math
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from fedexp.engine.runner import loggable
from fedexp.engine.runner import run
from fedexp.figures import canvas
from fedexp.figures import plots
from fedexp.figures.pca import MODEL_SPREAD_TOL
from fedexp.figures.pca import client_model_pca
from fedexp.report import main as report_main
from fedexp.report import render
from fedexp.report.reach import kib_ticks
from fedexp.report.reach import reach_plot
from fedexp.report.reach import reach_table
from fedexp.tracking.base import NullTracker
from fedexp.tuning import objective as tuning
from helpers import cli_env as _env
from helpers import log_finished_run as _log_run
from helpers import mlflow_db
from helpers import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

CLI = [sys.executable, "-c", "from fedexp.cli import entry; entry()"]
OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


@pytest.fixture
def store(tmp_path):
    uri = mlflow_db(tmp_path / "m.db")
    return uri, MlflowClient(uri)


# --- 6. tables and labels that say what they show --------------------------------------------


def test_a_cell_of_one_run_shows_its_value_alone():
    groups = {("fedavg",): [0.81], ("local",): [0.70, 0.80]}
    md = render.table(groups, 1, "algorithm", "", labels=render.ALGORITHM_LABELS)
    assert "| FedAvg | 81.00 (n=1) |" in md and "± 0.00" not in md
    assert "| Local | 75.00 ± 7.07 (n=2) |" in md
    tex = render.table(groups, 1, "algorithm", "", fmt="latex", best=True)
    assert "\\textbf{81.00 (n=1)}" in tex and "75.00 $\\pm$ 7.07 (n=2)" in tex


def test_report_says_n_1_and_leaves_its_csv_std_empty(store, capsys):
    uri, client = store
    _log_run(client, "one", "fedavg", 0, **{"acc/mean": 0.81, "val/acc/mean": 0.9})
    for seed, v in enumerate((0.70, 0.80)):
        _log_run(client, "one", "local", seed, **{"acc/mean": v, "val/acc/mean": v})
    report_main(["--uri", uri, "-e", "one"])
    out = capsys.readouterr().out
    assert "a cell of one run shows its value alone (n=1: no spread)" in out.splitlines()[0]
    assert "| FedAvg | 81.00 (n=1) |" in out
    report_main(["--uri", uri, "-e", "one", "--format", "csv"])
    rows = {r["row"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert rows["FedAvg"]["std"] == "" and rows["FedAvg"]["n"] == "1"
    assert float(rows["Local"]["std"]) == pytest.approx(100 * 0.0707107, rel=1e-5)
    report_main(["--uri", uri, "-e", "one", "--select-by", "val/acc/mean", "--allow-pooling"])
    out = capsys.readouterr().out
    chosen = [ln for ln in out.splitlines() if ln.startswith("| FedAvg |")][-1]
    assert "90.00 (n=1)" in chosen


def test_end_of_run_table_rows_are_named_for_what_they_are(capsys, monkeypatch):
    from fedexp.cli.output import print_table as _print_table

    monkeypatch.setenv("COLUMNS", "80")
    view = (
        "view: .venv/bin/fedexp ui --uri sqlite:////a/long/path/to/some/mlflow.db, then open "
        "http://127.0.0.1:5000/#/experiments/1?workflowType=machine_learning"
    )
    seg = ("iou", "label_iou", "dice", "acc", "loss")  # a segmentation run: the widest table
    result = SimpleNamespace(
        per_client=[{**{k: 0.5 for k in seg}, "num_test": 10.0}] * 2,
        metrics={f"{k}/{s}": 0.5 for k in seg for s in ("mean", "weighted", "worst", "best_mean")},
        output_dir=Path("/some/where/outputs/2026-11-22/10-00-00"),
        tracker=SimpleNamespace(describe=lambda: "MLflow run x [not markup]\n" + view),
    )
    _print_table(result)
    lines = capsys.readouterr().out.splitlines()
    assert view in lines and "MLflow run x [not markup]" in lines  # never wrapped, not markup
    labels = [ln.split("│")[1].strip() for ln in lines if ln.count("│") > 2]
    assert labels[-4:] == [
        "mean over clients",
        "weighted by test n",
        "worst client",
        "mean of best rounds",
    ]  # one line each at 80 columns
    assert "not the best client" in " ".join(lines)


def test_a_tuning_trials_line_shows_the_objective_first(monkeypatch):
    metrics = {"acc/mean": 0.88, "val/acc/mean": 0.91, "val/acc/worst": 0.5}
    assert list(tuning.job_metrics({"val_fraction": 0.2}, metrics).items()) == [
        ("val/acc/mean", 0.91),
        ("acc/mean", 0.88),
    ]
    assert tuning.job_metrics({"val_fraction": 0.0}, metrics) == {"acc/mean": 0.88}
    monkeypatch.setattr(tuning, "_optimised", lambda: False)  # a plain grid: nothing optimised
    assert tuning.job_metrics({"val_fraction": 0.2}, metrics) == {"acc/mean": 0.88}


def test_edge_of_a_search_range():
    from optuna.distributions import CategoricalDistribution
    from optuna.distributions import IntUniformDistribution
    from optuna.distributions import LogUniformDistribution
    from optuna.distributions import UniformDistribution

    lr = LogUniformDistribution(1e-4, 1.0)
    assert tuning.edge_of(lr, 0.9) == ("upper", 1.0, "[0.0001, 1] (log scale)")
    assert tuning.edge_of(lr, 1.3e-4)[:2] == ("lower", 1e-4)
    assert tuning.edge_of(lr, 0.01) is None  # the middle of the log range
    assert tuning.edge_of(UniformDistribution(0.0, 1.0), 0.5) is None
    assert tuning.edge_of(UniformDistribution(0.0, 1.0), 0.97)[0] == "upper"
    assert tuning.edge_of(IntUniformDistribution(1, 10), 1)[0] == "lower"
    grid = CategoricalDistribution((1, 0.1, 0.01, 0.001, 0.0001))
    assert tuning.edge_of(grid, 1) == ("upper", 1.0, "{0.0001, 0.001, 0.01, 0.1, 1}")
    assert tuning.edge_of(grid, 0.01) is None
    assert tuning.edge_of(CategoricalDistribution((0.1, 1)), 1) is None  # two: both are ends
    assert tuning.edge_of(CategoricalDistribution(("a", "b", "c")), "a") is None


def _sweep_config(tmp_path: Path, task: list[str]):
    return OmegaConf.create(
        {
            "hydra": {
                "sweeper": {
                    "_target_": OPTUNA,
                    "params": {
                        "lr": "tag(log, interval(0.0001, 1))",
                        "algorithm.mu": "tag(log, interval(0.001, 1))",
                    },
                },
                "sweep": {"dir": str(tmp_path)},
                "overrides": {"task": task},
            }
        }
    )


def test_the_end_of_a_study_warns_of_a_best_value_at_the_edge(tmp_path, capsys):
    results = {
        "name": "optuna",
        "best_params": {"lr": 0.95, "algorithm.mu": 0.03},
        "best_value": 0.9,
    }
    (tmp_path / "optimization_results.yaml").write_text(yaml.safe_dump(results))
    callback = tuning.NaNTrialsFail()
    callback.on_multirun_end(_sweep_config(tmp_path, ["hparams_search=fedprox"]))
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "fedexp: warning: the best lr=0.95 lies at the upper end (1) of its search range "
        "[0.0001, 1] (log scale): the optimum may lie beyond it; widen the range and tune again"
    ]
    # the command line's search space wins over the config's, as in the sweeper
    wider = ["hparams_search=fedprox", "lr=tag(log, interval(0.0001, 10))"]
    callback.on_multirun_end(_sweep_config(tmp_path, wider))
    assert capsys.readouterr().err == ""
    # another sweeper: nothing to say
    cfg = _sweep_config(tmp_path, [])
    cfg.hydra.sweeper._target_ = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
    callback.on_multirun_end(cfg)
    assert capsys.readouterr().err == ""


def test_optuna_logs_without_colour_codes_off_a_terminal(monkeypatch):
    import optuna

    stream = io.StringIO()  # a file, not a terminal
    monkeypatch.setattr(sys, "stderr", stream)
    logger = logging.getLogger("optuna")
    try:
        tuning.plain_optuna_logs()
        tuning.plain_optuna_logs()  # idempotent: one handler
        optuna.logging.get_logger("optuna.study").info("A new study created in memory")
        assert stream.getvalue().count("A new study created in memory") == 1
        assert "\x1b[" not in stream.getvalue()
        assert stream.getvalue().startswith("[I ")
    finally:
        for handler in [h for h in logger.handlers if getattr(h, "fedexp_plain", False)]:
            logger.removeHandler(handler)
        optuna.logging.enable_default_handler()


@pytest.mark.slow
def test_a_real_study_is_plain_in_a_file_and_warns_at_the_edge(tmp_path):
    """Three trials over lr ∈ {0.01, 0.1, 1} (about 12 s): stderr to a file has no colour
    codes, and a best lr at an end of the choices is named."""
    proc = run_cli(
        "run", "-m", "hparams_search=lr", "rounds=1", "lr=choice(0.01,0.1,1)",
        "hydra.sweeper.n_trials=3", "tracker=none", "num_clients=3", "progress=none",
        "checkpoint_every=0", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "A new study created in memory" in proc.stderr and "\x1b[" not in proc.stderr
    best = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    lr = best["best_params"]["lr"]
    warned = [ln for ln in proc.stderr.splitlines() if "lies at the" in ln]
    if lr in (0.01, 1):
        assert warned == [
            f"fedexp: warning: the best lr={lr:g} lies at the {'upper' if lr == 1 else 'lower'} "
            f"end ({lr:g}) of its search range {{0.01, 0.1, 1}}: the optimum may lie beyond "
            "it; widen the range and tune again"
        ]
    else:
        assert warned == []


# --- 7. figures ------------------------------------------------------------------------------


def _drawn(monkeypatch) -> list:
    """The figures the plotting functions save (to read what they drew)."""
    saved = []
    save = canvas._save

    def keep(fig, path):
        saved.append(fig)
        return save(fig, path)

    monkeypatch.setattr(canvas, "_save", keep)
    return saved


def test_equal_client_models_are_said_to_be_equal_not_projected(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 200, generator=gen)
    fedavg = base.repeat(5, 1)  # every client evaluates the global model
    pfednet = fedavg + 1e-8 * torch.randn(5, 200, generator=gen, dtype=torch.float64).float()
    spread = fedavg + 0.1 * torch.randn(5, 200, generator=gen)
    for models in (fedavg, pfednet.double(), torch.zeros(3, 4)):
        pca = client_model_pca(models)
        assert pca.equal and pca.spread < MODEL_SPREAD_TOL and pca.explained == [0.0, 0.0]
    pca = client_model_pca(spread)
    assert not pca.equal and pca.explained[0] > 0.2 and sum(pca.explained) <= 1 + 1e-12
    closed = _drawn(monkeypatch)
    assert plots.plot_client_models(fedavg, tmp_path / "a.png") == tmp_path / "a.png"
    ax = closed[-1].axes[0]
    assert "all 5 client models equal" in ax.texts[0].get_text()
    assert "below the tolerance 1e-10" in ax.texts[0].get_text()
    assert ax.get_xlabel() == "PC1" and not ax.collections  # no scatter of noise
    plots.plot_client_models(spread, tmp_path / "b.png")
    ax = closed[-1].axes[0]
    assert ax.get_xlabel().startswith("PC1 (") and ax.collections
    assert not [t for t in ax.texts if "equal" in t.get_text()]


def test_reach_plot_has_number_ticks_and_the_tables_names(tmp_path):
    def run_curve(kib: list[float], acc: list[float]) -> dict:
        return {"curve_bytes": [k * 1024 for k in kib], "curve_metric": acc}

    groups = {
        ("fedavg",): [run_curve([0, 2, 4, 6, 400], [0.5, 0.7, 0.8, 0.85, 0.9])],
        ("pfednet",): [run_curve([0, 0.5, 1, 1.5, 2], [0.5, 0.6, 0.7, 0.8, 0.9])],
    }
    shown = reach_plot(
        groups, str(tmp_path / "r.png"), "acc/mean", render.ALGORITHM_LABELS, "algorithm"
    )
    assert list(shown["lines"]) == ["FedAvg", "pFedNet"]
    assert shown["xscale"] == "symlog"
    assert shown["xticklabels"] == ["0", "0.1", "1", "10", "100"]
    assert all(text and "^" not in text and "10⁰" not in text for text in shown["xticklabels"])
    assert kib_ticks([0, 0.6, 30])[2] == [0, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20]
    assert kib_ticks([0, 3, 5e6])[3][-2:] == ["100,000", "1,000,000"]
    assert kib_ticks([0, 10, 20, 30])[0] == "linear" and kib_ticks([0, 0])[0] == "linear"
    rows = {("fedavg",): [{"up": 1024.0, "down": 2048.0, "final": 0.93}]}
    table = reach_table(rows, "algorithm", 0.9, "acc/mean", render.ALGORITHM_LABELS)
    assert table.splitlines()[-1] == "| FedAvg | 1/1 | 1.0 | 2.0 | 0.9300 |"


def test_every_rounds_byte_counts_are_logged(small_cfg):
    row = {"round": 2.0, "bytes/up": 10, "bytes/up_cum": 20, "acc/mean": 0.5}
    assert loggable(row, {**row, "round": 1.0}) == {
        "bytes/up": 10,
        "bytes/up_cum": 20,
        "acc/mean": 0.5,
    }
    tracker = NullTracker()
    run(small_cfg("rounds=3"), tracker=tracker)
    for key in ("bytes/up", "bytes/down", "bytes/up_dense", "bytes/up_cum"):
        assert sorted(tracker.metrics[key]) == [1, 2, 3], key


# --- 11. noise -------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_alembic_lines_when_a_model_imports_optuna(tmp_path):
    """VGG-8 imports MONAI, which imports Optuna, which imports Alembic: its INFO lines."""
    proc = subprocess.run(
        [*CLI, "run", "rounds=1", "dataset=digits", "model=vgg8", "partition=dirichlet"]
        + ["num_clients=2", "progress=none", "checkpoint_every=0", "tracker=none"]
        + [f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "setup plugin" not in proc.stdout + proc.stderr
    assert "setup plugin" not in (tmp_path / "run" / "cli.log").read_text()


def test_the_dataset_source_is_given_with_its_type(tmp_path):
    from mlflow.data.dataset_source_registry import resolve_dataset_source

    from fedexp.tracking.dataset_input import DatasetRecord
    from fedexp.tracking.dataset_input import mlflow_source

    path = str(tmp_path / "bc.csv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_dataset_source(path)  # MLflow's guess: two "local" sources, a warning
    assert any("multiple ways" in str(w.message) for w in caught)
    local = DatasetRecord("csv", path, "local", "0" * 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none
        source = mlflow_source(local)
        code = mlflow_source(DatasetRecord("bc", "sklearn.datasets.load_x", "code", "0" * 64))
    assert source._get_source_type() == "local" and source.uri == path
    assert code._get_source_type() == "code" and "load_x" in code.to_json()


def test_float_rounds_in_history_are_integers_in_the_csv_files(small_cfg):
    res = run(small_cfg("rounds=2", "num_clients=3"), tracker=NullTracker())
    with open(res.output_dir / "clients_rounds.csv") as fh:
        text = fh.read()
    rows = [line.split(",") for line in text.splitlines()[1:]]
    assert rows[0][:2] == ["0", "0"]  # round 0, client 0: not 0.0, 0.0
    assert all(r[0].isdigit() and r[1].isdigit() for r in rows)
    assert not math.isnan(float(text.splitlines()[1].split(",")[2]))
