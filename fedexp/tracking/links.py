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
``fedexp ui`` command that serves one (:mod:`fedexp.cli.ui`: MLflow's server from fedexp's own
interpreter, so ``mlflow`` need not be on ``PATH``), written as the user can type it.

A sweep's link opens its runs grouped by the keys that vary (:func:`sweep_view_url`). MLflow's
URL has no "group by" parameter: grouping is UI state. But MLflow's own "Save view" (the views
menu of the runs page) stores a whole view (search filter, group by, columns, which runs are
shown) as an experiment tag ``mlflow.sharedViewState.<key>`` and shares it as
``#/experiments/<id>/runs?viewStateShareKey=<key>&compareRunsMode=<TABLE|CHART>``. MLflow 3.17.2's
UI (``useSharedExperimentViewState``) reads that parameter on the *runs tab* route only: the bare
experiment route (``#/experiments/<id>``) redirects to the runs tab keeping ``workflowType`` but
dropping ``viewStateShareKey`` and ``compareRunsMode``, and a URL that already carries a search
facet (``searchFilter``, ``orderByKey``, ...) skips the stored view. The tag's value is a saved-view
envelope, ``{"name", "createdAt", "updatedAt", "state"}`` (ms since the epoch), whose ``state``
is the view as JSON, compressed as the UI writes it: ``"deflate;"`` + base64 of the zlib stream
(plain JSON is read too). The UI takes the state's search facets and its UI state (``groupBy``,
``runsHiddenMode``, ``selectedColumns``, ...; not the per-run ``runsExpanded``/``runsPinned``/
``runsHidden``/``runsVisibilityMap``) over the defaults. :func:`shared_view` writes that tag: this
sweep's runs (``tags.`mlflow.parentRunId` = '<parent>'``) grouped by the varying keys, a
collapsed row per configuration sorted by its mean headline, best first, and in the charts each
group's mean with its min-max range; every run shown (MLflow shows the first 10 otherwise).
:func:`read_shared_view` decodes such a tag as the UI does; ``scripts/check_mlflow_ui.py --sweep``
opens one in headless Chromium and checks that the page is grouped.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import sys
import zlib
from collections.abc import Iterable, Sequence
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
#: The prefix of a view state the UI compressed (zlib, then base64).
DEFLATE_PREFIX = "deflate;"


def ui_base(uri: str) -> str:
    """The web UI's address for a tracking URI: the server itself, or ``mlflow ui``'s."""
    if is_server(uri):
        return uri.rstrip("/")
    return DEFAULT_UI


def experiment_url(base: str, experiment_id: str) -> str:
    """The experiment's runs page in the machine-learning view."""
    return f"{base.rstrip('/')}/#/experiments/{quote(str(experiment_id))}?{ML_VIEW_QUERY}"


def runs_url(base: str, experiment_id: str) -> str:
    """The experiment's runs tab in the machine-learning view (where a shared view opens)."""
    return f"{base.rstrip('/')}/#/experiments/{quote(str(experiment_id))}/runs?{ML_VIEW_QUERY}"


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
    off ``PATH``); without a script, ``python -m fedexp``.
    """
    script = Path(sys.executable).parent / "fedexp"
    if not script.is_file():
        return [sys.executable, "-m", "fedexp"]
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

    The runs tab's route (the experiment's own route drops the share key when it redirects), the
    chart view (``compareRunsMode=CHART``): a chart per metric, a line per group of runs.
    """
    page = runs_url(base, experiment_id)
    return f"{page}&{SHARE_PARAM}={quote(share_key)}&compareRunsMode=CHART"


def compress_state(text: str) -> str:
    """A view state as MLflow's UI stores it: ``"deflate;"`` + base64 of the zlib stream."""
    return DEFLATE_PREFIX + base64.b64encode(zlib.compress(text.encode())).decode("ascii")


def decompress_state(text: str) -> str:
    """The JSON of a stored view state, compressed (:func:`compress_state`) or not."""
    if not text.startswith(DEFLATE_PREFIX):
        return text
    return zlib.decompress(base64.b64decode(text.removeprefix(DEFLATE_PREFIX))).decode()


