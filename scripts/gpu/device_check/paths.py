"""Where the check's files are, and what its processes import from."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # scripts/gpu
ROOT = HERE.parents[1]
#: the check's entry (each step's child process runs it with ``--child``)
ENTRY = HERE / "check.py"


def _import_paths() -> None:
    """fedexp, the tests' helpers and golden cases, the benchmark scripts: importable."""
    for path in (ROOT, ROOT / "tests", ROOT / "scripts", ROOT / "scripts" / "peers", HERE):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def _pythonpath() -> str:
    return os.environ.get("PYTHONPATH", "")
