"""A stacked sweep's groups in worker processes, where a worker's death is its jobs' alone.

``hydra/launcher=stacked`` with ``hydra.launcher.n_jobs`` > 1 runs its groups in worker
processes (:mod:`fedexp.sweep.stacked`). It ran them with joblib's loky backend, which ends
every worker with SIGKILL when one dies: a ``kill -9`` of one worker (or the OOM killer)
ended the sweep with joblib's 36-line ``TerminatedWorkerError`` traceback, and every job,
the other groups' too, was listed as "stopped with the sweep" (issue 70, item 8).

Here each worker is a process of its own (``spawn``) that takes groups one at a time over a
pipe until none is left, as joblib's workers take tasks; the task and the groups travel as
cloudpickle's bytes (joblib's serialiser, which it requires: Hydra's task function may be a
closure), the returns as the same. A worker that dies while it holds a group is said in one line
(``fedexp: sweep worker 4242 died (signal 9, SIGKILL) holding job 0 (algorithm=fedavg
seed=0), job 1 (algorithm=fedavg seed=1); the other groups go on``: the overrides every job
shares left out); its jobs return NaN, as a failed job of a
sweep does, and the sweep's summary lists them as failed (their folders hold no status); the
other workers' groups run to their end, and a new worker takes the groups left when none is.
A worker whose group raised (Ctrl-C, SIGTERM: its runs stopped, KILLED with their
checkpoints) passes the exception on; it is raised once every worker has ended. A worker
whose parent dies (SIGKILL) stops its runs as on SIGTERM rather than run on alone.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence, Set
from multiprocessing.connection import Connection
from multiprocessing.connection import wait
from typing import Any

#: A group: its jobs as (number, overrides).
Group = list[tuple[int, list[str]]]


def _child(conn: Connection, task: bytes) -> None:
    """A worker: run each group the parent sends (``None``: stop), send back its returns."""
    import cloudpickle

    parent = os.getppid()

    def orphaned() -> None:  # the parent died (SIGKILL): stop as on SIGTERM, not run on alone
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=orphaned, name="fedexp-parent-watch", daemon=True).start()
    run = cloudpickle.loads(task)
    while True:
        group = conn.recv()
        if group is None:
            return
        try:
            result = ("ok", run(cloudpickle.loads(group)))
        except BaseException as exc:  # noqa: BLE001 - the parent raises it (Ctrl-C: stopped)
            result = ("raised", exc)
        try:
            conn.send_bytes(cloudpickle.dumps(result))
        except OSError:  # the parent is gone (SIGTERM to the whole process group): no one to tell
            return


def _how(code: int | None) -> str:
    """``signal 9, SIGKILL`` for −9, ``exit code 1`` for 1."""
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {-code}, {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def died_line(pid: int, code: int | None, group: Group, common: Set[str] = frozenset()) -> str:
    """The one line of a worker that died holding ``group``.

    ``common``: the overrides every job of the sweep shares, left out.
    """
    held = ", ".join(
        f"job {n} ({' '.join(o for o in overrides if o not in common)})" for n, overrides in group
    )
    return f"fedexp: sweep worker {pid} died ({_how(code)}) holding {held}; the other groups go on"


class _Worker:
    def __init__(self, ctx: Any, task: bytes) -> None:
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(theirs, task), daemon=True)
        self.proc.start()
        theirs.close()
        self.group: int | None = None  # the index of the group it holds


def _receive(worker: _Worker, ready: list) -> tuple[tuple[str, Any] | None, bool]:
    """(what ``worker`` sent, or None; whether its end of the pipe closed: it is ending).

    A dead worker's pipe reads as ready too (at its end): that is its death, whichever of
    the pipe and the process's sentinel ``wait`` saw first, never a message to wait for
    again (the loop would spin on the closed pipe, the sentinel never looked at).
    """
    import cloudpickle

    if worker.conn not in ready:
        return None, False
    try:
        if not worker.conn.poll():
            return None, False
        return cloudpickle.loads(worker.conn.recv_bytes()), False
    except (EOFError, OSError):  # its end closed: it died (while sending, perhaps)
        return None, True


def run_groups(
    run: Callable[[Group], list],
    todo: Sequence[Group],
    processes: int,
    dead: Callable[[Group], list],
) -> list[list]:
    """Each group's returns, the groups run in ``processes`` worker processes.

    Args:
        run: a group's returns (a module-level function, or one cloudpickle serialises).
        todo: the groups, taken in order as workers come free.
        processes: the workers at once.
        dead: the returns of a group whose worker died (one a job).

    Returns:
        Each group's returns, in the order of ``todo``.

    Raises:
        BaseException: the first a group raised (Ctrl-C, SIGTERM), once every worker ended.
    """
    import cloudpickle

    ctx = mp.get_context("spawn")
    task = cloudpickle.dumps(run)
    results: list[list | None] = [None] * len(todo)
    every = [set(o) for group in todo for _, o in group]
    common = set.intersection(*every) if every else set()
    raised: list[BaseException] = []
    waiting = list(range(len(todo)))
    workers = [_Worker(ctx, task) for _ in range(min(processes, len(todo)))]

    def give(worker: _Worker) -> None:
        worker.group = waiting.pop(0) if waiting and not raised else None
        try:
            worker.conn.send(
                None if worker.group is None else cloudpickle.dumps(todo[worker.group])
            )
        except OSError:  # (it died meanwhile: its sentinel says so)
            pass

    for worker in workers:
        give(worker)
    try:
        while any(w.group is not None for w in workers):
            busy = [w for w in workers if w.group is not None]
            ready = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy])
            for worker in busy:
                got, ended = _receive(worker, ready)
                if got is not None:
                    kind, value = got
                    if kind == "ok":
                        results[worker.group] = value  # type: ignore[index]
                    else:
                        raised.append(value)
                        results[worker.group] = []  # type: ignore[index]
                    give(worker)
                elif ended or worker.proc.sentinel in ready:
                    worker.proc.join()
                    group = todo[worker.group]  # type: ignore[index]
                    print(died_line(worker.proc.pid or 0, worker.proc.exitcode, group, common),
                          file=sys.stderr, flush=True)  # fmt: skip
                    results[worker.group] = dead(group)  # type: ignore[index]
                    worker.group = None
                    if waiting and not raised and all(w.group is None for w in workers):
                        fresh = _Worker(ctx, task)  # the groups left need a worker
                        workers.append(fresh)
                        give(fresh)
    except BaseException:
        for worker in workers:  # SIGTERM for the parent: the workers stop as it does
            if worker.proc.is_alive() and sys.exc_info()[0] is not KeyboardInterrupt:
                os.kill(worker.proc.pid or 0, signal.SIGTERM)
        for worker in workers:
            worker.proc.join()
        raise
    for worker in workers:
        worker.proc.join()
    if raised:
        raise raised[0]
    return [r if r is not None else [] for r in results]


def nan_returns(group: Group) -> list:
    """The ``JobReturn`` of each job of a group whose worker died: NaN, as a failed job's."""
    from hydra.core.utils import JobReturn
    from hydra.core.utils import JobStatus

    returns = []
    for _ in group:
        ret = JobReturn()
        ret.status, ret.return_value = JobStatus.COMPLETED, math.nan
        returns.append(ret)
    return returns
