"""Dispatcher: ``python -m data_prep {luna16,brats,synthetic} ...``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = "usage: python -m data_prep {luna16,brats,synthetic} [options]  (--help per command)"


def _commands() -> dict[str, Callable[[Sequence[str] | None], int]]:
    from data_prep import brats
    from data_prep import luna16
    from data_prep import synthetic

    return {"luna16": luna16.main, "brats": brats.main, "synthetic": synthetic.main}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sub-command named by the first argument."""
    args = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if not args or args[0] not in commands:
        print(USAGE, file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    return commands[args[0]](args[1:])


if __name__ == "__main__":
    raise SystemExit(main())
