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

A local store (SQLite, a file store) has no web server of its own: :func:`ui_command` is the
``fedexp ui`` command that serves one (:mod:`fedexp.ui`: MLflow's server from fedexp's own
interpreter, so ``mlflow`` need not be on ``PATH``), written as the user can type it.

A sweep's link opens its runs grouped by the keys that vary (:func:`sweep_view_url`). MLflow's
URL has no "group by" parameter: grouping is UI state. But MLflow's own "Share" button stores a
whole view (search filter, group by, columns, which runs are shown) as an experiment tag
``mlflow.sharedViewState.<key>`` and opens it with ``?viewStateShareKey=<key>``
(``useSharedExperimentViewState`` in MLflow's UI; 3.17 also lists such a tag, written as a
named envelope, among the experiment's saved views). :func:`shared_view` writes that tag: this
sweep's runs (``tags.`mlflow.parentRunId` = '<parent>'``), grouped by the varying keys with
the mean and the min-max range of each group in the charts, every run shown (MLflow shows the
first 10 otherwise).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from urllib.parse import quote

#: The query that selects MLflow's machine-learning view ("Model training").
ML_VIEW_QUERY = "workflowType=machine_learning"
#: Where ``mlflow ui`` / ``mlflow server`` (and ``fedexp ui``) listen by default.
DEFAULT_UI = "http://127.0.0.1:5000"
#: MLflow's default tracking store: a SQLite database in the working directory.
DEFAULT_STORE = "sqlite:///mlflow.db"
#: The URL parameter naming a shared view of an experiment page, and its experiment tag.
SHARE_PARAM, SHARE_TAG_PREFIX = "viewStateShareKey", "mlflow.sharedViewState."


def ui_base(uri: str) -> str:
    """The web UI's address for a tracking URI: the server itself, or ``mlflow ui``'s."""
    if is_server(uri):
        return uri.rstrip("/")
    return DEFAULT_UI


def experiment_url(base: str, experiment_id: str) -> str:
    """The experiment's runs page in the machine-learning view."""
    return f"{base.rstrip('/')}/#/experiments/{quote(str(experiment_id))}?{ML_VIEW_QUERY}"


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    """One run's page in the machine-learning view."""
    exp, run = quote(str(experiment_id)), quote(str(run_id))
    return f"{base.rstrip('/')}/#/experiments/{exp}/runs/{run}?{ML_VIEW_QUERY}"


def is_server(uri: str) -> bool:
    """Whether ``uri`` is a tracking server (``http(s)://``), which serves its own UI."""
    return uri.lower().startswith(("http://", "https://"))


def default_store() -> str:
    """The store ``fedexp ui`` serves when none is given: where ``fedexp run`` writes by default.

    ``$MLFLOW_TRACKING_URI`` when set, else MLflow's own default, ``sqlite:///mlflow.db`` in the
    working directory.
    """
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_STORE


def _same_store(a: str, b: str) -> bool:
    """Whether two URIs name the same store (a relative SQLite path is the cwd's)."""

    def norm(uri: str) -> str:
        if uri.startswith("sqlite:///") and uri.removeprefix("sqlite:///") not in ("", ":memory:"):
            path, sep, query = uri.removeprefix("sqlite:///").partition("?")
            return f"sqlite:///{Path(path).resolve()}{sep}{query}"
        return uri.rstrip("/")

    return norm(a) == norm(b)


def fedexp_command() -> list[str]:
    """``fedexp`` as the user can type it: on ``PATH``, else the venv's script, else ``-m``.

    The script beside the running interpreter (``.venv/bin/fedexp``) is named by its path
    relative to the working directory when it lies under it (``make run`` leaves ``fedexp``
    off ``PATH``); without a script, ``python -m fedexp.cli``.
    """
    script = Path(sys.executable).parent / "fedexp"
    if not script.is_file():
        return [sys.executable, "-m", "fedexp.cli"]
    found = shutil.which("fedexp")
    if found and Path(found).resolve() == script.resolve():
        return ["fedexp"]
    try:
        return [str(script.absolute().relative_to(Path.cwd()))]
    except ValueError:
        return [str(script.absolute())]


def ui_command(uri: str) -> str:
    """The ``fedexp ui`` command that serves the UI for a local store (none for a server).

    ``--uri`` is left out when ``uri`` is the store ``fedexp ui`` opens by default
    (:func:`default_store`). One line, shell-quoted.
    """
    if is_server(uri):
        return ""
    command = [*fedexp_command(), "ui"]
    if not _same_store(uri, default_store()):
        command += ["--uri", uri]
    return shlex.join(command)


def sweep_view_url(base: str, experiment_id: str, share_key: str) -> str:
    """A sweep's runs in the machine-learning view, on its shared view (:func:`shared_view`).

    The chart view (``compareRunsMode=CHART``): a chart per metric, a line per group of runs.
    """
    page = experiment_url(base, experiment_id)
    return f"{page}&{SHARE_PARAM}={quote(share_key)}&compareRunsMode=CHART"


def shared_view(
    name: str,
    parent_run_id: str,
    group_by: list[dict[str, str]],
    columns: list[str] | None = None,
    created_ms: int = 0,
) -> tuple[str, str]:
    """The experiment tag of a sweep's view: ``(key, value)``; its share key is the parent id.

    Args:
        name: the view's name in MLflow's list of saved views.
        parent_run_id: the sweep's parent run: the view shows its child runs only.
        group_by: MLflow's group-by keys, ``[{"mode": "param" | "tag", "groupByData": key}]``
            (:func:`fedexp.sweep.group_keys`); groups aggregate by their mean.
        columns: the runs table's columns (``params.`partition.delta```, ``metrics.`acc/mean```).
        created_ms: when the view was made (milliseconds since the epoch).

    The value is MLflow 3.17's saved-view envelope (``name``, ``createdAt``, ``updatedAt``, the
    state as a JSON string) with the same state at its top level, which is what earlier MLflow
    3 releases read from the tag.
    """
    state: dict = {
        "searchFilter": f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
        "groupBy": {"aggregateFunction": "average", "groupByKeys": group_by} if group_by else None,
        "groupsExpanded": {},
        "runsHiddenMode": "SHOW_ALL",
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
    }
    if columns:
        state["selectedColumns"] = columns
    envelope = {
        "name": name,
        "createdAt": created_ms,
        "updatedAt": created_ms,
        "state": json.dumps(state),
        **state,
    }
    return f"{SHARE_TAG_PREFIX}{parent_run_id}", json.dumps(envelope)
