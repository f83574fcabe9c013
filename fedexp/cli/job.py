"""One job of ``fedexp run`` (Hydra's task function, :func:`fedexp.cli._hydra_run`).

The config's checks (:func:`checked`), the threads and the output folder (:func:`prepare`),
and a single run: its per-client table, or one line and exit 1 on an error
(:func:`single_run`). A sweep's job (``-m``) takes the same steps in
:mod:`fedexp.cli.sweep_job`. Hydra, OmegaConf, torch and the runner are imported where they
are used.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

from fedexp.cli.output import describe_stop
from fedexp.cli.output import print_table
from fedexp.cli.overrides import USAGE
from fedexp.errors import ConfigError
from fedexp.errors import DataError
from fedexp.errors import FedexpError
from fedexp.errors import Terminated

if TYPE_CHECKING:
    from omegaconf import DictConfig

log = logging.getLogger("fedexp")


def _set_threads(cfg: DictConfig, hc: DictConfig) -> None:
    """Choose the run's torch threads and log the choice (:mod:`fedexp.engine.threads`).

    The cores available over the processes sharing them: the sweep's parallel jobs (the
    launcher's ``n_jobs``), the run's ranks; ``threads=N`` overrides. One line, e.g.
    ``threads: 1 (2 cores shared by 2 sweep jobs)``. Where a core is left idle and the run
    draws figures, they are drawn in a helper process there (:mod:`fedexp.figures.drawer`).
    """
    from hydra.types import RunMode

    from fedexp.engine.threads import apply_threads
    from fedexp.engine.threads import available_cores
    from fedexp.engine.threads import launcher_jobs
    from fedexp.figures import drawer

    jobs = 1
    if hc.mode == RunMode.MULTIRUN and hc.launcher is not None:
        jobs = launcher_jobs(hc.launcher.get("n_jobs"), available_cores())
    choice = apply_threads(cfg, jobs)
    from fedexp.engine.round.stacking import current

    stacked = current.get() is not None  # (then the run takes them as runner.run says)
    note = "; a stacked group's merged client work takes them, each run's own steps 1"
    log.info("%s%s", choice.line(), note if stacked else "")
    if choice.idle and cfg.get("figures", True) and drawer.helper_allowed():
        drawer.start_helper()
    else:
        drawer.stop_helper()


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def run_name(cfg: DictConfig, hc: DictConfig) -> str:
    """A single run's MLflow name: its algorithm, then what its command line changes.

    ``fedexp run partition=dirichlet num_clients=20`` is ``fedavg dirichlet N=20`` (at most 40
    characters, :func:`fedexp.sweep.run_name`: settings that change no result, such as
    ``tracker.*`` or ``progress``, are left out); a run that changes nothing else, the
    default run, is ``fedavg · breast_cancer · logreg · seed 0``.
    """
    from fedexp.sweep import run_name as overrides_name

    choices = hc.runtime.choices
    name = overrides_name([str(o) for o in hc.overrides.task], str(choices.get("algorithm")))
    if name:
        return name
    parts = [str(choices.get(g)) for g in ("algorithm", "dataset", "model") if choices.get(g)]
    return " · ".join([*parts, f"seed {cfg.seed}"])


def objective(cfg: DictConfig, result) -> float:  # noqa: ANN001 - RunResult, imported lazily
    """The task function's return value (what Optuna's sweeper maximises).

    :func:`fedexp.tuning.objective.objective_value`: the headline metric's mean over clients at
    the last round, on the validation splits where ``val_fraction > 0``.
    """
    from fedexp.tuning.objective import objective_value

    return float(objective_value(cfg, result.metrics))


def checked(cfg: DictConfig) -> None:
    """Refuse classes not fedexp's own before any import, then check every setting.

    The run settings' ranges first (before torch and the runner are imported), then every
    group node against its target's signature and declared ranges
    (:func:`fedexp.engine.config_check.check_groups`): all before the tracker is created and the
    data are read, so a bad value leaves nothing behind.

    Raises:
        ConfigError: the first bad setting, in one line.
    """
    from fedexp.config.instantiate import check_targets
    from fedexp.config.schema import validate

    check_targets(cfg, "")
    validate(cfg)
    from fedexp.cli.distributed import check_place
    from fedexp.engine.config_check import check_groups

    check_groups(cfg)
    check_place(cfg)  # distributed.* against torchrun's or the SLURM job's processes
    if cfg.get("resume"):  # refused before a line reaches the resumed run's cli.log
        from fedexp.engine.files.resume import check_resume_early

        check_resume_early(cfg)


def prepare(cfg: DictConfig, hc: DictConfig) -> dict[str, str]:
    """Threads, the output folder; returns the run's tags (``choice.<group>``)."""
    from omegaconf import open_dict

    _set_threads(cfg, hc)
    with open_dict(cfg):
        if cfg.output_dir is None:
            cfg.output_dir = hc.runtime.output_dir
    return {
        f"choice.{k}": str(v)
        for k, v in hc.runtime.choices.items()
        if not k.startswith(("hydra", "experiment_"))  # experiment_<group>: derived choices
    }


