"""The ``fedexp`` command: ``fedexp run [overrides]`` (Hydra main, version 1.3).

``fedexp --help`` / ``fedexp run --help`` print :func:`fedexp.cli.help.help_text` (every run
setting with its default and meaning, the config groups, examples); ``fedexp run --hydra-help``
is Hydra's own help. A single run prints its per-client table; a sweep (``-m``) prints one line
per job and a summary at the end (:mod:`fedexp.sweep`), and exits 1 if any job failed.

A refused setting exits 2, before anything runs; ``fedexp ui`` and ``fedexp report`` are
the other commands (examples: ``fedexp --help``).

The package: this module reads the command line and dispatches it; ``overrides.py`` checks
``fedexp run``'s overrides before Hydra composes anything; ``job.py`` is one job of the run
(Hydra's task function: a single run), ``sweep_job.py`` one job of a sweep; ``distributed.py``
and ``group_lost.py`` a run over processes torchrun or SLURM started; ``output.py`` what a run
prints at its end; ``help.py`` the help text; ``ui.py`` the ``fedexp ui`` command.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from fedexp.cli import overrides
from fedexp.cli.overrides import USAGE
from fedexp.cli.overrides import checked_paths
from fedexp.cli.overrides import group_option_errors
from fedexp.cli.overrides import hydra_code_override
from fedexp.cli.overrides import override_shape_errors
from fedexp.cli.overrides import sweep_without_multirun
from fedexp.errors import Terminated

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Hydra, OmegaConf, torch and the runner are imported where they are used: ``fedexp --help``
# and ``fedexp report --help`` import none of them (tests/test_startup.py).

# Alembic logs "setup plugin ..." at INFO when MONAI imports Optuna; here it runs in every job's
# process (a worker imports this module to unpickle the task), and Hydra leaves the level alone.
logging.getLogger("alembic").setLevel(logging.WARNING)


def _hydra_run(cfg: DictConfig) -> float:
    """One job of ``fedexp run``: the task function of :func:`_hydra_main`.

    Defined here, in ``fedexp.cli``: Hydra names the job after the task function's module,
    and so each run's log file, ``cli.log``.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from fedexp.cli.distributed import group_job
    from fedexp.cli.job import checked
    from fedexp.cli.job import single_run
    from fedexp.cli.sweep_job import sweep_job
    from fedexp.sweep.stacked import job_hydra

    hc = job_hydra.get()  # a stacked sweep's job: its thread's own
    if hc is None:
        hc = HydraConfig.get()
    job = sweep_job if hc.mode == RunMode.MULTIRUN else single_run
    return group_job(cfg, hc, job, checked)  # torchrun, a SLURM job's tasks: one group


def _hydra_main() -> Callable[[], Any]:
    """The Hydra app around :func:`_hydra_run` (version_base 1.3), built on first use."""
    import hydra

    from fedexp.config.instantiate import register_resolvers
    from fedexp.config.schema import register_configs

    register_configs()
    register_resolvers()
    conf = overrides.CONFIG_DIR
    return hydra.main(version_base="1.3", config_path=conf, config_name="config")(_hydra_run)


def _wants_help(args: list[str]) -> bool:
    """``fedexp run --help``/``-h`` (ours); ``--hydra-help`` is left to Hydra."""
    return any(a in ("-h", "--help") for a in args)


def entry() -> None:
    """The ``fedexp`` program (console script, ``python -m fedexp``): main, then a fast exit.

    :func:`main` runs the command; its objects are then left to the operating system.
    Python's finalisation collects garbage over every object alive at the exit, module by
    module: after ``import torch`` that is half a second of every command's end on this
    2-core machine (0.55 s of the 1.9 s ``python -c "import torch"`` takes; docs/benchmarks.md
    "Start-up"). :func:`gc.freeze` takes them out of the collector's view first, so the exit
    frees them by reference count only. The rest of the exit is Python's: threads are joined,
    exit handlers run (MLflow's, logging's), streams are flushed. Not in :func:`main`, which
    tests call in their own process.
    """
    import gc

    from fedexp.figures.drawer import allow_helper

    allow_helper()
    try:
        main()
    finally:
        gc.freeze()


