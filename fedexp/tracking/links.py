"""Links into MLflow's web UI that open in its machine-learning view.

MLflow 3's UI has two views, GenAI (traces, sessions, judges) and "Model training" (runs,
metrics, charts), and opens an experiment in the GenAI view by default: in MLflow 3.17 the
view is the ``workflowType`` query parameter of the page's URL, else the browser's stored
choice (``localStorage["mlflow.workflowType"]``, GenAI when unset). The experiment tag
``mlflow.experimentKind = custom_model_development`` (set by
:class:`fedexp.tracking.mlflow_tracker.MLflowTracker`) is only read where the view switcher
is off (e.g. managed MLflow). So every link fedexp prints carries
``?workflowType=machine_learning``; ``scripts/check_mlflow_ui.py`` opens one in headless
Chromium and checks that the runs table shows.
"""

from __future__ import annotations

from urllib.parse import quote

#: The query that selects MLflow's machine-learning view ("Model training").
ML_VIEW_QUERY = "workflowType=machine_learning"
#: Where ``mlflow ui`` / ``mlflow server`` listen by default.
DEFAULT_UI = "http://127.0.0.1:5000"


def ui_base(uri: str) -> str:
    """The web UI's address for a tracking URI: the server itself, or ``mlflow ui``'s."""
    if uri.lower().startswith(("http://", "https://")):
        return uri.rstrip("/")
    return DEFAULT_UI


def experiment_url(base: str, experiment_id: str) -> str:
    """The experiment's runs page in the machine-learning view."""
    return f"{base.rstrip('/')}/#/experiments/{quote(str(experiment_id))}?{ML_VIEW_QUERY}"


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    """One run's page in the machine-learning view."""
    exp, run = quote(str(experiment_id)), quote(str(run_id))
    return f"{base.rstrip('/')}/#/experiments/{exp}/runs/{run}?{ML_VIEW_QUERY}"


def ui_command(uri: str) -> str:
    """The command that serves the UI for a local store (none needed for a server)."""
    if uri.lower().startswith(("http://", "https://")):
        return ""
    return f"mlflow ui --backend-store-uri {uri}"
