"""One run over several machines (issue 70, "One run over several machines").

Two machines are played on this one: torchrun's node agents, twice on localhost with a c10d
rendezvous (``--nnodes=2 --nproc-per-node=1``), as a user starts them on two machines (or
``srun torchrun`` under SLURM); and spawned ranks that say they are on two machines
(``GROUP_RANK``, ``LOCAL_RANK``) for the data set's loading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from listening import descendants
from listening import off_loopback
from listening import sampled

from fedexp.config.instantiate import instantiate_checked
from fedexp.engine.processes.ranks import loopback_interface
from fedexp.engine.runner import run
from fedexp.tracking.base import NullTracker
from helpers import assert_same_run_files
from helpers import compose_config

pytestmark = pytest.mark.slow  # several processes, whole CLI runs: make test-slow


def test_each_machine_loads_its_data_and_shares_it_with_its_ranks_alone(tmp_path):
    """Two machines of two ranks: each machine's first rank loads the data set and its other
    rank maps that copy, never the other machine's (though their folders sit side by side, as
    on a file system they share); an error on machine 1 stops every rank, named on machine 0."""
    from distributed_worker import spawn_ranks
    from nodes_worker import machine_data

    spawn_ranks(machine_data, str(tmp_path), 2, size=4, timeout=600)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    node = compose_config("dataset=synthetic", "dataset.num_samples=500").dataset
    alone = hashlib.sha256(instantiate_checked(node, "dataset").x.tobytes()).hexdigest()
    assert [g["x"] for g in got] == [alone] * 4
    assert all(g["mapped"] for g in got)
    assert got[0]["folder"] == got[1]["folder"] != got[2]["folder"] == got[3]["folder"]
    assert all(g["left"] == [] for g in got)  # both machines' folders removed
    for r in (2, 3):
        assert got[r]["error"][0] == "ConfigError" and "num_features" in got[r]["error"][1]
        assert "(on node" not in got[r]["error"][1]
    for r in (0, 1):
        assert got[r]["error"] == ["ConfigError", f"{got[2]['error'][1]} (on node 1)"]


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TINY = [
    "dataset=synthetic",
    "num_clients=4",
    "rounds=2",
    "progress=none",
    "checkpoint_every=0",
    "device=cpu",
    "tracker=none",
]
#: The variables of a group (torchrun's, SLURM's); the agents start without them.
GROUP_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SUBMITIT_EXECUTOR",
    "FEDEXP_TEST_SIGNAL",
)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment without a group's variables; temp files under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k not in GROUP_VARS}
    env.pop("MLFLOW_TRACKING_URI", None)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**env, "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp_path / "tmp"), **extra}


def _two_nodes(cwd: Path, args: list[str], env: dict[str, str]) -> list[subprocess.Popen]:
    """Two torchrun node agents on localhost, one rendezvous, each in its own session.

    The first hosts the rendezvous' store (the second starts once it listens): the node a
    test kills is the second, whose death its survivor's agent outlives.
    """
    from fedexp.engine.processes.launch import _free_port

    port = _free_port()
    command = [
        TORCHRUN,
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=fedexp-two-nodes",
        "--max-restarts=0",
        "-m",
        "fedexp",
        "run",
        *args,
    ]
    agents = []
    for _ in range(2):
        agents.append(
            subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
        deadline = time.monotonic() + 120
        while len(agents) == 1 and time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                break
            time.sleep(0.05)
    return agents


def _end(agents: list[subprocess.Popen], timeout: float = 300) -> list[tuple[str, str]]:
    """Each agent's (stdout, stderr) once it ended; whatever is left of them killed."""
    try:
        return [a.communicate(timeout=timeout) for a in agents]
    finally:
        for a in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(a.pid, signal.SIGKILL)
            a.wait()


def test_two_nodes_write_what_one_process_does(tmp_path):
    """Two node agents of one process each: one run folder, one results line, one process's
    figures; the ranks listen on loopback alone (the interface named for the localhost
    nodes), and nothing is left in the temp folder."""
    alone = tmp_path / "alone"
    run(compose_config(*TINY, output_dir=alone), tracker=NullTracker())
    work = tmp_path / "work"
    work.mkdir()
    env = _env(tmp_path, GLOO_SOCKET_IFNAME=loopback_interface() or "lo")
    agents = _two_nodes(work, TINY, env)
    with sampled([a.pid for a in agents]) as seen:
        ended = _end(agents)
    out = "".join(o for o, _ in ended)
    err = "".join(e for _, e in ended)
    assert [a.returncode for a in agents] == [0, 0], err[-3000:]
    assert "distributed: 2 processes on 2 node(s), started by torchrun" in out
    assert out.count("results: ") == 1, out[-3000:]  # rank 0 alone prints the end of the run
    ours = _without_agents_exit_race(err)
    assert "fedexp:" not in ours and "Traceback" not in ours, err[-3000:]
    (folder,) = list((work / "outputs").glob("*/*"))  # one folder: rank 0's
    assert_same_run_files(alone, folder)
    ranks = {pid for pid, _, _ in seen} - {a.pid for a in agents}
    assert len(ranks) == 2, seen  # each node's rank was seen listening (gloo)
    assert not off_loopback(s for s in seen if s[0] in ranks), seen
    assert _left(tmp_path / "tmp") == []


