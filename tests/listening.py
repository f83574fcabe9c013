"""The TCP sockets a process tree listens on, sampled through its life (issue 70, item 6).

Linux's ``/proc/net/tcp`` and ``/proc/net/tcp6`` list every socket of the network namespace
with its state and inode; ``/proc/<pid>/fd`` links a process's descriptors to those inodes
(``socket:[inode]``). Neither needs root for the user's own processes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

#: ``st`` of a listening socket in ``/proc/net/tcp*`` (``TCP_LISTEN``).
_LISTEN = "0A"
#: Addresses that only this machine reaches.
LOOPBACK = ("127.0.0.1", "::1")


def _address(hex_address: str) -> str:
    """``0100007F`` (IPv4) or the 32 digits of IPv6, as ``/proc/net/tcp*`` writes them."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # 32-bit words, host order
    return str(ipaddress.ip_address(raw))


def listening_inodes() -> dict[str, tuple[str, int]]:
    """Every listening TCP socket of this network namespace: inode -> (address, port)."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN:
                address, port = fields[1].split(":")
                out[fields[9]] = (_address(address), int(port, 16))
    return out


def descendants(root: int) -> list[int]:
    """``root`` and the processes it started, theirs, and so on (alive now)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def listening(pids: Iterable[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of each TCP socket in the listening state that ``pids`` hold."""
    sockets = listening_inodes()
    out = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in sockets:
                    out.add((pid, *sockets[target[8:-1]]))
    return out


@contextlib.contextmanager
def sampled(roots: Iterable[int], every_s: float = 0.05) -> Iterator[set[tuple[int, str, int]]]:
    """What the trees of ``roots`` listen on, sampled every ``every_s`` seconds while inside.

    Yields the set it fills (pid, address, port); a last sample is taken on the way out.
    """
    seen: set[tuple[int, str, int]] = set()
    roots = list(roots)
    stop = threading.Event()

    def sample() -> None:
        seen.update(listening(p for r in roots for p in descendants(r)))

    def loop() -> None:
        while not stop.wait(every_s):
            sample()

    thread = threading.Thread(target=loop, daemon=True, name="listening")
    sample()
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


def off_loopback(seen: Iterable[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    """The sockets of ``seen`` that listen elsewhere than on loopback."""
    return sorted(s for s in seen if s[1] not in LOOPBACK)
