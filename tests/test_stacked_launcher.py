"""``hydra/launcher=stacked`` (issue 41) through the real CLI: jobs grouped by what they share,
each job still a job (folder, status, its own log lines, MLflow child run), its figures those of
the same job under Hydra's basic launcher."""

from __future__ import annotations

import csv
import json
import pickle
import re
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from fedexp.sweep.stacked import balanced
from fedexp.sweep.stacked import groups
from fedexp.sweep.stacked import stack_key
from fedexp.sweep.stacked import stackable
from helpers import ROOT
from helpers import compose_config
from helpers import run_cli

TINY = ["rounds=3", "num_clients=4", "device=cpu", "checkpoint_every=0", "progress=log"]


def test_jobs_group_by_everything_but_seed_and_partition():
    jobs = [
        ["algorithm=fedavg", "seed=0"],
        ["algorithm=fedavg", "seed=1"],
        ["algorithm=ditto", "seed=0"],
        ["algorithm=fedavg", "partition.delta=2", "seed=0"],
        ["algorithm=fedavg", "partition=dirichlet", "seed=1"],
        ["algorithm=fedavg", "lr=0.5", "seed=0"],
    ]
    assert stack_key(jobs[0]) == stack_key(jobs[3]) == stack_key(jobs[4]) == ("algorithm=fedavg",)
    assert groups(jobs, 64) == [[0, 1, 3, 4], [2], [5]]
    assert groups(jobs, 2) == [[0, 1], [2], [3, 4], [5]]


def test_the_last_group_is_split_to_keep_every_process_busy_at_the_end():
    tables = [list(range(20 * g, 20 * g + 20)) for g in range(15)]  # pfednet_tables' groups
    split = balanced(tables, 2)
    assert [len(g) for g in split] == [20] * 14 + [10, 10]
    assert sum(split, []) == sum(tables, [])  # every job once, in order
    assert balanced(tables[:14], 2) == tables[:14]  # a multiple of the processes: as it was
    assert [len(g) for g in balanced([[0, 1, 2]] * 5, 4)] == [3, 3, 3, 3, 1, 1, 1]
    assert [len(g) for g in balanced([[0, 1, 2, 3]] * 3, 4)] == [4, 4, 2, 2]
    assert balanced([[0], [1], [2]], 2) == [[0], [1], [2]]  # a job alone is not split
    assert balanced(tables[:3], 1) == tables[:3]


def test_runs_over_several_processes_are_never_threads_of_one():
    assert stackable(compose_config())
    assert stackable(compose_config("distributed.nproc=1"))
    assert not stackable(compose_config("distributed.nproc=2"))
    assert not stackable(compose_config("distributed.nodes=2"))


def test_jobs_that_change_into_their_folders_are_never_threads_of_one():
    """A process has one working directory: ``hydra.job.chdir=true`` jobs run one by one."""
    from omegaconf import open_dict

    for chdir in (False, True):
        config = compose_config()
        with open_dict(config):
            config.hydra = {"job": {"chdir": chdir}}
        assert stackable(config) is not chdir


def _rows(folder):
    with open(folder / "rounds.csv") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def stacked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stacked")
    uri = f"sqlite:///{tmp}/m.db"
    proc = run_cli(
        "run",
        "-m",
        "algorithm=fedavg,local",
        "seed=0,1",
        *TINY,
        "hydra/launcher=stacked",
        f"tracker.uri={uri}",
        f"hydra.sweep.dir={tmp}/sweep",
        cwd=tmp,
    )
    return proc, uri, tmp / "sweep"


