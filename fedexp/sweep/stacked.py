"""``hydra/launcher=stacked``: a sweep's runs that can share a cohort run as one (issue 41).

The launcher (the Hydra plugin ``hydra_plugins.fedexp_stacked``) groups the sweep's jobs whose
overrides are equal but for the keys of :data:`STACKABLE`, and runs each group's jobs as
threads of this process whose client work is merged into one cohort a round
(:mod:`fedexp.engine.round.stacking`); a job alone in its group runs as Hydra's basic launcher
runs it. Every job stays a job: its folder, ``.hydra/`` record, log file, rounds.csv,
checkpoints, MLflow run (nested under the sweep's parent), status file and line in the
terminal, exactly as the other launchers leave them; Hydra's callbacks meet each job
(``on_job_start`` and ``on_job_end``, in the job's thread, as ``run_job`` calls them: tuning's
``NaNTrialsFail`` fails a job that returned NaN).

Which keys may differ inside a group, and why:

* ``seed``: a run's seed keys its model initialisation (made by its own engine), its client
  sampling and every client's (seed, round, client) streams, which travel with the cohort
  (``Cohort.keys``); nothing of the merged work reads it otherwise.
* ``partition`` and ``partition.*`` (δ, Dirichlet α, shards...): they choose which samples each
  client holds. Each run keeps its own clients' data (a pool), and the merged cohort reads
  the runs' pools side by side; clients of different sizes take different step counts, and
  only clients of equal step counts (``Context.work_key``) share a call.

Anything else (the algorithm and its λ, the learning rate, the model, the number of clients or
rounds, the compressor, DP) changes what the shared call computes, so jobs that differ in it
are in different groups. The merge itself checks the algorithm's and the solver's settings
again (:meth:`fedexp.engine.round.stacking.Stack._signature`). An algorithm that reads its
run's seed inside ``client_update`` (FedALA, L2GD) runs stacked too, its work called run by
run. ``hydra.launcher.max_runs`` (default 64) caps a group: the merged cohort and the runs'
data are held at once (the solver slices the cohort to the memory budget).

A group's runs share one process, and so one core's Python: with several groups (several
algorithms) ``hydra.launcher.n_jobs`` of them run at a time, each in a worker process
(:mod:`fedexp.sweep.workers`: one that dies ends its own group's jobs only); the default,
-1, is a process a core (at most one a group), 1 every group in this process; the last
group of a count that is no multiple of the processes is split over those of the last turn
(:func:`balanced`). Each job's ``hydra.launcher.n_jobs`` reads the processes that run at
once, so that its torch threads share the cores among them.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from omegaconf import OmegaConf
from omegaconf import open_dict
from omegaconf import read_write

#: Keys that may differ between the runs of one group (a key, and its sub-keys).
STACKABLE = ("seed", "partition")

#: The Hydra config (``HydraConfig.get()``'s node) of the job this thread runs, in a stacked
#: group; None elsewhere (the CLI then reads Hydra's global one).
job_hydra: contextvars.ContextVar[Any] = contextvars.ContextVar("job_hydra", default=None)

log = logging.getLogger(__name__)


def stack_key(overrides: Sequence[str]) -> tuple[str, ...]:
    """What a job must share with the others of its group: its overrides but the stackable."""
    kept = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in STACKABLE or key.startswith(tuple(f"{k}." for k in STACKABLE)):
            continue
        kept.append(item)
    return tuple(sorted(kept))


def groups(job_overrides: Sequence[Sequence[str]], max_runs: int) -> list[list[int]]:
    """The jobs (indices) in groups of at most ``max_runs``, in the order of their first job."""
    by_key: dict[tuple[str, ...], list[list[int]]] = {}
    order: list[list[int]] = []
    for i, overrides in enumerate(job_overrides):
        chunks = by_key.setdefault(stack_key(overrides), [])
        if not chunks or len(chunks[-1]) >= max(1, max_runs):
            chunks.append([])
            order.append(chunks[-1])
        chunks[-1].append(i)
    return order


def balanced(todo: list[list[Any]], processes: int) -> list[list[Any]]:
    """The groups, the last one split so that the last ones share the processes evenly.

    Worker processes take the groups in order as they come free, so with a number of groups
    that is no multiple of the processes the last group runs alone while the others wait (the
    15 groups of ``pfednet_tables`` on two processes: about 9 s of one core idle). Its runs
    are split into as many parts as there are processes left for the last turn: two halves on
    two processes. Which runs share a group changes none of a run's figures beyond what
    stacking itself may (a run's accuracies are those of the run alone, its losses within
    1e-5: ``tests/test_stacking.py``).
    """
    left = len(todo) % processes
    if processes < 2 or left == 0 or len(todo[-1]) < 2:
        return todo
    last = todo[-1]
    parts = min(processes - left + 1, len(last))
    size = -(-len(last) // parts)
    return todo[:-1] + [last[i : i + size] for i in range(0, len(last), size)]


@dataclass
class _Job:
    """A job made ready as ``hydra.core.utils.run_job`` makes it, before it runs."""

    idx: int
    config: DictConfig
    task_cfg: DictConfig
    hydra_cfg: DictConfig
    hc: Any
    output_dir: str
    log_file: str | None


class _ThreadFiles(logging.Handler):
    """The jobs' log files: each record goes to the file of the job whose thread made it.

    The group's merged client work runs on the stack's own thread, in a copy of the context
    of the job that started it (:data:`job_hydra` set): its records (``memory: ...``) go to
    that job's file.
    """

    def __init__(self, like: logging.FileHandler | None) -> None:
        super().__init__(like.level if like is not None else logging.NOTSET)
        self.like = like
        self.files: dict[int, logging.FileHandler] = {}
        self.jobs: dict[int, logging.FileHandler] = {}  # by id of the job's Hydra config

    def add(self, thread: int, path: str, job: Any = None) -> None:
        """Send ``thread``'s records to ``path`` (appended, as Hydra's file handler does).

        ``job``: the job's Hydra config (:data:`job_hydra`), whose records from other threads
        go there too.
        """
        handler = logging.FileHandler(path)
        if self.like is not None:
            handler.setFormatter(self.like.formatter)
            handler.setLevel(self.like.level)
        self.files[thread] = handler
        if job is not None:
            self.jobs[id(job)] = handler

    def emit(self, record: logging.LogRecord) -> None:
        handler = self.files.get(record.thread or 0)
        if handler is None:
            handler = self.jobs.get(id(job_hydra.get()))
        if handler is not None and self.filter(record):
            handler.handle(record)

    def close(self) -> None:
        for handler in self.files.values():
            handler.close()
        super().close()


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list:
    """The sweep's jobs, stacked where they can be; their ``JobReturn`` in job order.

    Args:
        launcher: the plugin (its ``config``, ``hydra_context``, ``task_function`` and
            ``max_runs``).
        job_overrides: each job's overrides.
        initial_job_idx: the first job's number.
    """
    from hydra.core.singleton import Singleton
    from hydra.core.utils import configure_log
    from hydra.core.utils import setup_globals

    from fedexp.engine.threads import available_cores
    from fedexp.engine.threads import launcher_jobs

    if int(launcher.max_runs) < 1:  # (one line, before anything runs)
        print(
            f"fedexp: error: hydra.launcher.max_runs={launcher.max_runs}: expected >= 1",
            file=sys.stderr,
        )
        raise SystemExit(2)
    setup_globals()
    config = launcher.config
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    returns: list = [None] * len(job_overrides)
    todo = [
        [(initial_job_idx + i, list(job_overrides[i])) for i in group]
        for group in groups(job_overrides, int(launcher.max_runs))
    ]
    wanted = launcher_jobs(getattr(launcher, "n_jobs", 1), available_cores())
    n_jobs = min(wanted, len(todo))
    if n_jobs > 1:
        todo = balanced(todo, n_jobs)
        from functools import partial

        from fedexp.sweep.workers import nan_returns
        from fedexp.sweep.workers import run_groups

        state = Singleton.get_state()
        task = launcher.hydra_context, launcher.task_function, config, int(launcher.max_runs)
        # a worker's death ends its own group's jobs only (fedexp.sweep.workers)
        run = partial(_worker, *task, n_jobs, state=state)
        done = run_groups(run, todo, n_jobs, nan_returns)
    else:
        from fedexp.figures import drawer

        if available_cores() > 1 and config.get("figures", True) and drawer.helper_allowed():
            drawer.start_helper()  # before the groups load torch (fedexp.figures.drawer)
        here = _Launcher(
            launcher.hydra_context, launcher.task_function, config, int(launcher.max_runs), 1
        )
        done = [_group(here, jobs) for jobs in todo]
    for jobs, rets in zip(todo, done, strict=True):
        for (idx, _), ret in zip(jobs, rets, strict=True):
            returns[idx - initial_job_idx] = ret
    return returns


@dataclass
class _Launcher:
    """What a worker process needs of the launcher."""

    hydra_context: Any
    task_function: Any
    config: DictConfig
    max_runs: int
    #: the processes that run groups at once (each job's ``hydra.launcher.n_jobs``)
    processes: int


def _worker(
    hydra_context: Any,
    task_function: Any,
    config: DictConfig,
    max_runs: int,
    processes: int,
    jobs: list[tuple[int, list[str]]],
    state: dict,
) -> list:
    """A group in a worker process (``n_jobs`` > 1), as Hydra's joblib launcher runs its jobs."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import setup_globals

    setup_globals()
    Singleton.set_state(state)
    return _group(_Launcher(hydra_context, task_function, config, max_runs, processes), jobs)


