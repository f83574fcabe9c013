"""Helpers shared by the Luna16 and BraTS converters.

Everything here writes *inside* the output folder only, and always through a temporary name
followed by an atomic :func:`os.replace`, so an interrupted run never leaves a half-written
``images.npy`` or study cache behind. :func:`prepare_out` refuses an output folder that is a
symlink or holds a symlink where a converter writes, and file names inside it are built from
fixed names and :func:`safe_id` only, so nothing is ever written outside ``--out``.

Bad inputs follow one rule: a problem confined to one study (or one row of a candidate list)
is recorded in a :class:`RunLog` (one line naming the file and what was expected), the study is
skipped and the run goes on; ``OUT/skipped.csv`` lists what was skipped and why. Only when
nothing usable remains does a converter stop, with one ``error: ...`` line and exit status 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn
from rich.progress import MofNCompleteColumn
from rich.progress import Progress
from rich.progress import TextColumn
from rich.progress import TimeElapsedColumn
from rich.progress import TimeRemainingColumn

from fedexp.errors import DataError

STUDIES_DIR = "studies"
"""Sub-folder of the output folder holding one ``.npz`` per converted study (resume cache)."""

SKIPPED_CSV = "skipped.csv"
"""Output file listing what was skipped (``path,reason``); only written when something was."""

_TMP_PREFIX = ".partial-"
_ECHO_LIMIT = 20
"""Skip messages echoed on the console per run; the rest are only in ``skipped.csv``."""


@dataclass(frozen=True)
class Skip:
    """A study or file that could not be converted.

    Attributes:
        path: The offending file or folder.
        reason: One-line human-readable reason.
    """

    path: str
    reason: str


class StudyError(DataError):
    """A study cannot be converted because of one of its files (fedexp's :class:`DataError`).

    Args:
        path: The offending file.
        reason: One-line reason.
    """

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


@dataclass
class RunLog:
    """Counters and skip records collected during one conversion run.

    Attributes:
        skipped: Studies (or files) that were skipped, with reasons.
        converted: Number of studies converted in this run.
        reused: Number of studies taken from the resume cache.
    """

    skipped: list[Skip] = field(default_factory=list)
    converted: int = 0
    reused: int = 0

    def skip(self, path: Path | str, reason: str, console: Console | None = None) -> None:
        """Record a skipped study and echo it on the console.

        Args:
            path: The file or folder that failed.
            reason: Why it was skipped.
            console: Where to print the message; nothing is printed when ``None``.
        """
        self.skipped.append(Skip(str(path), reason))
        if console is None:
            return
        if len(self.skipped) <= _ECHO_LIMIT:
            console.print(
                f"[yellow]skipped[/yellow] {path}: {reason}", highlight=False, soft_wrap=True
            )
        elif len(self.skipped) == _ECHO_LIMIT + 1:
            console.print(f"[yellow]skipped[/yellow] more; all are listed in {SKIPPED_CSV}")

    def reasons(self) -> dict[str, int]:
        """Number of skips per kind of reason (the text before the reason's first colon)."""
        reasons: dict[str, int] = {}
        for item in self.skipped:
            key = item.reason.split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
        return reasons

    def as_dict(self) -> dict[str, Any]:
        """Return the log as a JSON-serialisable dict (for ``summary.json``)."""
        return {
            "studies_converted": self.converted,
            "studies_reused": self.reused,
            "n_skipped": len(self.skipped),
            "skipped_by_reason": self.reasons(),
            "skipped": [asdict(s) for s in self.skipped],
        }


def one_line(exc: BaseException, limit: int = 240) -> str:
    """Condense an exception (ITK errors span several lines) into one short line.

    Args:
        exc: The exception.
        limit: Maximum number of characters kept.

    Returns:
        ``"<ExceptionType>: <message>"`` on one line.
    """
    text = " ".join(str(exc).split())
    match = re.search(r"Reason: (.*)", text)
    if match:
        text = match.group(1)
    return f"{type(exc).__name__}: {text}"[:limit]


def console_for(quiet: bool) -> Console:
    """Return a stderr console (silenced when ``quiet``)."""
    return Console(stderr=True, quiet=quiet)


def progress_bar(console: Console) -> Progress:
    """Build the rich progress bar used by all converters."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=console.quiet,
    )


def require_dir(path: Path, what: str) -> Path:
    """Fail with a one-line message unless ``path`` is an existing directory.

    Args:
        path: Folder to check.
        what: What the folder is supposed to be (used in the message).

    Returns:
        The resolved path.

    Raises:
        SystemExit: If the folder does not exist.
    """
    if not path.is_dir():
        raise SystemExit(f"error: {what} {path} does not exist or is not a directory")
    return path.resolve()


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:  # pragma: no cover - raced away
        return "?"


def prepare_out(out: Path, root: Path, names: Sequence[str] = ()) -> Path:
    """Create the output folder, refusing anything that would write outside it.

    Refused, each with one line: an output folder that is a symlink (even to a folder), that
    exists as a file, that is ``root`` or lies inside it, or that holds a symlink in a place the
    converter writes to (``studies/``, one of ``names``, ``skipped.csv`` or a cached study
    ``studies/*.npz``). Symlinks *above* ``out`` are the user's file system and are followed.

    Args:
        out: Output folder (created if missing).
        root: Raw data folder (resolved).
        names: Fixed file names the converter writes in ``out``.

    Returns:
        The resolved output folder.

    Raises:
        SystemExit: On any of the above, or if the folder cannot be created.
    """
    out = Path(out).absolute()
    if out.is_symlink():
        raise SystemExit(
            f"error: output folder {out} is a symlink (to {_link_target(out)}); "
            "data_prep writes only into a real folder: give the folder itself"
        )
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: output folder {out} exists and is not a directory")
    out = out.resolve()
    if out == root or root in out.parents:
        raise SystemExit(f"error: output folder {out} must not lie inside the raw folder {root}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"error: cannot create output folder {out}: {one_line(exc)}") from exc
    studies = out / STUDIES_DIR
    written = [studies, *(out / name for name in (*names, SKIPPED_CSV))]
    if studies.is_dir() and not studies.is_symlink():
        written += sorted(studies.glob("*.npz"))
    for path in written:
        if path.is_symlink():
            raise SystemExit(
                f"error: {path} is a symlink (to {_link_target(path)}); data_prep writes only "
                f"inside {out} and will not write through it: remove the link"
            )
    return out


def file_stamp(paths: Iterable[Path]) -> str:
    """Identify input files by name, size and modification time (for the resume cache).

    Missing files are stamped as such, so a study is recomputed once they appear.
    """
    parts = []
    for path in paths:
        try:
            stat = path.stat()
            parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
        except OSError:
            parts.append(f"{path.name}:missing")
    return "|".join(parts)


def fingerprint(params: Mapping[str, Any]) -> str:
    """Stable short hash of conversion parameters (used to invalidate the resume cache)."""
    blob = json.dumps(params, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


def _tmp_name(target: Path) -> Path:
    return target.with_name(f"{_TMP_PREFIX}{os.getpid()}-{target.name}")


@contextmanager
def atomic_path(target: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; rename it onto ``target`` on success.

    Args:
        target: Final file path.

    Yields:
        The temporary path to write to. It is removed if the body raises.
    """
    tmp = _tmp_name(target)
    if tmp.is_symlink() or tmp.exists():  # never write through a planted temporary name
        tmp.unlink()
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json(target: Path, data: Mapping[str, Any]) -> None:
    """Atomically write ``data`` as indented JSON."""
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def write_csv(target: Path, frame: pd.DataFrame) -> None:
    """Atomically write a data frame as CSV without the index."""
    with atomic_path(target) as tmp:
        frame.to_csv(tmp, index=False)


def cleanup_partials(out: Path) -> None:
    """Remove temporary files left in ``out`` by an interrupted earlier run."""
    for folder in (out, out / STUDIES_DIR):
        if folder.is_dir() and not folder.is_symlink():
            for leftover in folder.glob(f"{_TMP_PREFIX}*"):
                leftover.unlink()


def write_skipped(out: Path, log: RunLog) -> Path:
    """Write ``OUT/skipped.csv`` (``path,reason``) or remove a stale one when nothing was skipped.

    Returns:
        The path of ``skipped.csv``.
    """
    target = out / SKIPPED_CSV
    if log.skipped:
        rows = [asdict(item) for item in log.skipped]
        write_csv(target, pd.DataFrame(rows, columns=["path", "reason"]))
    elif target.is_file() or target.is_symlink():
        target.unlink()
    return target


def finish_run(
    out: Path, log: RunLog, summary: dict[str, Any], count: int, what: str, console: Console
) -> dict[str, Any]:
    """A converter's last writes: ``skipped.csv``, ``summary.json`` (with ``out``), one line.

    Returns:
        ``summary``, its ``out`` set.
    """
    summary["out"] = str(out)
    write_skipped(out, log)
    write_json(out / "summary.json", summary)
    console.print(f"[green]wrote[/green] {count} {what} to {out}", highlight=False)
    return summary


def skip_line(summary: Mapping[str, Any], out: Path) -> str | None:
    """One stderr line counting what a finished run skipped, or ``None`` if nothing was."""
    if not summary.get("n_skipped"):
        return None
    kinds = ", ".join(f"{n} {kind}" for kind, n in summary["skipped_by_reason"].items())
    return f"skipped {summary['n_skipped']} ({kinds}); details in {out / SKIPPED_CSV}"


def nothing_usable(out: Path, log: RunLog, what: str) -> SystemExit:
    """Write ``skipped.csv`` and build the one-line error of a run with nothing usable left.

    The final arrays are not written, so the outputs of an earlier run stay as they were.

    Args:
        out: Output folder.
        log: The run's skip records.
        what: What is missing, e.g. ``"all 3 volumes were skipped"``.

    Returns:
        The exception to raise (exit status 1).
    """
    target = write_skipped(out, log)
    if not log.skipped:
        return SystemExit(f"error: nothing to convert: {what}")
    first = log.skipped[0]
    return SystemExit(
        f"error: nothing to convert: {what}; first: {first.path}: {first.reason} "
        f"({len(log.skipped)} skipped, listed in {target})"
    )


def id_problem(study_id: str) -> str | None:
    """Why a study id (file stem, folder name, CSV value) cannot name a study, or ``None``.

    Ids become file names inside ``OUT/studies``; ids with a path separator, ``..``, control
    characters or nothing at all are refused rather than sanitised, so that a malicious
    ``../../evil`` can never even look like a path.
    """
    if not study_id.strip():
        return "empty id"
    if "/" in study_id or "\\" in study_id or ".." in study_id:
        return f"{study_id!r} contains a path separator or '..'"
    if any(ord(ch) < 32 for ch in study_id):
        return f"{study_id!r} contains control characters"
    return None


def safe_id(study_id: str) -> str:
    """Turn a study id into a safe, distinct file name (keeps letters, digits, ``._-``).

    An id that needed any replacement gets a short hash of the original, so two ids never share
    a cache file; the result never contains a path separator and never starts with a dot.
    """
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", study_id).replace("..", "__")
    if cleaned != study_id or not cleaned or cleaned.startswith("."):
        digest = hashlib.sha1(study_id.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        cleaned = f"_{cleaned.lstrip('.')}-{digest}"
    return cleaned


class StudyCache:
    """Per-study ``.npz`` results inside ``OUT/studies`` that make a conversion resumable.

    A cached study is reused only when it was produced with the same parameter fingerprint;
    otherwise it is recomputed and overwritten.

    Args:
        out: Output folder.
        params: Parameters that influence a study's result.
    """

    def __init__(self, out: Path, params: Mapping[str, Any]) -> None:
        self.folder = out / STUDIES_DIR
        self.folder.mkdir(exist_ok=True)
        self.params = dict(params)

    def _path(self, study_id: str) -> Path:
        return self.folder / f"{safe_id(study_id)}.npz"

    def _key(self, tag: str) -> str:
        return fingerprint({**self.params, "_study_tag": tag})

    def load(
        self, study_id: str, tag: str = "", keys: Sequence[str] | None = None
    ) -> dict[str, np.ndarray] | None:
        """Return the cached arrays of a study, or ``None`` if absent, stale or unreadable.

        Args:
            study_id: Study identifier (series UID, patient name).
            tag: Per-study part of the fingerprint (e.g. a hash of the study's inputs).
            keys: Arrays to read (all when ``None``).
        """
        path = self._path(study_id)
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                if str(data["_fingerprint"]) != self._key(tag):
                    return None
                wanted = [k for k in data.files if k != "_fingerprint"] if keys is None else keys
                return {k: data[k] for k in wanted}
        except (OSError, ValueError, KeyError, EOFError):
            return None

    def save(self, study_id: str, arrays: Mapping[str, np.ndarray], tag: str = "") -> None:
        """Atomically store a study's arrays together with the parameter fingerprint."""
        with atomic_path(self._path(study_id)) as tmp, open(tmp, "wb") as handle:
            np.savez(handle, _fingerprint=np.array(self._key(tag)), **arrays)


def write_stacked(
    target: Path, parts: Iterable[np.ndarray], shape: Sequence[int], dtype: Any
) -> None:
    """Stream arrays into one ``.npy`` file (memory-mapped, so it may exceed RAM).

    Args:
        target: Final ``.npy`` path.
        parts: Arrays concatenated along axis 0.
        shape: Shape of the final array.
        dtype: Its dtype.

    Raises:
        ValueError: If the parts do not fill ``shape`` exactly.
    """
    with atomic_path(target) as tmp:
        array = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=tuple(shape))
        start = 0
        for part in parts:
            array[start : start + len(part)] = part
            start += len(part)
        if start != shape[0]:
            raise ValueError(f"expected {shape[0]} rows, wrote {start}")
        array.flush()
        del array
