"""``tracker.uri`` pointing at an MLflow tracking server (started here on loopback)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from fedexp.engine.runner import run

pytestmark = pytest.mark.slow  # several processes or whole CLI runs: make test-slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path}/server.db",
            "--default-artifact-root",
            str(tmp_path / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the MLflow server did not start")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_run_logs_to_a_tracking_server(small_cfg, mlflow_server):
    cfg = small_cfg("rounds=2")
    with open_dict(cfg):
        cfg.tracker.uri = mlflow_server
        cfg.tracker.experiment = "served"
    res = run(cfg)
    client = MlflowClient(mlflow_server)
    r = client.get_run(res.run_id)
    assert r.info.status == "FINISHED" and r.data.params["rounds"] == "2"
    assert [m.step for m in client.get_metric_history(res.run_id, "acc/weighted")] == [0, 1, 2]
    assert "clients.csv" in {a.path for a in client.list_artifacts(res.run_id)}
