"""Test hook (tests/test_rank_faults.py): a rank of a run sends a signal as a round starts.

With this folder on ``PYTHONPATH`` and
``FEDEXP_TEST_SIGNAL=<rank>:<round>:<signal>[:group|:parent]`` (``1:3:SIGKILL``), every Python
process imports this module as it starts (``sitecustomize``), the ranks that
``distributed.nproc`` spawns too, and ``Engine.run_round`` of rank ``<rank>`` sends
``<signal>`` to its own process, with ``:group`` to its process group (what a terminal does on
Ctrl-C), with ``:parent`` to its parent (torchrun's agent, which passes it on to every rank),
as round ``<round>`` (1-based, as the run counts them) starts: a fault at a known round, with
no hook in fedexp itself. Without the variable it does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys

_TARGET = "fedexp.engine.round.engine"


def _patch(engine_class: type) -> None:
    rank, when, name, *to = os.environ["FEDEXP_TEST_SIGNAL"].split(":")
    sig = signal.Signals[name]
    original = engine_class.run_round

    def run_round(self):  # noqa: ANN001, ANN202 - Engine.run_round's signature
        mine = self.ranks.rank if self.ranks is not None else 0
        if mine == int(rank) and self.round + 1 == int(when):
            if to == ["group"]:
                os.killpg(os.getpgrp(), sig)
            elif to == ["parent"]:
                os.kill(os.getppid(), sig)
            else:
                os.kill(os.getpid(), sig)
        return original(self)

    engine_class.run_round = run_round


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the engine module's class as it is first imported."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201, ARG002
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader
        exec_module = loader.exec_module

        def patched(module):  # noqa: ANN001, ANN202
            exec_module(module)
            _patch(module.Engine)

        loader.exec_module = patched
        return spec


if os.environ.get("FEDEXP_TEST_SIGNAL"):
    sys.meta_path.insert(0, _Finder())
