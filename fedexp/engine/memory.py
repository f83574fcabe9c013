"""Memory: the budget a cohort's local step may fill, a client's share of it, the round's peak.

A cohort trains as one computation (:mod:`fedexp.engine.solver.steps`), so its activations
grow with the clients of a step: DenseNet-BC on 16 LUNA16 patches keeps about 0.5 GiB a
client, 53 GB for 100 clients on an H200 (docs/benchmarks.md). The solver cuts a cohort into
slices of clients that fit :attr:`Context.memory_budget`, from a measured estimate of one
client's step (:func:`client_step_bytes`); the slices' results equal the whole cohort's
(each client's draws and arithmetic are its own). The round logs its peak
(:func:`peak_mib`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
from typing import TYPE_CHECKING

import torch

from fedexp.models import conv_gemm

if TYPE_CHECKING:
    from fedexp.engine.solver.context import Context

#: what a client's step holds beyond the tensors autograd saves for the backward pass: the
#: gradients flowing back, vmap's batched copies of weights and norms' statistics, the
#: allocator's rounding. Measured: DenseNet-BC (k=6, 3 blocks of 16) on 16 patches of 32x32
#: saves 270 MiB a client, and its vmapped cohort peaked at 534 MiB a client on an H200.
OVERHEAD = 2.0
#: the share of the device's free memory (CUDA) or of the available RAM (CPU) that an
#: ``auto`` budget takes
CUDA_SHARE = 0.8
CPU_SHARE = 0.5

log = logging.getLogger("fedexp")


def resolve_budget(gib: float, device: torch.device) -> int:
    """The budget in bytes: ``gib`` GiB if > 0, else from what the device has free now.

    Args:
        gib: the ``memory_budget`` setting (GiB; 0: auto).
        device: the run's device.
    """
    if gib > 0:
        return int(gib * 2**30)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_SHARE)
    return int(available_ram() * CPU_SHARE)


def available_ram() -> int:
    """Bytes of memory available to a new allocation (``MemAvailable``; else free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 4 * 2**30


def client_step_bytes(ctx: Context, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes one client's local step on the minibatch (x, y) takes, estimated.

    Measured once per shape by running the task's loss and its backward pass on the model's
    initial parameters: the distinct tensors autograd saves for the backward, other than the
    parameters and the inputs (the activations), and with ``conv_gemm`` the receptive fields
    a cohort's convolutions copy (:func:`fedexp.models.conv_gemm.counting_fields`), times
    :data:`OVERHEAD`, plus the parameters' own rows (parameters, gradient, an optimiser's
    two moments).
    """
    key = (tuple(x.shape), tuple(y.shape))
    cached = ctx.step_bytes.get(key)
    if cached is not None:
        return cached
    params = ctx.model.initial().detach()
    if x.is_floating_point():  # the data's precision (a float64 run's too)
        params = params.to(x.dtype)
    params.requires_grad_(True)
    held = {params.untyped_storage().data_ptr(), x.untyped_storage().data_ptr()}
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in held:  # not the parameters or the inputs
            seen[(t.data_ptr(), t.nbytes)] = t.nbytes
        return t

    fields = (
        conv_gemm.counting_fields(ctx.model.module)
        if getattr(ctx.model, "conv_gemm", False)
        else contextlib.nullcontext([])
    )
    with (
        fields as copies,
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        loss = ctx.task.loss(ctx.model(params, x), y)
    loss.backward()
    saved = sum(seen.values()) + sum(copies)  # + the cohort path's receptive fields
    out = int(saved * OVERHEAD) + 4 * params.numel() * params.element_size()
    ctx.step_bytes[key] = out
    log.info(
        "memory: a client's local step on %s inputs takes about %s; the budget of %s holds "
        "%d clients a step",
        "x".join(map(str, x.shape)),
        _size(out),
        _size(ctx.memory_budget),
        ctx.memory_budget // max(1, out),
    )
    return out


def _size(n: float) -> str:
    """``n`` bytes in the largest unit that keeps it ≥ 1."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


#: glibc's ``mallopt`` parameters (``malloc.h``)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: what freed memory glibc keeps: every block it frees up to this size, and this much free
#: memory at the heap's top before it gives any back
KEEP_BYTES = 2**30
#: whether :func:`keep_freed_memory` took in this process (None: not called yet)
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Have glibc's ``malloc`` keep the memory tensors free for the next ones (a run's CPU).

    PyTorch's CPU allocator takes each tensor from ``malloc``. glibc maps a block of 32 MiB
    or more (at first 128 KiB, rising with what is freed) straight from the kernel and
    unmaps it when it is freed, and gives the heap's free top back to the kernel beyond
    twice that. A round makes and frees the same large tensors step after step (a cohort's
    ``[m, d]`` parameters, gradients, updates), so each was fresh memory again: the kernel
    faulted in and zeroed every page of it at its first write. With both thresholds at
    :data:`KEEP_BYTES` the freed blocks stay in the heap and the next tensor of that size
    reuses them. ``p - 0.1 * g`` on 4 rows of 11 million floats (a ResNet-18 each), one
    thread: 160 ms before, 63 ms after; on 10 rows of 64,642 (the 2-conv CNN), 1.65 ms and
    0.54 ms; the process's peak resident memory 8 % higher in the first case. Up to a GiB
    of what a run frees then stays the process's until it ends (its peak is what it held
    anyway).

    Returns:
        Whether the setting took (False where the C library is not glibc, or the call
        failed): nothing else changes then.
    """
    global _kept
    if _kept is not None:
        return _kept
    _kept = False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
            return False
        _kept = bool(libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES)
        )
    except OSError:
        pass
    return _kept


def reset_peak(device: torch.device) -> None:
    """Start the next peak from now (CUDA; the CPU's resident peak is the process's own)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float:
    """The peak memory since :func:`reset_peak`, MiB.

    The CUDA allocator's on CUDA; on the CPU the process's peak resident memory so far
    (``getrusage``'s ``ru_maxrss``).
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
