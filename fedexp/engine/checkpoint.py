"""Atomic checkpoints in safetensors (a format that executes no code when loaded).

The file holds every tensor of the run's state under a path-like key (``server/x``,
``client/3/theta``, ``uplink_residual/3``, ...); JSON metadata holds the round, the MLflow run
id, the byte ledger and the resolved config. It is written to a temporary file in the same
folder and renamed over the previous one, so a crash never leaves a torn checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fedexp.errors import FedexpError

FILENAME = "last.safetensors"


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
    final = folder / FILENAME
    tmp = folder / f".{FILENAME}.tmp-{os.getpid()}"
    save_file(flatten_state(tensors), str(tmp), metadata={"fedexp": json.dumps(meta)})
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    return final


def load(path: str | Path, device: torch.device | str = "cpu") -> tuple[dict[str, Any], dict]:
    """Read a checkpoint (a file or the folder holding ``last.safetensors``)."""
    file = Path(path)
    if file.is_dir():
        file = file / FILENAME
    if not file.is_file():
        raise FedexpError(f"resume={path}: no checkpoint found (expected {file})")
    try:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {})["fedexp"])
        tensors = load_file(str(file), device=str(device))
    except Exception as exc:  # noqa: BLE001 - any failure means an unusable file
        raise FedexpError(f"resume={path}: {file} is not a fedexp checkpoint ({exc})") from None
    return unflatten_state(tensors), meta
