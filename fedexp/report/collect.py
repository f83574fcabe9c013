"""Runs from MLflow: finished runs, filters, name checks, the latest run per configuration.

A run's *configuration* is its params (the resolved config, ``flatten_config``) without the
keys in :data:`IGNORED_KEYS` / :data:`IGNORED_PREFIXES`, which say where and how a run was
executed, not what it computes:

* ``output_dir``, ``resume``: where a run writes, and which checkpoint it continued from (a
  resumed run computes what the uninterrupted one would);
* ``progress``, ``threads``, ``device``, ``backend``: display, CPU threads, the torch device
  and the sequential/lockstep client loop (same results up to floating-point rounding);
* ``checkpoint_every``: how often a checkpoint is written; ``figures``: whether the run drew
  its figures;
* ``divergence_factor``: a stopping rule; a FINISHED run never tripped it, so its numbers do
  not depend on it;
* ``tracker.*``: where the run was recorded.

``eval_every`` and ``eval_participants`` are kept: they change which rounds are evaluated and
so what ``--agg best`` and ``--agg last:K`` see.

mlflow is imported inside the functions (``fedexp report --help`` imports none of it).
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedexp.errors import FedexpError

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

#: Params that do not change a run's results (see the module docstring).
IGNORED_KEYS = (
    "output_dir",
    "resume",
    "progress",
    "threads",
    "device",
    "backend",
    "checkpoint_every",
    "figures",
    "divergence_factor",
)
#: Prefixes of params that do not change a run's results.
IGNORED_PREFIXES = ("tracker.",)
#: The value of a key a run has neither as a param nor as a tag.
UNSET = "-"
#: Runs asked from the store per page.
_PAGE = 1000


def sort_key(v: str) -> tuple[int, float | str]:
    """Order of param values: numbers first, in numeric order, then text."""
    try:
        return (0, float(v))
    except ValueError:
        return (1, v)


def ignored(key: str) -> bool:
    """Whether the param ``key`` is left out of a run's configuration."""
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES)


@dataclass(frozen=True)
class Run:
    """What the report needs of one finished MLflow run.

    Attributes:
        run_id: MLflow's run id.
        start_time: start, milliseconds since the epoch (the latest run of a configuration
            wins).
        params: the run's params (the resolved config, ``lr``, ``algorithm.mu``, ...).
        tags: the run's tags (``choice.algorithm``, ``sweep``, ...).
        metrics: the last logged value of each metric.
    """

    run_id: str
    start_time: int
    params: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)

    def get(self, key: str) -> str:
        """The value of ``key``: a param, else a tag, else :data:`UNSET`."""
        if key in self.params:
            return self.params[key]
        return self.tags.get(key, UNSET)

    def config(self) -> tuple[tuple[str, str], ...]:
        """The params that define what the run computes, sorted (see the module docstring)."""
        return tuple(sorted((k, v) for k, v in self.params.items() if not ignored(k)))


def client_for(uri: str | None) -> MlflowClient:
    """An MLflow client of ``uri`` (None: MLflow's default tracking URI).

    Raises:
        FedexpError: no server answers at an ``http(s)://`` URI (at once, not after MLflow's
            minutes of retries).
    """
    import os

    import mlflow
    from mlflow.tracking import MlflowClient

    from fedexp.tracking.mlflow_tracker import check_reachable

    where = uri or mlflow.get_tracking_uri()
    key = "--uri" if uri else "MLFLOW_TRACKING_URI"
    check_reachable(where, key=key)
    said = f"{key}={where}"
    if not uri and not os.environ.get("MLFLOW_TRACKING_URI"):  # MLflow's default: say so
        said = f"MLflow's default store {where} (no --uri, MLFLOW_TRACKING_URI not set)"
    _check_store_exists(where, said)
    return MlflowClient(where)


def _check_store_exists(uri: str, said: str) -> None:
    """A report reads a store: a local one (SQLite file, file store folder) must exist.

    MLflow would create an empty store there (a database file, its folders) and then say the
    experiment does not exist; a report creates nothing.

    Args:
        uri: the store.
        said: how the message names it (``--uri=...``, ``MLFLOW_TRACKING_URI=...``, or
            MLflow's default).

    Raises:
        FedexpError: the local store is missing.
    """
    from urllib.parse import urlparse

    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
        if str(path) != ":memory:" and not path.is_file():
            raise FedexpError(
                f"{said}: no MLflow store there ({path} does not exist); give the "
                "store a run wrote to (the URI a run printed)"
            )
        return
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = Path(parsed.path if parsed.scheme == "file" else uri)
        if not path.is_dir():
            raise FedexpError(
                f"{said}: no MLflow store there ({path} is not a folder); give the "
                "store a run wrote to (the URI a run printed)"
            )


