"""MetaImage (``.mhd``) headers read strictly, before ITK opens them.

ITK's MetaIO follows a header's ``ElementDataFile`` wherever it points (a relative path, an
absolute one, a ``LIST`` of files, a ``%d`` pattern), so a header planted in a data folder can
make the converter read any file of the machine. :func:`mhd_problem` parses the header the
way MetaIO does (the first ``ElementDataFile``; ``Key = Value`` lines only), works out every
file ITK would open (:func:`mhd_data_files`) and refuses one that lies outside ``--root`` after
symlinks are resolved, or that disagrees with the header's sizes.
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from data_prep.common import StudyError
from data_prep.common import one_line

_MET_BYTES = {
    "MET_CHAR": 1,
    "MET_UCHAR": 1,
    "MET_SHORT": 2,
    "MET_USHORT": 2,
    "MET_INT": 4,
    "MET_UINT": 4,
    "MET_FLOAT": 4,
    "MET_LONG_LONG": 8,
    "MET_ULONG_LONG": 8,
    "MET_DOUBLE": 8,
}
_HEADER_KEY = re.compile(r"[ \t]*([A-Za-z_][A-Za-z0-9_.\-]*)[ \t]*=(.*)")
"""A MetaImage header line ``Key = Value`` (the key as MetaIO reads it: up to ``=``)."""
_HEADER_FORM = "(expected 'Key = Value' lines up to ElementDataFile, as ITK writes them)"
_MAX_HEADER_LINE = 480
"""Longest header line accepted, in bytes (MetaIO reads at most 499 characters a value)."""
_MAX_HEADER_LINES = 1000
_MAX_LIST_LINE = 4096
_MAX_LIST_LINES = 1_000_000


def _header_line(path: Path, number: int, raw: bytes) -> str:
    """One header line as text without its line break, or a StudyError saying why not."""
    body = raw[:-1] if raw.endswith(b"\n") else raw
    body = body[:-1] if body.endswith(b"\r") else body
    if len(body) > _MAX_HEADER_LINE:
        reason = f"line {number} is longer than {_MAX_HEADER_LINE} bytes"
    else:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            reason = f"line {number} is not UTF-8 text"
        else:
            if not any(unicodedata.category(ch) == "Cc" and ch != "\t" for ch in text):
                return text
            reason = f"line {number} holds control characters"
    raise StudyError(path, f"unreadable header: {reason} {_HEADER_FORM}")


def _list_lines(path: Path, handle: BinaryIO, after: int) -> list[tuple[int, str]]:
    """The file names that follow ``ElementDataFile = LIST``, one a line, to the end of file."""
    names: list[tuple[int, str]] = []
    blank_at = 0
    for number in range(after + 1, after + 1 + _MAX_LIST_LINES):
        raw = handle.readline(_MAX_LIST_LINE + 3)
        if not raw:
            return names
        body = raw.rstrip(b"\r\n")
        try:
            text = body.decode("ascii")
        except UnicodeDecodeError:
            text = "\x00"
        if len(body) > _MAX_LIST_LINE or not text.isprintable():
            reason = f"LIST line {number} is not a printable ASCII file name"
            raise StudyError(path, f"unsupported ElementDataFile: {reason}")
        name = text.rstrip()
        if not name:
            blank_at = blank_at or number
            continue
        if blank_at:
            reason = f"LIST line {blank_at} is empty (expected one data file name a line)"
            raise StudyError(path, f"unsupported ElementDataFile: {reason}")
        names.append((number, name))
    raise StudyError(
        path, f"unsupported ElementDataFile: LIST of more than {_MAX_LIST_LINES} lines"
    )


def read_mhd_header(path: Path) -> tuple[dict[str, str], list[tuple[int, str]]]:
    """Read a MetaImage header as ITK's MetaIO does, strictly, without executing anything.

    MetaIO stops at the *first* ``ElementDataFile`` and also takes ``:`` as a separator, a
    carriage return as the end of a key and leading ``=``/``:`` as part of the separator; a
    lenient reader would then check another data file than the one ITK opens. So every line up
    to ``ElementDataFile`` must be a plain ``Key = Value`` line (or blank), anything else is
    refused; the value loses leading blanks, ``=`` and ``:`` and trailing blanks, like MetaIO's.

    Args:
        path: ``.mhd`` header.

    Returns:
        The fields up to and including the first ``ElementDataFile`` (a later repeat of a key
        wins, as in MetaIO) and, for ``ElementDataFile = LIST``, the file names of the lines
        that follow with their line numbers.

    Raises:
        StudyError: ``unreadable header: ...`` naming the offending line, or ``unsupported
            ElementDataFile: ...`` for a malformed LIST.
    """
    fields: dict[str, str] = {}
    with open(path, "rb") as handle:
        for number in range(1, _MAX_HEADER_LINES + 1):
            raw = handle.readline(_MAX_HEADER_LINE + 3)
            if not raw:
                return fields, []
            line = _header_line(path, number, raw)
            if not line.strip(" \t"):
                continue
            match = _HEADER_KEY.fullmatch(line)
            if match is None:
                shown = line if len(line) <= 60 else f"{line[:57]}..."
                reason = f"line {number} {shown!r} is not a 'Key = Value' line"
                raise StudyError(path, f"unreadable header: {reason} {_HEADER_FORM}")
            key, value = match.group(1), match.group(2).lstrip(" \t=:").rstrip(" \t")
            fields[key] = value
            if key == "ElementDataFile":
                listed = _list_lines(path, handle, number) if value.startswith("LIST") else []
                return fields, listed
    reason = f"no ElementDataFile in the first {_MAX_HEADER_LINES} lines"
    raise StudyError(path, f"unreadable header: {reason} {_HEADER_FORM}")


def _opened_as(header: Path, name: str) -> Path:
    r"""The path MetaIO opens for a data file ``name`` given in ``header``.

    A name that starts with ``/`` or ``~`` counts as a full path (``~`` is *not* expanded:
    it is a folder of the current directory); any other is appended to the header's folder
    (the text up to the last ``/`` or ``\``), without resolving ``..`` or symlinks.
    """
    text = str(header)
    cut = max(text.rfind("/"), text.rfind("\\"))
    if name.startswith(("/", "~")) or cut < 0:
        return Path.cwd() / name
    return Path(text[: cut + 1] + name)


def _digits(words: Sequence[str]) -> list[int]:
    """Whole numbers ≥ 0 written with digits only (MetaIO would take ``atof`` of anything)."""
    if not all(word.isascii() and word.isdigit() for word in words):
        raise ValueError(f"{' '.join(words)!r} are not whole numbers ≥ 0")
    return [int(word) for word in words]


def _c_div(a: int, b: int) -> int:
    """C's integer division (truncates toward zero), as MetaIO computes its step."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _pattern_names(value: str, slices: int) -> list[str]:
    """The file names of ``ElementDataFile = <printf pattern> [min [max [step]]]`` (MetaIO).

    Only one ``%d`` conversion (``%d``, ``%3d``, ``%03d``; ``%%`` is a literal ``%``) and whole
    numbers are supported: ITK formats the name with C's ``snprintf``, where another
    conversion reads memory, and a step of 0 makes it loop forever or divide by zero.

    Raises:
        ValueError: what is not supported.
    """
    words = [word for word in value.split(" ") if word]
    pattern = words[0]
    if len(words) >= 5:
        pattern = " ".join(words[:-3])
        low, high, step = _digits(words[-3:])
    else:
        numbers = _digits(words[1:])
        low, high, step = 1, slices, 1
        if len(numbers) >= 1:
            low = numbers[0]
            high = low + slices - 1
        if len(numbers) >= 2:
            high = numbers[1]
            step = _c_div(high - low, slices)
        if len(numbers) >= 3:
            step = numbers[2]
    parts = re.split(r"(%%|%0?[0-9]{0,2}d)", pattern)
    conversions = [part for part in parts[1::2] if part != "%%"]
    if len(conversions) != 1 or any("%" in part for part in parts[0::2]):
        raise ValueError("expected exactly one %d conversion such as %03d in the file name")
    if step <= 0:
        raise ValueError(f"step {step} (from {value!r}); expected a step ≥ 1")
    if 1 + _c_div(high - low, step) > slices:
        high = (slices - 1) * step + low

    def name(i: int) -> str:
        return "".join(
            ("%" if part == "%%" else part % i) if k % 2 else part for k, part in enumerate(parts)
        )

    names = [name(i) for i in range(low, high + 1, step)]
    if len(names) != slices:
        raise ValueError(f"names {len(names)} files for the {slices} slices of DimSize")
    return names


