"""What a node of a run over several machines says when the group loses a process.

A node that dies (or a rank of it) makes the other ranks' collectives fail
(:class:`~fedexp.engine.processes.launch.GroupLost`); each surviving node then prints one line
(:func:`fedexp.cli.distributed.say_once`) that says where the run was and the command that
resumes it: the node's own torchrun command, read from its agent's command line, with the
run's overrides and ``resume=`` the kept checkpoints.
"""

from __future__ import annotations

import os
import shlex
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from fedexp.engine.processes.place import Place
    from fedexp.errors import Terminated


def _node() -> str:
    """This node's number in the group (torchrun's ``GROUP_RANK``, ``SLURM_NODEID``), or ?."""
    return os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or "?"


def _siblings_alive(place: Place) -> bool | None:
    """Whether this node's ranks all live (the processes its starter started), or None.

    torchrun's agent is the parent of its node's ranks; a rank that ended has been reaped by
    it, or is a zombie until it is.
    """
    if place.local_size < 2:
        return True
    parent, alive = os.getppid(), 0
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        alive += int(fields[1]) == parent and fields[0] != "Z"
    return alive >= place.local_size


def _relaunch(place: Place) -> list[str] | None:
    """The command that started this node's processes, up to ``run``: its starter's, or None.

    torchrun's, read from its agent's command line (this rank's parent's; ``srun torchrun``
    under SLURM alike): :func:`starter_command`. None for a SLURM job's tasks (``fedexp run``
    submits the job again) or where it cannot be read.
    """
    if place.starter != "torchrun":
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except (OSError, UnicodeDecodeError):
        return None
    return starter_command(argv)


def starter_command(argv: Sequence[str]) -> list[str] | None:
    """``torchrun [its options] -m fedexp`` of a torchrun agent's ``argv``, or None.

    The agent is ``python .../torchrun ...`` or ``python -m torch.distributed.run ...``; what
    follows its ``fedexp run`` (the overrides) is left out.
    """
    names = ("torchrun", "torch.distributed.run")
    start = next((i for i, a in enumerate(argv) if Path(a).name in names), None)
    end = next(
        (i for i in range(len(argv) - 1, 0, -1) if argv[i] == "run" and "fedexp" in argv[i - 1]),
        None,
    )
    if start is None or end is None or end <= start:
        return None
    return ["torchrun", *argv[start + 1 : end]]


def lost_line(exc: Exception, cfg: DictConfig, overrides: Sequence[str], place: Place) -> str:
    """What a surviving node says when the group lost a process: where, and how to resume.

    ``node 0 of 2: a process of another node stopped in round 3; checkpoint kept: torchrun
    --nnodes=2 ... -m fedexp run ... resume=<run>/checkpoints`` (the node's own torchrun
    command: the same on every node but for its ``--node-rank``), ``overrides`` being the
    command line's (a follower's own ``hydra.*`` ones left out). A rank of this machine
    that died is named (``rank 1 died (signal 9, SIGKILL) in round 3``: ``exc.who``,
    :func:`~fedexp.engine.processes.launch.dead_sibling`); one machine's line has no
    ``node 0 of 1:``. A resume needs the checkpoint where every node reads it: the run's
    folder on storage the nodes share.
    """
    from omegaconf import OmegaConf

    from fedexp.cli.output import describe_stop
    from fedexp.errors import RankDied

    where = str(getattr(exc, "where", "")).strip()
    said = str(getattr(exc, "who", "") or "")  # "rank 1 died (signal 9, SIGKILL)": known here
    if not said:
        alive = _siblings_alive(place)
        node = {True: "another node", False: "this node", None: "the group"}[alive]
        said = f"a process of {node} stopped"
    text = f"{said} {where}".rstrip()
    if place.nodes > 1:
        text = f"node {_node()} of {place.nodes}: {text}"
    hc = OmegaConf.create({"overrides": {"task": [str(o) for o in overrides]}})
    return as_started(describe_stop(RankDied(text), cfg, hc), place)


def as_started(line: str, place: Place | None) -> str:
    """``line`` with its resume command as the group was started, else as it is.

    Under torchrun: ``torchrun [its options] -m fedexp run ...`` (:func:`_relaunch`).
    """
    command = _relaunch(place) if place is not None else None
    if command is None:
        return line
    quoted = " ".join(shlex.quote(a) for a in command)
    return line.replace("; checkpoint kept: fedexp run ", f"; checkpoint kept: {quoted} run ")


def raise_if_group_lost(exc: Terminated) -> None:
    """SIGTERM in a group started from outside, because a rank of this machine died: that.

    torchrun's agent, seeing a rank die, sends SIGTERM to the others, often before their
    collectives fail; the survivor then names the rank that died, with the group's resume
    command (:class:`~fedexp.engine.processes.launch.GroupLost`, said by :func:`lost_line`),
    and removes its scratch folder. A SIGTERM with every rank alive stays "terminated
    (SIGTERM)".

    Raises:
        GroupLost: a rank of this machine is gone.
    """
    from fedexp.engine.processes.launch import group_lost

    lost = group_lost(exc)
    if lost is not None:
        raise lost from None


def sigterm_after_failure(previous: Any, place: Place | None) -> Any:
    """SIGTERM's handler once a run failed: ignored in a group (``place``), else ``previous``.

    torchrun's agent sends SIGTERM as soon as a rank ends; restored to its default, it would
    end this rank before its one line is out (and leave its scratch folder).
    """
    return signal.SIG_IGN if place is not None else previous