def _group(launcher: Any, jobs: list[tuple[int, list[str]]]) -> list:
    """A group's ``JobReturn``: stacked, or job by job as Hydra's basic launcher runs them.

    Job by job: a job alone in its group, and the jobs of a run over several processes
    (``distributed.nproc`` or ``nodes`` > 1: a process joins one torch.distributed group, so
    its runs cannot be threads beside each other).
    """
    from hydra.core.utils import configure_log
    from hydra.core.utils import run_job

    config = launcher.config
    try:
        first = _sweep_config(launcher, jobs[0][1], jobs[0][0])  # (composed once, used below)
        if len(jobs) > 1 and stackable(first):
            return _run_group(launcher, jobs, first)
        return [
            run_job(
                hydra_context=launcher.hydra_context,
                task_function=launcher.task_function,
                config=first if i == 0 else _sweep_config(launcher, overrides, idx),
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
            )
            for i, (idx, overrides) in enumerate(jobs)
        ]
    finally:
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)


def stackable(config: DictConfig) -> bool:
    """Whether the runs of a group like ``config``'s may be threads of one process.

    Not a run over several processes (``distributed.nproc`` or ``distributed.nodes`` > 1):
    each of its processes joins the one torch.distributed group a process can hold. Nor jobs
    that change into their folders (``hydra.job.chdir=true``): a process has one working
    directory, and threads would share it. The group's runs share these settings (they are
    not stackable keys), so the first job's decide.
    """
    distributed = OmegaConf.select(config, "distributed", default=None) or {}
    if bool(OmegaConf.select(config, "hydra.job.chdir", default=False)):
        return False
    return int(distributed.get("nproc", 1) or 1) <= 1 and int(distributed.get("nodes", 1) or 1) <= 1


