"""The data set of a run over several ranks: loaded once a machine, and mapped by its ranks.

A rank keeps only its own clients' rows
(:meth:`fedexp.engine.clients.pool.ClientTable.build`), but a
loader reads, or for the synthetic table draws, the data set whole. When every rank loaded it,
P ranks on one machine held P copies of the whole table while their clients' tables were built
(at 10^6 clients of 10 rows and 30 features, 1.2 GB each).

Now the first rank of each machine (rank 0 of ``distributed.nproc``; ``LOCAL_RANK`` 0 of each
node under torchrun or SLURM: :func:`machine_of`) alone loads it, from that machine's own
files, and writes its arrays as ``.npy`` files (NumPy's own format, read back with
``allow_pickle=False``: nothing is unpickled) to a fresh folder, with its other fields and a
random token in ``meta.json`` (a scratch folder that names its owner, so that a rank killed
before it removes the folder leaves it to the next run's reaper,
:func:`fedexp.engine.clients.states.owned_folder`). The machine's other ranks memory-map the
arrays of their machine's folder (one that cannot read it loads the data set itself); no rank
reads another machine's, even where ``store_dir`` is a file system they share: memory is a
machine's, and a node reads its data where it runs. The first rank maps the files too and drops
its own copy. Once every rank has said which it did, each folder is removed: the mapped files
stay readable, unnamed, until the ranks let them go, and the pages of one copy serve every rank
of the machine.

A data set whose arrays are memory-mapped already (the prepared image arrays) is loaded by
each rank from its own files. A user's error in the data set's config or files is met by a
machine's first rank and passed on, so every rank stops with the same message.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import secrets
import socket
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from fedexp import errors
from fedexp.config.instantiate import instantiate_checked
from fedexp.data.dataset import ArrayDataset
from fedexp.engine.clients.states import owned_folder
from fedexp.engine.clients.states import release_scratch
from fedexp.engine.processes.ranks import Ranks
from fedexp.errors import DataError
from fedexp.errors import FedexpError

META = "meta.json"


def load_dataset(node: DictConfig, ranks: Ranks | None, folder: str | None = None) -> ArrayDataset:
    """The run's data set (the ``dataset`` config ``node``), once per machine over ranks.

    The first rank of each machine loads it (:func:`machine_of`) and shares it with the
    machine's other ranks; no rank maps another machine's files.

    Args:
        node: the ``dataset`` config.
        ranks: this process's rank, or None for a run in one process (it loads the data set).
        folder: where a machine's first rank writes the arrays (``store_dir``); None: the
            system's temp folder.

    Raises:
        FedexpError: the data set's config or files are wrong (on every rank: the first
            machine's that met it).
    """
    if ranks is None:
        return instantiate_checked(node, "dataset")
    machine, leads = machine_of(ranks)
    said: dict[str, Any] = {"machine": machine, "leads": leads}
    data, error, written = None, None, None
    if leads:
        try:
            data = instantiate_checked(node, "dataset")
        except BaseException as exc:  # said to every rank first, so that none waits for it
            error = exc
            said["error"] = str(exc) if isinstance(exc, FedexpError) else None
            said["kind"] = type(exc).__name__
        else:
            written = _write(data, folder) if not mapped(data.x) else None
            if written is None:  # mapped already, or no room to write: each rank loads its own
                said["own"] = True
            else:
                said.update(folder=str(written[0]), token=written[1])
    told = ranks.gather_json(said)
    try:
        if error is not None:
            raise error
        _raise_theirs(told, machine)
        lead = next((t for t in told if t["leads"] and t["machine"] == machine), said)
        if "folder" in lead:
            shared = _open(Path(lead["folder"]), lead["token"])
            data = shared if shared is not None else data
        if data is None:  # a machine whose files are mapped already, or unreadable: its own
            data = instantiate_checked(node, "dataset")
        if any("folder" in t for t in told):
            ranks.gather_json(mapped(data.x))  # every rank has mapped the files, or loaded
    finally:
        if written is not None:
            release_scratch(written[0])
    return data


def machine_of(ranks: Ranks) -> tuple[str, bool]:
    """This rank's machine (a name its ranks share) and whether it loads the data set for them.

    torchrun and SLURM say which machine a rank runs on (``GROUP_RANK``, torchrun's node rank;
    ``SLURM_NODEID``) and its rank there (``LOCAL_RANK``): each machine's rank 0 there loads.
    The ranks fedexp starts itself (``distributed.nproc``, no ``LOCAL_RANK``) share one
    machine: rank 0 loads.
    """
    env = os.environ
    local = env.get("LOCAL_RANK")
    if local is None:
        return "", ranks.leader
    machine = env.get("GROUP_RANK") or env.get("SLURM_NODEID") or socket.gethostname()
    return machine, local.strip() == "0"


def _raise_theirs(told: list[dict[str, Any]], machine: str) -> None:
    """The error a machine's first rank met loading the data set, raised here too.

    This machine's first, else the first machine's (named): its class, so that every rank
    handles it alike.
    """
    failed = [t for t in told if t["leads"] and "error" in t]
    if not failed:
        return
    said = next((t for t in failed if t["machine"] == machine), failed[0])
    if said["error"] is None:
        raise RuntimeError("a rank failed to load the data set (its traceback says why)")
    kind = getattr(errors, said.get("kind", ""), None)  # the same class: the same handling
    if not (isinstance(kind, type) and issubclass(kind, FedexpError)):
        kind = DataError
    where = "" if said["machine"] == machine else f" (on node {said['machine']})"
    raise kind(f"{said['error']}{where}")


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