def experiment_named(client: MlflowClient, name: str, uri: str | None = None) -> Any:
    """The experiment ``name`` of the store (an ``mlflow.entities.Experiment``).

    Raises:
        FedexpError: no such experiment; the known names are listed, closest first (``uri``,
            if given, names the store).
    """
    exp = client.get_experiment_by_name(name)
    if exp is None:
        known = [e.name for e in client.search_experiments()]
        where = f" in {uri}" if uri else ""
        raise FedexpError(
            f"--experiment {name!r}: no such experiment{where}; known (closest first): "
            f"{', '.join(closest_first(name, known)) or '(none)'}"
        )
    return exp


def fetch(client: MlflowClient, experiments: list[str]) -> list[Run]:
    """Every FINISHED run of the named experiments, newest first.

    Raises:
        FedexpError: an experiment does not exist (the known names are listed).
    """
    ids = [experiment_named(client, name).experiment_id for name in experiments]
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs(
            ids,
            filter_string="attributes.status = 'FINISHED'",
            max_results=_PAGE,
            order_by=["attributes.start_time DESC"],
            page_token=token,
        )
        runs.extend(
            Run(
                r.info.run_id,
                int(r.info.start_time or 0),
                dict(r.data.params),
                dict(r.data.tags),
                dict(r.data.metrics),
            )
            for r in page
        )
        token = page.token
        if not token:
            return runs


def closest_first(name: str, names: Iterable[str]) -> list[str]:
    """``names`` sorted, the close matches of ``name`` (difflib) first, closest first."""
    names = sorted(set(names))
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.6)
    return close + [n for n in names if n not in close]


def key_names(runs: Iterable[Run]) -> set[str]:
    """Params and tags the runs have (MLflow's own ``mlflow.*`` tags left out)."""
    out: set[str] = set()
    for r in runs:
        out.update(r.params)
        out.update(t for t in r.tags if not t.startswith("mlflow."))
    return out


def check_keys(runs: list[Run], keys: Iterable[str], option: str) -> None:
    """Every key of ``option`` is a param or tag of at least one run.

    Raises:
        FedexpError: one line naming the key and the valid names, close matches first.
    """
    have = key_names(runs) | {t for r in runs for t in r.tags}
    for key in keys:
        if key not in have:
            valid = ", ".join(closest_first(key, key_names(runs))) or "(none)"
            raise FedexpError(
                f"{option} {key!r}: no run has this param or tag; valid names (closest first): "
                f"{valid}"
            )


def check_metric(runs: list[Run], metric: str, option: str) -> None:
    """``metric`` is logged by at least one run.

    Raises:
        FedexpError: one line naming the metric and the logged ones, close matches first.
    """
    if not runs:
        raise FedexpError(f"{option} {metric!r}: no finished run to read it from")
    names = {m for r in runs for m in r.metrics}
    if metric not in names:
        valid = ", ".join(closest_first(metric, names)) or "(none)"
        raise FedexpError(
            f"{option} {metric!r}: no finished run has this metric; valid names (closest "
            f"first): {valid}"
        )


def by_sweep(runs: list[Run], sweep: str) -> list[Run]:
    """The runs tagged ``sweep = <sweep>``.

    Raises:
        FedexpError: no run has the tag value (the sweep ids of the runs are listed).
    """
    kept = [r for r in runs if r.tags.get("sweep") == sweep]
    if not kept:
        known = {r.tags["sweep"] for r in runs if "sweep" in r.tags}
        raise FedexpError(
            f"--sweep {sweep!r}: no finished run has the tag sweep={sweep}; sweeps of these "
            f"runs (closest first): {', '.join(closest_first(sweep, known)) or '(none)'}"
        )
    return kept


def same_value(a: str, b: str) -> bool:
    """Whether two param values are equal: as text, or as numbers (``1`` equals ``1.0``)."""
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def parse_where(items: list[str]) -> list[tuple[str, str]]:
    """``["lr=0.1", "choice.algorithm=ditto"]`` -> ``[("lr", "0.1"), ...]``.

    Raises:
        FedexpError: an item is not KEY=VALUE.
    """
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise FedexpError(f"--where {item!r}: expected KEY=VALUE, e.g. lr=0.1")
        out.append((key.strip(), value.strip()))
    return out


def where(runs: list[Run], conditions: list[tuple[str, str]]) -> list[Run]:
    """The runs whose params/tags have every ``(key, value)`` (numbers compared as numbers).

    Raises:
        FedexpError: no run is left (the values the first failing key takes are listed).
    """
    check_keys(runs, [k for k, _ in conditions], "--where")
    kept = runs
    for key, value in conditions:
        left = [r for r in kept if same_value(r.get(key), value)]
        if not left:
            seen = sorted({r.get(key) for r in kept})
            raise FedexpError(
                f"--where {key}={value}: no run left; {key} takes the values {', '.join(seen)}"
            )
        kept = left
    return kept


