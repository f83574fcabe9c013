"""A sweep (``fedexp run -m``): one MLflow parent run, its jobs nested child runs, a summary.

:class:`SweepCallback` is a Hydra callback (``hydra.callbacks.sweep`` in conf/config.yaml). In
the process that launches the sweep, whatever the launcher (sequential, joblib, SLURM):

* ``on_multirun_start``: refuses a SLURM launcher where there is no SLURM (one line, exit 1);
  works out which keys vary across the sweep (:func:`varying_keys`: its command-line sweeps
  ``algorithm=fedavg,ditto`` and the sweeper's ``hydra.sweeper.params``, Optuna's included)
  and their values (:func:`sweep_values`); names the experiment of an ad-hoc sweep by them
  (:func:`experiment_name`, ``fedexp/algorithm,seed 2026-11-22 10:00:00``;
  ``tracker.experiment=NAME`` wins); starts the parent MLflow run, named by the sweep's
  command-line overrides (none with ``tracker=none``); writes what the jobs need to
  ``<sweep dir>/fedexp_sweep.json`` (:class:`SweepInfo`); quiets the launcher's own lines
  (Hydra's ``#3 : algorithm=...`` per job) and prints one line saying how many jobs run and
  where each one logs; on a terminal it draws one live display (:class:`LiveSweep`: a bar of
  the jobs done and failed with the ETA, a line per running job with its round).
* each job (the CLI's task function, maybe in a joblib worker or on a SLURM node) reads that
  file, tags its MLflow run ``mlflow.parentRunId`` (a nested child run), names it by the
  varying keys (:func:`child_name`: short and value first, ``local δ=2 s1``), gives it a colour
  of its own (``mlflow.runColor``: a hue per configuration, a shade per seed), keeps its
  per-round lines in its own log file (``<job dir>/<job name>.log``; the terminal gets one line
  per job) and records its outcome in its own folder (:func:`write_status`,
  ``fedexp_status.json``: ok/failed/killed, the error line, run id, final and best headline).
* ``on_multirun_end``: reads every job's status (a job folder without one counts as failed),
  prints the summary (:class:`SweepSummary`: ok/failed jobs with their errors, the best
  configuration, the experiment and its link, which opens the runs grouped by the varying keys,
  the ``fedexp report`` command to run), logs the sweep's summary on the parent run
  (:func:`summarise`: per configuration the final and best headline, mean over seeds, as
  metrics, a table artifact and the run's description), ends it FAILED if any job failed,
  else FINISHED, and keeps the summary in :data:`last` for the CLI's exit code.
* a sweep that Hydra stops before its end (the sweeper raises, Ctrl-C) never reaches
  ``on_multirun_end``: the CLI calls :func:`end_unfinished`, which waits for the jobs still
  running to stop, ends their runs KILLED (those whose process is gone, or after a SIGTERM, see
  :meth:`SweepCallback._stop_children`), prints the same summary (of the jobs so far) and ends
  the parent run FAILED, or KILLED when interrupted; a sweep stopped before any job started an
  MLflow run leaves nothing in MLflow (its parent run, and the ad-hoc experiment made for it,
  are deleted).

The link (:func:`fedexp.tracking.links.sweep_view_url`) opens MLflow's runs tab on a view saved
with the experiment (tag ``mlflow.sharedViewState.<parent run id>``): this sweep's runs grouped
by the varying keys but the seed (a param, or a config group's ``choice.<group>`` tag), a row per
configuration, best first, and in the charts each group's mean and min-max range.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from fedexp.sweep.names import RUN_NAME_CHARS  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import SHORT_KEYS  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import child_name  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import experiment_name  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import group_keys  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import report_command  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import run_color  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import run_name  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import short_name  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import slurm_missing  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import sweep_size  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import sweep_values  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.names import varying_keys  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.status import NO_STATUS  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import STATUS_FILE  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import STOPPED  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import SWEEP_FILE  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import ConfigResult  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import JobStatus  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import SweepInfo  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import _mean  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import best_of  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import read_statuses  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import summarise  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.status import write_status  # noqa: F401 - re-exported: fedexp.sweep is the API  # noqa: F401
from fedexp.sweep.summary import LiveSweep  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.summary import SweepSummary  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.summary import _terminal  # noqa: F401 - re-exported: fedexp.sweep is the API
from fedexp.sweep.summary import metric_label  # noqa: F401 - re-exported: fedexp.sweep is the API

SUMMARY_FILE = "fedexp_summary.txt"
MLFLOW_TARGET = "fedexp.tracking.mlflow_tracker.MLflowTracker"
#: The one line for a SLURM launcher where ``sbatch`` is not on PATH.
NO_SLURM = (
    "hydra/launcher=slurm: no SLURM here (sbatch not found on PATH); use "
    "hydra/launcher=parallel or run on the cluster's login node"
)

#: The summary of the last sweep this process launched (None before): the CLI exits 1 when
#: it counts a failed job.
last: SweepSummary | None = None
#: The sweep this process started and has not summarised yet (see :func:`end_unfinished`).
_active: SweepCallback | None = None
#: The launchers' loggers whose per-job lines (``#3 : algorithm=... seed=...``) a sweep quiets.
LAUNCHER_LOGGERS = (
    "hydra._internal.core_plugins.basic_launcher",
    "hydra_plugins.hydra_joblib_launcher._core",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher",
)
#: Seconds a stopped sweep waits for its jobs' processes to end before it sends SIGTERM.
STOP_GRACE_S = 10.0


class SweepCallback(Callback):
    """Hydra callback of fedexp's sweeps (see the module's docstring)."""

    def __init__(self) -> None:
        self.info: SweepInfo | None = None
        self.uri: str | None = None
        self.groups: list[str] = []
        self.tuning = False  # a hyper-parameter search (the Optuna sweeper)
        self.sweep_dir = ""
        self.named = False  # tracker.experiment was given (else the experiment is ad hoc)
        self._parent: Any = None  # the parent run's MLflowTracker, in the launching process
        self._live: LiveSweep | None = None
        self._levels: dict[str, int] = {}  # the launchers' loggers' levels before the sweep

    def __getstate__(self) -> dict[str, Any]:
        """Pickled into joblib workers with Hydra's context: without the MLflow client."""
        return {**self.__dict__, "_parent": None, "_live": None}

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Check the launcher, name the experiment, start the parent run, write the info."""
        global _active
        from omegaconf import OmegaConf

        target = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
        if slurm_missing(target):
            print(f"fedexp: error: {NO_SLURM}", file=sys.stderr)
            sys.exit(1)
        task = [str(o) for o in config.hydra.overrides.task]
        params = OmegaConf.select(config, "hydra.sweeper.params")
        params = OmegaConf.to_container(params) if params is not None else {}
        varying = varying_keys(task, params)
        try:
            values = sweep_values(task, params)
        except Exception:  # noqa: BLE001 - only colours and the job count depend on it
            values = {}
        self.groups = [str(k) for k in config.hydra.runtime.choices]
        sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
        searched = OmegaConf.select(config, "hydra.runtime.choices.hparams_search", default=None)
        self.tuning = "optuna" in sweeper.lower() or searched not in (None, "null")
        live = _terminal() and not OmegaConf.select(config, "hydra.verbose", default=False)
        self.info = SweepInfo(
            uuid.uuid4().hex,
            varying,
            started=time.time(),
            values={k: v for k, v in values.items() if k in varying},
            live=live,
        )
        self.sweep_dir = str(config.hydra.sweep.dir)
        if OmegaConf.select(config, "tracker._target_") == MLFLOW_TARGET:
            self.uri = OmegaConf.select(config, "tracker.uri")
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.info.started))
            given = OmegaConf.select(config, "tracker.experiment")
            self.named = bool(given)
            self.info.experiment = given or experiment_name(varying, when)
            self._start_parent(task, self.sweep_dir)
        self.info.write(self.sweep_dir)
        _active = self
        total = OmegaConf.select(config, "hydra.sweeper.n_trials", default=None)
        total = int(total) if self.tuning and total else sweep_size(values)
        self._announce(config, total)
        if live:
            self._live = LiveSweep(self.sweep_dir, self.info, total).start()

    def _announce(self, config: Any, total: int | None) -> None:
        """Quiet the launcher's line per job; say in one line what runs and where it logs."""
        from omegaconf import OmegaConf

        if not OmegaConf.select(config, "hydra.verbose", default=False):
            for name in LAUNCHER_LOGGERS:
                logger = logging.getLogger(name)
                self._levels.setdefault(name, logger.level)
                logger.setLevel(logging.WARNING)
        jobs = OmegaConf.select(config, "hydra.launcher.n_jobs", default=None)
        at_once = f", {jobs} at a time" if isinstance(jobs, int) and jobs > 1 else ""
        count = f"{total} job{'s' if total != 1 else ''}" if total else "jobs"
        assert self.info is not None
        keys = [k if k == "seed" else SHORT_KEYS.get(k, k) for k in self.info.varying]
        over = f" over {', '.join(keys)}" if keys else ""
        log_name = f"{OmegaConf.select(config, 'hydra.job.name', default=None) or 'cli'}.log"
        print(f"sweep: {count}{over}{at_once}; rounds: <job>/{log_name}", flush=True)

    def _start_parent(self, task: list[str], sweep_dir: str) -> None:
        from fedexp.errors import FedexpError
        from fedexp.tracking.mlflow_tracker import MLflowTracker

        assert self.info is not None
        tags = {
            "fedexp.sweep": "parent",
            "fedexp.sweep.dir": sweep_dir,
            "fedexp.sweep.overrides": " ".join(task),
            "fedexp.sweep.varying": ",".join(self.info.varying),
        }
        # the settings every job shares (the sweep's constant command-line overrides)
        params = {
            k: v[0]
            for k, v in self.info_values(task).items()
            if v and len(v) == 1 and not k.startswith("tracker")
        }
        # MLflow says "Creating initial MLflow database tables..." on a new store: not here
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        try:
            # no system metrics: the parent spans the sweep; each child run samples its own
            self._parent = MLflowTracker(self.uri, self.info.experiment, system_metrics=False)
            name = " ".join(task) or "sweep"
            self.info.parent_run_id = self._parent.start(name, params, tags)
        except FedexpError as exc:
            print(f"fedexp: error: {exc}", file=sys.stderr)
            sys.exit(1)

    @staticmethod
    def info_values(task: list[str]) -> dict[str, list[str] | None]:
        """The values of the sweep's command-line overrides (``{}`` where they cannot parse)."""
        try:
            return sweep_values(task)
        except Exception:  # noqa: BLE001 - the parent's params are a convenience
            return {}

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Read the jobs' outcomes, print the summary, end the parent run."""
        self.finish()

    def finish(self, stopped: str | None = None, status: str = "FAILED") -> SweepSummary:
        """Summarise the sweep on stdout and end its parent run (see the module's docstring).

        Args:
            stopped: why the sweep ended before its end (the sweeper raised, Ctrl-C), or None
                for a sweep that ran every job; a stopped sweep's parent run ends ``status``.
            status: the parent run's status for a stopped sweep (FAILED or KILLED).
        """
        global last, _active
        _active = None
        if self._live is not None:
            live, self._live = self._live, None
            live.stop()
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        if self.info is None:  # on_multirun_start failed (Hydra made it a warning)
            self.info = SweepInfo("", [])
        if stopped and self._parent is not None:
            self._stop_children(stopped)
        jobs = read_statuses(
            self.sweep_dir, self.info.sweep_id, self.info.started, self.info.varying
        )
        for job in jobs if stopped else []:
            if job.error == NO_STATUS:  # its process went with the sweep (joblib's workers)
                job.status, job.error = "killed", STOPPED
        summary = SweepSummary(jobs, self.sweep_dir, self.info.experiment, stopped=stopped)
        summary.parent_run_id = self.info.parent_run_id
        summary.metric, summary.configs = summarise(jobs, self.info.varying)
        summary.tuning = self.tuning
        if self.info.experiment is not None:
            summary.report = report_command(
                self.info.experiment,
                self.uri,
                self.info.varying,
                self.groups,
                summary.metric,
                tuning=self.tuning,
            )
        if self._parent is not None and stopped and self._nothing_recorded():
            summary.deleted = self._delete_empty(status)
        elif self._parent is not None:
            summary.link, summary.grouped = self._view(summary)
        text = summary.text()
        print(f"\n{text}", flush=True)
        last = summary
        if self._parent is not None and not summary.deleted:
            self._log_summary(summary)
            ended = status if stopped else "FAILED" if summary.failed else "FINISHED"
            self._parent.end(ended)
        self._parent = None
        return summary

    # ---- the parent run's records -------------------------------------------------------

    def _log_summary(self, summary: SweepSummary) -> None:
        """The parent run's metrics, table, description and summary file; never raises."""
        parent = self._parent
        path = Path(self.sweep_dir) / SUMMARY_FILE
        try:
            path.write_text(summary.text() + "\n")
            parent.set_tags(
                {
                    "fedexp.sweep.summary": summary.counts(),
                    "mlflow.note.content": summary.markdown(),
                }
            )
            parent.log_artifact(path)
            killed = len(summary.killed)
            metrics = {
                "jobs/ok": len(summary.jobs) - len(summary.failed),
                "jobs/failed": len(summary.failed) - killed,
                "jobs/stopped": killed,
            }
            m = summary.metric
            for config in summary.configs if m else []:
                label = metric_label(config.name)
                metrics[f"final {m}/{label}"] = _mean(config.final)
                metrics[f"best {m}/{label}"] = _mean(config.best)
            parent.log_metrics(metrics, step=0)
            if m and summary.configs:
                parent.log_table([c.row(m) for c in summary.configs], "sweep_summary.json")
                top = summary.best()
                if top is not None:
                    parent.set_tags({"fedexp.sweep.best": summary.best_line() or top.name})
        except Exception as exc:  # noqa: BLE001 - the summary is printed whatever MLflow says
            print(f"fedexp: warning: the sweep's summary is not in MLflow: {exc}", file=sys.stderr)

    def _experiment_id(self) -> str:
        run = self._parent._call(self._parent.client.get_run, self.info.parent_run_id)
        return run.info.experiment_id

    def _view(self, summary: SweepSummary) -> tuple[str | None, str | None]:
        """The link that opens the sweep grouped by its varying keys, and what it groups by.

        The view is MLflow's own shared view state, stored as an experiment tag
        (:func:`fedexp.tracking.links.shared_view`); where it cannot be stored, the plain
        link to the experiment (and None: nothing is grouped).
        """
        from fedexp.tracking.links import shared_view
        from fedexp.tracking.links import sweep_view_url
        from fedexp.tracking.links import ui_base
        from fedexp.tracking.links import ui_command

        parent = self._parent
        keys = group_keys(self.info.varying, self.groups)
        names = [k["groupByData"].removeprefix("choice.") for k in keys]
        grouped = ", ".join(SHORT_KEYS.get(k, k) for k in names) or None
        try:
            exp_id = self._experiment_id()
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.info.started))
            name = f"sweep {when}: {self.info.parent_run_id[:8]}"
            columns = [f"params.`{k}`" for k in self.info.varying if k not in self.groups]
            metric = f"metrics.`{summary.metric}`" if summary.metric else None
            logged = [{"tag": r.data.tags, "param": r.data.params} for r in self._children()]
            groups = {tuple(d[k["mode"]].get(k["groupByData"]) for k in keys) for d in logged}
            key, value = shared_view(
                name,
                self.info.parent_run_id,
                keys,
                columns=[*columns, metric] if metric else columns,
                created_ms=int(self.info.started * 1000),
                order_by=metric,
                collapsed=sorted(groups, key=str) if keys else [],
            )
            parent._call(parent.client.set_experiment_tag, exp_id, key, value)
            url = sweep_view_url(ui_base(parent.uri), exp_id, self.info.parent_run_id)
        except Exception as exc:  # noqa: BLE001 - the plain link still opens the experiment
            logging.getLogger("fedexp").debug("no grouped view of the sweep: %s", exc)
            return parent.link(), None
        serve = ui_command(parent.uri)
        return (f"{serve}, then open {url}" if serve else f"open {url}"), grouped

    def _children(self, running_only: bool = False) -> list:
        """The parent run's child runs (every status, or the RUNNING ones)."""
        parent = self._parent
        query = f"tags.`mlflow.parentRunId` = '{self.info.parent_run_id}'"
        if running_only:
            query += " and attributes.status = 'RUNNING'"
        from mlflow.entities import ViewType

        return parent._call(
            parent.client.search_runs,
            [self._experiment_id()],
            filter_string=query,
            run_view_type=ViewType.ALL,
            max_results=5000,
        )

    def _stop_children(self, why: str) -> None:
        """End KILLED the child runs a stopped sweep leaves RUNNING; never raises.

        Ctrl-C reaches every job of a local sweep (one process group): each ends its run
        KILLED, unless its process is killed first (joblib's workers are, as the launcher
        stops). A child run still RUNNING whose process is on this host is waited for (at most
        :data:`STOP_GRACE_S`), sent SIGTERM if it is still there (the job ends its run KILLED),
        and at last ended KILLED here, tagged ``fedexp.reaped`` with the reason in its
        description. Runs of other hosts (SLURM nodes) are left to their jobs.
        """
        import socket

        from mlflow.entities import RunTag

        from fedexp.tracking.reaper import HOST_TAG
        from fedexp.tracking.reaper import NOTE_TAG
        from fedexp.tracking.reaper import PID_TAG
        from fedexp.tracking.reaper import REAPED_TAG
        from fedexp.tracking.reaper import STARTED_TAG
        from fedexp.tracking.reaper import _gone

        parent, host = self._parent, socket.gethostname()
        try:
            runs = [r for r in self._children(True) if r.data.tags.get(HOST_TAG) == host]
        except Exception as exc:  # noqa: BLE001 - the summary comes first
            logging.getLogger("fedexp").debug("could not look for running jobs: %s", exc)
            return

        def alive(run: Any) -> bool:
            pid = run.data.tags.get(PID_TAG, "")
            if not pid.isdigit() or int(pid) == os.getpid():
                return False
            return _gone(int(pid), run.data.tags.get(STARTED_TAG)) is None

        deadline = time.monotonic() + STOP_GRACE_S
        while any(alive(r) for r in runs) and time.monotonic() < deadline:
            time.sleep(0.2)
        for run in runs:
            if alive(run):
                try:
                    os.kill(int(run.data.tags[PID_TAG]), signal.SIGTERM)
                except OSError:
                    pass
        deadline = time.monotonic() + 5
        while any(alive(r) for r in runs) and time.monotonic() < deadline:
            time.sleep(0.2)
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        for run in runs:
            run_id = run.info.run_id
            try:
                now = parent._call(parent.client.get_run, run_id)
                if now.info.status != "RUNNING":
                    continue  # the job ended it itself
                pid = run.data.tags.get(PID_TAG, "?")
                note = (
                    f"**Stopped with its sweep ({why}).** Process {pid} on {host} ended without "
                    f"closing this run; marked KILLED at {when} by the sweep's parent run "
                    f"{self.info.parent_run_id}."
                )
                before = now.data.tags.get(NOTE_TAG, "").strip()
                note = f"{note}\n\n{before}" if before else note
                parent._call(parent.client.set_terminated, run_id, "KILLED")
                tags = [RunTag(REAPED_TAG, f"stopped with sweep {self.info.sweep_id}: {why}")]
                tags.append(RunTag(NOTE_TAG, note[:8000]))
                parent._call(parent.client.log_batch, run_id, tags=tags)
            except Exception as exc:  # noqa: BLE001 - the summary comes first
                logging.getLogger("fedexp").debug("could not end run %s: %s", run_id, exc)

    def _nothing_recorded(self) -> bool:
        """Whether no job of this sweep started an MLflow run."""
        try:
            return not self._children()
        except Exception:  # noqa: BLE001 - when unsure, keep everything
            return False

    def _delete_empty(self, status: str) -> str:
        """Delete the parent run of a sweep that recorded nothing, and its ad-hoc experiment.

        Returns:
            What was deleted, in words, for the summary.
        """
        from mlflow.entities import ViewType

        parent = self._parent
        try:
            exp_id = self._experiment_id()
            parent.end(status)
            parent._call(parent.client.delete_run, self.info.parent_run_id)
            what = "the sweep stopped before any job started a run; its parent run was deleted"
            others = parent._call(
                parent.client.search_runs, [exp_id], run_view_type=ViewType.ACTIVE_ONLY
            )
            if not self.named and not others:
                parent._call(parent.client.delete_experiment, exp_id)
                what += f", and its experiment '{self.info.experiment}' too"
            return what
        except Exception as exc:  # noqa: BLE001 - then the parent run stays, ended
            return f"the sweep stopped before any job started a run ({exc})"


def end_unfinished(stopped: str, status: str = "FAILED") -> SweepSummary | None:
    """Summarise and end a sweep of this process that Hydra stopped before its end.

    Hydra calls ``on_multirun_end`` only when the sweeper returns: when it raises (Optuna's
    sweeper once every trial failed) or a job stops the sweep (Ctrl-C), the CLI calls this, so
    that the summary is still printed, the jobs' runs and the parent run do not stay RUNNING,
    and a sweep that recorded nothing leaves nothing in MLflow.

    Returns:
        The summary, or None where no sweep was left unfinished.
    """
    return _active.finish(stopped, status) if _active is not None else None
