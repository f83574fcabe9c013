"""A rank of tests/test_nodes.py's groups that play several machines on this one.

Started with torch.multiprocessing's spawn (:func:`distributed_worker.spawn_ranks`); each rank
says which machine it is on as torchrun does (``GROUP_RANK``, ``LOCAL_RANK``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from distributed_worker import _leave

from fedexp.engine.processes.launch import _join
from helpers import compose_config


def machine_data(rank: int, size: int, port: int, out: str, per_machine: int) -> None:
    """Rank ``rank`` of ``size`` on machine ``rank // per_machine``: loads a synthetic table
    (the machines' folders in one ``<out>/scratch``, as on a file system they share), then a
    data set that only machine 1 cannot load; writes what it got to ``<out>/rank<r>.json``."""
    from fedexp.engine.processes.ranks import Ranks
    from fedexp.engine.processes.shared_data import load_dataset
    from fedexp.engine.processes.shared_data import mapped
    from fedexp.errors import FedexpError

    machine = rank // per_machine
    os.environ.update(GROUP_RANK=str(machine), LOCAL_RANK=str(rank % per_machine))
    _join(rank, size, port, "gloo")
    done = False
    try:
        ranks = Ranks.current()
        scratch = Path(out) / "scratch"
        node = compose_config("dataset=synthetic", "dataset.num_samples=500").dataset
        data = load_dataset(node, ranks, str(scratch))
        got = {
            "mapped": mapped(data.x),
            "folder": Path(data.x.filename).parent.name if mapped(data.x) else None,
            "x": hashlib.sha256(np.ascontiguousarray(data.x).tobytes()).hexdigest(),
        }
        ranks.gather_json(None)  # every machine's first rank has returned, its folder removed
        got["left"] = sorted(p.name for p in scratch.iterdir())
        features = 0 if machine == 1 else 5  # machine 1's files differ: it alone fails
        bad = compose_config("dataset=synthetic", f"dataset.num_features={features}").dataset
        try:
            load_dataset(bad, ranks, str(scratch))
            got["error"] = None
        except FedexpError as exc:
            got["error"] = [type(exc).__name__, str(exc)]
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(got))
        done = True
    finally:
        _leave(done)