#: torchrun's records of its agents (``E1202 16:32:14.737000 28039 torch/distributed/elastic/...``)
#: and c10d's C++ warnings (``[W1202 16:32:19.324449535 TCPStore.cpp:106] ...``) with the
#: lines of their stacks.
AGENT_RECORD = re.compile(
    r"^(?:[IWE]\d{4} [\d:.]+ +\d+ torch/distributed/elastic/"
    r"|\[[IWE]\d{4} [\d:.]+ +(?:TCPStore|socket|Utils)\.(?:cpp|hpp):\d+\]"
    r"|Exception raised from \w+ at .*/c10d/|frame #\d+: |<omitting python frames>$)"
)


def _without_agents_exit_race(err: str) -> str:
    """A successful run's stderr without what torchrun's agents say of their exit barrier.

    The barrier's store lives in one agent: when that agent passes the barrier and exits
    first, another may still be waiting on it or sending its heartbeat, and logs the lost
    connection with a traceback of torchrun's own (pytorch/pytorch#69520, open), after every
    rank has finished and with exit code 0. What remains is the ranks' own stderr: a rank's
    traceback or a ``fedexp:`` line stays in it.
    """
    return "\n".join(line for line in err.splitlines() if not AGENT_RECORD.match(line))


def _left(tmp: Path) -> list[str]:
    """What is left in the agents' temp folder but torchrun's own logs (``torchelastic_*``)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchelastic_"))


def _running_in(folder: Path) -> list[int]:
    """The live processes whose working folder is ``folder`` (a run's agents and ranks)."""
    found = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError):
            if entry.isdigit() and Path(f"/proc/{entry}/cwd").resolve() == folder.resolve():
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                found += [int(entry)] if state != "Z" else []
    return found


def test_a_node_that_dies_is_one_line_on_the_other_with_its_resume_command(tmp_path):
    """Once the run has a checkpoint, the second node dies whole (its agent and its rank,
    SIGKILL). The first node prints one ``fedexp:`` line that says so and the torchrun
    command that resumes from the kept checkpoint, and exits non-zero; nothing of the run is
    left (no process, no temp or scratch folder), and that command, run on both nodes,
    finishes the run as one process runs it whole."""
    work = tmp_path / "work"
    work.mkdir()
    env = _env(tmp_path)
    args = [*TINY, "rounds=50", "checkpoint_every=1", "store=disk", f"store_dir={tmp_path / 's'}"]
    args = [a for a in args if a not in ("rounds=2", "checkpoint_every=0")]
    agents = _two_nodes(work, args, env)
    survivor, dead = agents
    try:
        deadline = time.monotonic() + 300
        while not list(work.glob("outputs/*/*/checkpoints/last.safetensors")):
            assert time.monotonic() < deadline and survivor.poll() is None, "no checkpoint"
            time.sleep(0.05)
        ranks = descendants(dead.pid)[1:]
        os.killpg(dead.pid, signal.SIGKILL)  # the node: its agent, and its rank
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, err = survivor.communicate(timeout=300)
    finally:
        _end(agents)
    lines = [line for line in err.splitlines() if line.startswith("fedexp:")]
    assert len(lines) == 1, err[-3000:]
    assert "fedexp/" not in err, err[-3000:]  # no frame of fedexp's: torchrun's report alone
    said = re.fullmatch(
        r"fedexp: node (\d) of 2: a process of another node stopped in round \d+; checkpoint "
        r"kept: torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d "
        r"--rdzv-endpoint=127\.0\.0\.1:\d+ --rdzv-id=fedexp-two-nodes --max-restarts=0 -m "
        r"fedexp run (.*) resume=(\S+)",
        lines[0],
    )
    assert said, lines[0]
    assert said.group(2) == " ".join(args)  # (no follower's hydra.* overrides)
    assert (Path(said.group(3)) / "last.safetensors").is_file()
    assert survivor.returncode != 0
    assert _running_in(work) == []
    assert _left(tmp_path / "tmp") == []
    assert list((tmp_path / "s").iterdir()) == []
    # the command said, on both nodes, finishes the run as one process runs it whole
    command = shlex.split(lines[0].split("checkpoint kept: ", 1)[1])
    command[0] = TORCHRUN  # ("torchrun": the venv's, which this test's PATH may lack)
    again = [subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(2)]  # fmt: skip
    err = "".join(e for _, e in _end(again))
    assert [a.returncode for a in again] == [0, 0], err[-3000:]
    assert _running_in(work) == []
    alone = tmp_path / "alone"
    whole = [a for a in args if not a.startswith(("store", "checkpoint_every"))]
    run(compose_config(*whole, output_dir=alone), tracker=NullTracker())
    assert_same_run_files(alone, Path(said.group(3)).parent)