def read_shared_view(value: str) -> dict:
    """The view state in a ``mlflow.sharedViewState.<key>`` tag's value, read as MLflow 3.17 does.

    A saved-view envelope (JSON: a string ``name``, a number ``createdAt``, a string ``state``:
    the state's JSON, maybe compressed); else the whole value is the state, its JSON maybe
    compressed (earlier MLflow 3 releases).

    Raises:
        ValueError: the value is neither.
    """
    try:
        try:
            envelope = json.loads(value)
        except ValueError:
            envelope = None
        if (
            isinstance(envelope, dict)
            and isinstance(envelope.get("name"), str)
            and isinstance(envelope.get("createdAt"), int | float)
            and isinstance(envelope.get("state"), str)
        ):
            state = json.loads(decompress_state(envelope["state"]))
        else:
            state = json.loads(decompress_state(value))
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"not a shared view state: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError("not a shared view state: not a JSON object")
    return state


def group_id(group_by: list[dict[str, str]], values: Sequence[str | None]) -> str:
    """A group's id in MLflow's runs table: ``tag.choice.algorithm.local,param.lr.0.1``.

    Each group-by key as ``<mode>.<key>.<value>`` (``null`` for a run without the key), joined
    by commas; the keys of a view's ``groupsExpanded`` (a group is expanded unless it is there
    as false).
    """
    return ",".join(
        f"{key['mode']}.{key['groupByData']}.{value or 'null'}"
        for key, value in zip(group_by, values, strict=True)
    )


def shared_view(
    name: str,
    parent_run_id: str,
    group_by: list[dict[str, str]],
    columns: list[str] | None = None,
    created_ms: int = 0,
    order_by: str | None = None,
    collapsed: Iterable[Sequence[str | None]] = (),
) -> tuple[str, str]:
    """The experiment tag of a sweep's view: ``(key, value)``; its share key is the parent id.

    Args:
        name: the view's name in MLflow's list of saved views.
        parent_run_id: the sweep's parent run: the view shows its child runs only.
        group_by: MLflow's group-by keys, ``[{"mode": "param" | "tag", "groupByData": key}]``
            (:func:`fedexp.sweep.group_keys`); groups aggregate by their mean.
        columns: the runs table's columns (``params.`partition.delta```, ``metrics.`acc/mean```).
        created_ms: when the view was made (milliseconds since the epoch).
        order_by: a metric to sort by, highest first (``metrics.`acc/mean```): MLflow sorts
            the groups by their mean of it, so the best configuration comes first.
        collapsed: groups shown collapsed, each by its values of the ``group_by`` keys (a row
            per configuration; a group's runs show when it is expanded).

    Returns:
        The tag's key, ``mlflow.sharedViewState.<parent_run_id>``, and its value: MLflow 3.17's
        saved-view envelope (``name``, ``createdAt``, ``updatedAt``, ``state``: the state's JSON
        compressed as the UI compresses it), with the same state, plain, at its top level, which
        is what earlier MLflow 3 releases read from the tag (3.17 reads the envelope first).
    """
    state: dict = {
        "searchFilter": f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
        "groupBy": {"aggregateFunction": "average", "groupByKeys": group_by} if group_by else None,
        "groupsExpanded": {group_id(group_by, v): False for v in collapsed} if group_by else {},
        "runsHiddenMode": "SHOW_ALL",
        "useGroupedValuesInCharts": True,
        "hideEmptyCharts": True,
    }
    if columns:
        state["selectedColumns"] = columns
    if order_by:
        state |= {"orderByKey": order_by, "orderByAsc": False}
    envelope = {
        "name": name,
        "createdAt": created_ms,
        "updatedAt": created_ms,
        "state": compress_state(json.dumps(state)),
        **state,
    }
    return f"{SHARE_TAG_PREFIX}{parent_run_id}", json.dumps(envelope)
