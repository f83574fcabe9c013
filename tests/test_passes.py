"""Local epochs are a shuffling DataLoader's epochs (issues 23 and 44): ``sampling=shuffle``.

pFedSOP (§V-B), FedRep, FedALA and TDPFed train "one local epoch" as a pass of a shuffling
DataLoader: every sample once, in a random order, a fresh order each epoch, cut into ⌈n/B⌉
batches of B with a short last batch of n mod B. With ``sampling=shuffle`` (the default) a
client's minibatches cut successive pseudorandom permutations of its data epoch by epoch
(``fedexp.engine.solver.passes.pass_indices``), counter-based like the draws with replacement, so a
client draws the same alone, in any cohort and in any grouping; in a cohort of unequal clients
a short batch is padded to B and its padding weighs nothing.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedexp import streams
from fedexp.engine.runner import build_engine
from fedexp.engine.solver import passes
from fedexp.engine.solver.steps import draw_batch
from fedexp.models.task import PADDING
from helpers import cohort_of

pytestmark = pytest.mark.usefixtures("one_thread")


def _epochs(keys: torch.Tensor, num: torch.Tensor, size: int, epochs: int) -> list[list[int]]:
    """Each stream's samples of its first ``epochs`` epochs, in order, padding left out."""
    per = [math.ceil(int(n) / size) for n in num]
    out: list[list[int]] = [[] for _ in per]
    for t in range(epochs * max(per)):
        draws = torch.full_like(keys, t)
        idx = passes.pass_indices(keys, draws, size, num)
        valid = passes.pass_valid(draws, size, num)
        for i, p in enumerate(per):
            if t < epochs * p:
                out[i].extend(idx[i][valid[i]].tolist())
    return out


@pytest.mark.parametrize("size", [1, 3, 32, 100])
def test_each_epoch_is_a_permutation_in_short_last_batches(size):
    """Epoch e of a stream is ⌈n/B⌉ draws whose samples (padding left out) are a permutation of
    its n samples; every batch is full but the last, which holds n − (⌈n/B⌉ − 1)·B, for every
    domain size (powers of two, one above, one sample) and batch size."""
    sizes = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 64, 65, 100, 255, 256, 257]
    keys = streams.stream_keys(3, streams.CLIENT, 1, list(range(len(sizes))))
    num = torch.tensor(sizes)
    seqs = _epochs(keys, num, size, 3)
    for i, n in enumerate(sizes):
        assert len(seqs[i]) == 3 * n
        for e in range(3):
            assert sorted(seqs[i][e * n : (e + 1) * n]) == list(range(n)), (n, e)
        per = math.ceil(n / size)
        widths = [passes.pass_width(t, size, n) for t in range(3 * per)]
        assert widths == ([size] * (per - 1) + [n - (per - 1) * size]) * 3
        valid = passes.pass_valid(torch.arange(3 * per), size, torch.full((3 * per,), n))
        assert valid.sum(1).tolist() == widths
        assert all(v[:w].all() and not v[w:].any() for v, w in zip(valid, widths, strict=True))


def test_passes_differ_and_orders_are_uniform():
    """Each pass has its own order, each stream its own; over many streams the first sample of
    a pass is uniform (χ²) and so is the pair of the first two (no structure the Feistel
    network leaves behind)."""
    m, n = 4000, 6
    keys = streams.stream_keys(0, streams.CLIENT, 0, list(range(m)))
    seq = torch.tensor(_epochs(keys, torch.full((m,), n), n, 2))
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


def test_local_epochs_visit_every_sample_exactly_e_times(small_cfg):
    """The engine's default draws: E·⌈n/B⌉ minibatches of a cohort of unequal clients visit
    each client's every training sample exactly E times, and nothing more: the padding of the
    short batches is marked (with replacement they miss about e⁻¹ of them)."""
    engine = build_engine(small_cfg("local_epochs=2", "batch_size=8"))
    assert engine.ctx.sampling == "shuffle"
    clients = list(range(len(engine.clients)))
    num = [engine.clients[n].num_train for n in clients]
    assert len({n % 8 for n in num}) > 1  # clients whose last batches differ
    cohort = cohort_of(engine, clients, 0)
    steps = [engine.ctx.steps_for(engine.clients[n]) for n in clients]
    assert steps == [2 * math.ceil(n / 8) for n in num]
    seen: list[list[int]] = [[] for _ in clients]
    for t in range(max(steps)):
        draws = cohort.draws.clone()
        x, y = draw_batch(engine.ctx, cohort)
        idx = passes.pass_indices(cohort.keys, draws, 8, engine.pool.size[cohort.rows])
        for i, n in enumerate(clients):
            if t >= steps[i]:
                continue
            keep = y[i] != PADDING
            data = engine.clients[n]
            assert torch.equal(x[i][keep], data.x_train[idx[i][keep]])
            assert torch.equal(y[i][keep], data.y_train[idx[i][keep]].to(y.dtype))
            seen[i].extend(idx[i][keep].tolist())
    for i, n in enumerate(num):
        assert sorted(seen[i]) == sorted(list(range(n)) * 2)
    keys, draws = cohort.keys, torch.zeros_like(cohort.draws)
    idx = torch.cat(
        [
            passes.minibatch_indices(
                keys, draws + t, 8, engine.pool.size[cohort.rows], "replacement"
            )
            for t in range(math.ceil(num[0] / 8))
        ],
        1,
    )
    assert len(set(idx[0, : num[0]].tolist())) < num[0]


