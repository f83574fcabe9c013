"""A sweep (``fedexp run -m``): one MLflow parent run, its jobs nested child runs, a summary.

:class:`SweepCallback` is a Hydra callback (``hydra.callbacks.sweep`` in conf/config.yaml). In
the process that launches the sweep, whatever the launcher (sequential, joblib, SLURM):

* ``on_multirun_start``: refuses a SLURM launcher where there is no SLURM (one line, exit 1);
  works out which keys vary across the sweep (:func:`varying_keys`: its command-line sweeps
  ``algorithm=fedavg,ditto`` and the sweeper's ``hydra.sweeper.params``, Optuna's included);
  names the experiment of an ad-hoc sweep by them (:func:`experiment_name`,
  ``fedexp/algorithm,seed 2026-11-22 10:00:00``; ``tracker.experiment=NAME`` wins); starts the
  parent MLflow run, named by the sweep's command-line overrides (none with ``tracker=none``);
  and writes what the jobs need to ``<sweep dir>/fedexp_sweep.json`` (:class:`SweepInfo`).
* each job (the CLI's task function, maybe in a joblib worker or on a SLURM node) reads that
  file, tags its MLflow run ``mlflow.parentRunId`` (a nested child run), names it by the
  varying keys (:func:`child_name`, ``algorithm=ditto,seed=2``: Hydra's override_dirname
  without the keys constant across the sweep), and records its outcome in its own folder
  (:func:`write_status`, ``fedexp_status.json``: ok/failed, the error line, run id, overrides).
* ``on_multirun_end``: reads every job's status (a job folder without one counts as failed),
  prints the summary (:class:`SweepSummary`: ok/failed jobs with their errors, the experiment,
  the ``fedexp report`` command to run), ends the parent run FAILED if any job failed, else
  FINISHED, with the summary as its description, a tag and an artifact, and keeps the summary
  in :data:`last` for the CLI's exit code.
* a sweep that Hydra stops before its end (the sweeper raises, Ctrl-C) never reaches
  ``on_multirun_end``: the CLI calls :func:`end_unfinished`, which prints the same summary (of
  the jobs so far) and ends the parent run FAILED, or KILLED when interrupted.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

SWEEP_FILE = "fedexp_sweep.json"
STATUS_FILE = "fedexp_status.json"
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


def slurm_missing(launcher: str) -> bool:
    """Whether ``launcher`` (a launcher option or ``_target_``) is SLURM and sbatch is absent."""
    return "slurm" in launcher.lower() and shutil.which("sbatch") is None


def _key(item: str) -> str:
    """The key of a ``key=value`` override, without Hydra's ``+``/``++``/``~`` prefixes."""
    return item.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def varying_keys(task: Iterable[str], sweeper_params: Mapping[str, Any] | None = None) -> list[str]:
    """The keys that take more than one value across a sweep, in the order they are given.

    Args:
        task: the sweep's command-line overrides in sweep form (``hydra.overrides.task`` as
            ``on_multirun_start`` sees it: ``algorithm=fedavg,ditto``, ``seed=range(3)``).
        sweeper_params: ``hydra.sweeper.params`` (``{key: "a,b"}``; the Optuna sweeper's
            ``interval(...)``, ``choice(...)``, ``range(...)`` vary too). A key also given on
            the command line takes the command line's value (as Hydra's sweepers do).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = [f"{k}={v}" for k, v in (sweeper_params or {}).items()]
    varies: dict[str, bool] = {}
    for override in parser.parse_overrides([*given, *task]):
        if override.is_hydra_override():
            continue
        key = override.key_or_group
        if override.is_discrete_sweep():
            many = len(set(override.sweep_string_iterator())) > 1
        else:
            many = override.is_sweep_override()  # an interval: Optuna draws from it
        varies.pop(key, None)  # the later (command-line) value wins, and sets the order
        varies[key] = many
    return [k for k, many in varies.items() if many]


def child_name(job_overrides: Iterable[str], varying: Iterable[str]) -> str:
    """A job's run name: its overrides of the varying keys, as Hydra's override_dirname.

    ``["algorithm=ditto", "seed=2", "rounds=5"]`` with ``varying = ["algorithm", "seed"]``
    gives ``"algorithm=ditto,seed=2"`` (sorted, joined with commas, like override_dirname);
    ``""`` when nothing varies.
    """
    keys = set(varying)
    items = [i.lstrip("+~") for i in job_overrides if "=" in i and _key(i) in keys]
    return ",".join(sorted(items))


def experiment_name(varying: Iterable[str], when: str) -> str:
    """The MLflow experiment of an ad-hoc sweep: ``fedexp/<varying keys> <date time>``."""
    return f"fedexp/{','.join(varying) or 'sweep'} {when}"


def report_command(
    experiment: str,
    uri: str | None,
    varying: Iterable[str],
    groups: Iterable[str],
    metric: str | None = None,
    tuning: bool = False,
) -> str:
    """The ``fedexp report`` command that tabulates a sweep.

    A tuning sweep (Hydra's Optuna sweeper, ``hparams_search``) gets one row per method and
    ``--select-by val/<headline>/mean``: each method's best configuration on the validation
    split, reported on test (``docs/tuning.md``).

    Rows: ``choice.algorithm`` (the method) when the algorithm varies or nothing else does,
    else the first varying key; columns: the other varying keys; the seed is what cells
    average over. A config group's key is its ``choice.<group>`` tag, another key its param.

    Args:
        experiment: the sweep's MLflow experiment.
        uri: ``tracker.uri`` when given (None: MLflow's default store, which report uses too).
        varying: the sweep's varying keys (:func:`varying_keys`).
        groups: the config groups (``hydra.runtime.choices``' keys).
        metric: the headline metric when it is not report's default ``acc/mean``.
        tuning: the sweep is a hyper-parameter search (the tuned keys are not columns).
    """
    group_set = set(groups)
    if tuning:
        command = ["fedexp", "report"] + (["--uri", uri] if uri else [])
        command += ["--experiment", experiment, "--rows", "choice.algorithm"]
        if metric and metric != "acc/mean":
            command += ["--metric", metric]
        return shlex.join([*command, "--select-by", f"val/{metric or 'acc/mean'}"])
    keys = [f"choice.{k}" if k in group_set else k for k in varying if k != "seed"]
    if "choice.algorithm" in keys or not keys:
        rows = ["choice.algorithm"]
    else:
        rows = keys[:1]
    cols = [k for k in keys if k not in rows]
    command = ["fedexp", "report"]
    if uri:
        command += ["--uri", uri]
    command += ["--experiment", experiment, "--rows", *rows]
    if cols:
        command += ["--cols", *cols]
    if metric and metric != "acc/mean":
        command += ["--metric", metric]
    return shlex.join(command)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


@dataclass
class SweepInfo:
    """What the jobs of a sweep need from the launching process (``fedexp_sweep.json``).

    Attributes:
        sweep_id: this sweep's id (the jobs copy it into their status files).
        varying: the keys that vary across the sweep.
        experiment: the MLflow experiment of the sweep's runs (None: no MLflow).
        parent_run_id: the parent run's id (None with ``tracker=none``).
        started: the sweep's start, seconds since the epoch.
    """

    sweep_id: str
    varying: list[str]
    experiment: str | None = None
    parent_run_id: str | None = None
    started: float = 0.0

    def write(self, sweep_dir: str | Path) -> None:
        """Write ``<sweep_dir>/fedexp_sweep.json``."""
        _write_json(Path(sweep_dir) / SWEEP_FILE, asdict(self))

    @classmethod
    def read(cls, sweep_dir: str | Path) -> SweepInfo | None:
        """The sweep's info, or None where the file is missing or unreadable."""
        try:
            data = json.loads((Path(sweep_dir) / SWEEP_FILE).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError):
            return None


@dataclass
class JobStatus:
    """The outcome of one job of a sweep (``<job dir>/fedexp_status.json``).

    Attributes:
        job: Hydra's job number.
        status: "ok" or "failed".
        name: the job's run name (its overrides of the varying keys).
        overrides: all of the job's overrides.
        error: the one-line error of a failed job.
        run_id: the job's MLflow run, where one was started.
        metrics: the headline metric(s) of a finished job (``{"acc/mean": 0.81}``).
        sweep_id: the sweep's id (:class:`SweepInfo`).
    """

    job: int
    status: str
    name: str = ""
    overrides: list[str] = field(default_factory=list)
    error: str = ""
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    sweep_id: str = ""

    @property
    def ok(self) -> bool:
        """Whether the job finished."""
        return self.status == "ok"

    @property
    def label(self) -> str:
        """``job 3 algorithm=ditto,seed=2``: the job and what sets it apart."""
        return f"job {self.job} {self.name or ' '.join(self.overrides)}".strip()


def write_status(job_dir: str | Path, status: JobStatus) -> None:
    """Record a job's outcome in its own folder."""
    status.error = (status.error.strip().splitlines() or [""])[0]
    _write_json(Path(job_dir) / STATUS_FILE, asdict(status))


def read_statuses(sweep_dir: str | Path, sweep_id: str, since: float) -> list[JobStatus]:
    """Every job of the sweep ``sweep_id`` under ``sweep_dir``, by job number.

    A job is a folder holding a status file of this sweep, or Hydra's ``.hydra/overrides.yaml``
    written since ``since`` (the job started); the latter without a status file counts as
    failed (the job was killed or crashed before it could record its end).
    """
    import yaml

    root = Path(sweep_dir)
    jobs: dict[Path, JobStatus] = {}
    for path in root.rglob(STATUS_FILE):
        try:
            status = JobStatus(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if status.sweep_id == sweep_id:
            jobs[path.parent] = status
    for path in root.rglob(".hydra/overrides.yaml"):
        folder = path.parent.parent
        if folder in jobs or path.stat().st_mtime < since - 1:
            continue
        try:
            overrides = [str(o) for o in yaml.safe_load(path.read_text()) or []]
        except (OSError, yaml.YAMLError):
            overrides = []
        number = int(folder.name) if folder.name.isdigit() else len(jobs)
        jobs[folder] = JobStatus(
            job=number,
            status="failed",
            overrides=overrides,
            error="no status recorded: the job stopped before its end (killed? out of memory?)",
            sweep_id=sweep_id,
        )
    return sorted(jobs.values(), key=lambda s: s.job)


@dataclass
class SweepSummary:
    """The end of a sweep, as printed on the terminal.

    Attributes:
        jobs: every job's status.
        sweep_dir: the sweep's folder.
        experiment: the MLflow experiment (None with ``tracker=none``).
        report: the ``fedexp report`` command for its tables (None without MLflow).
        link: how to open the experiment in MLflow's ML view (None without MLflow).
        parent_run_id: the parent MLflow run.
        stopped: why the sweep stopped before its end, or None.
    """

    jobs: list[JobStatus]
    sweep_dir: str
    experiment: str | None = None
    report: str | None = None
    link: str | None = None
    parent_run_id: str | None = None
    stopped: str | None = None

    @property
    def failed(self) -> list[JobStatus]:
        """The jobs that failed."""
        return [j for j in self.jobs if not j.ok]

    def counts(self) -> str:
        """``"3 jobs: 2 ok, 1 failed"``."""
        n = len(self.jobs)
        return (
            f"{n} job{'s' if n != 1 else ''}: {n - len(self.failed)} ok, {len(self.failed)} failed"
        )

    def text(self) -> str:
        """The summary's lines."""
        lines = [f"sweep done, {self.counts()} (folder {self.sweep_dir})"]
        if self.stopped:
            lines = [
                f"sweep stopped before its end ({self.stopped}); {self.counts()} so far "
                f"(folder {self.sweep_dir})"
            ]
        lines += [f"  failed: [{j.label}] {j.error}" for j in self.failed]
        if self.experiment is not None:
            parent = f" (parent run {self.parent_run_id})" if self.parent_run_id else ""
            lines.append(f"MLflow experiment: {self.experiment}{parent}")
            if self.link:
                lines.append(f"view: {self.link}")
        else:
            lines.append("MLflow: nothing recorded (tracker=none); results in the job folders")
        if self.report is not None:
            lines.append(f"tables: {self.report}")
        return "\n".join(lines)


class SweepCallback(Callback):
    """Hydra callback of fedexp's sweeps (see the module's docstring)."""

    def __init__(self) -> None:
        self.info: SweepInfo | None = None
        self.uri: str | None = None
        self.groups: list[str] = []
        self.tuning = False  # a hyper-parameter search (the Optuna sweeper)
        self.sweep_dir = ""
        self._parent: Any = None  # the parent run's MLflowTracker, in the launching process

    def __getstate__(self) -> dict[str, Any]:
        """Pickled into joblib workers with Hydra's context: without the MLflow client."""
        return {**self.__dict__, "_parent": None}

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
        self.groups = [str(k) for k in config.hydra.runtime.choices]
        sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
        searched = OmegaConf.select(config, "hydra.runtime.choices.hparams_search", default=None)
        self.tuning = "optuna" in sweeper.lower() or searched not in (None, "null")
        self.info = SweepInfo(uuid.uuid4().hex, varying, started=time.time())
        self.sweep_dir = str(config.hydra.sweep.dir)
        if OmegaConf.select(config, "tracker._target_") == MLFLOW_TARGET:
            self.uri = OmegaConf.select(config, "tracker.uri")
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.info.started))
            given = OmegaConf.select(config, "tracker.experiment")
            self.info.experiment = given or experiment_name(varying, when)
            self._start_parent(task, self.sweep_dir)
        self.info.write(self.sweep_dir)
        _active = self

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
        try:
            # no system metrics: the parent spans the sweep; each child run samples its own
            self._parent = MLflowTracker(self.uri, self.info.experiment, system_metrics=False)
            name = " ".join(task) or "sweep"
            self.info.parent_run_id = self._parent.start(name, {}, tags)
        except FedexpError as exc:
            print(f"fedexp: error: {exc}", file=sys.stderr)
            sys.exit(1)

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
        if self.info is None:  # on_multirun_start failed (Hydra made it a warning)
            self.info = SweepInfo("", [])
        jobs = read_statuses(self.sweep_dir, self.info.sweep_id, self.info.started)
        summary = SweepSummary(jobs, self.sweep_dir, self.info.experiment, stopped=stopped)
        summary.parent_run_id = self.info.parent_run_id
        if self._parent is not None:
            summary.link = self._parent.link()
        if self.info.experiment is not None:
            metric = next((k for j in jobs if j.ok for k in j.metrics), None)
            summary.report = report_command(
                self.info.experiment,
                self.uri,
                self.info.varying,
                self.groups,
                metric,
                tuning=self.tuning,
            )
        text = summary.text()
        print(f"\n{text}", flush=True)
        last = summary
        if self._parent is not None:
            path = Path(self.sweep_dir) / SUMMARY_FILE
            path.write_text(text + "\n")
            self._parent.set_tags(
                {"fedexp.sweep.summary": summary.counts(), "mlflow.note.content": text}
            )
            self._parent.log_artifact(path)
            ended = status if stopped else "FAILED" if summary.failed else "FINISHED"
            self._parent.end(ended)
            self._parent = None
        return summary


def end_unfinished(stopped: str, status: str = "FAILED") -> SweepSummary | None:
    """Summarise and end a sweep of this process that Hydra stopped before its end.

    Hydra calls ``on_multirun_end`` only when the sweeper returns: when it raises (Optuna's
    sweeper once every trial failed) or a job stops the sweep (Ctrl-C), the CLI calls this, so
    that the summary is still printed and the parent run does not stay RUNNING.

    Returns:
        The summary, or None where no sweep was left unfinished.
    """
    return _active.finish(stopped, status) if _active is not None else None