def sigterm_as_exception() -> Any:
    """Make SIGTERM stop the run like Ctrl-C (tracker run KILLED, checkpoint kept).

    Returns:
        The previous handler, to restore, or None (not the main thread: signals left alone).
    """
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:
        return None


def single_run(cfg: DictConfig, hc: DictConfig) -> float:
    """``fedexp run``: one run, its per-client table, exit 1 on an error."""
    try:
        checked(cfg)
    except ConfigError as exc:
        print(f"fedexp: error: {exc}", file=sys.stderr)
        _discard_folder(hc)
        sys.exit(USAGE)
    from fedexp.cli.distributed import say_once
    from fedexp.cli.group_lost import as_started
    from fedexp.cli.group_lost import raise_if_group_lost
    from fedexp.cli.group_lost import sigterm_after_failure
    from fedexp.engine.processes.place import env_place
    from fedexp.engine.runner import run
    from fedexp.engine.threads import round_callbacks

    tags = prepare(cfg, hc)
    previous, done = sigterm_as_exception(), False
    try:  # (round_callbacks: threads that follow the load, fedexp.engine.threads)
        result = run(cfg, run_name=run_name(cfg, hc), tags=tags, callbacks=round_callbacks())
        done = True
    except (FedexpError, KeyboardInterrupt) as exc:
        if isinstance(exc, Terminated):
            raise_if_group_lost(exc)  # (torchrun: a rank that died, said so)
        # one line a machine (in a group, the others' may follow: torchrun's resume command)
        say_once(f"fedexp: {as_started(describe_stop(exc, cfg, hc), env_place())}")
        code = 128 + signal.SIGTERM if isinstance(exc, Terminated) else 130
        if not isinstance(exc, KeyboardInterrupt):
            code = USAGE if isinstance(exc, ConfigError) else 1
        if isinstance(exc, ConfigError | DataError):  # refused before it ran: no empty folder
            _discard_folder(hc)
        sys.exit(code)
    finally:
        if previous is not None:
            failed = sigterm_after_failure(previous, env_place())
            signal.signal(signal.SIGTERM, previous if done else failed)
    print_table(result)
    return objective(cfg, result)


def _discard_folder(hc: DictConfig) -> None:
    """Remove the run's folder Hydra made if the run was refused before it wrote anything.

    A refused resume: Hydra's record of it (``.hydra/resume-<stamp>``) in the run's folder.
    """
    from fedexp.config.instantiate import discard_fresh_dir
    from fedexp.config.instantiate import discard_resume_record

    discard_fresh_dir(hc.runtime.output_dir)
    discard_resume_record(hc.runtime.output_dir, str(hc.output_subdir))