def test_a_stream_alone_draws_the_short_batch_unpadded(small_cfg):
    """What a client's stream gives it alone (``ClientData.batch``) is its cohort row without
    the padding: the short last batch of an epoch has n mod B samples."""
    engine = build_engine(small_cfg("batch_size=8"))
    clients = [0, 2, 4]
    cohort = cohort_of(engine, clients, 1)
    by_client = passes.client_streams(engine.seed, 1, clients)
    for _ in range(math.ceil(max(engine.clients[n].num_train for n in clients) / 8)):
        x, y = draw_batch(engine.ctx, cohort)
        for i, n in enumerate(clients):
            xb, yb = engine.clients[n].batch(8, by_client[n])
            keep = y[i] != PADDING
            assert torch.equal(xb, x[i][keep]) and torch.equal(yb.to(y.dtype), y[i][keep])


def test_sampling_is_a_setting(small_cfg):
    with pytest.raises(Exception, match="sampling='bogus'"):
        build_engine(small_cfg("sampling=bogus"))
    engine = build_engine(small_cfg("sampling=replacement"))
    assert engine.ctx.sampling == "replacement"


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_the_compiled_kernel_is_the_tensor_arithmetic(device):
    """On the CPU ``pass_indices`` runs a compiled loop (once it pays: ``passes._compiled``), and
    for a cohort on a GPU the same loop on the host (``passes.pass_indices_host``: no cycle walk
    read back): bit for bit the tensor version, for every domain size, batch size and draw
    counter, and on the cohort's device."""
    from fedexp.engine.solver.passes_cpu import pass_indices_cpu

    gen = torch.Generator().manual_seed(0)
    m = 200
    keys = streams.stream_keys(7, streams.CLIENT, 3, list(range(m)))
    num = torch.randint(1, 5000, (m,), generator=gen)
    num[:12] = torch.tensor([1, 2, 3, 4, 5, 7, 8, 9, 255, 256, 257, 4096])
    draws = torch.randint(0, 200, (m,), generator=gen)
    on = [t.to(device) for t in (keys, draws, num)]
    for size in (1, 7, 32, 129):
        tensor = passes.pass_indices_tensor(*on[:2], size, on[2])
        assert tensor.device.type == device
        assert torch.equal(pass_indices_cpu(keys, draws, size, num, passes._PASS, passes._ROUND),
                           tensor.cpu()), size  # fmt: skip
        host = passes.pass_indices_host(*on[:2], size, on[2])
        assert host.device.type == device and torch.equal(host, tensor), size
        # a cohort's way: keys, counters and sizes on the host, the indices on the device
        sent = passes.pass_indices(keys, draws, size, num, device)
        assert sent.device.type == device and torch.equal(sent, tensor), size
        if device != "cpu":  # every call there takes the host's kernel
            assert torch.equal(passes.pass_indices(*on[:2], size, on[2]), tensor), size


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampling", ["shuffle", "replacement"])
def test_a_gpu_cohort_draws_its_minibatches_without_waiting_for_the_device(small_cfg, sampling):
    """A cohort keeps its rows, keys and draw counters on the host (``Cohort``'s docstring):
    its minibatches' indices are drawn there and reach the GPU in copies the host does not
    wait for, so that drawing a block of steps and a single step makes no synchronisation
    (``torch.cuda.set_sync_debug_mode("error")`` raises at one)."""
    from fedexp.engine.solver.steps import Ahead
    from fedexp.engine.solver.steps import draw_batch

    engine = build_engine(small_cfg("device=cuda", f"sampling={sampling}", "batch_size=8"))
    ctx = engine.ctx
    cohort = cohort_of(engine, list(range(len(engine.clients))), 0)
    assert {t.device.type for t in (cohort.rows, cohort.keys, cohort.draws)} == {"cpu"}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, y = draw_batch(ctx, cohort, Ahead(ctx, cohort, 6))
        x1, y1 = draw_batch(ctx, cohort)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert x.device.type == x1.device.type == "cuda"
    assert cohort.draws.tolist() == [2] * len(cohort)


