"""Record the golden figures of every case in ``cases.py`` (issue 22).

The figures in the repository were recorded on main at c973b3d, before the one-path refactor,
with ``backend=lockstep`` added to every case (its cohort path where an algorithm had one, the
per-client hooks elsewhere). Run from the repository root, on the engine whose figures are to
be kept (a new case, or a figure that changes on purpose: say why in the commit)::

    .venv/bin/python tests/golden/record.py            # every case
    .venv/bin/python tests/golden/record.py fedavg ifca   # some cases (updates them in place)

Writes ``tests/golden/states/<case>.safetensors`` (the engine's whole state tree after the
last round: server, every client, channel residuals and replicas, best-so-far) and
``tests/golden/metrics.json`` (each round's training metrics and evaluation aggregates).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

from golden.cases import CASES  # noqa: E402
from golden.golden import metrics_path  # noqa: E402
from golden.golden import run_case  # noqa: E402
from golden.golden import state_path  # noqa: E402


def main(names: list[str]) -> None:
    """Record ``names`` (default: every case)."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    path = metrics_path()
    table = json.loads(path.read_text()) if path.exists() else {}
    for name in names or list(CASES):
        state, history, _ = run_case(name, HERE / "tmp")
        state_path(name).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone().contiguous() for k, v in state.items()}, state_path(name))
        table[name] = history
        print(f"{name}: {len(state)} tensors, {len(history)} rounds", flush=True)
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