def _sweep_config(launcher: Any, overrides: Sequence[str], idx: int) -> DictConfig:
    sweep_config = launcher.hydra_context.config_loader.load_sweep_config(
        launcher.config, list(overrides)
    )
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = idx
        sweep_config.hydra.job.num = idx
        sweep_config.hydra.launcher.n_jobs = launcher.processes  # (the jobs' thread share)
    return sweep_config


def derived_config(
    like: DictConfig, like_overrides: Sequence[str], overrides: Sequence[str]
) -> DictConfig | None:
    """A job's sweep config from another job's of its group, or None where it must be composed.

    Composing a config (Hydra's defaults list, every YAML file read and merged: 0.1 s) takes
    longer than a small run's rounds, and Hydra composes each job twice (the sweeper checks
    the batch, the launcher launches it). The runs of a group differ in a few values
    (``seed=3``, ``partition.delta=2``), which Hydra applies to the composed defaults in order
    (``ConfigLoaderImpl._apply_overrides_to_config``): applying the job's values with that
    same function to a copy of ``like`` (``like_overrides`` applied to the same defaults) gives
    the config Hydra composes, and ``hydra.overrides.task`` and ``hydra.job.override_dirname``
    are made as Hydra makes them. Derived only when both jobs name the same keys in the same
    order and differ in plain values (no config group such as ``partition=dirichlet``, no
    ``+``/``~``, no ``hydra.*``); otherwise None. tests/test_stacked_launcher.py holds derived
    configs equal to composed ones.
    """
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    parser = OverridesParser.create()
    mine = parser.parse_overrides(list(overrides))
    theirs = parser.parse_overrides(list(like_overrides))
    if len(mine) != len(theirs):
        return None
    choices = like.hydra.runtime.choices
    changed = []
    for a, b in zip(mine, theirs, strict=True):
        if a.key_or_group != b.key_or_group or a.package != b.package:
            return None
        if a.input_line == b.input_line:
            continue
        if (
            a.type != OverrideType.CHANGE
            or b.type != OverrideType.CHANGE
            or a.package is not None
            or a.key_or_group in choices  # a config group
            or a.is_hydra_override()
            or a.is_sweep_override()
        ):
            return None
        changed.append(a)
    config = copy.deepcopy(like)
    ConfigLoaderImpl._apply_overrides_to_config(changed, config)
    app = [o for o in mine if not o.is_hydra_override()]
    job = config.hydra.job
    with open_dict(config.hydra):
        config.hydra.overrides.task = [o.input_line for o in app]
        job.override_dirname = get_overrides_dirname(
            overrides=app,
            kv_sep=job.config.override_dirname.kv_sep,
            item_sep=job.config.override_dirname.item_sep,
            exclude_keys=job.config.override_dirname.exclude_keys,
        )
    return config


