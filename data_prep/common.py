"""Helpers shared by the Luna16 and BraTS converters.

Everything here writes *inside* the output folder only, and always through a temporary name
followed by an atomic :func:`os.replace`, so an interrupted run never leaves a half-written
``images.npy`` or study cache behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

STUDIES_DIR = "studies"
"""Sub-folder of the output folder holding one ``.npz`` per converted study (resume cache)."""

_TMP_PREFIX = ".partial-"


@dataclass(frozen=True)
class Skip:
    """A study or file that could not be converted.

    Attributes:
        path: The offending file or folder.
        reason: One-line human-readable reason.
    """

    path: str
    reason: str


class StudyError(Exception):
    """A study cannot be converted because of one of its files.

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
        if console is not None:
            console.print(
                f"[yellow]skipped[/yellow] {path}: {reason}", highlight=False, soft_wrap=True
            )

    def as_dict(self) -> dict[str, Any]:
        """Return the log as a JSON-serialisable dict (for ``summary.json``)."""
        reasons: dict[str, int] = {}
        for item in self.skipped:
            key = item.reason.split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
        return {
            "studies_converted": self.converted,
            "studies_reused": self.reused,
            "n_skipped": len(self.skipped),
            "skipped_by_reason": reasons,
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


def prepare_out(out: Path, root: Path) -> Path:
    """Create the output folder, refusing to write inside the raw data folder.

    Args:
        out: Output folder (created if missing).
        root: Raw data folder.

    Returns:
        The resolved output folder.

    Raises:
        SystemExit: If ``out`` is ``root`` or lies inside it.
    """
    out = out.resolve()
    if out == root or root in out.parents:
        raise SystemExit(f"error: output folder {out} must not lie inside the raw folder {root}")
    out.mkdir(parents=True, exist_ok=True)
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
        if folder.is_dir():
            for leftover in folder.glob(f"{_TMP_PREFIX}*"):
                leftover.unlink()


def safe_id(study_id: str) -> str:
    """Turn a study id into a safe file name (keeps letters, digits, ``._-``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", study_id)


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


def extract_patch(plane: np.ndarray, row0: int, col0: int, size: int, fill: float) -> np.ndarray:
    """Cut a ``size``×``size`` window out of a 2-D (or channels-first 3-D) array, padding.

    Parts of the window that fall outside ``plane`` are filled with ``fill``.

    Args:
        plane: Array of shape ``(H, W)`` or ``(C, H, W)``.
        row0: Top row of the window (may be negative).
        col0: Left column of the window (may be negative).
        size: Window side length.
        fill: Padding value.

    Returns:
        The window, shape ``(size, size)`` or ``(C, size, size)``, same dtype as ``plane``.
    """
    height, width = plane.shape[-2:]
    patch = np.full((*plane.shape[:-2], size, size), fill, dtype=plane.dtype)
    r0, r1 = max(row0, 0), min(row0 + size, height)
    c0, c1 = max(col0, 0), min(col0 + size, width)
    if r0 < r1 and c0 < c1:
        patch[..., r0 - row0 : r1 - row0, c0 - col0 : c1 - col0] = plane[..., r0:r1, c0:c1]
    return patch
