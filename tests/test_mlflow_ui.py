"""MLflow's web UI opens fedexp's links in its machine-learning view (a real browser)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedexp.tracking.links import ML_VIEW_QUERY
from fedexp.tracking.links import experiment_url
from fedexp.tracking.links import run_url
from fedexp.tracking.links import runs_url
from fedexp.tracking.links import ui_base
from helpers import mlflow_db

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from check_mlflow_ui import chromium  # noqa: E402


def test_links_carry_the_machine_learning_view():
    assert experiment_url("http://h:5000/", "7") == f"http://h:5000/#/experiments/7?{ML_VIEW_QUERY}"
    assert run_url("http://h:5000", "7", "ab").endswith(f"/#/experiments/7/runs/ab?{ML_VIEW_QUERY}")
    assert runs_url("http://h:5000", "7") == f"http://h:5000/#/experiments/7/runs?{ML_VIEW_QUERY}"
    assert ui_base("sqlite:///m.db") == "http://127.0.0.1:5000"
    assert ui_base("https://mlflow.example/") == "https://mlflow.example"


@pytest.mark.skipif(chromium() is None, reason="no Chromium here (make ui-check installs it)")
def test_headless_chromium_shows_the_runs_table(tmp_path):
    """Serve a real run, open fedexp's experiment link, read the rendered page and screenshot."""
    png = tmp_path / "ui.png"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts/check_mlflow_ui.py"), "--out", str(png)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ml view" in done.stdout and png.stat().st_size > 10_000


def test_run_and_sweep_lines_link_to_the_machine_learning_view(tmp_path):
    from fedexp.tracking.mlflow_tracker import MLflowTracker

    uri = mlflow_db(tmp_path / "m.db")
    tracker = MLflowTracker(uri, "links", system_metrics=False)
    tracker.start("one", {}, {})
    tracker.end()
    exp = tracker.client.get_experiment_by_name("links").experiment_id
    text = tracker.describe()
    assert f" ui --uri {uri}, then open " in text  # `fedexp ui`, one line
    assert experiment_url("http://127.0.0.1:5000", exp) in text
