"""A rank of tests/test_distributed.py's runs: joins a gloo group and runs configs in turn.

Rank 0 writes each run's logged metrics to ``<out>/<name>.json``; the other ranks take part.
Started with torch.multiprocessing's spawn, so that it runs in a fresh interpreter.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from fedexp.engine.launch import _join
from fedexp.engine.runner import run
from fedexp.tracking.base import NullTracker
from helpers import compose_config


def main(rank: int, size: int, port: int, out: str, jobs: list[tuple[str, list[str]]]) -> None:
    """Run every (name, overrides) of ``jobs`` over ``size`` ranks."""
    _join(rank, size, port, "gloo")
    try:
        for name, overrides in jobs:
            tracker = NullTracker()
            run(compose_config(*overrides), tracker=tracker)
            if rank == 0:
                metrics = {
                    k: {str(s): v for s, v in steps.items()} for k, steps in tracker.metrics.items()
                }
                (Path(out) / f"{name}.json").write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()
