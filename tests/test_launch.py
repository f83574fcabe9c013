"""One run over processes started from outside (issue "Beyond one process", its launch parts).

``torchrun --standalone --nproc-per-node 2 -m fedexp run ...`` writes what one process writes,
in one folder, with one MLflow run; a SLURM job of several nodes is checked off-cluster: the
sbatch script submitit would submit (a fake ``sbatch`` keeps it), the torch.distributed
variables a task derives from SLURM's, and a job of two tasks run by submitit's local
executor, which goes through the same code in each task.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pandas as pd
import pytest

from fedexp.cli.distributed import FOLLOWER_OVERRIDES
from fedexp.cli.distributed import check_place
from fedexp.cli.distributed import export_submitit_env
from fedexp.cli.distributed import prepare_argv
from fedexp.engine.processes.place import Place
from fedexp.engine.processes.place import env_place
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.tracking.base import NullTracker
from helpers import assert_same_run_files
from helpers import compose_config
from helpers import mlflow_db
from helpers import run_cli

pytestmark = pytest.mark.slow  # several processes or whole CLI runs: make test-slow

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TINY = [
    "dataset=synthetic",
    "num_clients=4",
    "rounds=2",
    "progress=none",
    "checkpoint_every=0",
    "device=cpu",
]
#: The variables of a group; a test's child processes start without them.
GROUP_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SUBMITIT_EXECUTOR",
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in GROUP_VARS}
    env.pop("MLFLOW_TRACKING_URI", None)
    return {**env, "PYTHONWARNINGS": "ignore", **extra}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The tiny run's folder, on one process."""
    out = tmp_path_factory.mktemp("one") / "run"
    run(compose_config(*TINY, "tracker=none", output_dir=out), tracker=NullTracker())
    return out


def test_torchrun_two_processes_write_what_one_does(one_process, tmp_path):
    from mlflow import MlflowClient

    uri = mlflow_db(tmp_path / "mlflow.db")
    tracker = [f"tracker.uri={uri}", "tracker.experiment=launch", "tracker.system_metrics=false"]
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "fedexp", "run", *TINY] + tracker,
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "distributed: 2 processes on 1 node(s), started by torchrun" in proc.stdout
    assert proc.stdout.count("results: ") == 1  # rank 0 alone prints the end of the run
    assert "fedexp:" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    folders = list((tmp_path / "outputs").glob("*/*"))
    assert len(folders) == 1, folders  # rank 1 made no folder of its own
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["mlruns", "outputs"]
    assert_same_run_files(one_process, folders[0])
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("launch").experiment_id])
    assert len(runs) == 1
    final = pd.read_csv(one_process / "rounds.csv").iloc[-1]
    assert runs[0].data.metrics["acc/mean"] == pytest.approx(final["acc/mean"], rel=1e-4)


def test_torchrun_refuses_a_disagreeing_nproc_in_one_line(tmp_path):
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "fedexp", "run"]
        + ["distributed.nproc=3", *TINY],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0  # torchrun's own status; each process exited 2
    assert proc.stderr.count("fedexp: error:") == 1, proc.stderr
    assert "distributed.nproc=3 disagrees with torchrun's 2 processes per node" in proc.stderr
    assert "exitcode  : 2" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # refused before Hydra made a folder


TORCHRUN_RANK_1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-m", "seed=0,1"], "-m: a sweep cannot run under torchrun"),
        (["distributed.nproc=3"], "distributed.nproc=3 disagrees with torchrun's 2 processes"),
        (["distributed.nodes=2"], "distributed.nodes=2 disagrees with torchrun's 1 node(s)"),
    ],
)
def test_torchrun_refusals(args, needle):
    with mock.patch.dict(os.environ, TORCHRUN_RANK_1):
        _, error, code = prepare_argv(args)
    assert code == 2 and needle in error


