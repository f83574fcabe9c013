"""``distributed.nproc=P``: the run's other P − 1 processes, started from the first.

The process the user started becomes rank 0 (it keeps the tracker, the progress display and
the run's files); it starts ranks 1 … P−1 with :mod:`torch.multiprocessing` (spawn), each with
the same resolved config, and they join one torch.distributed process group over a local TCP
port. What each rank runs: :mod:`fedexp.engine.processes.ranks`.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf, open_dict

from fedexp.engine.processes.ranks import TIMEOUT, Ranks, peer_left
from fedexp.errors import FedexpError

log = logging.getLogger("fedexp")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


def _threads(size: int) -> None:
    """Split this machine's cores among the ranks (unless ``threads`` set them)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // size))


def _join(rank: int, size: int, port: int, backend: str) -> Ranks:
    dist.init_process_group(
        _backend(backend),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=TIMEOUT,
    )
    ranks = Ranks.current()
    assert ranks is not None
    return ranks


def rank_main(
    rank: int, size: int, port: int, config: str, backend: str, job: Callable[[DictConfig], Any]
) -> None:
    """A rank ≥ 1: join the group and run ``job`` on the config.

    ``job`` is the runner's run, without tracker or files. It builds its share of the clients
    while rank 0 builds its own. A user's error (:class:`FedexpError`: a setting, the data) is
    left to rank 0 to print, as under torchrun: every rank builds from the same config and
    data, so rank 0 meets it too. So is a collective, or the group's start, that fails because
    another rank left first (:func:`~fedexp.engine.processes.ranks.peer_left`): that rank says why.
    Anything else is printed with its traceback.
    """
    logging.getLogger("fedexp").setLevel(logging.WARNING)
    cfg = OmegaConf.create(config)
    if not cfg.get("threads"):
        _threads(size)
    try:
        _join(rank, size, port, backend)
        job(cfg)
        dist.barrier()  # with rank 0's stop(): every rank done before the group goes
    except FedexpError:  # a setting or the data: rank 0 meets it too and alone says it
        os._exit(1)
    except BaseException as exc:  # noqa: BLE001 - reported, and the group torn down for rank 0
        if peer_left(exc):  # rank 0 (or another) failed first, and says why
            os._exit(1)
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _leave()


def _leave() -> None:
    """End a rank ≥ 1 that finished: Python's exit handlers run, the C++ runtime's do not.

    Its results are with rank 0 by now. Python's handlers remove what the rank made (a
    ``store=disk`` scratch folder, through its finalizer) and flush its logs; then the process
    ends without the C++ static destructors, where gloo's threads beside interpreter teardown
    could abort it ("terminate called without an active exception") after a good run.
    """
    gc.collect()
    atexit._run_exitfuncs()  # (weakref.finalize's, logging's, multiprocessing's)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start(cfg: DictConfig, output_dir: str, entry: Callable[..., None]) -> tuple[Ranks, list[Any]]:
    """Start ranks 1 … P−1 of ``cfg`` and join the group as rank 0.

    Args:
        cfg: the run's config (``distributed.nproc`` = P > 1).
        output_dir: the run's folder (rank 0's; the others write nothing).
        entry: a module-level function ``(rank, size, port, config, backend)`` that calls
            :func:`rank_main` with the job (the runner's, which this module cannot import).

    Returns:
        (this process's :class:`Ranks`, the started processes: :func:`stop` them).
    """
    size = int(cfg.distributed.nproc)
    backend = str(cfg.distributed.get("backend", "auto"))
    child = cfg.copy()
    with open_dict(child):
        child.output_dir = output_dir
        child.progress = "none"
    config = OmegaConf.to_yaml(child, resolve=True)
    port = _free_port()
    context = mp.get_context("spawn")
    procs = [
        context.Process(target=entry, args=(r, size, port, config, backend), daemon=True)
        for r in range(1, size)
    ]
    for p in procs:
        p.start()
    if not cfg.get("threads"):
        _threads(size)
    try:
        ranks = _join(0, size, port, backend)
    except BaseException:
        stop(procs, failed=True)
        raise
    log.info("distributed: %d processes (%s)", size, dist.get_backend())
    return ranks, procs


def stop(procs: list[Any], *, failed: bool = False) -> None:
    """Wait for the other ranks (or end them, when the run failed) and leave the group."""
    if not failed and dist.is_initialized():
        dist.barrier()
    for rank, p in enumerate(procs, start=1):
        if failed:
            p.terminate()
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
        elif not failed and p.exitcode:  # after the last barrier: the run's results are whole
            log.warning("rank %d ended with exit code %s after the run finished", rank, p.exitcode)
    if dist.is_initialized():
        dist.destroy_process_group()
