"""Large CPU tensors on transparent huge pages (fedexp.engine.clients.hugepages): the run's pool of
training data and the clients' state columns in memory."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedexp.engine.clients import hugepages
from fedexp.engine.clients.pool import ClientTable
from fedexp.engine.clients.states import ClientStates

LINUX = sys.platform.startswith("linux")


def _vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``address`` (Linux)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_large_tensor_is_zero_writable_and_outlives_its_maker():
    shape = (hugepages.MIN_BYTES // 4 // 16 + 1, 16)  # just over the threshold in float32
    t = hugepages.zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and not t.any()
    t[::1000] = 3.0
    view = t[4999:5001]
    del t
    gc.collect()  # the mapping lives as long as a view of it does
    assert view.tolist() == [[0.0] * 16, [3.0] * 16]
    e = hugepages.empty((hugepages.MIN_BYTES // 8,), torch.float64)
    e.fill_(1.5)
    assert e.shape == (hugepages.MIN_BYTES // 8,) and float(e.sum()) == 1.5 * len(e)


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
def test_large_tensors_are_advised_huge_and_small_ones_left_to_torch():
    big = hugepages.zeros((hugepages.MIN_BYTES // 4,), torch.float32)
    assert "hg" in _vm_flags(big.data_ptr())  # MADV_HUGEPAGE on its mapping
    small = hugepages.zeros((1000,), torch.float32)
    assert small._base is None and not small.any()
    # (whether torch's own allocations are advised depends on what the process did before:
    # numpy advises its large arrays, and glibc reuses that memory; nothing to assert there)


@pytest.mark.skipif(not LINUX, reason="madvise and /proc/self/smaps are Linux's")
def test_the_pool_and_the_state_columns_in_memory_are_on_huge_pages():
    rows, d = 40_000, 16  # 2.4 MiB of float32 inputs
    x = torch.arange(rows * d, dtype=torch.float32).reshape(rows, d)
    y = torch.arange(rows) % 2
    parts = np.array_split(np.arange(rows), 4)
    splits = (parts, [p[:0] for p in parts], [p[:0] for p in parts])
    table = ClientTable.build(x, y, splits, torch.device("cpu"))
    assert "hg" in _vm_flags(table.pool.x.data_ptr())
    assert torch.equal(table[2].x_train, x[parts[2]])  # the rows it holds are the data's

    size = 40_000  # a 16-float column is 2.4 MiB
    states = ClientStates(size, lambda n: {"v": torch.zeros(16)}, "cpu")
    clients = [0, 7, size - 1]
    states.write(clients, [{"v": torch.full((16,), float(n + 1))} for n in clients])
    col = states._cols["v"]
    assert "hg" in _vm_flags(col.data_ptr())
    assert [float(s["v"][0]) for s in states.rows([0, 1, 7, size - 1])] == [1.0, 0.0, 8.0, size]
