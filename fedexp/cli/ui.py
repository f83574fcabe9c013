"""``fedexp ui``: MLflow's web UI on the store a run wrote to, with the link that opens it.

    fedexp ui                                  # sqlite:///mlflow.db in this folder
    fedexp ui --uri sqlite:///runs/mlflow.db --port 5001 --experiment fedexp/tuning

A local store (SQLite, a file store) has no web server of its own. This command starts
MLflow's tracking server on it (``python -m mlflow server`` from fedexp's own interpreter, so
``mlflow`` need not be on ``PATH``: ``make run`` leaves it in ``.venv/bin``), listening on
127.0.0.1 only, waits until it answers, and prints the link that opens an experiment in
MLflow's machine-learning view (:mod:`fedexp.tracking.links`): ``--experiment``, else the one
of the latest run. Ctrl-C stops the server and the command quietly (exit code 0; 130 before
the server started).

The server runs in a process group of its own without MLflow's job runner (the background
workers of GenAI evaluation jobs, which a viewer of training runs does not need), so that
stopping it leaves no process behind. A store that does not exist is refused in one line
(MLflow would create an empty one); a tracking server (``http(s)://``) serves its own UI: the
command prints its link and starts nothing.

Imports nothing heavy until it runs (``fedexp ui --help`` is light).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

from fedexp.errors import FedexpError
from fedexp.tracking.links import ML_VIEW_QUERY
from fedexp.tracking.links import default_store
from fedexp.tracking.links import experiment_url
from fedexp.tracking.links import is_server

#: The only address the server listens on: this machine.
HOST = "127.0.0.1"
#: MLflow's own default port.
DEFAULT_PORT = 5000
#: Seconds the server has to answer its health check after it starts.
START_TIMEOUT_S = 120.0
#: Seconds a stopping server has after SIGINT, then after SIGTERM, before the next signal.
STOP_GRACE_S = 10.0

EPILOG = """\
examples:
  fedexp ui                                   the store of `fedexp run` in this folder
  fedexp ui --experiment fedexp/tuning        link to that experiment
  fedexp ui --uri sqlite:///elsewhere/mlflow.db --port 5001

Stop it with Ctrl-C. The link carries ?workflowType=machine_learning: MLflow 3 opens
experiments in its GenAI view otherwise."""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option's help; the epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port from 1 to 65535")
    return port


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``fedexp ui``."""
    p = argparse.ArgumentParser(
        prog="fedexp ui",
        description=textwrap.fill(
            "Start MLflow's web UI on a run's tracking store, on 127.0.0.1, and print the link "
            "that opens it in MLflow's machine-learning view. Runs MLflow's server from "
            "fedexp's own Python (mlflow need not be on PATH); Ctrl-C stops it.",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=_Formatter,
    )
    p.add_argument(
        "--uri",
        default=None,
        help="tracking store to serve (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db "
        "in this folder: where `fedexp run` writes)",
    )
    p.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, metavar="N", help="port on 127.0.0.1"
    )
    p.add_argument(
        "--experiment",
        "-e",
        default=None,
        metavar="NAME",
        help="experiment the printed link opens (default: the latest run's)",
    )
    return p


def server_command(uri: str, port: int) -> list[str]:
    """MLflow's tracking server on ``uri`` at 127.0.0.1:``port``, run by this interpreter.

    One worker, no access log (each request of the page would print a line).
    """
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--registry-store-uri",  # the same store, given: MLflow says so otherwise
        uri,
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        "1",
        "--uvicorn-opts=--no-access-log",
    ]


