"""Large CPU tensors on transparent huge pages, zero-filled as they are first touched.

A round gathers each sampled client's rows from the run's pool of training data and from the
clients' state columns: random rows of tensors of tens to hundreds of MiB. On 4 KiB pages
nearly every row is a TLB miss and a page-table walk; on 2 MiB pages the tables of a
160 MiB pool fit the TLB's second level. Linux gives anonymous memory huge pages either
always or, in its ``madvise`` mode (the default of many distributions), only to memory that
asks with ``madvise(MADV_HUGEPAGE)``; PyTorch's CPU allocator does not ask. The tensors
made here do.

Measured against torch's own allocation in the same benchmark run (``python
scripts/bench_distributed.py --pages small huge``; the figures are in docs/benchmarks.md):
one process's FedAvg round of 10^4 logistic-regression clients out of 10^5 takes 8 % less
time, Ditto's 7 %.

The memory comes from an anonymous ``mmap``, which the kernel fills with zeros on first
touch, so :func:`zeros` costs no time and no resident memory until rows are written. Where
the kernel has no huge pages (``never``, another system), the same memory stays on 4 KiB
pages: the tensors are the same, only slower to gather from.
"""

from __future__ import annotations

import math
import mmap

import torch

#: Tensors from this size on are mapped (smaller ones gain nothing: one huge page is 2 MiB).
MIN_BYTES = 2 * 2**20


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zero-filled CPU tensor in an anonymous mapping advised huge.

    None when it is small or this system cannot map it that way.
    """
    count = math.prod(shape)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError):
        return None
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: 4 KiB pages, still zero-filled when touched
        pass
    # the tensor keeps ``buf`` alive; the mapping goes when the tensor's storage does
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor, on huge pages when at least :data:`MIN_BYTES`."""
    out = _mapped(shape, dtype)
    return torch.empty(shape, dtype=dtype) if out is None else out


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros, on huge pages when at least :data:`MIN_BYTES`.

    A mapped one costs no time and no memory until its pages are first touched.
    """
    out = _mapped(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if out is None else out
