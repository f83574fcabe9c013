"""What every converter's command line does once its options are read.

``python -m data_prep.brats`` and ``python -m data_prep.luna16`` run their conversion, say a
data or file-system error in one ``error:`` line (exit status 1, no traceback), print the line
that counts what was skipped, and exit 1 when nothing was written.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from data_prep.common import one_line
from data_prep.common import skip_line
from fedexp.errors import DataError


def run_conversion(convert: Callable[[], Mapping[str, Any]]) -> int:
    """Run ``convert`` (the options bound) and give the command's exit status.

    Args:
        convert: () -> the conversion's summary (``out``, ``n_samples``, the skipped counts).

    Returns:
        0 when samples were written, 1 when none were.

    Raises:
        SystemExit: ``error: ...`` for a :class:`DataError` or an ``OSError`` (a full disk, a
            folder without write permission), in one line.
    """
    try:
        summary = convert()
    except DataError as exc:
        raise SystemExit(f"error: {exc}") from None
    except OSError as exc:
        raise SystemExit(f"error: {one_line(exc)}") from None
    line = skip_line(summary, Path(summary["out"]))
    if line is not None:
        print(line, file=sys.stderr)
    return 0 if summary["n_samples"] > 0 else 1
