"""One job of a sweep, ``fedexp run -m`` (:func:`sweep_job`): it never stops the sweep.

Its tags name the sweep, its parent run and its overrides (:func:`_sweep_tags`); its outcome
goes to ``<job dir>/fedexp_status.json`` (:mod:`fedexp.sweep`), which the sweep's callback
reads. It takes the single run's steps (:mod:`fedexp.cli.job`).
"""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fedexp.cli.job import checked
from fedexp.cli.job import objective
from fedexp.cli.job import prepare
from fedexp.cli.job import run_name
from fedexp.cli.job import sigterm_as_exception
from fedexp.cli.output import describe_stop
from fedexp.errors import ConfigError
from fedexp.errors import FedexpError
from fedexp.errors import Terminated

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from fedexp.sweep import JobStatus
    from fedexp.sweep import SweepInfo


def _headline(result) -> dict[str, float]:  # noqa: ANN001 - RunResult, imported lazily
    """``{"acc/mean": 0.81}``: the headline metric's mean over clients (test splits)."""
    from fedexp.tuning.objective import headline

    key = f"{headline(result.metrics)}/mean"
    return {key: float(result.metrics[key])} if key in result.metrics else {}


def _sweep_tags(cfg: DictConfig, hc: DictConfig, info: SweepInfo | None) -> dict[str, str]:
    """A sweep job's tags: the parent run, the sweep, the job's overrides, key by key.

    Every override is a tag ``sweep.<key>`` (the varying keys among them; a config group's is
    also ``choice.<group>``, a setting's also a param), and the job's colour in MLflow's charts
    is ``mlflow.runColor`` (:func:`fedexp.sweep.run_color`: a hue per configuration).
    """
    from omegaconf import open_dict

    from fedexp.sweep import run_color

    sweep = Path(hc.sweep.dir).as_posix().replace("/", "_")
    with open_dict(cfg):
        if "experiment" in cfg.tracker and cfg.tracker.experiment is None:
            # the sweep's experiment (named by the callback), else one per sweep folder
            cfg.tracker.experiment = (info and info.experiment) or f"fedexp/{sweep}"
    tags = {"sweep": sweep, "sweep.overrides": " ".join(hc.overrides.task)}
    tags.update(
        {f"sweep.{o.split('=', 1)[0]}": o.split("=", 1)[1] for o in hc.overrides.task if "=" in o}
    )
    tags["fedexp.job"] = str(hc.job.num)
    if info is not None and info.parent_run_id:
        tags["mlflow.parentRunId"] = info.parent_run_id  # a nested child run in MLflow's UI
    if info is not None and info.varying:
        tags["mlflow.runColor"] = run_color(hc.overrides.task, info.varying, info.values)
    return tags


def _job_name(cfg: DictConfig, hc: DictConfig, info: SweepInfo | None) -> str:
    """A sweep job's run name: its values of the varying keys, else the single-run name."""
    from fedexp.sweep import child_name

    name = child_name(hc.overrides.task, info.varying) if info is not None else ""
    return name or run_name(cfg, hc)


