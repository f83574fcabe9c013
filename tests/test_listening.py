"""Every socket a run over several processes listens on is on loopback (issue 70, item 6).

A two-process run was seen listening on every interface (``*:59901``, ``[::]:53951``): torch's
``TCPStore`` server, the group's key-value store (no authentication), binds ``::`` whatever
host ``init_process_group`` was given, and gloo listens on the address the host name resolves
to. The run's sockets are sampled through its life, from ``/proc`` (no root needed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from listening import listening
from listening import off_loopback
from listening import sampled

from fedexp.engine.processes.ranks import keep_on_loopback
from fedexp.engine.processes.ranks import listen
from fedexp.engine.processes.ranks import loopback_interface

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp"
)

_WILDCARD = """
import socket, sys, time
a = socket.create_server(("0.0.0.0", 0))
b = socket.create_server(("127.0.0.1", 0))
print(a.getsockname()[1], b.getsockname()[1], flush=True)
time.sleep(60)
"""


def test_the_sampler_sees_a_socket_on_every_interface():
    """The check can fail: a process listening on 0.0.0.0 is caught, its loopback one is not."""
    child = subprocess.Popen([sys.executable, "-c", _WILDCARD], stdout=subprocess.PIPE, text=True)
    try:
        wide, narrow = (int(p) for p in child.stdout.readline().split())
        with sampled([os.getpid()]) as seen:
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert (child.pid, "0.0.0.0", wide) in seen
    assert off_loopback(seen) == [(child.pid, "0.0.0.0", wide)]
    assert (child.pid, "127.0.0.1", narrow) in seen


def test_the_store_socket_is_bound_to_the_host_it_names():
    sock = listen("127.0.0.1")
    try:
        port = sock.getsockname()[1]
        assert (os.getpid(), "127.0.0.1", port) in listening([os.getpid()])
    finally:
        sock.close()


def test_gloo_is_kept_on_loopback_unless_the_user_named_an_interface(monkeypatch):
    name = loopback_interface()
    assert name in ("lo", "lo0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    keep_on_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] == name
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"  # the user's


@pytest.mark.slow
def test_a_two_process_run_listens_on_loopback_alone(tmp_path):
    """The issue's command, sampled 20 times a second from start to end: every socket of
    rank 0 and of the rank it started listens on 127.0.0.1 or ::1."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    env.pop("MLFLOW_TRACKING_URI", None)
    args = ["distributed.nproc=2", "store=disk", "rounds=40", "checkpoint_every=5"]
    args += ["progress=none", "tracker.system_metrics=false", f"store_dir={tmp_path / 'store'}"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from fedexp.cli import entry; entry()", "run", *args],
        cwd=tmp_path,
        env={**env, "PYTHONWARNINGS": "ignore"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with sampled([proc.pid]) as seen:
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "results: " in out
    assert len({pid for pid, _, _ in seen}) >= 2, seen  # both ranks were seen listening
    assert not off_loopback(seen), seen
