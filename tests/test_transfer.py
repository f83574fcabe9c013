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


#: where fedexp still makes a tensor on a device from host values in one call, and why
DIRECT = {
    "fedexp/engine/processes/ranks.py": "a collective's message length (the gather waits anyway)",
    "fedexp/graph/prox.py": "a threshold that is a tensor already",
    "fedexp/graph/incidence.py": "a graph's edges when it is built (device None: theirs)",
}


def test_host_values_reach_a_device_through_to_device():
    """``torch.tensor(..., device=...)`` / ``torch.as_tensor(..., device=...)`` of host values
    copies from pageable memory, which a GPU's host waits for: fedexp's code sends them
    through :func:`fedexp.transfer.to_device` instead, but where :data:`DIRECT` says why not."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found: dict[str, list[int]] = {}
    for path in sorted((root / "fedexp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and node.func.attr in ("tensor", "as_tensor")
                and any(k.arg == "device" for k in node.keywords)
            ):
                found.setdefault(str(path.relative_to(root)), []).append(node.lineno)
    assert set(found) <= set(DIRECT), {p: v for p, v in found.items() if p not in DIRECT}
    gone = set(DIRECT) - set(found)
    assert not gone, f"no longer direct, to leave DIRECT: {gone}"