@pytest.mark.parametrize(
    "model", [("model=logreg",), ("model=mlp", "model.hidden=6", "model.norm=batch")]
)
def test_a_cohort_of_unequal_clients_trains_as_each_alone_in_plain_epochs(small_cfg, model):
    """30 steps of a cohort of clients whose epochs differ in length and in n mod B (short
    batches padded at different steps; one vmapped step, BatchNorm's too, its statistics over
    the rows that are not padding) equal, client by client, a plain loop: the epochs of a
    shuffling DataLoader, batches of B and a short last one, a plain SGD step on the mean loss
    of each batch (autograd on the module; BatchNorm's statistics of the batch's samples)."""
    engine = build_engine(small_cfg(*model, "local_steps=30", "batch_size=8", "lr=0.1"))
    ctx = engine.ctx
    clients = list(range(len(engine.clients)))
    num = [engine.clients[n].num_train for n in clients]
    assert len({n % 8 for n in num}) > 2 and len({math.ceil(n / 8) for n in num}) > 1
    assert all(n % 8 == 0 or math.ceil(n / 8) < 30 for n in num)  # short batches are met
    cohort = cohort_of(engine, clients, 0)
    start = engine.server["x"].detach().clone()
    params = start.expand(len(clients), -1).clone()
    out = ctx.train(params, cohort, steps=30, lr=0.1)
    objective = ctx.model_objective()
    for i, n in enumerate(clients):
        data, p, key = engine.clients[n], start.clone(), cohort.keys[i : i + 1]
        size = torch.tensor([num[i]])

        def batches(data=data, key=key, size=size):  # noqa: ANN001, ANN202
            """torch's DataLoader, epoch after epoch; epoch e's order: the stream's e-th."""
            for e in range(30):
                order = passes.pass_indices(key, torch.tensor([e]), int(size), size)[0].tolist()
                dataset = torch.utils.data.TensorDataset(data.x_train, data.y_train)
                yield from torch.utils.data.DataLoader(dataset, batch_size=8, sampler=order)

        for _, (xb, yb) in zip(range(30), batches(), strict=False):
            _, grad, post = ctx.loss_grad_post(objective, p, xb, yb, None)
            p = p - 0.1 * grad
            if post is not None:  # running statistics: the forward pass's
                p = torch.where(ctx.model.buffer_mask, post, p)
        torch.testing.assert_close(out.params[i], p, rtol=1e-5, atol=1e-6)


