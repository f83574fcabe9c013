"""Local epochs are shuffled passes (issue 23, item 1): the draws of ``sampling=shuffle``.

pFedSOP (§V-B), FedRep, FedALA and TDPFed train "one local epoch" as a pass of a shuffling
DataLoader: every sample once, in a random order, a fresh order each pass. With
``sampling=shuffle`` (the default) a client's minibatches cut successive pseudorandom
permutations of its data (``fedexp.engine.rng.pass_indices``), counter-based like the draws
with replacement, so a client draws the same alone, in any cohort and in any grouping.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.engine import rng
from fedexp.engine.runner import build_engine
from fedexp.engine.solver.steps import draw_batch
from helpers import cohort_of

pytestmark = pytest.mark.usefixtures("one_thread")


def _sequence(keys: torch.Tensor, num: torch.Tensor, size: int, draws: int) -> torch.Tensor:
    """The first ``draws`` minibatches of each stream, concatenated: [m, draws · size]."""
    return torch.cat(
        [rng.pass_indices(keys, torch.full_like(keys, t), size, num) for t in range(draws)], 1
    )


@pytest.mark.parametrize("size", [1, 3, 32, 100])
def test_each_pass_is_a_permutation(size):
    """Positions [e·n, (e+1)·n) of a stream's sequence are a permutation of its n samples,
    for every domain size (powers of two, one above, one sample) and batch size."""
    sizes = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 64, 65, 100, 255, 256, 257]
    keys = rng.stream_keys(3, rng.CLIENT, 1, list(range(len(sizes))))
    num = torch.tensor(sizes)
    seq = _sequence(keys, num, size, math.ceil(3 * max(sizes) / size))
    for i, n in enumerate(sizes):
        for e in range(3):
            assert sorted(seq[i, e * n : (e + 1) * n].tolist()) == list(range(n)), (n, e)


def test_passes_differ_and_orders_are_uniform():
    """Each pass has its own order, each stream its own; over many streams the first sample of
    a pass is uniform (χ²) and so is the pair of the first two (no structure the Feistel
    network leaves behind)."""
    m, n = 4000, 6
    keys = rng.stream_keys(0, rng.CLIENT, 0, list(range(m)))
    seq = _sequence(keys, torch.full((m,), n), n, 2)
    first, second = seq[:, 0], seq[:, 1]
    same = float((seq[:, :n] == seq[:, n:]).all(1).float().mean())
    assert same < 3 / math.factorial(n)  # passes differ (uniform orders: 1 / 720 alike)
    counts = torch.bincount(first, minlength=n).double()
    chi2 = float(((counts - m / n) ** 2 / (m / n)).sum())
    assert chi2 < 20.5  # χ²(5), 0.999 quantile
    pairs = torch.bincount(first * n + second, minlength=n * n).double()
    pairs = pairs[pairs > 0]  # the 30 ordered pairs of distinct samples
    assert pairs.numel() == n * (n - 1)
    expected = m / pairs.numel()
    chi2 = float(((pairs - expected) ** 2 / expected).sum())
    assert chi2 < 59.7  # χ²(29), 0.999 quantile


def test_one_local_epoch_visits_every_sample_once(small_cfg):
    """The engine's default draws: ⌈n/B⌉ minibatches of a cohort visit each client's every
    training sample, each once within its first n positions (with replacement they miss
    about e⁻¹ of them)."""
    engine = build_engine(small_cfg("local_epochs=1", "batch_size=8"))
    assert engine.ctx.sampling == "shuffle"
    clients = list(range(len(engine.clients)))
    cohort = cohort_of(engine, clients, 0)
    num = [engine.clients[n].num_train for n in clients]
    seen = [[] for _ in clients]
    pool = engine.pool
    for _ in range(math.ceil(max(num) / 8)):
        draw_batch(engine.ctx, cohort)
    keys, draws = cohort.keys, torch.zeros_like(cohort.draws)
    for t in range(math.ceil(max(num) / 8)):
        idx = rng.minibatch_indices(keys, draws + t, 8, pool.size[cohort.rows], "shuffle")
        for i in range(len(clients)):
            seen[i].extend(idx[i].tolist())
    for i, n in enumerate(num):
        assert sorted(seen[i][:n]) == list(range(n))
    engine.ctx.sampling = "replacement"
    idx = torch.cat(
        [
            rng.minibatch_indices(keys, draws + t, 8, pool.size[cohort.rows], "replacement")
            for t in range(math.ceil(num[0] / 8))
        ],
        1,
    )
    assert len(set(idx[0, : num[0]].tolist())) < num[0]


def test_draw_batch_gathers_the_pass_indices(small_cfg):
    """What the solver gathers is each client's rows at its pass indices."""
    engine = build_engine(small_cfg("batch_size=8"))
    clients = [0, 2, 4]
    cohort = cohort_of(engine, clients, 1)
    x, y = draw_batch(engine.ctx, cohort)
    idx = rng.pass_indices(cohort.keys, torch.zeros_like(cohort.draws), 8,
                           engine.pool.size[cohort.rows])  # fmt: skip
    for i, n in enumerate(clients):
        data = engine.clients[n]
        assert torch.equal(x[i], data.x_train[idx[i]])
        assert torch.equal(y[i], data.y_train[idx[i]])
    assert cohort.draws.tolist() == [1, 1, 1]


def test_sampling_is_a_setting(small_cfg):
    with pytest.raises(Exception, match="sampling='bogus'"):
        build_engine(small_cfg("sampling=bogus"))
    engine = build_engine(small_cfg("sampling=replacement"))
    assert engine.ctx.sampling == "replacement"


def test_the_cpu_kernel_is_the_tensor_arithmetic():
    """On the CPU ``pass_indices`` runs a compiled loop: bit for bit the tensor version (the
    one other devices run), for every domain size, batch size and draw counter."""
    gen = torch.Generator().manual_seed(0)
    m = 200
    keys = rng.stream_keys(7, rng.CLIENT, 3, list(range(m)))
    num = torch.randint(1, 5000, (m,), generator=gen)
    num[:12] = torch.tensor([1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 4096])
    draws = torch.randint(0, 200, (m,), generator=gen)
    for size in (1, 7, 32, 129):
        assert torch.equal(
            rng.pass_indices(keys, draws, size, num),
            rng.pass_indices_tensor(keys, draws, size, num),
        ), size
