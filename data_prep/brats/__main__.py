"""``python -m data_prep.brats``: see :mod:`data_prep.brats.cli`."""

from data_prep.brats.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
