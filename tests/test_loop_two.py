"""The researcher's loop, round two (items 5, 6, 7, 11): viewing results with ``fedexp ui``,
tables and labels that say what they show, figures that do not plot noise, and no noise on
the terminal or in files."""

from __future__ import annotations

import csv
import io
import itertools
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from mlflow.entities import Metric
from mlflow.entities import Param
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from fedexp.cli.ui import missing_store
from fedexp.cli.ui import server_command
from fedexp.cli.ui import server_env
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
from fedexp.tracking.links import experiment_url
from fedexp.tracking.links import fedexp_command
from fedexp.tracking.links import ui_command
from fedexp.tuning import objective as tuning
from helpers import ROOT
from helpers import mlflow_db
from helpers import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

CLI = [sys.executable, "-c", "from fedexp.cli import entry; entry()"]
OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
_clock = itertools.count(1_700_000_000_000, 1000)


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_run(client: MlflowClient, experiment: str, algorithm: str, seed: int, **metrics):
    """A FINISHED run as fedexp logs it: choice.algorithm, params, one value per metric."""
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    rid = client.create_run(
        exp_id, start_time=next(_clock), tags={"choice.algorithm": algorithm}
    ).info.run_id
    params = {"lr": 0.1, "seed": seed, "algorithm._target_": f"fedexp.algorithms.{algorithm}.X"}
    ms = [Metric(k, float(v), next(_clock), 3) for k, v in metrics.items()]
    client.log_batch(rid, metrics=ms, params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(rid, "FINISHED")
    return rid


@pytest.fixture
def store(tmp_path):
    uri = mlflow_db(tmp_path / "m.db")
    return uri, MlflowClient(uri)


# --- 5. viewing results: `fedexp ui`, and its command on one line ---------------------------


def test_the_ui_hint_is_one_fedexp_ui_command(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    fedexp = " ".join(fedexp_command())
    # the default store here: no --uri; another one: named; a server: nothing to serve
    assert ui_command(f"sqlite:///{tmp_path}/mlflow.db") == f"{fedexp} ui"
    assert ui_command("sqlite:///mlflow.db") == f"{fedexp} ui"
    assert ui_command("sqlite:////elsewhere/m.db") == f"{fedexp} ui --uri sqlite:////elsewhere/m.db"
    assert ui_command("http://127.0.0.1:5000") == ""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/m.db")
    assert ui_command("sqlite:////elsewhere/m.db") == f"{fedexp} ui"  # what `fedexp ui` opens
    # `fedexp` is the venv's script: by name on PATH, else by its path (make run's case)
    script = Path(sys.executable).parent / "fedexp"
    monkeypatch.setattr("shutil.which", lambda name: None)
    (command,) = fedexp_command()
    assert Path(command).resolve() == script.resolve()


@pytest.mark.slow
def test_a_run_prints_where_to_look_on_one_line_each(tmp_path):
    """A real run: the view line is one line (not wrapped at 80 columns), with `fedexp ui`."""
    uri = mlflow_db(tmp_path / "m.db")
    proc = subprocess.run(
        [*CLI, "run", "rounds=2", "num_clients=3", "progress=none", "checkpoint_every=0"]
        + [f"tracker.uri={uri}", "tracker.experiment=loop2", f"hydra.run.dir={tmp_path}/run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(), "COLUMNS": "80"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    (view,) = [ln for ln in lines if ln.startswith("view: ")]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("loop2")
    url = experiment_url("http://127.0.0.1:5000", exp.experiment_id)
    command, rest = view.removeprefix("view: ").split(" ", 1)
    assert rest == f"ui --uri {uri}, then open {url}"
    script = Path(sys.executable).parent / "fedexp"  # by name on PATH, else by path
    assert command == "fedexp" or Path(command).resolve() == script.resolve()
    assert f"results: {tmp_path}/run" in lines
    # the end-of-run table names its aggregate rows for what they are
    for row in ("mean over clients", "weighted by test n", "worst client", "mean of best rounds"):
        assert any(f" {row} │" in ln for ln in lines), row
    # 7: bytes/up and bytes/down every round (a dense run's are constant): lines, not dots
    rid = client.search_runs([exp.experiment_id])[0].info.run_id
    for key in ("bytes/up", "bytes/down", "bytes/up_dense"):
        history = client.get_metric_history(rid, key)
        assert sorted(m.step for m in history) == [1, 2], key
        assert len({m.value for m in history}) == 1
    # 11: round, client and num_test are integers in clients_rounds.csv (and round in rounds.csv)
    with open(tmp_path / "run" / "clients_rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["round"], r["client"]) for r in rows[:4]] == [
        ("0", "0"),
        ("0", "1"),
        ("0", "2"),
        ("1", "0"),
    ]
    assert all(r["num_test"].isdigit() for r in rows)
    with open(tmp_path / "run" / "rounds.csv") as fh:
        assert [r["round"] for r in csv.DictReader(fh)] == ["0", "1", "2"]


def test_the_ui_runs_mlflows_server_from_this_python_on_localhost():
    command = server_command("sqlite:///m.db", 5001)
    assert command[:4] == [sys.executable, "-m", "mlflow", "server"]
    assert command[command.index("--backend-store-uri") + 1] == "sqlite:///m.db"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--port") + 1] == "5001"
    env = server_env({"PATH": "/nowhere"})  # PATH does not matter: no `mlflow` looked up
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false" and env["PATH"] == "/nowhere"


def _ui(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    from fedexp.cli import main

    monkeypatch.setattr(sys, "argv", ["fedexp", "ui", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_the_ui_refuses_a_store_that_does_not_exist(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    code, out, err = _ui(capsys, monkeypatch)  # the default: sqlite:///mlflow.db here
    assert code == 1 and not out and err.count("\n") == 1
    assert err.startswith("fedexp: error: the default store sqlite:///mlflow.db: no MLflow store")
    assert f"{tmp_path / 'mlflow.db'} does not exist" in err
    missing = tmp_path / "nowhere" / "m.db"
    code, _, err = _ui(capsys, monkeypatch, "--uri", f"sqlite:///{missing}")
    assert code == 1 and f"--uri=sqlite:///{missing}: no MLflow store there" in err
    assert not list(tmp_path.iterdir())  # nothing created
    assert missing_store(str(tmp_path)) is None and "is not a folder" in missing_store("mlruns")


@pytest.mark.parametrize("port", ["0", "65536", "x"])
def test_the_ui_refuses_a_bad_port(capsys, monkeypatch, port):
    code, _, err = _ui(capsys, monkeypatch, "--port", port)
    assert code == 2 and "--port" in err


def test_the_ui_refuses_an_unknown_experiment_and_a_busy_port(store, capsys, monkeypatch):
    uri, client = store
    client.create_experiment("alpha")
    code, _, err = _ui(
        capsys, monkeypatch, "--uri", uri, "--experiment", "alpah", "--port", str(_free_port())
    )
    assert code == 1 and "--experiment 'alpah': no such experiment" in err and "alpha" in err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = _ui(capsys, monkeypatch, "--uri", uri, "--port", str(port))
    assert code == 1 and f"127.0.0.1:{port} is in use" in err


def test_help_lists_the_ui_command_and_its_help_is_light():
    top = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=120)
    assert "fedexp ui [--uri URI] [--port N] [--experiment NAME]" in top.stdout
    code = textwrap.dedent(
        """
        import sys
        from fedexp.cli import main
        sys.argv = ["fedexp", "ui", "--help"]
        try:
            main()
        except SystemExit:
            pass
        print("LOADED", *sorted({m.split(".")[0] for m in sys.modules}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert "usage: fedexp ui" in proc.stdout and "--experiment NAME" in proc.stdout
    loaded = next(ln for ln in proc.stdout.splitlines() if ln.startswith("LOADED")).split()
    assert not {"mlflow", "torch", "hydra", "numpy"} & set(loaded)


@pytest.mark.slow
def test_the_ui_serves_the_store_prints_the_link_and_stops_on_ctrl_c(store, tmp_path):
    """A real server (about 6 s): up on 127.0.0.1, the ML-view link, Ctrl-C ends it all."""
    import psutil

    uri, client = store
    _log_run(client, "older", "fedavg", 0, **{"acc/mean": 0.5})
    _log_run(client, "latest", "fedavg", 0, **{"acc/mean": 0.6})
    port = _free_port()
    errors = open(tmp_path / "stderr.txt", "w+")  # noqa: SIM115 - read after the process ends
    proc = subprocess.Popen(
        [*CLI, "ui", "--uri", uri, "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=errors,
        text=True,
        env=_env(),
        # a test run started in the background by a non-interactive shell inherits SIGINT
        # ignored, and so would the child (Python then installs no KeyboardInterrupt handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            seen.append(line)
            if line.startswith("open ") or not line:
                break
        base = f"http://127.0.0.1:{port}"
        exp = client.get_experiment_by_name("latest").experiment_id
        assert seen[-1].startswith(f"open {experiment_url(base, exp)}  (experiment 'latest'"), seen
        with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
            assert answer.status == 200
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the server, in a process group of its own
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "fedexp ui: stopped" in proc.stdout.read()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
        errors.seek(0)
        assert "Traceback" not in errors.read()  # uvicorn's cancelled lifespan, issue 43 item 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        errors.close()


@pytest.mark.slow
def test_ctrl_c_while_the_ui_starts_its_server_stops_it_quietly(tmp_path):
    """Ctrl-C as the server starts (it dies inside its imports): no traceback, exit 0.

    The server is stopped with SIGINT; what it writes from then on (Python's traceback of a
    KeyboardInterrupt, uvicorn's cancelled lifespan task) is dropped. A few seconds: the
    signal goes as soon as fedexp ui says it serves, long before the server answers.
    """
    uri = mlflow_db(tmp_path / "m.db")
    proc = subprocess.Popen(
        [*CLI, "ui", "--uri", uri, "--port", str(_free_port())],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("fedexp ui: serving "), line
        time.sleep(1.0)  # the server's Python is importing MLflow: the worst moment to stop it
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "fedexp ui: stopped" in out
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


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
