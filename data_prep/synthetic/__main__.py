"""``python -m data_prep.synthetic``: see :mod:`data_prep.synthetic.cli`."""

from data_prep.synthetic.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
