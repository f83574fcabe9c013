"""What runs inside a step's child process: the :class:`Step` a step function gets, and the
device helpers every step uses."""

from __future__ import annotations

import gc
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .sizes import Sizes


class Step:
    """What a step function gets: its sizes, deadline, folders, result dict and a saver."""

    def __init__(self, name: str, sizes: Sizes, deadline: float, out: Path, work: Path) -> None:
        self.name, self.sizes, self.deadline = name, sizes, deadline
        self.out, self.work = out, work  # $OUT (files that come back), scratch
        self.result_file = work / f"{name}.json"
        self.result: dict[str, Any] = {}

    def left(self) -> float:
        """Seconds to this step's deadline."""
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """Write what the step has so far (a step stopped from outside keeps it)."""
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=_jsonable))
        tmp.replace(self.result_file)

    def say(self, line: str) -> None:
        """A progress line."""
        print(f"  [{self.name}] {line}", flush=True)


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def _device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device: torch.device) -> float | None:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


def _free(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
