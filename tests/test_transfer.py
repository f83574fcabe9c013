"""Host-made tensors onto the run's device without a host wait (``fedexp.transfer``, issue 39)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedexp.data.client import client_ids
from fedexp.transfer import to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_values_arrive_on_the_device_with_their_dtype(device):
    """Lists, arrays and tensors arrive equal, on the device, in the asked dtype; on the CPU
    the host tensor itself (nothing copied)."""
    for values, dtype in (([3, 1, 2], torch.int64), ([0.5, 0.25], torch.float32),
                          (np.arange(5), None), (torch.arange(4.0), torch.float64)):  # fmt: skip
        out = to_device(values, device, dtype)
        want = torch.as_tensor(values, dtype=dtype)
        assert out.device.type == device and out.dtype == want.dtype
        assert torch.equal(out.cpu(), want)
    host = torch.arange(6)
    assert to_device(host, "cpu") is host
    ids = client_ids([4, 9, 2], device)
    assert ids.device.type == device and ids.tolist() == [4, 9, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_copy_to_the_gpu_does_not_synchronise():
    """From page-locked memory the copy is queued: ``set_sync_debug_mode("error")`` lets it
    pass, where a plain ``.to("cuda")`` of pageable memory raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = to_device([1, 2, 3], "cuda", torch.int64)
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2, 3]).to("cuda")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.tolist() == [1, 2, 3]