def test_a_stacked_sweep_keeps_every_job_a_job(stacked):
    proc, uri, sweep = stacked
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sweep done, 4 jobs: 4 ok, 0 failed" in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # the terminal gets job lines, warnings and errors: not the merged work's INFO lines
    # (issue 70, item 5: ``memory: ...`` from the group's own thread)
    assert "memory:" not in proc.stdout + proc.stderr, proc.stdout[-2000:]
    for n in range(4):
        job = sweep / str(n)
        status = json.loads((job / "fedexp_status.json").read_text())
        assert status["status"] == "ok" and status["job"] == n
        assert (job / ".hydra" / "overrides.yaml").is_file()
        assert len(_rows(job)) == 4  # rounds 0..3
        # its log file holds its own lines only, every one marked with its job
        lines = [ln for ln in (job / "cli.log").read_text().splitlines() if "round " in ln]
        assert len(lines) == 3, lines
        assert all(f"[job {n}] round" in ln for ln in lines), lines
    # the merged work's lines (on its group's own thread) go to the file of the job that
    # started it: each group's estimate of a client's step
    logs = [(sweep / str(n) / "cli.log").read_text() for n in range(4)]
    assert sum(log.count("][INFO] - memory: ") for log in logs) >= 2, logs
    client = MlflowClient(uri)
    experiment = re.search(r"^MLflow experiment: (fedexp/\S+ \S+ \S+) \(parent", proc.stdout, re.M)
    assert experiment, proc.stdout[-2000:]
    exp = client.get_experiment_by_name(experiment.group(1))
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 4 and all(r.info.status == "FINISHED" for r in children)
    assert all(r.data.metrics.get("acc/mean") is not None for r in children)
    # the sweep's tables, as of any sweep: a row per algorithm, two seeds each
    report = run_cli(
        "report", "--uri", uri, "--experiment", experiment.group(1), "--rows", "choice.algorithm",
        cwd=sweep.parent,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    rows = [ln for ln in report.stdout.splitlines() if ln.startswith("| ") and "(n=2)" in ln]
    assert [r.split("|")[1].strip() for r in rows] == ["FedAvg", "Local"], report.stdout


@pytest.mark.slow
def test_a_stacked_sweep_ends_as_the_basic_launchers(stacked, tmp_path):
    proc, _, sweep = stacked
    assert proc.returncode == 0
    basic = run_cli(
        "run",
        "-m",
        "algorithm=fedavg,local",
        "seed=0,1",
        *TINY,
        "tracker=none",
        f"hydra.sweep.dir={tmp_path}/sweep",
        cwd=tmp_path,
    )
    assert basic.returncode == 0, basic.stderr[-3000:]
    for n in range(4):
        a, b = _rows(sweep / str(n)), _rows(tmp_path / "sweep" / str(n))
        assert [r["acc/mean"] for r in a] == [r["acc/mean"] for r in b]
        for ra, rb in zip(a, b, strict=True):
            if ra.get("train/train_loss"):
                assert float(ra["train/train_loss"]) == pytest.approx(
                    float(rb["train/train_loss"]), rel=1e-5
                )


def _round(progress) -> int:
    try:
        return int(json.loads(progress.read_text())["round"])
    except (OSError, ValueError, KeyError):
        return -1


@pytest.mark.slow
def test_ctrl_c_stops_every_run_of_a_stacked_group(tmp_path):
    """Every run of the group ends KILLED with its checkpoint and resume command; exit 130,
    no traceback, no abort (a ``Thread.join`` cut by Ctrl-C once let the process exit under
    a running job)."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", "from fedexp.cli import entry; entry()", "run", "-m"]
        + ["hydra/launcher=stacked", "seed=0,1,2", "rounds=400", "tracker=none", "progress=log"]
        + [f"hydra.sweep.dir={tmp_path}/sweep"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a test run started in the background by a non-interactive shell inherits SIGINT
        # ignored, and so would the child (Python then installs no KeyboardInterrupt handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            progress = [tmp_path / "sweep" / str(n) / "fedexp_progress.json" for n in range(3)]
            if all(_round(p) > 10 for p in progress):  # past the first checkpoint (round 10)
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-3000:]
    for n in range(3):
        status = json.loads((tmp_path / "sweep" / str(n) / "fedexp_status.json").read_text())
        assert status["status"] == "killed", status
        assert f"resume={tmp_path}/sweep/{n}/checkpoints" in err
    assert "3 stopped so far" in out, out[-2000:]


_CALLBACKS = """
import math, os, sys, types
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from fedexp.config.instantiate import register_resolvers
from fedexp.config.schema import register_configs
from fedexp.sweep import stacked
from fedexp.tuning.objective import NaNTrialsFail

register_resolvers()
register_configs()
initialize_config_dir(sys.argv[1], version_base="1.3")
loader = GlobalHydra.instance().config_loader()
master = loader.load_configuration(
    "config",
    ["hydra/launcher=stacked", "hydra.sweep.dir=sweep", "+hydra.job.env_set.FEDEXP_SAID=yes"],
    RunMode.MULTIRUN,
)
seen = []

class Callbacks:  # (as Hydra's: every callback of hydra.callbacks, here a recorder and NaN's)
    def on_job_start(self, config, task_function, **kwargs):
        seen.append(f"start {config.seed} {config.hydra.job.num}")

    def on_job_end(self, config, job_return, **kwargs):
        NaNTrialsFail().on_job_end(config, job_return)
        seen.append(f"end {config.seed} {job_return.status.name}")

context = types.SimpleNamespace(config_loader=loader, callbacks=Callbacks())
def task(cfg):
    seen.append(f"env {os.environ.get('FEDEXP_SAID')}")
    return math.nan if cfg.seed == 1 else float(cfg.seed)

launcher = types.SimpleNamespace(
    hydra_context=context, task_function=task, config=master, max_runs=64, processes=1
)
jobs = [(n, [f"seed={n}"]) for n in range(3)]
assert stacked.stack_key(jobs[0][1]) == stacked.stack_key(jobs[2][1])  # one group
returns = stacked._group(launcher, jobs)
print("STATUS", [r.status.name for r in returns], sorted(seen), os.environ.get("FEDEXP_SAID"))
"""


def test_a_stacked_groups_jobs_meet_hydras_callbacks_as_run_job_calls_them(tmp_path):
    """Each job of a stacked group meets the sweep's ``on_job_start`` and ``on_job_end`` (in
    its thread), as Hydra's ``run_job`` calls them: tuning's NaN callback fails a NaN job; and
    its ``hydra.job.env_set``."""
    proc = subprocess.run(
        [sys.executable, "-c", _CALLBACKS, str(ROOT / "conf")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("STATUS"))
    assert line == (
        "STATUS ['COMPLETED', 'FAILED', 'COMPLETED'] ['end 0 COMPLETED', 'end 1 FAILED', "
        "'end 2 COMPLETED', 'env yes', 'env yes', 'env yes', 'start 0 0', 'start 1 1', "
        "'start 2 2'] None"  # (hydra.job.env_set: set for the jobs, then unset)
    ), line
    for n in range(3):  # each job its own record, as run_job leaves it
        assert (tmp_path / "sweep" / str(n) / ".hydra" / "overrides.yaml").is_file()


def test_a_group_cap_below_one_is_refused_in_one_line(tmp_path):
    proc = run_cli(
        "run", "-m", "hydra/launcher=stacked", "seed=0,1", "hydra.launcher.max_runs=0",
        "tracker=none", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "fedexp: error: hydra.launcher.max_runs=0: expected >= 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "sweep").glob("*/fedexp_status.json"))  # nothing ran


def _sweep_configs(jobs: list[list[str]]) -> tuple:
    """Hydra's config loader and the sweep's master config (a multirun of the real config)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from helpers import CONF

    initialize_config_dir(str(CONF), version_base="1.3")
    loader = GlobalHydra.instance().config_loader()
    master = loader.load_configuration(
        "config", ["hydra/launcher=stacked", "hydra.sweep.dir=x/${now:%H-%M-%S}"], RunMode.MULTIRUN
    )
    return loader, master