class DerivingLoader:
    """Hydra's config loader, deriving a job's sweep config from its group's where it can.

    :meth:`load_sweep_config` composes the first job of each group (:func:`stack_key`) and
    derives the others from it (:func:`derived_config`); everything else is the loader's. The
    launcher puts it in the Hydra context it shares with the sweeper (:func:`derive_configs`),
    so the sweeper's check of the batch and the launch both derive: a 20-run group is composed
    once, not 40 times. Pickled without what it keeps (a worker process composes its own).
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._composed: dict[tuple, tuple[DictConfig, list[str]]] = {}

    def load_sweep_config(self, master_config: DictConfig, sweep_overrides: list[str]) -> Any:
        """The job's sweep config: derived from its group's first where it can be."""
        key = (id(master_config), *stack_key(sweep_overrides))
        known = self._composed.get(key)
        if known is not None:
            derived = derived_config(*known, sweep_overrides)
            if derived is not None:
                return derived
        config = self.loader.load_sweep_config(master_config, list(sweep_overrides))
        if known is None:  # (a pristine copy: a launched job's hydra node is made read-only)
            self._composed[key] = copy.deepcopy(config), list(sweep_overrides)
        return config

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # (unpickling: not yet set)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __getstate__(self) -> dict:
        return {"loader": self.loader}

    def __setstate__(self, state: dict) -> None:
        self.loader, self._composed = state["loader"], {}


def derive_configs(hydra_context: Any) -> None:
    """Make ``hydra_context``'s config loader a :class:`DerivingLoader` (once)."""
    if not isinstance(hydra_context.config_loader, DerivingLoader):
        hydra_context.config_loader = DerivingLoader(hydra_context.config_loader)


