"""``python -m data_prep.luna16``: see :mod:`data_prep.luna16.cli`."""

from data_prep.luna16.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
