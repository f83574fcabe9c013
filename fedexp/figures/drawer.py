"""Where a run's figures are drawn: one thread of this process, or a helper process.

matplotlib's state is not thread-safe, and the runs of a stacked sweep are threads of one
process: every figure of a process is drawn in one thread (:data:`_THREAD`), one at a time.
A short run's end is mostly its figures: matplotlib's import and first figure of each kind
(about a second on this project's 2-core machine) and three figures of 50-150 ms each, on
the core that ran the run while the others wait. Where the run leaves a core idle (a single
run, a stacked sweep of fewer groups than cores: :attr:`fedexp.engine.threads.ThreadChoice.idle`),
the ``fedexp`` program starts a helper process instead (:func:`start_helper`), before the run
loads torch: it warms up while the run starts on its one core, and draws the figures there,
the same PNG bytes (tests/test_drawer.py; docs/benchmarks.md "Start-up").

The helper is the program's, never a library user's or a test's own process: the ``fedexp``
command allows it (:func:`allow_helper`, through the environment variable
:data:`HELPER_ENV`, which its worker processes inherit); ``FEDEXP_FIGURE_HELPER=0`` keeps every
figure in the run's own process. A helper that dies leaves the figures to the thread.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: The thread of this process that draws its figures when no helper does.
_THREAD = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedexp-figures")
#: The helper process's pool (one process), once started.
_helper: cf.ProcessPoolExecutor | None = None
_lock = threading.Lock()

#: The figures of this thread's :func:`together` block, else None.
_together: contextvars.ContextVar[list[_Drawing] | None] = contextvars.ContextVar(
    "fedexp_figures_together", default=None
)

#: "1": this process tree is the ``fedexp`` program, which may start helpers; "0": never.
HELPER_ENV = "FEDEXP_FIGURE_HELPER"


def allow_helper() -> None:
    """Let this process and the workers it starts draw in a helper (the ``fedexp`` program)."""
    os.environ.setdefault(HELPER_ENV, "1")


def helper_allowed() -> bool:
    """Whether :func:`allow_helper` was called in this process tree (and not overridden)."""
    return os.environ.get(HELPER_ENV) == "1"


def _warm() -> None:
    """The helper's start: every figure drawn once first (:func:`fedexp.figures.canvas.warm`).

    Ctrl-C and SIGTERM are the run's to handle: the helper ignores them, and ends with the run
    (the pool's sentinel at the run's exit, or the end of its pipe if the run dies). Its objects are
    then frozen, as the program's are (:func:`fedexp.cli.entry`): its exit skips the
    interpreter's last garbage collections, which the run's exit waits for.
    """
    import gc
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.nice(10)  # the run's threads first, where they meet
    from fedexp.figures import canvas

    canvas.warm()
    gc.freeze()


def start_helper() -> None:
    """Draw this process's figures in a helper process from now on (once a process).

    The process starts now (``spawn``: a fresh interpreter, no copy of the run's memory) and
    warms up (:func:`_warm`) while the run goes on. The pool is let go at the process's exit
    handlers (:func:`stop_helper`), while the modules its callbacks use still stand: let go
    in the interpreter's finalisation, it printed "Exception ignored ... 'NoneType' object has
    no attribute 'util'" after a run that ended early.
    """
    global _helper
    import atexit
    import multiprocessing

    with _lock:
        if _helper is not None:
            return
        context = multiprocessing.get_context("spawn")
        _helper = cf.ProcessPoolExecutor(1, mp_context=context, initializer=_warm)
        _helper.submit(int)  # the pool starts its process on the first task
        atexit.register(stop_helper)


def stop_helper() -> None:
    """Back to the thread (a dead helper's pool is shut down)."""
    global _helper
    with _lock:
        helper, _helper = _helper, None
    if helper is not None:
        helper.shutdown(wait=False, cancel_futures=True)


def _call(name: str, *args: Any) -> Any:
    """:mod:`fedexp.figures.canvas`'s ``name(*args)``, in the process and thread that draw."""
    from fedexp.figures import canvas

    return getattr(canvas, name)(*args)


@dataclass
class _Drawing:
    """One figure asked for: its call, and the future of its result."""

    name: str
    args: tuple[Any, ...]
    future: cf.Future
    helper: bool  # submitted to the helper process (else to the thread)


def _submit(name: str, args: tuple[Any, ...]) -> _Drawing:
    helper = _helper
    if helper is not None:
        try:
            return _Drawing(name, args, helper.submit(_call, name, *args), True)
        except RuntimeError:  # dead (BrokenProcessPool is one), or shut down
            _helper_lost()
    return _Drawing(name, args, _THREAD.submit(_call, name, *args), False)


def _helper_lost() -> None:
    log.warning("the figures' helper process ended; drawing in the run's process")
    stop_helper()


def _result(drawing: _Drawing) -> Any:
    """The drawing's result (the PNG's path); a helper that died leaves it to the thread."""
    if not drawing.helper:
        return drawing.future.result()
    try:
        return drawing.future.result()
    except cf.process.BrokenProcessPool:  # (the module is loaded: the helper's pool is one)
        if _helper is not None:
            _helper_lost()
        return _THREAD.submit(_call, drawing.name, *drawing.args).result()


def draw(name: str, *args: Any) -> Any:
    """:mod:`fedexp.figures.canvas`'s ``name(*args)`` in the helper, or in :data:`_THREAD`.

    Returns its result (the PNG's path); an error of the drawing is raised here. By name, so
    that a process whose figures the helper draws never imports matplotlib; the arguments go
    to the helper by pickle: plain data (lists, numbers, NumPy arrays, paths,
    :class:`fedexp.figures.pca.ModelPCA`), no torch tensor (the helper does not import torch).
    Inside a :func:`together` block it returns None at once, and the block's end waits.
    """
    batch = _together.get()
    if batch is not None:
        batch.append(_submit(name, args))
        return None
    return _result(_submit(name, args))


@contextlib.contextmanager
def together(
    aside: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Iterator[list[Any]]:
    """The figures asked for in the block are drawn one after another, without a wait each.

    Yields the list that holds, once the block ends, every figure's result (the PNGs' paths,
    in the order asked). The block's end waits for them inside ``aside()``: a run of a stacked
    sweep lets the group's other runs take their turns meanwhile
    (:func:`fedexp.engine.round.stacking.aside`), as its figures are drawn by another thread
    or process. An error of a drawing is raised there; an error of the block leaves the
    figures asked for to finish on their own.
    """
    batch: list[_Drawing] = []
    results: list[Any] = []
    token = _together.set(batch)
    try:
        yield results
    finally:
        _together.reset(token)
    with aside():
        results.extend(_result(d) for d in batch)