def main() -> None:
    """Entry point: ``fedexp run [hydra overrides]``."""
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help") or (args[0] == "run" and _wants_help(args[1:])):
        from fedexp.cli.help import help_text

        print(help_text())
        sys.exit(0 if args else 2)
    if args[0] == "report":
        from fedexp.report import main as report

        report(args[1:])
        return
    if args[0] == "ui":
        from fedexp.cli.ui import main as ui

        ui(args[1:])
        return
    if args[0] != "run":
        print(f"fedexp: unknown command {args[0]!r} (expected: run, report or ui)", file=sys.stderr)
        sys.exit(2)
    bad = hydra_code_override(args[1:])
    if bad:
        _refuse(
            f"{bad}: Hydra settings that name code (callbacks, _target_, logging classes) "
            "cannot be overridden; only fedexp's own classes can be configured"
        )
    from fedexp.config.keys import added_or_removed_errors
    from fedexp.config.keys import unknown_key_errors
    from fedexp.config.schema import override_errors

    # lr=-1, algorithm=nope, algorithm.lamda=0.1: one line before Hydra composes anything
    early = override_shape_errors(args[1:]) or group_option_errors(args[1:])
    early = early or unknown_key_errors(args[1:], overrides.CONFIG_DIR)
    early = early or added_or_removed_errors(args[1:], overrides.CONFIG_DIR)
    early = early or override_errors(args[1:])
    if early:
        _refuse("; ".join(early))
    # dataset.path=/nope, resume=<folder without a checkpoint>: before Hydra makes a folder
    checked, paths = checked_paths(args[1:])
    args = [args[0], *checked]
    if paths:
        _refuse("; ".join(paths))
    from fedexp.tuning.search_space import search_space_errors

    # -m hparams_search=lr lr='interval(1, 0.1)': one line, not the Optuna sweeper's traceback
    tuning = search_space_errors(args[1:])
    if tuning:
        _refuse("; ".join(tuning))
    from fedexp.cli.distributed import prepare_argv

    # before Hydra makes a folder or anything runs: hydra/launcher=slurm without sbatch (exit
    # 1); torchrun: no sweep, distributed.* agreeing; distributed.nodes=K: one SLURM job (-m)
    hydra_args, refused, code = prepare_argv(args[1:])
    if refused:
        _refuse(refused, code)
    sweeps = sweep_without_multirun(hydra_args)
    if sweeps:
        _refuse("; ".join(sweeps))
    sys.argv = [sys.argv[0], *hydra_args]
    _early_helper(hydra_args)
    from fedexp.config.instantiate import note_given_dir

    for arg in hydra_args:  # a refused run removes the folder it named, if this made it
        if arg.startswith("hydra.run.dir=") and "-m" not in hydra_args:
            note_given_dir(arg.split("=", 1)[1])
    sweep = sys.modules.get("fedexp.sweep")
    if sweep is not None:  # the exit code is this command's: an earlier sweep's summary is not
        sweep.last = None
    try:
        _hydra_main()()
    except (SystemExit, KeyboardInterrupt) as exc:  # Hydra reported an error, or Ctrl-C
        _end_unfinished_sweep(exc)
        raise
    sweep = sys.modules.get("fedexp.sweep")
    if sweep is not None and sweep.last is not None and sweep.last.failed:
        sys.exit(1)  # the summary above names the failed jobs


def _early_helper(args: list[str]) -> None:
    """A single run's figures' helper, started before Hydra composes and torch loads.

    Its start (matplotlib, a first figure of each kind: about a second of a core) then
    overlaps the run's own start, which runs on one core, not the run's rounds, whose torch
    threads take every core (:mod:`fedexp.figures.drawer`). A sweep's jobs start theirs where a
    core is idle (:func:`fedexp.cli.job._set_threads`), which also lets this one go where the
    run has none (``figures=false``, ranks on every core).
    """
    import os

    from fedexp.engine.threads import available_cores
    from fedexp.figures import drawer

    if any(a in ("-m", "--multirun") for a in args) or "LOCAL_RANK" in os.environ:
        return
    if drawer.helper_allowed() and available_cores() > 1:
        drawer.start_helper()


def _refuse(message: str, code: int = USAGE) -> NoReturn:
    """``fedexp: error: <message>`` and exit ``code``; under torchrun one rank prints it."""
    from fedexp.cli.distributed import say_once

    say_once(f"fedexp: error: {message}")
    sys.exit(code)


def _end_unfinished_sweep(exc: BaseException) -> None:
    """Summarise a sweep that stopped before its end and end its parent run.

    See :func:`fedexp.sweep.end_unfinished`: KILLED on Ctrl-C or SIGTERM (the jobs' runs
    still RUNNING too), FAILED otherwise. Ctrl-C that reached the launching process itself
    (joblib's launcher: the jobs run in workers) exits 130 after the summary, without
    Python's traceback of the interrupted launcher.

    Raises:
        SystemExit: 130, in place of a KeyboardInterrupt once a sweep was summarised.
    """
    sweep = sys.modules.get("fedexp.sweep")
    if sweep is None:
        return
    code = exc.code if isinstance(exc, SystemExit) else 130
    killed = isinstance(exc, KeyboardInterrupt) or code in (130, 128 + signal.SIGTERM)
    why = "interrupted" if killed else f"an error above, exit code {code}"
    if isinstance(exc, Terminated) or code == 128 + signal.SIGTERM:
        why = "terminated (SIGTERM)"
    summary = sweep.end_unfinished(why, "KILLED" if killed else "FAILED")
    if summary is not None and isinstance(exc, KeyboardInterrupt):
        raise SystemExit(128 + signal.SIGTERM if isinstance(exc, Terminated) else 130)


def __getattr__(name: str) -> Any:
    """``fedexp.cli.OmegaConf``, imported on first use (module attribute, PEP 562)."""
    if name == "OmegaConf":
        from omegaconf import OmegaConf

        return OmegaConf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["entry", "main"]  # fedexp.cli.OmegaConf still resolves (__getattr__)
