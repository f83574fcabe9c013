"""The exchanges of a run over several processes (fedexp.engine.processes.ranks) on two gloo ranks:
bytes of any length gathered whole and in rank order (one collective for short records, a
second for the rest), and the weighted upload sums added the same whether they travel with
the round's records or through all_reduce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedexp.engine.processes.ranks import SHORT

pytestmark = pytest.mark.slow  # several processes or whole CLI runs: make test-slow


def _exchanges(out: Path, limit: int) -> dict:
    from distributed_worker import exchanges
    from distributed_worker import spawn_ranks

    spawn_ranks(exchanges, str(out), limit, timeout=300)
    return json.loads((out / "exchanges.json").read_text())


@pytest.mark.parametrize("limit", [1 << 12, 0], ids=["with-the-records", "all-reduce"])
def test_two_ranks_gather_bytes_whole_and_add_weighted_sums(tmp_path, limit):
    got = _exchanges(tmp_path, limit)
    for mine in (0, 1, SHORT - 8, SHORT - 7, 3 * SHORT + 5):
        expected = [[(r * 31 + i) % 251 for i in range(mine + r)] for r in range(2)]
        assert got[str(mine)] == expected, mine
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(6, 3, 4, generator=gen)
    b = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    w = torch.arange(1, 7, dtype=torch.float64) / 21
    want_a = (w.float()[:, None, None] * a).sum(0)
    want_b = (w[:, None] * b).sum(0)
    assert got["uploaded"] is True
    assert got["inline"] == [limit > 0] * 2
    torch.testing.assert_close(torch.tensor(got["mean"]["a"]).reshape(3, 4), want_a)
    torch.testing.assert_close(
        torch.tensor(got["mean"]["b"], dtype=torch.float64), want_b, rtol=1e-12, atol=1e-12
    )
    even = [0, 2, 4]  # only rank 0 sent: the sum is its senders' alone, on both ranks
    alone = got["rank 0 alone"]
    torch.testing.assert_close(
        torch.tensor(alone["a"]).reshape(3, 4), (w.float()[even, None, None] * a[even]).sum(0)
    )
    torch.testing.assert_close(
        torch.tensor(alone["b"], dtype=torch.float64), (w[even, None] * b[even]).sum(0)
    )
