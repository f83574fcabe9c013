"""The ``fedexp`` command: ``fedexp run [overrides]`` (Hydra main, version 1.3).

``fedexp --help`` / ``fedexp run --help`` print :func:`fedexp.cli_help.help_text` (every run
setting with its default and meaning, the config groups, examples); ``fedexp run --hydra-help``
is Hydra's own help. A single run prints its per-client table; a sweep (``-m``) prints one line
per job and a summary at the end (:mod:`fedexp.sweep`), and exits 1 if any job failed.

A refused setting exits 2, before anything runs; ``fedexp ui`` and ``fedexp report`` are
the other commands (examples: ``fedexp --help``).
"""

from __future__ import annotations

import difflib
import logging
import math
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from fedexp.cli_output import describe_stop, print_table
from fedexp.errors import ConfigError, DataError, FedexpError, Terminated

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from fedexp.sweep import JobStatus, SweepInfo

# Hydra, OmegaConf, torch and the runner are imported where they are used: ``fedexp --help``
# and ``fedexp report --help`` import none of them (tests/test_startup.py).

#: Exit status of a command refused for a bad setting (nothing ran); a run that fails exits 1.
USAGE = 2

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "conf")
log = logging.getLogger("fedexp")
# Alembic logs "setup plugin ..." at INFO when MONAI imports Optuna; here it runs in every job's
# process (a worker imports this module to unpickle the task), and Hydra leaves the level alone.
logging.getLogger("alembic").setLevel(logging.WARNING)


def _set_threads(cfg: DictConfig, hc: DictConfig) -> None:
    """Choose the run's torch threads and log the choice (:mod:`fedexp.engine.threads`).

    The cores available over the processes sharing them: the sweep's parallel jobs (the
    launcher's ``n_jobs``), the run's ranks; ``threads=N`` overrides. One line, e.g.
    ``threads: 1 (2 cores shared by 2 sweep jobs)``. Where a core is left idle and the run
    draws figures, they are drawn in a helper process there (:mod:`fedexp.figures.drawer`).
    """
    from hydra.types import RunMode

    from fedexp.engine.threads import apply_threads, available_cores, launcher_jobs
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


#: Parts of a ``hydra.*`` key, and words in its value, that make Hydra import and call code
#: before fedexp sees the config (callbacks, launcher/sweeper targets, logging classes).
_HYDRA_CODE_WORDS = ("_target_", "_args_", "callbacks", "class", "()")
_HYDRA_CODE_VALUE = re.compile(r"_target_|_args_|callbacks|(\bclass|\(\))\s*:")