def _prepare(
    launcher: Any, overrides: Sequence[str], idx: int, config: DictConfig | None = None
) -> _Job:
    """A job's config, folder and ``.hydra/`` record, as ``run_job`` makes them.

    ``config``: the job's sweep config if already composed (:func:`_sweep_config`).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import _save_config

    if config is None:
        config = _sweep_config(launcher, overrides, idx)
    HydraConfig.instance().set_config(config)
    output_dir = os.path.join(
        str(OmegaConf.select(config, "hydra.sweep.dir")),
        str(OmegaConf.select(config, "hydra.sweep.subdir")),
    )
    with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
        config.hydra.runtime.output_dir = os.path.abspath(output_dir)
    HydraConfig.instance().set_config(config)
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    hc = HydraConfig.get()  # (Hydra's own node: interpolations resolve in the job's config,
    hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)  # whose cache holds ${now:})
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    if config.hydra.output_subdir is not None:
        record = Path(config.hydra.runtime.output_dir) / str(config.hydra.output_subdir)
        _save_config(task_cfg, "config.yaml", record)
        _save_config(hydra_cfg, "hydra.yaml", record)
        _save_config(config.hydra.overrides.task, "overrides.yaml", record)
    log_file = OmegaConf.select(config, "hydra.job_logging.handlers.file.filename", default=None)
    return _Job(idx, config, task_cfg, hydra_cfg, hc, output_dir, log_file and str(log_file))


def _wait(ended: list[threading.Event]) -> None:
    """Until every job's thread has ended its job.

    On events, not ``Thread.join``: a ``join`` that Ctrl-C interrupts may mark the thread it
    waits for as ended while it runs (CPython 3.11's ``_wait_for_tstate_lock``), and the
    process would then exit under a job still in torch (abort: "terminate called without an
    active exception").
    """
    for event in ended:
        while not event.wait(0.2):
            pass


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM in the launcher's thread: the group stops as on Ctrl-C (the CLI's handler)."""
    from fedexp.errors import Terminated

    raise Terminated


def _run_group(
    launcher: Any, jobs: list[tuple[int, Sequence[str]]], first: DictConfig | None = None
) -> list:
    """One group's jobs as threads of one stack; their ``JobReturn``, in order.

    ``first``: the first job's sweep config if already composed.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import JobReturn
    from hydra.core.utils import JobStatus
    from hydra.core.utils import configure_log
    from hydra.core.utils import env_override

    from fedexp.engine.round.stacking import Stack
    from fedexp.engine.round.stacking import current as current_member

    before = HydraConfig.instance().cfg
    prepared = [
        _prepare(launcher, overrides, idx, first if i == 0 else None)
        for i, (idx, overrides) in enumerate(jobs)
    ]
    lead = prepared[0].config
    configure_log(lead.hydra.job_logging, lead.hydra.verbose)
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    router = _ThreadFiles(files[0] if files else None)
    for h in files:  # the first job's file: each job's file, by thread
        root.removeHandler(h)
        h.close()
    root.addHandler(router)
    HydraConfig.instance().set_config(lead)  # the sweep's mode and sweeper, for global readers
    stack = Stack(len(prepared))
    returns = [JobReturn() for _ in prepared]
    #: Hydra's callbacks of the sweep (``hydra.callbacks``): each job's ``on_job_start`` and
    #: ``on_job_end`` in its own thread, as ``run_job`` calls them around its task
    callbacks = launcher.hydra_context.callbacks
    log.debug("stacking %d runs: jobs %s", len(prepared), ", ".join(str(j.idx) for j in prepared))

    def body(i: int) -> None:
        job, ret = prepared[i], returns[i]
        if job.log_file:
            router.add(threading.get_ident(), job.log_file, job.hc)
        job_hydra.set(job.hc)
        current_member.set(stack.members[i])
        ret.cfg, ret.hydra_cfg = job.task_cfg, job.hydra_cfg
        ret.overrides = OmegaConf.to_container(job.config.hydra.overrides.task)
        ret.working_dir = os.getcwd()
        ret.task_name = str(job.config.hydra.job.name)
        try:
            callbacks.on_job_start(config=job.config, task_function=launcher.task_function)
            with stack.members[i].turns():
                ret.return_value = launcher.task_function(job.task_cfg)
            ret.status = JobStatus.COMPLETED
        except BaseException as exc:  # noqa: BLE001 - the job's (a KeyboardInterrupt: stopped)
            ret.return_value = exc
            ret.status = JobStatus.FAILED
        finally:
            stack.members[i].leave()
        try:  # (as run_job: not for a job stopped by Ctrl-C or an exit)
            if not isinstance(ret._return_value, KeyboardInterrupt | SystemExit):
                callbacks.on_job_end(config=job.config, job_return=ret)
        except Exception as exc:  # noqa: BLE001 - a callback's error fails its job
            ret.return_value = exc
            ret.status = JobStatus.FAILED
        finally:
            ended[i].set()

    ended = [threading.Event() for _ in prepared]
    threads = [
        threading.Thread(target=body, args=(i,), name=f"fedexp-job-{j.idx}", daemon=True)
        for i, j in enumerate(prepared)
    ]
    previous = signal.signal(signal.SIGTERM, _terminated)  # stops the group as Ctrl-C does
    # the jobs' ``hydra.job.env_set``, as run_job sets it around each job, until every job has
    # ended, stopped ones too (a hydra.* override is no stackable key: the jobs share it)
    try:
        with env_override(lead.hydra.job.env_set):
            try:
                for t in threads:
                    t.start()
                _wait(ended)
            except BaseException:
                stack.stop()  # every run ends as a stopped run (KILLED, its checkpoint kept)
                _wait(ended)
                raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        root.removeHandler(router)
        router.close()
        HydraConfig.instance().cfg = before
    # (``_return_value``: the getter raises a failed job's error; the sweeper reads it, as of
    # any launcher's jobs)
    stopped = [r._return_value for r in returns if isinstance(r._return_value, KeyboardInterrupt)]
    if stopped:  # Ctrl-C or SIGTERM in a job: the sweep stops, as with the other launchers
        raise stopped[0]
    exits = [r._return_value for r in returns if isinstance(r._return_value, SystemExit)]
    if exits:
        raise exits[0]
    return returns
