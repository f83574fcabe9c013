"""``python -m fedexp run ...``: the ``fedexp`` command, as torchrun starts it.

``torchrun --standalone --nproc-per-node 2 -m fedexp run <overrides>`` runs one run over two
processes (:mod:`fedexp.cli.distributed`).
"""

from fedexp.cli import entry

if __name__ == "__main__":
    entry()