def _hydra_code_override(args: list[str]) -> str | None:
    """The key of the first command-line override that makes Hydra run code, or None."""
    for arg in args:
        if "=" not in arg or arg.startswith("-"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key == "hydra" or key.startswith("hydra."):
            if any(w in key.split(".") for w in _HYDRA_CODE_WORDS) or _HYDRA_CODE_VALUE.search(
                value
            ):
                return key
    return None


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _run_name(cfg: DictConfig, hc: DictConfig) -> str:
    """A single run's MLflow name: its algorithm, then what its command line changes.

    ``fedexp run partition=dirichlet num_clients=20`` is ``fedavg dirichlet N=20`` (at most 40
    characters, :func:`fedexp.sweep.run_name`: settings that change no result, such as
    ``tracker.*`` or ``progress``, are left out); a run that changes nothing else, the
    default run, is ``fedavg · breast_cancer · logreg · seed 0``.
    """
    from fedexp.sweep import run_name

    choices = hc.runtime.choices
    name = run_name([str(o) for o in hc.overrides.task], str(choices.get("algorithm")))
    if name:
        return name
    parts = [str(choices.get(g)) for g in ("algorithm", "dataset", "model") if choices.get(g)]
    return " · ".join([*parts, f"seed {cfg.seed}"])


def _objective(cfg: DictConfig, result) -> float:  # noqa: ANN001 - RunResult, imported lazily
    """The task function's return value (what Optuna's sweeper maximises).

    :func:`fedexp.tuning.objective_value`: the headline metric's mean over clients at the last
    round, on the validation splits where ``val_fraction > 0``.
    """
    from fedexp.tuning import objective_value

    return float(objective_value(cfg, result.metrics))


def _headline(result) -> dict[str, float]:  # noqa: ANN001 - RunResult, imported lazily
    """``{"acc/mean": 0.81}``: the headline metric's mean over clients (test splits)."""
    from fedexp.tuning import headline

    key = f"{headline(result.metrics)}/mean"
    return {key: float(result.metrics[key])} if key in result.metrics else {}


def _checked(cfg: DictConfig) -> None:
    """Refuse classes not fedexp's own before any import, then check every setting.

    The run settings' ranges first (before torch and the runner are imported), then every
    group node against its target's signature and declared ranges
    (:func:`fedexp.config.groups.check_groups`): all before the tracker is created and the
    data are read, so a bad value leaves nothing behind.

    Raises:
        ConfigError: the first bad setting, in one line.
    """
    from fedexp.config.instantiate import check_targets
    from fedexp.config.schema import validate

    check_targets(cfg, "")
    validate(cfg)
    from fedexp.cli_distributed import check_place
    from fedexp.config.groups import check_groups

    check_groups(cfg)
    check_place(cfg)  # distributed.* against torchrun's or the SLURM job's processes
    if cfg.get("resume"):  # refused before a line reaches the resumed run's cli.log
        from fedexp.engine.files.resume import check_resume_early

        check_resume_early(cfg)


def _prepare(cfg: DictConfig, hc: DictConfig) -> dict[str, str]:
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


def _sigterm_as_exception() -> Any:
    """Make SIGTERM stop the run like Ctrl-C (tracker run KILLED, checkpoint kept).

    Returns:
        The previous handler, to restore, or None (not the main thread: signals left alone).
    """
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:
        return None


def _single_run(cfg: DictConfig, hc: DictConfig) -> float:
    """``fedexp run``: one run, its per-client table, exit 1 on an error."""
    try:
        _checked(cfg)
    except ConfigError as exc:
        print(f"fedexp: error: {exc}", file=sys.stderr)
        _discard_folder(hc)
        sys.exit(USAGE)
    from fedexp.cli_distributed import env_place, say_once
    from fedexp.cli_group_lost import as_started, raise_if_group_lost, sigterm_after_failure
    from fedexp.engine.runner import run
    from fedexp.engine.threads import round_callbacks

    tags = _prepare(cfg, hc)
    previous, done = _sigterm_as_exception(), False
    try:  # (round_callbacks: threads that follow the load, fedexp.engine.threads)
        result = run(cfg, run_name=_run_name(cfg, hc), tags=tags, callbacks=round_callbacks())
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
    return _objective(cfg, result)


def _discard_folder(hc: DictConfig) -> None:
    """Remove the run's folder Hydra made if the run was refused before it wrote anything.

    A refused resume: Hydra's record of it (``.hydra/resume-<stamp>``) in the run's folder.
    """
    from fedexp.config.instantiate import discard_fresh_dir, discard_resume_record

    discard_fresh_dir(hc.runtime.output_dir)
    discard_resume_record(hc.runtime.output_dir, str(hc.output_subdir))


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
    return name or _run_name(cfg, hc)


def _sweep_job(cfg: DictConfig, hc: DictConfig) -> float:
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
    from fedexp.sweep import JobStatus, SweepInfo, write_status
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
    """The body of :func:`_sweep_job`: fills ``status`` in; returns the objective or NaN."""
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
        _checked(cfg)
    except ConfigError as exc:
        return fail(str(exc), f"error: {exc}")
    tags = _sweep_tags(cfg, hc, info)
    tags.update(_prepare(cfg, hc))
    previous = _sigterm_as_exception()
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
    value = _objective(cfg, result)
    from fedexp.tuning import job_metrics

    shown = job_metrics(cfg, result.metrics)  # the objective first in a tuning sweep
    line = "  ".join([status.name, *(f"{k}={v:.4f}" for k, v in shown.items())])
    line += f"  run {status.run_id}" if status.run_id else ""
    if math.isnan(value):  # the sweeper sees a failed trial: so does the summary
        from fedexp.tuning import objective_key

        key = objective_key(cfg, result.metrics)
        status.error = f"the run finished, but its objective {key} is missing or not finite"
        line += f"  (objective {key}: NaN)"
    else:
        status.status = "ok"
    if not quiet:
        job_line(line)
    return value


def _hydra_run(cfg: DictConfig) -> float:
    """One job of ``fedexp run``: the task function of :func:`_hydra_main`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from fedexp.cli_distributed import group_job
    from fedexp.sweep.stacked import job_hydra

    hc = job_hydra.get()  # a stacked sweep's job: its thread's own
    if hc is None:
        hc = HydraConfig.get()
    job = _sweep_job if hc.mode == RunMode.MULTIRUN else _single_run
    return group_job(cfg, hc, job, _checked)  # torchrun, a SLURM job's tasks: one group


def _hydra_main() -> Callable[[], Any]:
    """The Hydra app around :func:`_hydra_run` (version_base 1.3), built on first use."""
    import hydra

    from fedexp.config.instantiate import register_resolvers
    from fedexp.config.schema import register_configs

    register_configs()
    register_resolvers()
    return hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(_hydra_run)


#: A sweep value Hydra expands itself (``choice(a,b)``, ``glob(*)``, ``range(3)``, ...).
_SWEEP_FUNCTION = re.compile(r"^\s*\w+\(")


def _group_option_errors(args: list[str]) -> list[str]:
    """``algorithm=nope``: one line naming the options, before Hydra's multi-line message.

    The closest options come first, as for a mistyped key (``algorithm=fedavgg: no such
    option; did you mean fedavg? (expected one of: ...)``).

    Looks at ``group=option`` (and ``group=a,b`` sweeps) where ``group`` is a folder of
    fedexp's ``conf/``; Hydra's own groups (``hydra/launcher=joblib`` comes from a plugin),
    package overrides (``@``), nested keys and Hydra's sweep functions are left to Hydra.
    """
    errors = []
    for arg in args:
        key, sep, value = arg.lstrip("+~").partition("=")
        folder = Path(CONFIG_DIR) / key
        if not sep or "." in key or "@" in key or key.startswith("hydra") or not folder.is_dir():
            continue
        if _SWEEP_FUNCTION.match(value) or arg.startswith("~"):
            continue
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        for option in value.split(","):  # (Hydra fails on GROUP=null with a traceback)
            if option.strip() not in options:
                close = difflib.get_close_matches(option.strip(), options, 3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                errors.append(
                    f"{key}={option}: no such option{hint} (expected one of: {', '.join(options)})"
                )
    return errors


#: Hydra's own command-line flags (``fedexp run --cfg job``...), those that take a value after.
_HYDRA_FLAGS = frozenset(
    {"-m", "--multirun", "--resolve", "--hydra-help", "--run", "-r", "--version", "--info", "-i"}
)
_HYDRA_VALUE_FLAGS = frozenset(
    {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
     "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
)  # fmt: skip


_INFO_VALUES = frozenset({"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})


def _override_shape_errors(args: list[str]) -> list[str]:
    """``rounds 10`` or ``--rounds=10``: one line saying to write ``rounds=10``.

    Hydra takes its overrides as ``key=value`` (``+key=value``, ``~key``); anything else that
    is not one of Hydra's own flags would meet Hydra's parser error or its usage text.
    """
    errors: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in _HYDRA_VALUE_FLAGS:
            i += 1  # its value
            continue
        if arg in ("--info", "-i") and i < len(args) and args[i] in _INFO_VALUES:
            i += 1  # its optional value
            continue
        if arg in _HYDRA_FLAGS or arg.startswith("~") or ("=" in arg and arg[0] != "-"):
            continue
        if arg.startswith("-") and arg.split("=")[0] in _HYDRA_VALUE_FLAGS | _HYDRA_FLAGS:
            continue  # --cfg=job, --info=plugins
        key, sep, value = arg.lstrip("-").partition("=")
        if not sep and i < len(args) and "=" not in args[i] and not args[i].startswith("-"):
            value, sep = args[i], "="
            i += 1
        shown = f"{arg} {value}" if sep and "=" not in arg else arg
        example = f"{key}={value}" if sep and value else f"{key}=<value>"
        errors.append(f"{shown!r}: overrides are written key=value, e.g. {example}")
    return errors


def _sweep_without_multirun(args: list[str]) -> list[str]:
    """``seed=0,1`` without ``-m``: one line saying to add it (Hydra's own error is five lines).

    Hydra sweeps an override of several values (``a,b``, ``range(...)``, ``choice(...)``) only
    in multirun mode. Read by Hydra's own parser, only where a value could be one (a comma or
    a parenthesis in it); a quoted value is one string, not a sweep.
    """
    if any(a in ("-m", "--multirun") for a in args):
        return []
    maybe = [
        a for a in args if "=" in a and a[0] != "-" and any(c in a.partition("=")[2] for c in ",(")
    ]
    if not maybe:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    errors = []
    for arg in maybe:
        try:
            (override,) = parser.parse_overrides([arg])
        except OverrideParseException:
            continue  # (Hydra's own message follows, one line)
        if override.is_sweep_override():
            key = override.get_key_element()
            errors.append(
                f"{arg}: several values are a sweep, run with -m (fedexp run -m {arg}); "
                f"a list is written {key}=[...]"
            )
    return errors


def _checked_paths(args: list[str]) -> tuple[list[str], list[str]]:
    """The paths a run reads, checked before Hydra makes its folder (nothing is created).

    ``dataset.path`` (:func:`fedexp.config.keys.dataset_path_errors`) and ``resume``
    (:func:`fedexp.engine.files.resume.resume_target`, which also takes a run's folder for
    its ``checkpoints/``: the override is rewritten so). A sweep of resumes (several values,
    a sweep function) and an interpolation are left to the run.

    Returns:
        (the command line, with ``resume=<run>`` as ``resume=<run>/checkpoints``; the errors).
    """
    from fedexp.config.keys import dataset_path_errors

    errors = dataset_path_errors(args, CONFIG_DIR)
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if key == "resume" and sep and value and value != "null":
            if not (_SWEEP_FUNCTION.match(value) or any(c in value for c in ",$[")):
                from fedexp.engine.files.resume import resume_target

                try:
                    arg = f"resume={resume_target(value)}"
                except ConfigError as exc:
                    errors.append(str(exc))
        out.append(arg)
    return out, errors


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
        from fedexp.cli_help import help_text

        print(help_text())
        sys.exit(0 if args else 2)
    if args[0] == "report":
        from fedexp.report import main as report

        report(args[1:])
        return
    if args[0] == "ui":
        from fedexp.ui import main as ui

        ui(args[1:])
        return
    if args[0] != "run":
        print(f"fedexp: unknown command {args[0]!r} (expected: run, report or ui)", file=sys.stderr)
        sys.exit(2)
    bad = _hydra_code_override(args[1:])
    if bad:
        _refuse(
            f"{bad}: Hydra settings that name code (callbacks, _target_, logging classes) "
            "cannot be overridden; only fedexp's own classes can be configured"
        )
    from fedexp.config.keys import added_or_removed_errors, unknown_key_errors
    from fedexp.config.schema import override_errors

    # lr=-1, algorithm=nope, algorithm.lamda=0.1: one line before Hydra composes anything
    early = _override_shape_errors(args[1:]) or _group_option_errors(args[1:])
    early = early or unknown_key_errors(args[1:], CONFIG_DIR)
    early = early or added_or_removed_errors(args[1:], CONFIG_DIR)
    early = early or override_errors(args[1:])
    if early:
        _refuse("; ".join(early))
    # dataset.path=/nope, resume=<folder without a checkpoint>: before Hydra makes a folder
    checked, paths = _checked_paths(args[1:])
    args = [args[0], *checked]
    if paths:
        _refuse("; ".join(paths))
    from fedexp.search_space import search_space_errors

    # -m hparams_search=lr lr='interval(1, 0.1)': one line, not the Optuna sweeper's traceback
    tuning = search_space_errors(args[1:])
    if tuning:
        _refuse("; ".join(tuning))
    from fedexp.cli_distributed import prepare_argv

    # before Hydra makes a folder or anything runs: hydra/launcher=slurm without sbatch (exit
    # 1); torchrun: no sweep, distributed.* agreeing; distributed.nodes=K: one SLURM job (-m)
    hydra_args, refused, code = prepare_argv(args[1:])
    if refused:
        _refuse(refused, code)
    sweeps = _sweep_without_multirun(hydra_args)
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
    threads take every core (:mod:`fedexp.figures.drawer`). A sweep's jobs start theirs where a core
    is idle (:func:`_set_threads`), which also lets this one go where the run has none
    (``figures=false``, ranks on every core).
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
    from fedexp.cli_distributed import say_once

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

if __name__ == "__main__":  # python -m fedexp.cli ...
    entry()