class _Recording:
    """A stand-in config loader that pickles: gives a copy of one config, and counts."""

    def __init__(self, config) -> None:  # noqa: ANN001
        self.config, self.calls = config, 0

    def load_sweep_config(self, master_config, overrides):  # noqa: ANN001, ANN201
        import copy

        self.calls += 1
        return copy.deepcopy(self.config)


def test_a_groups_configs_are_derived_from_its_first_as_hydra_composes_them():
    """``derived_config`` gives, for a value that differs (seed, partition.*), the config Hydra
    composes (values, ``hydra.overrides.task``, ``override_dirname``, flags, the ``${now:}`` of
    the sweep), and declines a config group, an added or removed key, or other keys."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from fedexp.sweep.stacked import DerivingLoader
    from fedexp.sweep.stacked import derived_config

    first = ["algorithm=ditto", "partition.delta=1", "seed=0", "lr=0.05"]
    same = [
        ["algorithm=ditto", "partition.delta=3", "seed=7", "lr=0.05"],
        ["algorithm=ditto", "partition.delta=1", "seed=2", "lr=0.05"],
        list(first),
    ]
    other = [
        ["algorithm=ditto", "partition=dirichlet", "seed=0", "lr=0.05"],  # a group
        ["algorithm=ditto", "seed=0", "partition.delta=1", "lr=0.05"],  # another order
        ["algorithm=ditto", "partition.delta=1", "seed=0"],  # fewer keys
        ["algorithm=ditto", "partition.delta=1", "+seed=0", "lr=0.05"],  # an add
        ["algorithm=fedavg", "partition.delta=1", "seed=0", "lr=0.05"],
    ]
    try:
        loader, master = _sweep_configs([first])
        like = loader.load_sweep_config(master, first)
        for job in same:
            derived = derived_config(like, first, job)
            composed = loader.load_sweep_config(master, job)
            assert derived is not None, job
            assert OmegaConf.to_container(derived) == OmegaConf.to_container(composed), job
            assert derived.seed == composed.seed and derived.partition == composed.partition
            assert derived.hydra.job.override_dirname == composed.hydra.job.override_dirname
            assert OmegaConf.select(derived, "hydra.sweep.dir") == OmegaConf.select(
                composed, "hydra.sweep.dir"
            )  # the sweep's ${now:}, resolved once
            for mine, theirs in ((derived, composed), (derived.hydra, composed.hydra)):
                assert OmegaConf.is_struct(mine) == OmegaConf.is_struct(theirs)
                assert OmegaConf.is_readonly(mine) == OmegaConf.is_readonly(theirs)
        assert like.seed == 0  # (a copy is derived: the first job's config is left as it was)
        for job in other:
            assert derived_config(like, first, job) is None, job
        # the loader the launcher gives the sweeper: each job as composed, first ones composed
        composed = []

        class Counting:
            def load_sweep_config(self, master_config, overrides):
                composed.append(overrides)
                return loader.load_sweep_config(master_config, overrides)

        deriving = DerivingLoader(Counting())
        valid = [job for job in other if not job[2].startswith("+")]  # (+seed: seed exists)
        for job in (first, *same, *valid):
            got = deriving.load_sweep_config(master, job)
            assert OmegaConf.to_container(got) == OmegaConf.to_container(
                loader.load_sweep_config(master, job)
            ), job
        assert composed == [first, *valid]
        with pytest.raises(ConfigCompositionException, match="already at 'seed'"):
            deriving.load_sweep_config(master, other[3])  # composed, and refused as Hydra does
        # pickled for the launcher's worker processes: without the configs it keeps (a worker
        # composes its own). Around a loader of this module's: Hydra's own is pickled by the
        # launcher's end-to-end tests, in the CLI's process (in this one, another test may
        # have made Hydra's plugin registry again, which re-runs its plugins' modules and
        # leaves every loader's config sources of classes pickle cannot find)
        kept = DerivingLoader(_Recording(like))
        kept.load_sweep_config(master, first)
        assert kept._composed and kept.loader.calls == 1
        unpickled = pickle.loads(pickle.dumps(kept))
        assert unpickled._composed == {} and unpickled.loader.calls == 1
        assert unpickled.load_sweep_config(master, first).seed == 0
        assert unpickled.loader.calls == 2  # composed: nothing kept came along
    finally:
        GlobalHydra.instance().clear()


def _group_returns(group):
    """A worker's group (tests/test_stacked_launcher.py): job 0's worker dies by SIGKILL."""
    import os
    import signal
    import time

    if group[0][0] == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # (the death is seen while this group still runs)
    return [float(n) for n, _ in group]


def test_a_dead_worker_ends_its_own_groups_jobs_and_says_which(capfd):
    """Issue 70, item 8: a ``kill -9`` of one worker ended the sweep with joblib's traceback,
    and joblib's loky killed the other workers (every job "stopped with the sweep"). Now one
    line names the worker and its jobs, and the other groups run to their end."""
    from fedexp.sweep.workers import run_groups

    job = [[f"algorithm={a}", f"seed={s}", "rounds=9"] for a in ("fedavg", "ditto") for s in (0, 1)]
    todo = [[(0, job[0]), (1, job[1])], [(2, job[2])], [(3, job[3])]]
    done = run_groups(_group_returns, todo, 2, lambda group: ["dead"] * len(group))
    assert done == [["dead", "dead"], [2.0], [3.0]]
    (line,) = [x for x in capfd.readouterr().err.splitlines() if x.startswith("fedexp:")]
    assert re.fullmatch(
        r"fedexp: sweep worker \d+ died \(signal 9, SIGKILL\) holding job 0 \(algorithm=fedavg "
        r"seed=0\), job 1 \(algorithm=fedavg seed=1\); the other groups go on",
        line,
    )


@pytest.mark.timeout(120)
def test_a_dead_workers_closed_pipe_seen_before_its_exit_is_its_death(capfd, monkeypatch):
    """The CI of 2026-12-02 hung here for an hour: ``wait`` named the killed worker's pipe
    (at its end) and not yet its sentinel; the loop read the pipe, met its end, and went round
    again without looking at the sentinel. A ``wait`` that never names a sentinel forces
    that order: the death is still seen, from the pipe's end."""
    from multiprocessing.connection import Connection
    from multiprocessing.connection import wait as real_wait

    from fedexp.sweep import workers

    def pipes_first(objects: list) -> list:
        ready = real_wait(objects)
        pipes = [o for o in ready if isinstance(o, Connection)]
        return pipes or ready

    monkeypatch.setattr(workers, "wait", pipes_first)
    job = [[f"algorithm={a}", f"seed={s}", "rounds=9"] for a in ("fedavg", "ditto") for s in (0, 1)]
    todo = [[(0, job[0]), (1, job[1])], [(2, job[2])], [(3, job[3])]]
    done = workers.run_groups(_group_returns, todo, 2, lambda group: ["dead"] * len(group))
    assert done == [["dead", "dead"], [2.0], [3.0]]
    err = capfd.readouterr().err.splitlines()
    assert sum(x.startswith("fedexp: sweep worker") for x in err) == 1


