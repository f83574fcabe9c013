"""Atomic checkpoints in safetensors (a format that executes no code when loaded).

The file holds every tensor of the run's state under a path-like key (``server/x``,
``client/3/theta``, ``uplink_residual/3``, ...); JSON metadata holds the round, the MLflow run
id, the byte ledger and the resolved config. It is written to a temporary file in the same
folder and renamed over the previous one, so a crash never leaves a torn checkpoint; temporary
files left by a process that died while writing are removed when the folder is next saved to
or loaded from.

Integrity: the file is sealed whole. The metadata key ``sha256`` holds a SHA-256 of every
tensor (name, dtype, shape and bytes, in sorted name order) and ``seal`` a SHA-256 of the JSON
metadata (round, run id, history, client history, ledger, config) together with that tensor
digest, so a changed digit in the header is caught as surely as a flipped bit in a tensor;
both are checked on load, and a mismatch is a :class:`CheckpointError` naming the file. A
checkpoint without a seal (written by an older fedexp, or stripped) is refused unless the
caller accepts it unverified (``resume_unsealed=true``: loaded with a warning).

The good checkpoint: beside ``last.safetensors`` the folder keeps ``good.safetensors``, the
last checkpoint whose round the runner found healthy (:func:`fedexp.engine.health._healthy`),
which is what a rescue after a divergence resumes from (:func:`rescue_point`). It is never
written twice: when the last checkpoint is healthy, :func:`promote` makes ``good.safetensors``
a hard link to it (a copy only where the file system has no hard links), atomically; the next
:func:`save` renames a new file over ``last.safetensors``, so the good one keeps the old file
and the two take twice the space only while they differ. Every checkpoint's metadata records
the round of the folder's good checkpoint when it was written (``good_round``, None: none yet).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file
from safetensors.torch import save_file

from fedexp.errors import CheckpointError

FILENAME = "last.safetensors"
#: The last checkpoint of a healthy round (see the module's docstring).
GOOD_FILENAME = "good.safetensors"
_TMP_PREFIX = f".{FILENAME}.tmp-"
_TMP_PREFIXES = (_TMP_PREFIX, f".{GOOD_FILENAME}.tmp-")
#: A temporary file of a live process older than this is stale too (its pid was reused).
_STALE_AFTER_S = 3600.0

log = logging.getLogger("fedexp")


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in sorted name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def seal(meta_json: str, tensor_digest: str) -> str:
    """SHA-256 of the metadata's JSON text and the tensors' digest (:func:`checksum`)."""
    digest = hashlib.sha256()
    digest.update(b"fedexp-checkpoint-seal|")
    digest.update(meta_json.encode())
    digest.update(b"|")
    digest.update(tensor_digest.encode())
    return digest.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Remove temporary checkpoint files left by dead writers in ``folder``; returns them.

    Those of ``last.safetensors`` and of ``good.safetensors`` alike. A temporary file is stale
    when its writer's pid is not alive, is this process (which is not writing now), or its file
    is older than an hour.
    """
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for prefix, tmp in ((p, t) for p in _TMP_PREFIXES for t in folder.glob(p + "*")):
        suffix = tmp.name.removeprefix(prefix)
        pid = int(suffix) if suffix.isdigit() else None
        try:
            old = time.time() - tmp.stat().st_mtime > _STALE_AFTER_S
        except FileNotFoundError:
            continue
        if pid is None or pid == os.getpid() or not _pid_alive(pid) or old:
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def flatten_state(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"client": {3: {"theta": t}}}`` -> ``{"client/3/theta": t}`` (CPU, contiguous copies)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_state(value, name + "/"))
        elif value is not None:
            out[name] = value.detach().to("cpu").contiguous().clone()
    return out