def test_a_process_loads_the_compiled_kernel_once_the_tensor_path_has_cost_as_much(
    monkeypatch, small_cfg
):
    """Rent or buy (``passes._compiled``): the tensor path draws until its estimated cost reaches
    the compiled kernel's start, every later call goes to the kernel, and a run's figures are
    the same whichever path drew them."""
    from fedexp.engine.solver import passes_cpu

    calls = []
    tensor, kernel = passes.pass_indices_tensor, passes_cpu.pass_indices_cpu
    monkeypatch.setattr(passes, "pass_indices_tensor", lambda *a: calls.append("t") or tensor(*a))
    monkeypatch.setattr(passes_cpu, "pass_indices_cpu", lambda *a: calls.append("k") or kernel(*a))
    monkeypatch.setattr(passes, "_tensor_spent_ms", 0.0)
    keys = streams.stream_keys(1, streams.CLIENT, 0, list(range(10)))
    draws, num = torch.zeros(10, dtype=torch.int64), torch.full((10,), 50)
    per_call = passes._TENSOR_CALL_MS + passes._TENSOR_INDEX_MS * 10 * 32
    first = int(-(-passes._KERNEL_START_MS // per_call))  # calls until the spent cost reaches it
    for _ in range(first + 3):
        passes.pass_indices(keys, draws, 32, num)
    assert calls == ["t"] * first + ["k"] * 3

    def final_states(spent: float) -> list:
        monkeypatch.setattr(passes, "_tensor_spent_ms", spent)
        engine = build_engine(small_cfg("algorithm=ditto", "local_steps=7", "batch_size=4"))
        engine.setup()
        for _ in range(3):
            engine.run_round()
        states = [v for s in engine.client_states for _, v in sorted(s.items())]
        return [v for _, v in sorted(engine.server.items())] + states

    calls.clear()
    by_tensor = final_states(-1e9)  # never reaches the kernel
    assert set(calls) == {"t"}
    calls.clear()
    by_kernel = final_states(passes._KERNEL_START_MS)  # the kernel from the first draw
    assert set(calls) == {"k"}
    assert len(by_tensor) > 5
    for a, b in zip(by_tensor, by_kernel, strict=True):
        assert torch.equal(a, b)


def test_stream_keys_hash_their_fixed_part_on_the_host_as_the_tensor_hash():
    """``streams.stream_keys`` hashes (seed, purpose, round) in Python integers
    (``streams._mix64_int``, no tensor to copy to the ids' device): bit for bit the tensor
    ``mix64`` of the same values, for seeds and rounds across the 64-bit range."""
    import random

    r = random.Random(0)
    values = [0, 1, -1, 2**63 - 1, -(2**63)] + [streams._s64(r.getrandbits(64)) for _ in range(500)]
    hashed = streams.mix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [streams._mix64_int(v) for v in values] == hashed
    ids = torch.arange(64)
    for seed, purpose, round_ in ((0, 0, 0), (7, streams.CLIENT, 3), (2**64 - 1, 5, 10**6)):
        head = streams.mix64(torch.tensor(streams._s64(seed)))
        head = streams.mix64(streams.mix64(head ^ purpose) ^ round_)
        assert torch.equal(streams.stream_keys(seed, purpose, round_, ids),
                           streams._srl(streams.mix64(head ^ ids), 1))  # fmt: skip


@pytest.mark.parametrize(
    "model",
    [("model=logreg",), ("model=mlp", "model.hidden=6", "dataset=digits")],
    ids=["logistic", "softmax-10-classes"],
)
def test_steps_of_whole_batches_skip_the_masks_to_the_same_bits(small_cfg, monkeypatch, model):
    """A step whose batches are all whole (``Ahead.short_steps`` false) takes the stacked
    loss without its padding masks (``ClassificationTask.loss_stacked(full=True)``): fewer ops,
    and every figure of the run the same bits as with the masks at every step."""
    from fedexp.engine.round.census import Census
    from fedexp.engine.solver.steps import Ahead

    settings = (*model, "partition=iid", "local_steps=10", "batch_size=32", "rounds=2")
    short_steps, seen = Ahead.short_steps, []

    def recorded(valid):  # noqa: ANN001, ANN202
        flags = short_steps(valid)
        seen.extend(flags)
        return flags

    def run() -> tuple[Census, object]:
        torch.manual_seed(0)
        engine = build_engine(small_cfg(*settings))
        assert engine.ctx.model.stacks  # the stacked loss (no vmap)
        engine.setup()
        with Census() as census:
            for _ in range(2):
                engine.run_round()
        return census, engine

    monkeypatch.setattr(Ahead, "short_steps", staticmethod(recorded))
    skipping, engine = run()
    assert True in seen and False in seen  # steps of both kinds were taken
    monkeypatch.setattr(Ahead, "short_steps", staticmethod(lambda v: [True] * len(short_steps(v))))
    masked, reference = run()
    assert skipping.total_ops < masked.total_ops, (skipping.summary(), masked.summary())
    assert skipping.total_reads == masked.total_reads
    assert torch.equal(engine.server["x"], reference.server["x"])
    for a, b in zip(engine.client_states, reference.client_states, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_stacked_loss_without_masks_gives_the_masked_bits():
    """``loss_stacked(full=True)`` (no label is padding) gives the masked loss's values and
    gradients bit for bit, binary (one logit) and softmax, at batch sizes with vector tails."""
    from fedexp.models.task import ClassificationTask

    for classes in (1, 3):
        task = ClassificationTask(max(2, classes))
        for size in (3, 4, 13, 32, 100):
            g = torch.Generator().manual_seed(size)
            logits = (3 * torch.randn(7, size, classes, generator=g)).requires_grad_(True)
            y = torch.randint(0, max(2, classes), (7, size), generator=g)
            out = []
            for full in (False, True):
                loss = task.loss_stacked(logits, y, full)
                (grad,) = torch.autograd.grad(loss.sum(), logits)
                out.append((loss.detach(), grad))
            (a, ga), (b, gb) = out
            assert torch.equal(a, b) and torch.equal(ga, gb), (classes, size)


def test_a_step_is_short_where_some_client_has_padding():
    """``Ahead.short_steps``: a step holds a short batch exactly where some client's batch
    has an entry that is not a sample (its padding is a suffix: the last entry tells)."""
    from fedexp.engine.solver.steps import Ahead

    sizes = torch.tensor([1, 5, 7, 8, 9, 16, 17, 31, 32, 33])
    for size in (1, 3, 8, 16):
        for group in (sizes[:1], sizes[3:4], sizes[5:6], sizes):
            m, k = len(group), 12
            draws = torch.arange(k).repeat(m) + torch.repeat_interleave(torch.arange(m), k)
            valid = passes.pass_valid(draws, size, group.repeat_interleave(k)).view(m, k, size)
            expected = (~valid).any(2).any(0).tolist()
            assert Ahead.short_steps(valid) == expected, (size, group.tolist())
