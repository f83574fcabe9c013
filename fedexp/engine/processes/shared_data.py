"""The data set of a run over several ranks: loaded once, by rank 0, and mapped by the others.

A rank keeps only its own clients' rows
(:meth:`fedexp.engine.clients.pool.ClientTable.build`), but a
loader reads, or for the synthetic table draws, the data set whole. When every rank loaded it,
P ranks on one machine held P copies of the whole table while their clients' tables were built
(at 10^6 clients of 10 rows and 30 features, 1.2 GB each).

Now rank 0 alone loads it and writes its arrays as ``.npy`` files (NumPy's own format, read
back with ``allow_pickle=False``: nothing is unpickled) to a fresh folder, with its other
fields and a random token in ``meta.json`` (a scratch folder that names its owner, so that a
rank 0 killed before it removes the folder leaves it to the next run's reaper,
:func:`fedexp.engine.clients.states.owned_folder`). Each rank that finds that folder with the token
(every rank on rank 0's machine, or all of them when ``store_dir`` is on a file system they
share) memory-maps the arrays; one that does not (another node) loads the data set itself, as
before. Rank 0 maps the files too and drops its own copy. Once every rank has said which it
did, rank 0 removes the folder: the mapped files stay readable, unnamed, until the ranks let
them go, and the pages of one copy serve every rank of the machine.

A data set whose arrays are memory-mapped already (the prepared image arrays) is loaded by
each rank from its own files. A user's error in the data set's config or files is met by rank
0 and passed on, so every rank stops with the same message.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import secrets
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from fedexp import errors
from fedexp.config.instantiate import instantiate_checked
from fedexp.data.dataset import ArrayDataset
from fedexp.engine.clients.states import owned_folder, release_scratch
from fedexp.engine.processes.ranks import Ranks
from fedexp.errors import DataError, FedexpError

META = "meta.json"


def load_dataset(node: DictConfig, ranks: Ranks | None, folder: str | None = None) -> ArrayDataset:
    """The run's data set (the ``dataset`` config ``node``), once per machine over ranks.

    Args:
        node: the ``dataset`` config.
        ranks: this process's rank, or None for a run in one process (it loads the data set).
        folder: where rank 0 writes the arrays (``store_dir``); None: the system's temp folder.

    Raises:
        FedexpError: the data set's config or files are wrong (on every rank: rank 0's).
    """
    if ranks is None:
        return instantiate_checked(node, "dataset")
    if ranks.leader:
        return _lead(node, ranks, folder)
    return _follow(node, ranks)


def _lead(node: DictConfig, ranks: Ranks, folder: str | None) -> ArrayDataset:
    try:
        data = instantiate_checked(node, "dataset")
    except FedexpError as exc:
        ranks.gather_json({"error": str(exc), "kind": type(exc).__name__})
        raise
    except BaseException:
        ranks.gather_json({"error": None})
        raise
    written = _write(data, folder) if not mapped(data.x) else None
    if written is None:  # mapped already, or no room to write: every rank loads its own
        ranks.gather_json({"own": True})
        return data
    where, token = written
    ranks.gather_json({"folder": str(where), "token": token})
    try:
        shared = _open(where, token)
        ranks.gather_json(shared is not None)  # every rank has mapped the files, or loaded
    finally:
        release_scratch(where)
    return data if shared is None else shared


def _follow(node: DictConfig, ranks: Ranks) -> ArrayDataset:
    told = ranks.gather_json(None)[0]
    if "error" in told:
        if told["error"] is None:
            raise RuntimeError("rank 0 failed to load the data set (its traceback says why)")
        kind = getattr(errors, told.get("kind", ""), None)  # rank 0's class: the same handling
        if not (isinstance(kind, type) and issubclass(kind, FedexpError)):
            kind = DataError
        raise kind(told["error"])
    if told.get("own"):
        return instantiate_checked(node, "dataset")
    shared = _open(Path(told["folder"]), told["token"])
    ranks.gather_json(shared is not None)
    return shared if shared is not None else instantiate_checked(node, "dataset")


def mapped(array: np.ndarray) -> bool:
    """Whether ``array`` (or what it views) is a memory-mapped file."""
    base: Any = array
    while base is not None:
        if isinstance(base, np.memmap | mmap.mmap):
            return True
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return False


def _write(data: ArrayDataset, folder: str | None) -> tuple[Path, str] | None:
    """``data``'s arrays as ``.npy`` files and its other fields in :data:`META`, in a new folder.

    Returns the folder and the token :data:`META` holds.

    None (and nothing left behind) when a field is neither an array nor JSON, or the files
    cannot be written (no room, no such folder): then each rank loads the data set itself.
    """
    arrays, fields = {}, {}
    for f in dataclasses.fields(data):
        value = getattr(data, f.name)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                return None
            arrays[f.name] = value
        else:
            fields[f.name] = value
    where, token = None, secrets.token_hex(16)
    try:
        where = owned_folder(folder)  # (a rank 0 killed before it removes it: reaped later)
        for name, value in arrays.items():
            np.save(where / f"{name}.npy", value, allow_pickle=False)
        meta = {"token": token, "fields": fields, "arrays": sorted(arrays)}
        (where / META).write_text(json.dumps(meta))  # last: a folder without it is not read
    except (OSError, TypeError, ValueError):
        if where is not None:
            release_scratch(where)
        return None
    return where, token


def _open(where: Path, token: str) -> ArrayDataset | None:
    """The data set of rank 0's folder, its arrays memory-mapped.

    None if this rank cannot read it: another machine's folder, or one of the same name
    without the token.
    """
    try:
        meta = json.loads((where / META).read_text())
        if meta.get("token") != token:
            return None
        arrays = {  # copy-on-write maps: writable arrays, and nothing goes back to the files
            name: np.load(where / f"{name}.npy", mmap_mode="c", allow_pickle=False)
            for name in meta["arrays"]
        }
        return ArrayDataset(**meta["fields"], **arrays)
    except (OSError, ValueError, KeyError, TypeError):
        return None
