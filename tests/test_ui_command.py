"""Viewing results with ``fedexp ui``: its command on one line, MLflow's server run from
this Python on localhost, the store and port checked, Ctrl-C that stops it quietly."""

from __future__ import annotations

import csv
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from fedexp.cli.ui import missing_store
from fedexp.cli.ui import server_command
from fedexp.cli.ui import server_env
from fedexp.tracking.links import experiment_url
from fedexp.tracking.links import fedexp_command
from fedexp.tracking.links import ui_command
from helpers import ROOT
from helpers import cli_env as _env
from helpers import log_finished_run as _log_run
from helpers import mlflow_db

pytestmark = pytest.mark.usefixtures("one_thread")

CLI = [sys.executable, "-c", "from fedexp.cli import entry; entry()"]


@pytest.fixture
def store(tmp_path):
    uri = mlflow_db(tmp_path / "m.db")
    return uri, MlflowClient(uri)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
