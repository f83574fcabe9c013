"""The processes of a group started from outside (torchrun, a SLURM job): which one died.

torchrun's agent, seeing a rank die, sends SIGTERM to the others, often before their
collectives fail; a survivor then says which rank of its machine died, not that it was
terminated (:func:`~fedexp.engine.processes.launch.group_lost`). For that every rank records
its process (pid, host, parent, start time) as the group joins (:func:`note_group`); a rank of
this machine is one with this rank's host and starter (its parent: the node's torchrun agent,
the SLURM step).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedexp.engine.processes.ranks import Ranks

#: Every rank's process (pid, host, parent, start time) of a group started from outside, in
#: rank order (:func:`note_group`), else None.
_group: list[dict[str, Any]] | None = None


def note_group(ranks: Ranks) -> None:
    """Gather every rank's process (pid, host, parent, start time) for :func:`dead_sibling`.

    Called as a group started from outside joins (torchrun, a SLURM job): one collective, at
    the start.
    """
    global _group
    from fedexp.engine.clients.states import _started

    pid = os.getpid()
    host, parent = socket.gethostname(), os.getppid()
    _group = ranks.gather_json({"pid": pid, "host": host, "parent": parent, "at": _started(pid)})


def _gone(pid: int, at: float | None) -> bool:
    """Whether process ``pid`` (started at ``at``) has ended.

    Ended: no such process, a zombie, or a later process that reused the pid.
    """
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return True
        return at is not None and abs(proc.create_time() - at) > 2.0
    except psutil.NoSuchProcess:
        return True
    except Exception:  # noqa: BLE001 - no access, a race: not known to be gone
        return False


def dead_sibling(wait: float = 0.0) -> tuple[int, int] | None:
    """(rank, pid) of the first rank of this machine that is gone, or None.

    Of this machine: on this host, started by this rank's starter (its parent: torchrun's
    agent of this node, the SLURM step), in the group :func:`note_group` recorded. None
    when every one lives (or none was recorded); ranks of other machines cannot be seen
    from here.

    Args:
        wait: seconds to look again while none is gone (a rank that is dying closes its
            sockets, failing the others' collectives, before its process is gone).
    """
    gone = gone_siblings(wait)
    return gone[0] if gone else None


def gone_siblings(wait: float = 0.0) -> list[tuple[int, int]]:
    """(rank, pid) of every rank of this machine that is gone (:func:`dead_sibling`'s).

    Args:
        wait: seconds to look again while none is gone.
    """
    if not _group:
        return []
    starter, me = (socket.gethostname(), os.getppid()), os.getpid()  # (machine, parent)
    siblings = [
        (rank, int(proc.get("pid") or 0), proc.get("at"))
        for rank, proc in enumerate(_group)
        if (proc.get("host"), proc.get("parent")) == starter and proc.get("pid") not in (0, me)
    ]
    deadline = time.monotonic() + wait
    while siblings:
        gone = [(rank, pid) for rank, pid, at in siblings if _gone(pid, at)]
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.01)
    return []


def is_zombie(pid: int) -> bool:
    """Whether ``pid`` is a zombie now (its exit status still readable)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def nodes() -> int:
    """The starters (torchrun's node agents) of the group :func:`note_group` recorded."""
    return len({(p.get("host"), p.get("parent")) for p in _group or []})


def peer_closed() -> bool:
    """Whether a TCP connection of this process was closed by its other end (CLOSE_WAIT).

    A process of the group that ended closes its sockets; this rank's ends of them wait in
    CLOSE_WAIT until it reads or closes them. Unknown (no access): False.
    """
    import psutil

    try:
        return any(
            c.status == psutil.CONN_CLOSE_WAIT for c in psutil.Process().net_connections("tcp")
        )
    except Exception:  # noqa: BLE001 - no access, no such interface: not known
        return False