def test_torchrun_ranks_after_the_first_make_no_hydra_folders():
    with mock.patch.dict(os.environ, TORCHRUN_RANK_1):
        assert env_place() == Place(1, 2, 1, 2, "torchrun")
        args, error, _ = prepare_argv(["rounds=2", "distributed.nproc=2"])
    assert error is None and args == ["rounds=2", "distributed.nproc=2", *FOLLOWER_OVERRIDES]
    with mock.patch.dict(os.environ, {**TORCHRUN_RANK_1, "RANK": "0", "LOCAL_RANK": "0"}):
        assert prepare_argv(["rounds=2"]) == (["rounds=2"], None, 0)


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> Path:
    """``sbatch`` and ``srun`` on PATH; sbatch copies its script to ``$FEDEXP_SBATCH_COPY``
    and fails, so that nothing waits for a job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/sh\ncp "$1" "$FEDEXP_SBATCH_COPY"\necho "sbatch: not a cluster" >&2\nexit 1\n'
    )
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


def test_nodes_need_the_slurm_launcher(fake_slurm, monkeypatch):
    for var in GROUP_VARS:
        monkeypatch.delenv(var, raising=False)
    _, error, code = prepare_argv(["distributed.nodes=2"])
    assert code == 2 and "distributed.nodes=2: more than one machine needs" in error
    _, error, code = prepare_argv(["distributed.nodes=0"])
    assert code == 2 and error == "distributed.nodes=0: expected an integer in [1, 1024]"
    args, error, _ = prepare_argv(["hydra/launcher=slurm", "distributed.nodes=2"])
    assert error is None and args == ["-m", "hydra/launcher=slurm", "distributed.nodes=2"]
    _, error, _ = prepare_argv(["-m", "hydra/launcher=slurm", "distributed.nodes=1,2"])
    assert "cannot be swept" in error
    _, error, _ = prepare_argv(
        ["hydra/launcher=slurm", "distributed.nodes=2", "distributed.nproc=1,2"]
    )
    assert "distributed.nproc=1,2: not swept" in error
    monkeypatch.setenv("PATH", "/nonexistent")
    _, error, code = prepare_argv(["hydra/launcher=slurm", "distributed.nodes=2"])
    assert code == 1 and "sbatch not found" in error


def test_nodes_without_slurm_exit_2_before_anything_runs(tmp_path):
    proc = run_cli("run", "distributed.nodes=2", *TINY, cwd=tmp_path, env=_env())
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fedexp: error: distributed.nodes=2: more than one machine needs hydra/launcher=slurm "
        "(one SLURM job of 2 nodes × distributed.nproc tasks each), or torchrun on each node"
    ]
    assert list(tmp_path.iterdir()) == []


def test_slurm_job_asks_for_nodes_and_tasks_per_node(fake_slurm, tmp_path):
    script = tmp_path / "job.sh"
    work = tmp_path / "work"
    work.mkdir()
    overrides = ["hydra/launcher=slurm", "distributed.nodes=2", "distributed.nproc=4"]
    proc = run_cli(
        "run",
        *overrides,
        *TINY,
        "tracker=none",
        cwd=work,
        env=_env(PATH=os.environ["PATH"], FEDEXP_SBATCH_COPY=str(script)),
        timeout=120,
    )
    assert proc.returncode != 0  # the fake sbatch refuses the job
    text = script.read_text()
    assert "#SBATCH --nodes=2\n" in text and "#SBATCH --ntasks-per-node=4\n" in text
    assert "#SBATCH --gpus-per-node=1\n" in text  # conf/hydra/launcher/slurm.yaml's
    assert "export SUBMITIT_EXECUTOR=slurm" in text
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "-m submitit.core._submit" in srun
    assert not (work / "outputs").exists()  # submitted as a sweep of one job (-m added)
    pickles = list((work / "multirun").glob("*/*/.submitit/*.pkl"))
    assert pickles and all(b"fedexp.cli" in p.read_bytes() for p in pickles)  # fedexp's job


SLURM_TASK = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "8",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
}


def test_a_slurm_task_derives_its_rank_from_slurm_variables():
    env = {k: v for k, v in os.environ.items() if k not in GROUP_VARS}
    with mock.patch.dict(os.environ, {**env, **SLURM_TASK}, clear=True):
        assert export_submitit_env() is not None
        place = env_place()
        exported = {k: os.environ[k] for k in GROUP_VARS[:-1]}
        cfg = compose_config("distributed.nodes=2", "distributed.nproc=4")
        check_place(cfg)  # agrees with the job
        with pytest.raises(ConfigError, match="distributed.nproc=3 disagrees with the SLURM"):
            check_place(compose_config("distributed.nodes=2", "distributed.nproc=3"))
    assert place == Place(5, 8, 1, 4, "the SLURM job") and place.nodes == 2
    assert exported["RANK"] == "5" and exported["WORLD_SIZE"] == "8"
    assert exported["LOCAL_RANK"] == "1" and exported["LOCAL_WORLD_SIZE"] == "4"
    assert exported["MASTER_ADDR"] == "gpu07"
    assert 20000 <= int(exported["MASTER_PORT"]) <= 60000


def test_a_job_of_two_submitit_tasks_is_one_run(one_process, tmp_path):
    """submitit's local executor runs a job's tasks as SLURM would (its own variables)."""
    proc = run_cli(
        "run",
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        "distributed.nproc=2",
        *TINY,
        "tracker=none",
        cwd=tmp_path,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = list((tmp_path / "multirun").glob("*/*/0"))
    assert_same_run_files(one_process, job)
    logs = sorted(job.parent.glob(".submitit/*/*_log.out"))
    assert len(logs) == 2
    assert "distributed: 2 processes on 1 node(s), started by the local job" in logs[0].read_text()
    assert "fedexp" not in logs[1].read_text()  # rank 1 prints nothing


def test_distributed_nproc_two_started_ranks_write_what_one_does(one_process, tmp_path):
    """``fedexp run distributed.nproc=2``: the command's process starts the other rank.

    With ``store=disk``: each rank's scratch folder is gone after the run, the started rank's
    too, which ends without the C++ runtime's exit (``launch._leave``).
    """
    store = tmp_path / "store"
    proc = run_cli(
        "run",
        *TINY,
        "distributed.nproc=2",
        "tracker=none",
        "store=disk",
        f"store_dir={store}",
        cwd=tmp_path,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("results: ") == 1
    assert "fedexp:" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr and "exit code" not in proc.stderr
    folders = list((tmp_path / "outputs").glob("*/*"))
    assert len(folders) == 1, folders
    assert_same_run_files(one_process, folders[0])
    assert store.is_dir() and not list(store.iterdir())  # both ranks' scratch folders removed


def test_a_data_error_over_two_started_ranks_is_one_line(tmp_path):
    """Every rank meets the same bad data; the user reads it once, without a traceback."""
    proc = run_cli(
        "run",
        *TINY,
        "num_clients=5000",
        "distributed.nproc=2",
        "tracker=none",
        cwd=tmp_path,
        env=_env(),
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len([line for line in lines if line.startswith("fedexp: error:")]) == 1, lines
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "sample" in proc.stderr


@pytest.mark.parametrize(("error", "printed"), [("data", False), ("bug", True)])
def test_a_started_rank_leaves_user_errors_to_rank_0_and_prints_bugs(tmp_path, error, printed):
    """A started rank that meets a user's error exits 1 silently (rank 0 builds the same and
    says it once); a bug's traceback is printed."""
    code = (
        "import sys, torch.multiprocessing as mp\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import distributed_worker\n"
        "from fedexp.engine.processes.launch import _free_port\n"
        "if __name__ == '__main__':\n"
        "    port, ctx = _free_port(), mp.get_context('spawn')\n"
        "    ps = [ctx.Process(target=distributed_worker.failing_rank,"
        " args=(r, 2, port, sys.argv[2])) for r in range(2)]\n"
        "    [p.start() for p in ps]\n"
        "    [p.join(120) for p in ps]\n"
        "    sys.exit(max(p.exitcode for p in ps))\n"
    )
    tests = str(Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", code, tests, error],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert ("Traceback" in proc.stderr) is printed, proc.stderr[-2000:]
    assert ("RuntimeError: a bug" in proc.stderr) is printed
    assert "DataError: bad rows" not in proc.stderr


_SAY = """
import os, sys, time, builtins
from pathlib import Path
from fedexp.cli.distributed import say_once
slow, flag, kill = float(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] == ["kill"]
real = builtins.print
if slow:  # this rank claims the line first and takes its time to print it; then: when it was out
    def late(*a, **k):
        flag.touch()  # (claimed: the other rank may start)
        time.sleep(slow)
        real(*a, **k)
        real(time.monotonic())
        if kill:  # killed once the line is out (torchrun stopping it)
            os.kill(os.getpid(), 9)
    builtins.print = late
say_once("fedexp: error: the same refusal on every rank")
if not slow:  # when this rank went on
    real(time.monotonic())
"""


def _say(flag: Path, slow: float, env: dict[str, str], *kill: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _SAY, str(slow), str(flag), *kill], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _said_by_two(
    flag: Path, env: dict[str, str], slow: float = 1.0, late: float = 0.0
) -> tuple[str, str, str, str]:
    """Rank 1 claims the line and takes ``slow`` seconds to print it; rank 0 comes ``late``.

    Returns:
        rank 1's stdout (when its line was out) and stderr, rank 0's stdout and stderr.
    """
    first = _say(flag, slow, env)
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the first rank has claimed the line
    time.sleep(late)
    second = subprocess.run(
        [sys.executable, "-c", _SAY, "0", str(flag)],
        env={**env, "RANK": "0", "LOCAL_RANK": "0"}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out, err = first.communicate(timeout=120)
    assert first.returncode == second.returncode == 0, err + second.stderr
    return out, err, second.stdout, second.stderr


def test_a_refusal_is_said_once_and_no_rank_leaves_before_it_is_out(tmp_path):
    """Whichever rank meets a refusal first prints it; the others wait for that line before
    they exit (torchrun stops every rank as soon as one exits), and no file marks it."""
    (tmp_path / "tmp").mkdir()
    env = _env(**TORCHRUN_RANK_1, MASTER_PORT="1", TMPDIR=str(tmp_path / "tmp"))
    out, err, out_0, err_0 = _said_by_two(tmp_path / "claimed", env)
    assert (err + err_0).count("fedexp: error:") == 1
    assert "fedexp: error:" in err  # the rank that came first, not rank 0
    assert float(out_0) >= float(out)  # rank 0 left after the line was out
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_line_said_once_leaves_nothing_when_its_rank_is_killed(tmp_path):
    """The rank that said the line is killed (SIGKILL) as it is out, before the other rank
    came (torchrun stopped it): nothing is left in TMPDIR (the marks are socket names,
    which go with their process; a marker file stayed there), and the group's next line is
    said (once: the file of the last one made it a line already said, and none printed it)."""
    (tmp_path / "tmp").mkdir()
    env = _env(**TORCHRUN_RANK_1, MASTER_PORT="2", TMPDIR=str(tmp_path / "tmp"))
    first = _say(tmp_path / "killed", 0.1, env, "kill")
    _, err = first.communicate(timeout=120)
    assert first.returncode == -9 and err.count("fedexp: error:") == 1, err
    assert list((tmp_path / "tmp").iterdir()) == []
    _, err, _, err_0 = _said_by_two(tmp_path / "claimed", env)
    assert (err + err_0).count("fedexp: error:") == 1, err + err_0


def test_a_refusal_is_said_once_when_a_rank_comes_late(tmp_path):
    """Rank 0 meets the refusal after rank 1 has said it: before the group is joined (every
    rank meets the line) the rank that said it waits for the others' check-in, so that its
    marks, which go with it, are there when rank 0 looks; rank 0 prints nothing."""
    (tmp_path / "tmp").mkdir()
    env = _env(**TORCHRUN_RANK_1, MASTER_PORT="3", TMPDIR=str(tmp_path / "tmp"))
    out, err, out_0, err_0 = _said_by_two(tmp_path / "claimed", env, slow=0.01, late=1.0)
    assert (err + err_0).count("fedexp: error:") == 1, err + err_0
    assert "fedexp: error:" in err
