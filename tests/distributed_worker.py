"""A rank of tests/test_distributed.py's runs: joins a gloo group and runs configs in turn.

Rank 0 writes each run's logged metrics to ``<out>/<name>.json``; the other ranks take part.
Started with torch.multiprocessing's spawn, so that it runs in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from safetensors.torch import save_file

from fedexp.engine.processes.launch import _join
from fedexp.engine.runner import run
from fedexp.tracking.base import NullTracker
from helpers import compose_config


def spawn_ranks(target, *args: object, size: int = 2, timeout: float = 600) -> None:  # noqa: ANN001
    """Run ``target(rank, size, port, *args)`` in ``size`` spawned processes; all must exit 0."""
    import torch.multiprocessing as mp

    from fedexp.engine.processes.launch import _free_port

    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, size, port, *args)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def main(rank: int, size: int, port: int, out: str, jobs: list[tuple[str, list[str]]]) -> None:
    """Run every (name, overrides) of ``jobs`` over ``size`` ranks."""
    _join(rank, size, port, "gloo")
    done = False
    try:
        for name, overrides in jobs:
            tracker = NullTracker()
            cfg = compose_config(*overrides)
            vectors, sliced = {}, []

            def slices(engine, metrics, into=sliced) -> None:  # noqa: ANN001
                into.append(engine._slices_told)

            run(cfg, tracker=tracker, callbacks=[last_vectors(cfg.rounds, vectors), slices])
            if rank == 0:
                metrics = {
                    k: {str(s): v for s, v in steps.items()} for k, steps in tracker.metrics.items()
                }
                metrics["test/round_slices"] = {"0": float(any(sliced))}  # (Engine._round_slices)
                (Path(out) / f"{name}.json").write_text(json.dumps(metrics))
                save_file(vectors, str(Path(out) / f"{name}.safetensors"))
        done = True
    finally:
        _leave(done)


def _leave(done: bool) -> None:
    """Leave the group as the runner's ranks do: after a barrier when this rank finished (so
    that no rank tears its side down while another still talks to it), at once on failure.

    A rank that finished then exits at once, as a forked multiprocessing child does: its
    results are written, and the interpreter's teardown beside gloo's threads once aborted
    a rank in CI (SIGABRT, "terminate called without an active exception"; not reproduced
    in some 30 runs here), which says nothing of the results these tests check.
    """
    try:
        if done:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if done:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def last_vectors(rounds: int, into: dict):
    """A run callback: after the last round, every client's evaluated model vector (every
    rank takes part: its own clients') into ``into["v"]``."""

    def keep(engine, metrics) -> None:  # noqa: ANN001 - the runner's callback
        if engine.round == rounds:
            into["v"] = engine.every_eval_vector().contiguous()

    return keep


def exchanges(rank: int, size: int, port: int, out: str, limit: int) -> None:
    """Rank ``rank`` of tests/test_rank_exchange.py: gathers bytes of many lengths and adds
    weighted upload sums (``limit``: :func:`~fedexp.engine.processes.ranks.sums_record`'s); rank 0
    writes what it got to ``<out>/exchanges.json``."""
    import torch

    from fedexp.engine.processes.ranks import SHORT
    from fedexp.engine.processes.ranks import Ranks
    from fedexp.engine.processes.ranks import reduce_uploads
    from fedexp.engine.processes.ranks import sums_record
    from fedexp.engine.processes.ranks import weighted_sums

    _join(rank, size, port, "gloo")
    done = False
    try:
        ranks = Ranks.current()
        lengths = [0, 1, SHORT - 8, SHORT - 7, 3 * SHORT + 5]
        got = {}
        for mine in lengths:  # every rank a different length: rank r sends mine + r bytes
            data = bytes((rank * 31 + i) % 251 for i in range(mine + rank))
            got[str(mine)] = [list(b) for b in ranks.gather_bytes(data)]
        # uploads of clients 0..5 (rank r: n % size == r), two parts of two dtypes
        senders = [n for n in range(6) if n % size == rank]
        gen = torch.Generator().manual_seed(7)
        a = torch.randn(6, 3, 4, generator=gen)
        b = torch.randn(6, 5, generator=gen, dtype=torch.float64)
        w = torch.arange(1, 7, dtype=torch.float64) / 21
        parts = {"a": a[senders], "b": b[senders]}
        own = weighted_sums(parts, w[senders])
        records = ranks.gather_json(sums_record(own, limit))
        updates, uploaded = reduce_uploads(ranks, list(range(6)), own, records)
        mean = updates[0]
        got["mean"] = {k: v.reshape(-1).tolist() for k, v in mean.items()}
        got["uploaded"] = uploaded
        got["inline"] = [r[1] is not None for r in records]
        # a round in which rank 1 has no sender: it learns the parts from rank 0's record
        alone = [n for n in senders if n % 2 == 0] if rank == 0 else []
        own = weighted_sums({"a": a[alone], "b": b[alone]}, w[alone]) if alone else {}
        records = ranks.gather_json(sums_record(own, limit))
        updates, _ = reduce_uploads(ranks, [0, 2, 4], own, records)
        got["rank 0 alone"] = {k: v.reshape(-1).tolist() for k, v in updates[0].items()}
        if rank == 0:
            (Path(out) / "exchanges.json").write_text(json.dumps(got))
        done = True
    finally:
        _leave(done)


def failing_rank(rank: int, size: int, port: int, error: str) -> None:
    """A started rank (:func:`fedexp.engine.processes.launch.rank_main`) whose job raises ``error``:
    ``"data"`` a user's DataError, else a bug (RuntimeError)."""
    from fedexp.engine.processes.launch import rank_main
    from fedexp.errors import DataError

    def job(cfg) -> None:  # noqa: ANN001 - the runner's job
        raise DataError("bad rows") if error == "data" else RuntimeError("a bug")

    rank_main(rank, size, port, "rounds: 1", "gloo", job)


def shared_data(rank: int, size: int, port: int, out: str) -> None:
    """Rank ``rank`` of tests/test_shared_data.py: loads a synthetic table through
    :func:`fedexp.engine.processes.shared_data.load_dataset` (rank 0's files in ``<out>/scratch``),
    then a data set whose config is wrong; writes what it got to ``<out>/rank<r>.json``."""
    import hashlib

    from fedexp.engine.processes.ranks import Ranks
    from fedexp.engine.processes.shared_data import load_dataset
    from fedexp.engine.processes.shared_data import mapped
    from fedexp.errors import FedexpError

    _join(rank, size, port, "gloo")
    done = False
    try:
        ranks = Ranks.current()
        scratch = Path(out) / "scratch"
        node = compose_config("dataset=synthetic", "dataset.num_samples=700").dataset
        data = load_dataset(node, ranks, str(scratch))
        got = {
            "mapped": [mapped(data.x), mapped(data.y), mapped(data.groups)],
            "x": hashlib.sha256(np.ascontiguousarray(data.x).tobytes()).hexdigest(),
            "y": hashlib.sha256(np.ascontiguousarray(data.y).tobytes()).hexdigest(),
            "groups": data.groups.tolist(),
            "fields": [data.name, data.num_classes, data.task, data.feature_names],
        }
        ranks.gather_json(None)  # rank 0 has returned, its folder removed
        got["left"] = sorted(p.name for p in scratch.iterdir())
        bad = compose_config("dataset=synthetic", "dataset.num_features=0").dataset
        try:
            load_dataset(bad, ranks, str(scratch))
            got["error"] = None
        except FedexpError as exc:
            got["error"] = [type(exc).__name__, str(exc)]
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(got))
        done = True
    finally:
        _leave(done)
