"""What a node of a run over several machines says when the group loses a process, and which
of its ranks loads the data set (issue 70, "One run over several machines"); the runs
themselves: tests/test_nodes.py."""

from __future__ import annotations

from unittest import mock

import pytest
from omegaconf import OmegaConf

from fedexp.cli.distributed import FOLLOWER_OVERRIDES
from fedexp.cli.distributed import _task
from fedexp.cli.group_lost import lost_line
from fedexp.cli.group_lost import starter_command
from fedexp.engine.processes.launch import GroupLost
from fedexp.engine.processes.place import Place
from fedexp.engine.processes.ranks import Ranks
from fedexp.engine.processes.shared_data import machine_of
from helpers import compose_config

AGENT = ["/venv/bin/python", "/venv/bin/torchrun", "--nnodes=2", "--rdzv-id", "run"]


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        ([*AGENT, "-m", "fedexp", "run", "rounds=5"], ["torchrun", *AGENT[2:], "-m", "fedexp"]),
        (  # python -m torch.distributed.run: its options kept, a value "run" among them
            ["python", "-m", "torch.distributed.run", "--nnodes=2", "-m", "fedexp", "run"],
            ["torchrun", "--nnodes=2", "-m", "fedexp"],
        ),
        (["python", "/venv/bin/torchrun", "train.py", "run"], None),  # not fedexp
        (["bash", "-c", "fedexp run"], None),  # not torchrun
    ],
)
def test_the_resume_command_starts_as_the_nodes_agent_was_started(argv, command):
    assert starter_command(argv) == command


def test_a_lost_process_is_one_line_with_the_torchrun_command_that_resumes(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.safetensors").write_bytes(b"")
    cfg = compose_config("rounds=50", output_dir=out)
    hc = OmegaConf.create({"overrides": {"task": ["rounds=50", *FOLLOWER_OVERRIDES]}})
    task = _task(hc)  # (a follower's hydra.* overrides left out)
    place = Place(1, 2, 0, 1)
    agent = ["python", "torchrun", "--nnodes=2", "--rdzv-endpoint=h:1", "-m", "fedexp", "run"]
    with (
        mock.patch.dict("os.environ", {"GROUP_RANK": "1"}),
        mock.patch("fedexp.cli.group_lost._relaunch", return_value=starter_command(agent)),
    ):
        line = lost_line(GroupLost("in round 7"), cfg, task, place)
    assert line == (
        "node 1 of 2: a process of another node stopped in round 7; checkpoint kept: torchrun "
        f"--nnodes=2 --rdzv-endpoint=h:1 -m fedexp run rounds=50 resume={out / 'checkpoints'}"
    )
    with mock.patch("fedexp.cli.group_lost._relaunch", return_value=None):  # a SLURM job's
        line = lost_line(GroupLost("in round 7"), cfg, task, place)
    assert line.endswith(f"checkpoint kept: fedexp run rounds=50 resume={out / 'checkpoints'}")


@pytest.mark.parametrize(
    ("env", "rank", "said"),
    [
        ({}, 0, ("", True)),  # distributed.nproc: one machine, rank 0 loads
        ({}, 3, ("", False)),
        ({"LOCAL_RANK": "0", "GROUP_RANK": "2"}, 4, ("2", True)),  # torchrun: node 2's first
        ({"LOCAL_RANK": "1", "GROUP_RANK": "2"}, 5, ("2", False)),
        ({"LOCAL_RANK": "0", "SLURM_NODEID": "1"}, 2, ("1", True)),  # a SLURM job's task
    ],
)
def test_each_machines_first_rank_loads_the_data_set(monkeypatch, env, rank, said):
    for key in ("LOCAL_RANK", "GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert machine_of(Ranks(rank, 8)) == said
