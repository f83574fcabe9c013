"""Local and remote MLflow stores checked before MLflow opens them.

:func:`check_reachable` probes an ``http(s)://`` tracking server (``<uri>/health``, 3 s), so
that with none answering a run fails at once with one line naming the URI instead of after
MLflow's minutes of retries. :func:`check_sqlite_path` checks a local ``sqlite:///`` store's
path: a part of it that is a file, a folder where the database should be, or a folder that
cannot be written fails with one line naming the path, instead of a bare ``FileExistsError``.
"""

from __future__ import annotations

import socket
import ssl
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from fedexp.errors import TrackerError

#: Seconds a tracking server has to answer the probe of :func:`check_reachable`.
PROBE_TIMEOUT_S = 3.0
#: The first bytes of every SQLite database file.
_SQLITE_HEADER = b"SQLite format 3\x00"


def _why(exc: BaseException, timeout: float) -> str | None:
    """Why nothing answered, in words; None if something did (TLS spoke, HTTP replied)."""
    reason = getattr(exc, "reason", exc)
    if isinstance(exc, urllib.error.HTTPError) or isinstance(reason, ssl.SSLError):
        return None  # a server answered (with an error status, or at least a TLS handshake)
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, TimeoutError | socket.timeout):
        return f"no answer within {timeout:g} s"
    if isinstance(reason, socket.gaierror):
        return f"unknown host: {reason.strerror or reason}"
    return str(reason) or type(reason).__name__


def check_reachable(uri: str, timeout: float = PROBE_TIMEOUT_S, key: str = "tracker.uri") -> None:
    """Fail fast when no server answers at an ``http(s)://`` tracking URI.

    Sends ``GET <uri>/health`` (MLflow's health check) with ``timeout``; any HTTP answer,
    error statuses included (authentication, a proxy), counts as reachable and is left to
    MLflow. Other URIs (SQLite, files, Databricks) are not probed.

    Raises:
        TrackerError: nothing answered, with the URI, the reason and what to do.
    """
    if not uri.lower().startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            return
    except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
        why = _why(exc, timeout)
    if why is None:
        return
    parts = urlsplit(uri)
    start = f"mlflow server --host {parts.hostname or '127.0.0.1'}"
    if parts.port:
        start += f" --port {parts.port}"
    raise TrackerError(
        f"{key}={uri}: no MLflow server answers ({why}); start one with `{start}`, "
        "or use tracker=none (or a local store, e.g. tracker.uri=sqlite:///mlflow.db)"
    )


def _blocking_file(path: Path) -> Path | None:
    """The first of ``path`` and its parents, from the root down, that exists but is no folder."""
    for part in (*reversed(path.parents), path):
        if part.exists() and not part.is_dir():
            return part
    return None


def _sqlite_problem(db: Path) -> str | None:
    """What makes ``db`` unusable as a SQLite store (creating its folder if needed), or None."""
    folder = db.parent
    if db.is_dir():
        return f"{db} is a folder, expected the database file (e.g. {db / 'mlflow.db'})"
    blocking = _blocking_file(folder)
    if blocking is not None:
        return f"{blocking} is a file, expected a folder to hold the database {db.name}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        there = next((p for p in folder.parents if p.is_dir()), Path("."))
        return (
            f"cannot create the folder {folder} for the database in {there} "
            f"({exc.strerror or exc}), expected a folder that can be written"
        )
    try:  # SQLite creates a journal beside the database, and fedexp its lock file
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return (
            f"the folder {folder} is not writable ({exc.strerror or exc}), expected one where "
            "the database, its journal and its lock file can be written"
        )
    lock = db.with_name(db.name + ".lock")
    if lock.exists() and not lock.is_file():
        return f"{lock} is not a file, expected the lock file of the database {db.name}"
    if not db.exists():
        return None
    try:
        with open(db, "r+b") as fh:
            head = fh.read(len(_SQLITE_HEADER))
    except OSError as exc:
        return f"the database {db} cannot be written ({exc.strerror or exc})"
    if head and head != _SQLITE_HEADER:
        return f"{db} is not a SQLite database, expected one (or no file, for a new store)"
    return None


def check_sqlite_path(uri: str, key: str = "tracker.uri") -> Path | None:
    """Make sure a local ``sqlite:///`` store can be opened; creates its folder if needed.

    Returns:
        The database file, or None for another kind of URI, or an in-memory database
        (nothing checked).

    Raises:
        TrackerError: a part of the path is a file, the database is a folder (or not a SQLite
            file), or its folder cannot be created or written; one line naming ``key``, the
            path in the way and what was expected.
    """
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]  # SQLAlchemy's options follow a ?
    if path in ("", ":memory:"):
        return None
    db = Path(path)
    problem = _sqlite_problem(db)
    if problem is not None:
        raise TrackerError(f"{key}={uri}: {problem}")
    return db