def sweep_job(cfg: DictConfig, hc: DictConfig) -> float:
    """One job of ``fedexp run -m``: never stops the sweep; records its outcome in its folder.

    Its lines carry ``[job N]``; a finished job prints one line (its name, headline metric
    and run id) instead of the per-client table; a failed one prints its error and returns
    NaN; its per-round lines go to its own log file (Hydra's ``<job dir>/<job name>.log``),
    not to the terminal, which gets warnings and errors only. Where the sweep draws a live
    display (a terminal, :class:`fedexp.sweep.LiveSweep`) the job prints nothing: the display
    prints its line. The outcome goes to ``<job dir>/fedexp_status.json`` (:mod:`fedexp.sweep`),
    which the sweep's callback reads.
    """
    from fedexp.engine.files.progress import job_label
    from fedexp.sweep import JobStatus
    from fedexp.sweep import SweepInfo
    from fedexp.sweep import write_status
    from fedexp.sweep.stacked import job_hydra

    info = SweepInfo.read(hc.sweep.dir)
    status = JobStatus(
        job=int(hc.job.num),
        status="failed",
        name=_job_name(cfg, hc, info),
        overrides=[str(o) for o in hc.overrides.task],
        sweep_id=info.sweep_id if info else "",
    )
    job_dir = Path(hc.runtime.output_dir)
    parallel = not str(hc.launcher.get("_target_", "")).endswith("BasicLauncher")
    live = bool(info and info.live)
    stacked = job_hydra.get() is not None  # one of a stacked group's threads
    with job_label(
        f"job {hc.job.num}",
        parallel=parallel,
        quiet=True,
        folder=job_dir,
        live=live,
        own_thread=stacked,
    ):
        try:
            return _sweep_job_run(cfg, hc, info, status)
        finally:
            write_status(job_dir, status)


def _sweep_job_run(
    cfg: DictConfig, hc: DictConfig, info: SweepInfo | None, status: JobStatus
) -> float:
    """The body of :func:`sweep_job`: fills ``status`` in; returns the objective or NaN."""
    import traceback

    from fedexp.config.instantiate import instantiate_checked
    from fedexp.engine.files.progress import job_line
    from fedexp.sweep import best_of

    quiet = bool(info and info.live)  # the sweep's live display prints the job's line

    def fail(error: str, line: str) -> float:
        status.error = error
        status.run_id = getattr(tracker, "run_id", None)
        if not quiet:
            job_line(f"fedexp: {line}", err=True)
        return math.nan  # one bad job of a sweep does not stop the others

    tracker = None
    try:
        checked(cfg)
    except ConfigError as exc:
        return fail(str(exc), f"error: {exc}")
    tags = _sweep_tags(cfg, hc, info)
    tags.update(prepare(cfg, hc))
    previous = sigterm_as_exception()
    try:
        from fedexp.engine.runner import run
        from fedexp.engine.threads import round_callbacks

        tracker = instantiate_checked(cfg.tracker, "tracker")
        rounds = round_callbacks()  # threads that follow the load (a sequential sweep's job)
        result = run(cfg, tracker=tracker, run_name=status.name, tags=tags, callbacks=rounds)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM stops the whole sweep
        fail("interrupted", describe_stop(exc, cfg, hc))
        status.status = "killed"
        sys.exit(128 + signal.SIGTERM if isinstance(exc, Terminated) else 130)
    except FedexpError as exc:
        return fail(str(exc), describe_stop(exc, cfg, hc))
    except Exception as exc:  # noqa: BLE001 - a bug in one job must not stop the sweep
        where = Path(cfg.output_dir) / "traceback.txt"
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(traceback.format_exc())
        error = f"{type(exc).__name__}: {exc} (traceback in {where})"
        return fail(error, f"error: {error}")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    status.run_id = getattr(tracker, "run_id", None)  # None: nothing tracked (tracker=none)
    status.metrics = _headline(result)
    for key in status.metrics:  # the best round of each, for the parent run's summary
        best = best_of(Path(result.output_dir) / "rounds.csv", key)
        if best is not None:
            status.best[key] = best
    value = objective(cfg, result)
    from fedexp.tuning.objective import job_metrics

    shown = job_metrics(cfg, result.metrics)  # the objective first in a tuning sweep
    line = "  ".join([status.name, *(f"{k}={v:.4f}" for k, v in shown.items())])
    line += f"  run {status.run_id}" if status.run_id else ""
    if math.isnan(value):  # the sweeper sees a failed trial: so does the summary
        from fedexp.tuning.objective import objective_key

        key = objective_key(cfg, result.metrics)
        status.error = f"the run finished, but its objective {key} is missing or not finite"
        line += f"  (objective {key}: NaN)"
    else:
        status.status = "ok"
    if not quiet:
        job_line(line)
    return value