def mhd_data_files(
    path: Path, header: dict[str, str], listed: list[tuple[int, str]], dims: list[int]
) -> list[tuple[str, Path]]:
    """The data files ITK reads for a header, as ``(how the header names it, path)``.

    ``LOCAL`` data follow the header in the same file (none listed); ``LIST [dim]`` names one
    file a line after the header; a name with ``%`` is a printf pattern over the last axis;
    any other name is one file. Paths are as MetaIO opens them (see :func:`_opened_as`).

    Raises:
        StudyError: ``unsupported ElementDataFile: ...`` for a form that is not supported.
    """
    value = header["ElementDataFile"]
    named = f"ElementDataFile {value!r}"
    if not (value.isascii() and value.isprintable()):
        reason = f"{value!r} (expected a printable ASCII file name, LOCAL, LIST or a %d pattern)"
        raise StudyError(path, f"unsupported ElementDataFile: {reason}")
    if value in ("Local", "LOCAL", "local"):
        return []
    if value.startswith("LIST"):
        words = [word for word in value.split(" ") if word]
        try:
            file_dim = _digits(words[1:2])[0] if len(words) > 1 else len(dims) - 1
        except ValueError:
            reason = f"unsupported ElementDataFile: {value!r} (expected LIST or LIST <dim>)"
            raise StudyError(path, reason) from None
        if not 0 < file_dim < len(dims):
            file_dim = len(dims) - 1
        needed = int(np.prod(dims[file_dim:]))
        if len(listed) < needed:
            reason = (
                f"unsupported ElementDataFile: LIST names {len(listed)} file(s) after the "
                f"header, DimSize {header['DimSize']} needs {needed}"
            )
            raise StudyError(path, reason)
        return [(f"{named}, line {n} {name!r}", _opened_as(path, name)) for n, name in listed]
    if "%" in value:
        try:
            names = _pattern_names(value, dims[-1])
        except ValueError as exc:
            raise StudyError(path, f"unsupported ElementDataFile: {value!r} ({exc})") from None
        return [(f"{named} file {name!r}", _opened_as(path, name)) for name in names]
    if not value:
        raise StudyError(path, "unsupported ElementDataFile: empty (expected a data file name)")
    return [(named, _opened_as(path, value))]