def latest_per_config(runs: list[Run]) -> tuple[list[Run], int]:
    """The latest run (by start time) of each configuration, and how many were dropped.

    Re-running a sweep into the same experiment (or reporting two experiments holding the
    same runs) would otherwise count every configuration twice.
    """
    latest: dict[tuple[tuple[str, str], ...], Run] = {}
    for run in runs:
        key = run.config()
        if key not in latest or (run.start_time, run.run_id) > (
            latest[key].start_time,
            latest[key].run_id,
        ):
            latest[key] = run
    kept = [r for r in runs if latest[r.config()] is r]
    return kept, len(runs) - len(kept)


@dataclass(frozen=True)
class Agg:
    """How a run's metric history becomes one number.

    Attributes:
        kind: ``final`` (the last logged value), ``best`` (max, or min when lower is better,
            over the logged rounds) or ``last`` (mean of the last ``k`` logged values).
        k: the number of values of ``last``.
    """

    kind: str = "final"
    k: int = 0

    @classmethod
    def parse(cls, text: str) -> Agg:
        """``final``, ``best`` or ``last:K`` (K ≥ 1).

        Raises:
            ValueError: anything else (argparse turns it into one line).
        """
        if text in ("final", "best"):
            return cls(text)
        kind, _, k = text.partition(":")
        if kind == "last" and k.isdigit() and int(k) >= 1:
            return cls("last", int(k))
        hint = ""
        if text in ("p10", "p50", "p90", "mean", "worst", "std", "weighted"):
            # --agg reduces a run's rounds; a reduction over clients is a metric of its own
            hint = f"; the clients' {text} is a metric: --metric acc/{text}"
        raise ValueError(
            f"--agg {text!r}: expected final, best or last:K with K ≥ 1 (last:5){hint}"
        )

    def __str__(self) -> str:
        return f"last:{self.k}" if self.kind == "last" else self.kind

    def describe(self, lower_is_better: bool) -> str:
        """The aggregation in words, for the table's header."""
        if self.kind == "final":
            return "final value (last logged round)"
        if self.kind == "best":
            return f"best over the logged rounds ({'min' if lower_is_better else 'max'})"
        return f"mean of the last {self.k} logged values"

    def of(self, history: list[tuple[int, float]], lower_is_better: bool) -> float:
        """The aggregate of ``[(step, value), ...]`` (sorted by step); NaN values skipped."""
        values = [v for _, v in history if not math.isnan(v)]
        if not values:
            return math.nan
        if self.kind == "final":
            return values[-1]
        if self.kind == "best":
            return min(values) if lower_is_better else max(values)
        tail = values[-self.k :]
        return sum(tail) / len(tail)


#: The metric a private run logs every round: ε spent so far, at ``privacy.delta``.
EPSILON = "privacy/epsilon"


def epsilon_of(run: Run) -> float:
    """The ε ``run`` spent: its final :data:`EPSILON`; ``inf`` for a run without DP.

    A run without DP: ``privacy.mode`` is ``none`` (or not a param: a run made before the
    ``privacy`` group), or the run logged no :data:`EPSILON`. A logged ε of the largest float
    is ∞ too: MLflow's SQL store keeps an infinite value so (a run with no noise, z = 0).
    """
    if run.params.get("privacy.mode", "none") == "none" or EPSILON not in run.metrics:
        return math.inf
    eps = float(run.metrics[EPSILON])
    return math.inf if eps >= sys.float_info.max else eps


def history(client: Any, run_id: str, metric: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` of a metric, one value per step (the last logged), by step."""
    points = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
    return sorted({m.step: float(m.value) for m in points}.items())


def values_of(
    client: Any,
    runs: list[Run],
    metric: str,
    agg: Agg,
    lower_is_better: bool = False,
    short: list[str] | None = None,
) -> dict[str, float]:
    """Each run's ``metric`` aggregated by ``agg``, by run id.

    ``final`` reads the value MLflow keeps with the run (no extra request); ``best`` and
    ``last:K`` fetch the run's history (``MlflowClient.get_metric_history``).

    Args:
        client: the MLflow client the runs were read with.
        runs: the runs.
        metric: the metric's name.
        agg: how a history becomes one number.
        lower_is_better: ``best`` is the minimum.
        short: with ``last:K``, receives the ids of the runs with fewer than K values after
            round 0 (their mean includes the initial model's, or fewer values than asked).
    """
    if agg.kind == "final":
        return {r.run_id: float(r.metrics[metric]) for r in runs}
    out = {}
    for r in runs:
        points = history(client, r.run_id, metric)
        out[r.run_id] = agg.of(points, lower_is_better)
        if short is not None and agg.kind == "last" and sum(s > 0 for s, _ in points) < agg.k:
            short.append(r.run_id)
    return out
