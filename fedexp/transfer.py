"""Values made on the host, onto the run's device in a copy the host does not wait for.

A copy to a GPU from pageable host memory makes the host wait until the device has run
everything queued before it (the device check counts each such wait among a round's host
synchronisations, ``torch.cuda.set_sync_debug_mode``); from page-locked memory the copy is
queued like a kernel and the host goes on. PyTorch's caching host allocator keeps the
page-locked block until the copy has run, so the source may be dropped at once. A round makes
a few such small tensors (its cohort's ids, aggregation weights): on the CPU nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: torch.Tensor | np.ndarray | Sequence[float] | Sequence[int],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``values`` as a tensor on ``device``; from the host to a GPU without a host wait.

    A tensor already on a device is moved as ``Tensor.to`` moves it (nothing to pin).
    """
    host = torch.as_tensor(values, dtype=dtype)
    if host.device.type == "cpu" and torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