def _outside(root: Path, file: Path) -> Path | None:
    """Where ``file`` really is (symlinks and ``..`` resolved) if that is outside ``root``."""
    real = Path(os.path.realpath(file))
    return None if real == root or root in real.parents else real


def mhd_problem(path: Path, root: Path | None = None) -> StudyError | None:
    """Check a MetaImage header and its data file before handing them to ITK.

    ITK reports a truncated or missing ``.raw`` as "No such file or directory"; this check
    gives the real reason. ITK also follows ``ElementDataFile`` anywhere (``../x.raw``, an
    absolute path, a symlink); a header or data file whose real path (symlinks resolved) is
    not under ``root`` is refused, like every other path that would leave ``--root``.

    Args:
        path: ``.mhd`` header.
        root: The raw folder every file read must lie under; ``None``: the header's folder.

    Returns:
        The problem (offending file and one-line reason) or ``None`` if the study looks fine.
    """
    root = Path(os.path.realpath(path.parent if root is None else root))
    real = _outside(root, path)
    if real is not None:
        reason = f"header outside root: {path} resolves to {real}; it must lie under --root {root}"
        return StudyError(path, reason)
    try:
        header, listed = read_mhd_header(path)
    except StudyError as exc:
        return exc
    except OSError as exc:
        return StudyError(path, f"unreadable header: {one_line(exc)}")
    data_name = header.get("ElementDataFile")
    if data_name is None or "DimSize" not in header:
        return StudyError(path, "unreadable header: no ElementDataFile/DimSize")
    try:
        dims = [int(v) for v in header["DimSize"].split()]
        channels = int(header.get("ElementNumberOfChannels", "1"))
        offset = int(header.get("HeaderSize", "0"))
        n_dims = int(header.get("NDims", str(len(dims))))
    except ValueError:
        return StudyError(
            path,
            f"unreadable header: DimSize {header['DimSize']!r} / NDims / HeaderSize "
            "(expected integers)",
        )
    if not dims or min(dims) < 1 or channels < 1:
        return StudyError(path, f"unreadable header: DimSize {header['DimSize']!r} (expected > 0)")
    if n_dims != len(dims):
        reason = f"header disagrees with itself: NDims {n_dims} but DimSize {header['DimSize']!r}"
        return StudyError(path, reason)
    try:
        files = mhd_data_files(path, header, listed, dims)
    except StudyError as exc:
        return exc
    for named, data_path in files:
        real = _outside(root, data_path)
        if real is not None:
            reason = (
                f"data file outside root: {named} resolves to {real}; the data file must lie "
                f"under --root {root}"
            )
            return StudyError(path, reason)
    for _, data_path in files:
        if not data_path.is_file():
            return StudyError(data_path, f"missing data file: {data_path}")
    if len(files) != 1 or "%" in data_name or data_name.startswith("LIST"):
        return None
    data_path = files[0][1]
    if header.get("CompressedData", "False")[:1] in ("T", "t", "1"):
        return None  # MetaIO's test: compressed when the value starts with T, t or 1
    n_bytes = _MET_BYTES.get(header.get("ElementType", ""))
    if n_bytes is None:
        return None
    expected = int(np.prod(dims)) * channels * n_bytes
    actual = data_path.stat().st_size
    needed = expected + max(offset, 0)
    what = f"DimSize {header['DimSize']} x {header['ElementType']} = {expected} bytes"
    if actual < needed:
        reason = f"truncated data file: {data_path} has {actual} of {needed} bytes ({what})"
        return StudyError(data_path, reason)
    if offset >= 0 and actual > needed:
        reason = (
            f"header disagrees with data: {path.name} says {what}"
            f"{f' after {offset} header bytes' if offset else ''}, but {data_path} has {actual}"
        )
        return StudyError(data_path, reason)
    return None