def unflatten_state(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Inverse of :func:`flatten_state` (integer-looking keys stay strings)."""
    tree: dict[str, Any] = {}
    for name, tensor in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = tensor
    return tree


def save(directory: str | Path, tensors: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write the checkpoint atomically; returns its path."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)
    final = folder / FILENAME
    tmp = folder / f"{_TMP_PREFIX}{os.getpid()}"
    flat = flatten_state(tensors)
    text, digest = json.dumps(meta), checksum(flat)
    metadata = {"fedexp": text, "sha256": digest, "seal": seal(text, digest)}
    try:
        save_file(flat, str(tmp), metadata=metadata)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def promote(directory: str | Path) -> Path:
    """Make the folder's last checkpoint its good one too; returns the good file's path.

    ``good.safetensors`` becomes a hard link to ``last.safetensors`` (no byte written), or a
    copy where the file system has no hard links, through a temporary file renamed over the
    previous good one, so a crash leaves either the old good checkpoint or the new one.
    """
    folder = Path(directory)
    source, final = folder / FILENAME, folder / GOOD_FILENAME
    tmp = folder / f".{GOOD_FILENAME}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(source, tmp)
        except OSError:  # no hard links here (some network and FAT file systems): a copy
            shutil.copyfile(source, tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def peek(path: str | Path) -> dict[str, Any] | None:
    """A checkpoint file's JSON metadata (round, ...), read from its header alone.

    Neither the tensors nor the seal are read or checked (:func:`load` does); None when the
    file is absent or is not a fedexp checkpoint.
    """
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["fedexp"])
        return meta if isinstance(meta, dict) and isinstance(meta.get("round"), int) else None
    except Exception:  # noqa: BLE001 - absent, torn or foreign: no checkpoint to speak of
        return None


def good_round(directory: str | Path, before: int) -> int | None:
    """The round of the folder's good checkpoint (None: none), before round ``before``.

    For the metadata of a checkpoint of round ``before`` that is not healthy itself. A good
    checkpoint of round ``before`` or later is not of the run being checkpointed (it was left
    by a run resumed from an earlier checkpoint): it is removed.
    """
    file = Path(directory) / GOOD_FILENAME
    meta = peek(file)
    if meta is None:
        return None
    if meta["round"] >= before:
        log.info("%s (round %d) is not of this run's past: removed", file, meta["round"])
        file.unlink(missing_ok=True)
        return None
    return meta["round"]


class RescuePoint(NamedTuple):
    """Where a run that diverged can be resumed from (:func:`rescue_point`).

    ``kind``: ``"last"`` (the last checkpoint, healthy itself, or written by an older fedexp
    that kept no good one: ``resume`` names the folder), ``"good"`` (the last checkpoint was
    taken while the loss blew up; ``resume`` names the good file, of an earlier round),
    ``"unhealthy"`` (checkpoints were kept, none healthy: start again) or ``"none"``.
    """

    kind: str
    resume: Path | None
    round: int | None
    last_round: int | None


def rescue_point(folder: str | Path) -> RescuePoint:
    """The checkpoint of ``folder`` a rescue (a smaller lr) should resume from.

    The last checkpoint when its round was healthy, else the good one; a last checkpoint
    without ``good_round`` metadata (an older fedexp's, or unreadable) is resumed as before.
    """
    folder = Path(folder)
    last, good = peek(folder / FILENAME), peek(folder / GOOD_FILENAME)
    last_round = None if last is None else last["round"]
    if last is not None and "good_round" in last and last["good_round"] == last_round:
        return RescuePoint("last", folder, last_round, last_round)
    if good is not None:
        return RescuePoint("good", folder / GOOD_FILENAME, good["round"], last_round)
    if last is not None and "good_round" in last:
        return RescuePoint("unhealthy", None, None, last_round)
    if (folder / FILENAME).exists():
        return RescuePoint("last", folder, last_round, last_round)
    return RescuePoint("none", None, None, None)


def load(
    path: str | Path, device: torch.device | str = "cpu", *, allow_unsealed: bool = False
) -> tuple[dict[str, Any], dict]:
    """Read a checkpoint (a file or the folder holding ``last.safetensors``).

    Args:
        path: the file (``last.safetensors``, ``good.safetensors``, ...) or its folder.
        device: where the tensors go.
        allow_unsealed: accept a checkpoint without a seal, unverified (with a warning);
            otherwise it is refused.

    Raises:
        CheckpointError: no file, not a checkpoint, corrupted (tensors or header), or unsealed.
    """
    file = Path(path)
    if file.is_dir():
        file = file / FILENAME
    remove_stale_temps(file.parent)
    if not file.is_file():
        run = Path(path) / "checkpoints"  # a run's folder: its checkpoints are in there
        hint = f"; {run}/ holds the run's: resume={run}" if (run / FILENAME).is_file() else ""
        raise CheckpointError(f"resume={path}: no checkpoint found (expected {file}){hint}")
    try:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as fh:
            metadata = fh.metadata() or {}
        text = metadata["fedexp"]
        meta = json.loads(text)
        tensors = load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - any failure means an unusable file
        raise CheckpointError(f"resume={path}: {file} is not a fedexp checkpoint ({exc})") from None
    expected, sealed = metadata.get("sha256"), metadata.get("seal")
    digest = checksum(tensors)
    if expected is not None and digest != expected:
        raise CheckpointError(
            f"resume={path}: {file} is corrupted (its tensors do not match the checksum "
            "stored when it was written); resume from an intact copy or start a new run"
        )
    if sealed is None:
        if not allow_unsealed:
            raise CheckpointError(
                f"resume={path}: {file} has no seal (written by an older fedexp, or altered): "
                "its header cannot be verified; add resume_unsealed=true to resume from it "
                "unverified"
            )
        log.warning("%s has no seal: resumed unverified (resume_unsealed=true)", file)
    elif sealed != seal(text, digest):
        raise CheckpointError(
            f"resume={path}: {file} is corrupted (its header (round, history, ledger or "
            "config) does not match the seal stored when it was written); resume from an "
            "intact copy or start a new run"
        )
    tensors = {k: v.to(device) for k, v in tensors.items()}
    return unflatten_state(tensors), meta