def server_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: without MLflow's job runner, and its warnings off.

    The job runner (huey workers for GenAI evaluation jobs) would be processes of their own to
    stop; its Python warnings (a web framework's deprecations) are nothing a viewer acts on.
    """
    env = dict(os.environ if environ is None else environ)
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def missing_store(uri: str) -> str | None:
    """Why a local ``uri`` names no store (a SQLite file, a file store folder), or None."""
    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///").split("?", 1)[0]
        if path in ("", ":memory:"):
            return "an in-memory database holds no runs to look at"
        if not Path(path).is_file():
            return f"{Path(path).absolute()} does not exist"
        return None
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        folder = Path(parsed.path if parsed.scheme == "file" else uri)
        if not folder.is_dir():
            return f"{folder.absolute()} is not a folder"
    return None


def port_taken(port: int) -> bool:
    """Whether something listens on 127.0.0.1:``port`` already."""
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


def _experiment_link(uri: str, name: str | None, base: str) -> tuple[str, str]:
    """The link to print and what it opens: ``name``'s experiment, else the latest run's.

    Raises:
        FedexpError: ``name`` is not an experiment of the store (the known ones listed).
    """
    from mlflow.tracking import MlflowClient

    from fedexp.report.collect import experiment_named

    client = MlflowClient(uri)
    if name is not None:
        exp = experiment_named(client, name, uri)
        return experiment_url(base, exp.experiment_id), f"experiment '{exp.name}'"
    ids = [e.experiment_id for e in client.search_experiments()]
    latest = client.search_runs(ids, max_results=1, order_by=["attributes.start_time DESC"])
    if not latest:
        return f"{base}/#/experiments?{ML_VIEW_QUERY}", "no run recorded yet"
    exp = client.get_experiment(latest[0].info.experiment_id)
    return (
        experiment_url(base, exp.experiment_id),
        f"experiment '{exp.name}', of the latest run; --experiment NAME for another",
    )


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def _wait_ready(proc: subprocess.Popen, port: int, timeout: float = START_TIMEOUT_S) -> None:
    """Wait until the server answers its health check.

    Raises:
        FedexpError: it exited first, or did not answer within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FedexpError(
                f"MLflow's server exited (code {proc.returncode}) before it answered; "
                "its output is above"
            )
        if _answers(f"http://{HOST}:{port}/health"):
            return
        time.sleep(0.25)
    raise FedexpError(f"MLflow's server did not answer on port {port} within {timeout:g} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop the server's process group: SIGINT, then SIGTERM, then SIGKILL."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> None:
    """``fedexp ui ARGS``: serve the store until Ctrl-C; errors as one line, exit 1.

    Ctrl-C while serving stops the server and exits 0; before the server started (MLflow is
    still being imported, the store read) it exits 130, without a traceback either way.
    """
    try:
        _main(argv)
    except KeyboardInterrupt:
        print("fedexp ui: stopped", file=sys.stderr, flush=True)
        sys.exit(130)


def _main(argv: list[str]) -> None:
    """:func:`main`, Ctrl-C aside."""
    args = parser().parse_args(argv)
    uri = args.uri or default_store()
    key = "--uri" if args.uri else ""
    if not args.uri and os.environ.get("MLFLOW_TRACKING_URI"):
        key = "MLFLOW_TRACKING_URI"
    try:
        if is_server(uri):
            _at_server(uri, args.experiment)
            return
        problem = missing_store(uri)
        if problem is not None:
            given = f"{key}={uri}" if key else f"the default store {uri}"
            raise FedexpError(
                f"{given}: no MLflow store there ({problem}); run fedexp ui from the folder "
                "you ran fedexp run in, or pass --uri with the store a run printed"
            )
        if port_taken(args.port):
            raise FedexpError(
                f"--port {args.port}: {HOST}:{args.port} is in use (another MLflow UI?); "
                "stop it, or pass another --port"
            )
        base = f"http://{HOST}:{args.port}"
        link, what = _experiment_link(uri, args.experiment, base)
    except FedexpError as exc:
        print(f"fedexp: error: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(serve(uri, args.port, link, what))


def _at_server(uri: str, experiment: str | None) -> None:
    """A tracking server serves its own UI: print its link, start nothing."""
    from fedexp.tracking.store import check_reachable

    base = uri.rstrip("/")
    if experiment is None:
        print(f"fedexp ui: {uri} is a tracking server, which serves the UI itself: open {base}")
        return
    check_reachable(uri, key="--uri")
    link, _ = _experiment_link(uri, experiment, base)
    print(f"fedexp ui: {uri} is a tracking server, which serves the UI itself: open {link}")


class _Relay(threading.Thread):
    """Pass the server's error output on, line by line, until :meth:`mute` is called.

    Stopping the server interrupts it wherever it is: uvicorn logs the cancelled lifespan
    task as an ERROR with its traceback, and a server still starting dies with Python's
    KeyboardInterrupt traceback. Neither is anything to act on once the user asked it to
    stop, so what the server writes after that is dropped.
    """

    def __init__(self, stream: IO[bytes]) -> None:
        super().__init__(name="fedexp-ui-stderr", daemon=True)
        self._stream = stream
        self._muted = threading.Event()

    def run(self) -> None:
        """Copy lines to this process's stderr while not muted; read to the end regardless."""
        for line in iter(self._stream.readline, b""):
            if not self._muted.is_set():
                sys.stderr.write(line.decode(errors="replace"))
                sys.stderr.flush()
        self._stream.close()

    def mute(self) -> None:
        """Drop whatever the server writes from now on."""
        self._muted.set()


def _stop_quietly(proc: subprocess.Popen, relay: _Relay) -> None:
    """Stop the server without its shutdown noise; a second Ctrl-C meanwhile is ignored."""
    relay.mute()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop(proc)
    finally:
        signal.signal(signal.SIGINT, previous)
    relay.join(timeout=STOP_GRACE_S)  # the server's children may hold the pipe a moment longer


def serve(uri: str, port: int, link: str, what: str) -> int:
    """Run the server until Ctrl-C (or SIGTERM); returns the exit code (0 after Ctrl-C)."""
    command = server_command(uri, port)
    print(f"fedexp ui: serving {uri} at http://{HOST}:{port} (Ctrl-C stops it)", flush=True)
    proc = subprocess.Popen(  # noqa: S603
        command, env=server_env(), start_new_session=True, stderr=subprocess.PIPE
    )
    relay = _Relay(proc.stderr)
    relay.start()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _wait_ready(proc, port)
        print(f"open {link}  ({what})", flush=True)
        code = proc.wait()
    except KeyboardInterrupt:
        _stop_quietly(proc, relay)
        print("fedexp ui: stopped", flush=True)
        return 0
    except FedexpError as exc:
        relay.join(timeout=1.0)  # what the server said before it gave up: above the error
        _stop_quietly(proc, relay)
        print(f"fedexp: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    relay.join(timeout=STOP_GRACE_S)
    if code:
        print(f"fedexp: error: MLflow's server stopped (exit code {code})", file=sys.stderr)
    return 1 if code else 0
