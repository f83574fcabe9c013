"""MLflow tracking through MLflow's own client and stores.

Default store: MLflow's own default, a SQLite file ``mlflow.db`` in the working directory;
``tracker.uri`` may name any other store or a tracking server (``http://host:5000``). Writes
to a SQLite store are serialised across processes with a file lock beside the database, so
the jobs of a parallel sweep lose no run and no metric.

An ``http(s)://`` URI is probed first (:func:`check_reachable`: ``<uri>/health``, 3 s): with no
server answering, the run fails at once with one line naming the URI, instead of after MLflow's
minutes of retries.

A run never stays RUNNING after its process stops: the runner ends it FAILED or KILLED on an
exception or Ctrl-C (the CLI turns SIGTERM into the same), and an exit handler ends a run still
open when the interpreter exits (KILLED). SIGKILL, the OOM killer and power loss escape
this; for them every run is tagged with its host, pid and the pid's start time
(``fedexp.host``, ``fedexp.pid``, ``fedexp.pid_started``), and every run that starts or resumes
ends the RUNNING runs of the whole store (every experiment) left by a process of this host that
is gone (KILLED, tagged ``fedexp.reaped``, the reason in the run's description): see
:meth:`MLflowTracker._reap`.

A local SQLite store's path is checked before MLflow opens it (:func:`check_sqlite_path`): a
part of it that is a file, a folder where the database should be, or a folder that cannot be
written fails at once with one line naming the path, instead of a bare ``FileExistsError`` or
MLflow's minute of retries.

System metrics (CPU utilisation, memory, disk, network; GPU too where ``nvidia-ml-py`` is
installed) are sampled by MLflow's own :class:`SystemMetricsMonitor` (psutil) every
``system_metrics_interval`` seconds (5 by default, so that a run of a minute has a dozen
points; MLflow's ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` environment variable overrides
it) from the moment the run is created or reopened until it ends, whatever its end (FINISHED,
FAILED, KILLED); the sample still pending when it ends is logged too, so even a short run has
one point. They appear as ``system/...`` metrics (e.g. ``system/cpu_utilization_percentage``)
with the sample index as step. ``tracker.system_metrics=false`` turns them off.

The run's data set is recorded as an MLflow dataset input (:meth:`MLflowTracker.log_dataset`),
and the per-client table as an MLflow table artifact (:meth:`MLflowTracker.log_table`).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import mlflow
from mlflow.entities import Metric
from mlflow.entities import Param
from mlflow.entities import RunStatus
from mlflow.entities import RunTag
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.tracking import MlflowClient

from fedexp.config.ranges import PositiveInt
from fedexp.config.ranges import Range
from fedexp.tracking.dataset_input import DatasetRecord
from fedexp.tracking.dataset_input import mlflow_source
from fedexp.tracking.links import experiment_url
from fedexp.tracking.links import ui_base
from fedexp.tracking.links import ui_command
from fedexp.tracking.reaper import HOST_TAG  # noqa: F401 - the tags are part of this module's API
from fedexp.tracking.reaper import NOTE_TAG  # noqa: F401 - the tags are part of this module's API
from fedexp.tracking.reaper import PID_TAG  # noqa: F401 - the tags are part of this module's API
from fedexp.tracking.reaper import REAPED_TAG  # noqa: F401 - the tags are part of this module's API
from fedexp.tracking.reaper import STARTED_TAG  # noqa: F401 - the tags are part of this module's API
from fedexp.tracking.reaper import Reaper  # noqa: F401 - the tags are part of this module's API
from fedexp.tracking.reaper import _started  # noqa: F401 - the tags are part of this module's API
from fedexp.tracking.store import check_reachable
from fedexp.tracking.store import check_sqlite_path

log = logging.getLogger("fedexp")

_MAX_PARAMS_PER_BATCH = 100
_MAX_METRICS_PER_BATCH = 1000
#: Seconds between two system-metrics samples (MLflow's own default is 10).
SYSTEM_METRICS_INTERVAL_S = 5.0
#: The dataset input's context tag (MLflow's key): the whole set, split among the clients.
DATASET_CONTEXT = "federated"


#: Experiment tag that selects MLflow's UI view; ``custom_model_development`` is the ML view.
EXPERIMENT_KIND = "mlflow.experimentKind"
ML_KIND = "custom_model_development"


class _SystemMetrics(SystemMetricsMonitor):
    """MLflow's system-metrics monitor, writing under the tracker's store lock.

    Also logs, when it finishes, the sample taken since its last publication (MLflow's own
    drops it), so that a run shorter than the interval still has one point.
    """

    def __init__(self, tracker: MLflowTracker, resume: bool) -> None:
        super().__init__(
            tracker.run_id,
            sampling_interval=tracker.system_metrics_interval,
            resume_logging=resume,
            tracking_uri=tracker.uri,
        )
        self._tracker = tracker

    def publish_metrics(self, metrics: dict[str, float]) -> None:
        """Write one aggregated sample now (serialised with the tracker's other writes)."""
        with self._tracker._locked():
            super().publish_metrics(metrics)
            self.mlflow_logger.flush()  # MLflow's logger may batch; nothing is left for later

    def finish(self) -> None:
        """Stop sampling, then log the pending sample; never raises."""
        try:
            super().finish()
            if any(m.metrics for m in self.monitors):
                self.publish_metrics(self.aggregate_metrics())
        except Exception as exc:  # noqa: BLE001 - system metrics must never fail a run
            log.debug("could not log the last system-metrics sample: %s", exc)


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """Defer Ctrl-C and SIGTERM until a write to the store has ended (main thread only).

    A KeyboardInterrupt raised inside SQLAlchemy's commit leaves the SQLite connection holding
    its write lock, so the write that ends the run KILLED then fails with "database is
    locked" and a traceback reaches the user. The signal is delivered again, to the handler
    it was meant for, as soon as the write is over (a write takes milliseconds).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    # a handler installed outside Python (getsignal: None) cannot be put back: left alone
    signals = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if received:
            signal.raise_signal(received[0])


class MLflowTracker(Reaper):
    """Logs one fedexp run as one MLflow run.

    Args:
        uri: tracking URI; None uses MLflow's default (``sqlite:///mlflow.db``) unless the
            MLFLOW_TRACKING_URI environment variable says otherwise.
        experiment: experiment name; None: "fedexp" for a single run, and for the runs of a
            multirun one experiment per sweep, "fedexp/<varying keys> <date time>" (set by
            the CLI, :mod:`fedexp.sweep`).
        retries: attempts for a write that fails on a busy store.
        system_metrics: log MLflow's system metrics (CPU, memory, disk, network) while the
            run is open.
        system_metrics_interval: seconds between two system-metrics samples.
    """

    def __init__(
        self,
        uri: str | None = None,
        experiment: str | None = None,
        retries: PositiveInt = 20,
        system_metrics: bool = True,
        system_metrics_interval: Annotated[float, Range(gt=0, note="seconds")] = (
            SYSTEM_METRICS_INTERVAL_S
        ),
    ) -> None:
        self.uri = uri or mlflow.get_tracking_uri()
        # where the URI came from: the setting, else the environment, else MLflow's default
        from_env = not uri and bool(os.environ.get("MLFLOW_TRACKING_URI"))
        key = "MLFLOW_TRACKING_URI" if from_env else "tracker.uri"
        check_reachable(self.uri, key=key)
        db = check_sqlite_path(self.uri, key=key)
        self.experiment = experiment or "fedexp"
        self.retries = retries
        self.system_metrics = system_metrics
        self.system_metrics_interval = float(system_metrics_interval)
        self._monitor: _SystemMetrics | None = None
        self.run_id: str | None = None
        self._lock_path = db.with_name(db.name + ".lock") if db is not None else None
        with self._locked():
            self.client = MlflowClient(tracking_uri=self.uri)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self._lock_path is None:
            yield
            return
        with open(self._lock_path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _call(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - thin retry wrapper
        for attempt in range(self.retries):
            try:
                with _uninterrupted(), self._locked():
                    return fn(*args, **kwargs)
            except MlflowException as exc:
                busy = "locked" in str(exc) or "busy" in str(exc)
                if not busy or attempt == self.retries - 1:
                    raise
                time.sleep(0.1 * (attempt + 1))
        return None

    def _experiment_id(self) -> str:
        """The experiment's id, created if needed, tagged for MLflow's machine-learning view.

        MLflow 3 opens an experiment without ``mlflow.experimentKind`` in its GenAI view
        (traces, prompts); ``custom_model_development`` opens the runs, metrics and charts.
        """
        exp = self._call(self.client.get_experiment_by_name, self.experiment)
        if exp is not None:
            exp_id = exp.experiment_id
            if exp.tags.get(EXPERIMENT_KIND) == ML_KIND:
                return exp_id
        else:
            try:
                exp_id = self._call(self.client.create_experiment, self.experiment)
            except MlflowException:  # created meanwhile by a concurrent job
                exp_id = self._call(
                    self.client.get_experiment_by_name, self.experiment
                ).experiment_id
        self._call(self.client.set_experiment_tag, exp_id, EXPERIMENT_KIND, ML_KIND)
        return exp_id

    def start(
        self,
        run_name: str,
        params: dict[str, str],
        tags: dict[str, str],
        resume_run_id: str | None = None,
    ) -> str:
        """Create the run (or reopen ``resume_run_id``) and log params and tags.

        A ``resume_run_id`` this store does not hold (the first run used ``tracker=none`` or
        another store) starts a new run tagged ``fedexp.resumed_from``; the caller sees a
        different id and replays the checkpoint's history into it.

        The run is tagged with this host, pid and the pid's start time (a resumed one
        re-tagged in the same write that makes it RUNNING again, so that no other job takes it
        for dead), then the runs of the store left RUNNING by processes of this host that are
        gone are ended KILLED (:meth:`_reap`).
        """
        pid = os.getpid()
        ident = {HOST_TAG: socket.gethostname(), PID_TAG: str(pid), STARTED_TAG: _started(pid)}
        resumed = self._stored_run(resume_run_id) if resume_run_id is not None else None
        if resumed is not None:
            self.run_id = resume_run_id
            self.set_tags({k: v for k, v in tags.items() if k not in ident})
            self._record_rescue(resumed.data.tags, tags, params)
            self._call(self._reopen, resume_run_id, ident)
            self._open(resumed=True)
            self._reap(resumed.info.experiment_id)
            return resume_run_id
        tags = {**tags, **ident}
        if resume_run_id is not None:
            log.warning(
                "run %s is not in %s: resuming into a new MLflow run", resume_run_id, self.uri
            )
            tags = {**tags, "fedexp.resumed_from": resume_run_id}
        run = self._call(
            self.client.create_run, self._experiment_id(), run_name=run_name, tags=tags
        )
        self.run_id = run.info.run_id
        self._open()
        self._reap(run.info.experiment_id)
        items = [Param(k[:250], str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
            self._call(
                self.client.log_batch, self.run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH]
            )
        return self.run_id

    def _record_rescue(
        self, before: dict[str, str], tags: dict[str, str], params: dict[str, str]
    ) -> None:
        """A resume after a failed attempt: its tags become one record of it (issue 70, item 10).

        A rescue from the good checkpoint resumes before the failed attempt's changes
        (``fedexp.resume.2.lr = 0.1 -> 100.0``, no longer in ``tags``) and its ``error``;
        left on the run, they would tell a reader that the rescued rounds ran with them. They
        go, and ``fedexp.attempt.<n>`` (``failed: DivergenceError: ...; after round 2: lr 0.1
        -> 100.0``) and ``fedexp.rescue`` (``resumed after round 2 with lr=0.1 (attempt 1
        failed)``) say what happened.
        """
        stale = sorted(k for k in before if k.startswith("fedexp.resume.") and k not in tags)
        if not stale and "error" not in before:
            return
        n = 1 + sum(k.startswith("fedexp.attempt.") for k in before)
        said = [f"after round {k.split('.')[2]}: {k.split('.', 3)[3]} {before[k]}" for k in stale]
        attempt = "; ".join([f"failed: {before.get('error', 'stopped')}", *said])
        keys = dict.fromkeys(k.split(".", 3)[3] for k in stale)
        settings = ", ".join(f"{k}={params.get(k, '(unset)')}" for k in keys)
        after = tags.get("fedexp.resumed_after_round", "?")
        rescue = f"resumed after round {after}" + (f" with {settings}" if settings else "")
        self.set_tags(
            {f"fedexp.attempt.{n}": attempt, "fedexp.rescue": f"{rescue} (attempt {n} failed)"}
        )
        for key in [*stale, *(["error"] if "error" in before else [])]:
            self._call(self.client.delete_tag, self.run_id, key)

    def _reopen(self, run_id: str, ident: dict[str, str]) -> None:
        """Re-tag a resumed run with this process and make it RUNNING (one locked write)."""
        self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in ident.items()])
        self.client.update_run(run_id, status="RUNNING")

    def _stored_run(self, run_id: str):  # noqa: ANN202 - mlflow.entities.Run or None
        """``run_id`` as this store holds it; None if it holds no such run (or a deleted one)."""
        try:
            run = self._call(self.client.get_run, run_id)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise
        return None if run.info.lifecycle_stage == "deleted" else run

    def _open(self, resumed: bool = False) -> None:
        """The run is RUNNING: end it at exit, and sample system metrics until it ends."""
        atexit.register(self._end_at_exit)
        if not self.system_metrics:
            return
        # MLflow says "Started monitoring system metrics." (INFO) on every run: not here
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        try:
            self._monitor = _SystemMetrics(self, resume=resumed)
            self._monitor.start()
        except Exception as exc:  # noqa: BLE001 - system metrics must never fail a run
            self._monitor = None
            log.warning("system metrics are off for this run: %s", exc)

    def _stop_monitor(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.finish()

    def _end_at_exit(self) -> None:
        """End a run still open when the interpreter exits (KILLED); never raises."""
        try:
            self.end("KILLED")
        except Exception:  # noqa: BLE001, S110 - best effort while exiting
            pass

    def last_step(self, key: str) -> int | None:
        """The largest step logged for ``key``."""
        history = self._call(self.client.get_metric_history, self.run_id, key)
        return max((m.step for m in history), default=None)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One batch per round; NaN values are skipped (MLflow stores them, plots don't)."""
        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if v is not None and not math.isnan(float(v))
        ]
        for i in range(0, len(items), _MAX_METRICS_PER_BATCH):
            self._call(
                self.client.log_batch, self.run_id, metrics=items[i : i + _MAX_METRICS_PER_BATCH]
            )

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a local file to the run's artifact store."""
        self._call(self.client.log_artifact, self.run_id, str(path), artifact_path)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Log ``rows`` as MLflow's table artifact (JSON, shown as a table in the run's UI).

        Written as MLflow's ``log_table`` writes it (pandas' ``split`` JSON, the run's
        ``mlflow.loggedArtifacts`` tag naming it a table), but whole: a table the run holds
        already (a resumed run's) is replaced. MLflow's own call appends to it (a resume
        held rounds 0..R twice) after downloading it, which drew its "Downloading
        artifacts" bar on the terminal.

        Args:
            rows: one dict a row (the same keys throughout; missing ones are empty cells).
            artifact_file: the artifact's name, ending in ``.json``.
        """
        import json
        import tempfile

        import pandas as pd
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        name = Path(artifact_file)
        with tempfile.TemporaryDirectory(prefix="fedexp-table-") as tmp:
            file = Path(tmp) / name.name
            pd.DataFrame(rows).to_json(file, orient="split", index=False, date_format="iso")
            folder = None if str(name.parent) == "." else name.parent.as_posix()
            self._call(self.client.log_artifact, self.run_id, str(file), folder)
        run = self._call(self.client.get_run, self.run_id)
        logged = json.loads(run.data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
        entry = {"path": artifact_file, "type": "table"}
        if entry not in logged:
            tag = json.dumps([*logged, entry])
            self._call(self.client.set_tag, self.run_id, MLFLOW_LOGGED_ARTIFACTS, tag)

    def log_dataset(self, record: DatasetRecord) -> None:
        """Log the run's data set as an MLflow dataset input (once per content hash).

        The input holds the name, the source (the file/folder, or the loader), the digest
        (the first 32 hex digits of :func:`~fedexp.tracking.dataset_input.content_hash`, the
        most MLflow stores), MLflow's tensor schema of ``x`` and ``y``, and a profile with
        sizes, shapes, the number of classes and the whole SHA-256. A resumed run that already
        holds this digest logs nothing; one whose data changed since it began gets a warning
        and a second input.
        """
        import json

        import numpy as np
        from mlflow.data.schema import TensorDatasetSchema
        from mlflow.entities import Dataset
        from mlflow.entities import DatasetInput
        from mlflow.entities import InputTag
        from mlflow.types import Schema
        from mlflow.types import TensorSpec

        run = self._call(self.client.get_run, self.run_id)
        held = [d.dataset for d in (run.inputs.dataset_inputs if run.inputs else [])]
        if any(d.name == record.name and d.digest == record.digest for d in held):
            return
        for d in held:
            if d.name == record.name:
                log.warning(
                    "data set %s changed since run %s began (digest %s, was %s): "
                    "both are recorded as its inputs",
                    record.name,
                    self.run_id,
                    record.digest,
                    d.digest,
                )
        source = mlflow_source(record)  # its type stated: MLflow's guess warns on a path

        def spec(dtype_shape: tuple[str, tuple[int, ...]]) -> Schema:
            dtype, shape = dtype_shape
            return Schema([TensorSpec(np.dtype(dtype), (-1, *shape[1:]))])

        schema = TensorDatasetSchema(features=spec(record.features), targets=spec(record.targets))
        entity = Dataset(
            name=record.name,
            digest=record.digest,
            source_type=source._get_source_type(),
            source=source.to_json(),
            schema=json.dumps(schema.to_dict()),
            profile=json.dumps(record.profile),
        )
        tags = [InputTag("mlflow.data.context", DATASET_CONTEXT)]
        self._call(self.client.log_inputs, self.run_id, datasets=[DatasetInput(entity, tags)])

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set run tags."""
        for k, v in tags.items():
            self._call(self.client.set_tag, self.run_id, k, str(v)[:5000])

    def end(self, status: str = "FINISHED") -> None:
        """Stop the system metrics, then terminate the run with ``status``."""
        atexit.unregister(self._end_at_exit)
        self._stop_monitor()
        if self.run_id is not None:
            self._call(
                self.client.set_terminated,
                self.run_id,
                RunStatus.to_string(RunStatus.from_string(status)),
            )

    def link(self) -> str:
        """The experiment's page in MLflow's machine-learning view, and how to serve it.

        ``?workflowType=machine_learning`` (:mod:`fedexp.tracking.links`): MLflow 3.17 opens
        the GenAI view otherwise, whatever the experiment's tags say.
        """
        try:
            exp = self._call(self.client.get_experiment_by_name, self.experiment)
        except MlflowException:
            exp = None
        if exp is None:
            return ui_command(self.uri) or ui_base(self.uri)
        url = experiment_url(ui_base(self.uri), exp.experiment_id)
        serve = ui_command(self.uri)
        return f"{serve}, then open {url}" if serve else f"open {url}"

    def describe(self) -> str:
        """Where the run is and how to look at it (the link opens MLflow's ML view)."""
        return (
            f"MLflow run {self.run_id} in experiment '{self.experiment}' at {self.uri}\n"
            f"view: {self.link()}"
        )