@pytest.mark.slow
def test_a_kill_9_of_a_stacked_sweeps_worker_leaves_the_other_group_running(tmp_path):
    """Issue 70, item 8 through the CLI: two groups (two algorithms) on two workers; one is
    killed (SIGKILL) past its runs' first checkpoint. One ``fedexp:`` line names it and its
    jobs, no traceback; the other group's jobs finish (status ok); the summary lists the dead
    ones as failed (not "stopped with the sweep")."""
    import os
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-c", "from fedexp.cli import entry; entry()", "run", "-m"]
        + ["hydra/launcher=stacked", "hydra.launcher.n_jobs=2", "algorithm=fedavg,fedprox"]
        + ["seed=0,1", "rounds=300", "tracker=none", "progress=log"]
        + [f"hydra.sweep.dir={tmp_path}/sweep"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        progress = [tmp_path / "sweep" / str(n) / "fedexp_progress.json" for n in range(4)]
        while time.monotonic() < deadline and not all(_round(p) > 10 for p in progress):
            time.sleep(0.1)
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "spawn_main"], capture_output=True, text=True
        ).stdout.split()
        victim = min(int(c) for c in children)  # the first worker: the first group, jobs 0, 1
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in err, err[-3000:]
    said = [x for x in err.splitlines() if x.startswith("fedexp: sweep worker")]
    assert said == [
        f"fedexp: sweep worker {victim} died (signal 9, SIGKILL) holding job 0 (algorithm=fedavg "
        "seed=0), job 1 (algorithm=fedavg seed=1); the other groups go on"
    ]
    for n in (2, 3):
        status = json.loads((tmp_path / "sweep" / str(n) / "fedexp_status.json").read_text())
        assert status["status"] == "ok", status
    assert "stopped with the sweep" not in out and "2 ok, 2 failed" in out, out[-2000:]
