"""The cohort engine (issues 14, 22): a cohort's messages in one pass equal message by message;
counter-based minibatch draws; the pooled data; batched evaluation; slices; batched losses.
(That every algorithm's figures are what they were before the one path: tests/test_golden.py.)"""

from __future__ import annotations

import math
import types

import pytest
import torch

from fedexp import streams
from fedexp.data.federated import ClientData
from fedexp.data.federated import PoolRows
from fedexp.engine.clients.pool import TrainPool
from fedexp.engine.runner import build_engine
from fedexp.engine.solver import passes
from fedexp.errors import DivergenceError


def _run(small_cfg, *overrides, rounds=3):
    engine = build_engine(small_cfg(*overrides))
    engine.setup()
    history = [engine.run_round() for _ in range(rounds)]
    return engine, history


def _message_by_message(engine):
    """The reference: every message through its channel on its own (``Transport._transmit``)."""
    engine.transport.send_cohort = lambda *args, **kwargs: None
    return engine


@pytest.mark.parametrize("compressor", ["stc", "topk", "sar", "stc_twomean", "topk_zlib"])
def test_a_cohorts_lossy_messages_coded_in_one_pass_equal_message_by_message(small_cfg, compressor):
    """Sparse codecs, error feedback, lossy downlink models, randomised codecs: the batched
    channel (``Transport._transmit_cohort``) sends the same bytes and the same values."""
    over = ("algorithm=fedavg", f"compressor={compressor}", "rounds=3")
    one = _message_by_message(build_engine(small_cfg(*over)))
    batched = build_engine(small_cfg(*over))
    calls = []
    inner = batched.transport._transmit_cohort
    batched.transport._transmit_cohort = lambda *a: calls.append(a[0]) or inner(*a)
    h_one = [one.run_round() for _ in range(3)]
    h_batched = [batched.run_round() for _ in range(3)]
    assert calls == ["down", "up"] * 3  # both ways in one pass every round
    assert torch.equal(batched.server["x"], one.server["x"])
    for d in ("up", "down"):
        assert batched.transport.residual[d].keys() == one.transport.residual[d].keys()
        for k, v in one.transport.residual[d].items():
            assert torch.equal(batched.transport.residual[d][k], v)
        assert batched.transport.replica[d].keys() == one.transport.replica[d].keys()
        for k, v in one.transport.replica[d].items():
            assert torch.equal(batched.transport.replica[d][k], v)
    for a, b in zip(h_one, h_batched, strict=True):
        assert a["bytes/up"] == b["bytes/up"] and a["bytes/down"] == b["bytes/down"]
    assert batched.ledger.messages == one.ledger.messages
    assert h_batched[-1]["bytes/up"] < h_batched[-1]["bytes/up_dense"]  # really compressed


@pytest.mark.parametrize(
    "algorithm,compressor",
    [("feddwa", "stc"), ("feddwa", "randk"), ("ifca", "topk"), ("ifca", "none")],
)
def test_named_parts_in_one_pass_equal_message_by_message(small_cfg, algorithm, compressor):
    """Messages with named parts (FedDWA's two models up; IFCA's clusters down, its update and
    cluster id up) cross their channel part by part in one pass: the same values, residuals,
    replicas, streams and bytes (per part too) as message by message."""
    over = (f"algorithm={algorithm}", f"compressor={compressor}")
    one = _message_by_message(build_engine(small_cfg(*over)))
    batched = build_engine(small_cfg(*over))
    parts = []
    inner = batched.transport._send_part_cohort
    batched.transport._send_part_cohort = lambda *a: parts.append((a[0], a[2])) or inner(*a)
    h_one, h_batched = [], []
    for engine, history in ((one, h_one), (batched, h_batched)):
        engine.setup()
        history.extend(engine.run_round() for _ in range(3))
    assert {name for _, name in parts} >= (
        {"model", "guide"} if algorithm == "feddwa" else {"clusters", "update", "cluster"}
    )
    for key, value in one.server.items():
        assert torch.equal(batched.server[key], value), key
    for d in ("up", "down"):
        for store in ("residual", "replica"):
            a, b = getattr(one.transport, store)[d], getattr(batched.transport, store)[d]
            assert a.keys() == b.keys()
            assert all(torch.equal(b[k], v) for k, v in a.items())
    for a, b in zip(h_one, h_batched, strict=True):
        assert {k: v for k, v in a.items() if k.startswith("bytes/")} == {
            k: v for k, v in b.items() if k.startswith("bytes/")
        }
    assert batched.ledger.messages == one.ledger.messages


def test_cohort_divergence_names_the_lowest_client(small_cfg):
    engine = build_engine(small_cfg("lr=1e38"))
    with pytest.raises(DivergenceError, match=r"^client 0: training loss is (nan|inf)"):
        for _ in range(3):
            engine.run_round()


def test_the_cohorts_finiteness_check_passes_overflowing_sums_and_names_the_first_bad_row(
    small_cfg,
):
    """``steps.check_rows`` checks each row's sum first: a row of finite entries whose sum
    overflows to inf passes, and a row with an inf or a NaN entry (whose sum is finite only
    if it is not checked) is named, the lowest one first."""
    from fedexp.engine.solver import steps

    engine = build_engine(small_cfg())
    cohort = types.SimpleNamespace(clients=[4, 7, 9])
    big = torch.full((3, 5), 3e38)  # every row's sum is inf
    steps.check_rows(engine.ctx, cohort, big, torch.zeros(3), 0.1)
    for bad, row in ((float("inf"), 1), (float("nan"), 2), (-float("inf"), 1)):
        params = big.clone()
        params[row, 3] = bad
        with pytest.raises(DivergenceError, match=rf"^client {cohort.clients[row]}: "):
            steps.check_rows(engine.ctx, cohort, params, torch.zeros(3), 0.1)
    with pytest.raises(DivergenceError, match=r"^client 7: training loss is nan"):
        steps.check_rows(engine.ctx, cohort, big, torch.tensor([0.0, float("nan"), 0.0]), 0.1)


# ------------------------------------------------------------------ the streams
@pytest.mark.parametrize("sampling", passes.SAMPLINGS)
def test_a_streams_draws_are_its_row_of_the_cohort_draw(sampling):
    clients = [0, 3, 7, 11]
    by_client = passes.client_streams(5, 2, clients, sampling)
    sizes = torch.tensor([10, 1, 37, 100])
    alone = []
    for n, num in zip(clients, sizes.tolist(), strict=True):
        alone.append([by_client[n].indices(8, num) for _ in range(3)])
    keys = streams.stream_keys(5, streams.CLIENT, 2, clients)
    for step in range(3):
        draws = torch.full((4,), step, dtype=torch.int64)
        together = passes.minibatch_indices(keys, draws, 8, sizes, sampling)
        for i in range(4):  # alone, a short batch is its row's samples (a prefix)
            width = len(alone[i][step])
            assert width == (
                8 if sampling == "replacement" else passes.pass_width(step, 8, int(sizes[i]))
            )
            assert torch.equal(together[i][:width], alone[i][step])
    assert all(s.draws == 3 for s in by_client.values())
    assert all(int(b.max()) == 0 for b in alone[1])  # one sample: always index 0


def test_batch_indices_are_uniform_and_streams_differ():
    keys = streams.stream_keys(0, streams.CLIENT, 0, list(range(400)))
    idx = streams.batch_indices(
        keys, torch.zeros(400, dtype=torch.int64), 700, torch.full((400,), 7)
    )
    counts = torch.bincount(idx.reshape(-1), minlength=7).double()
    expected = idx.numel() / 7
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 22.5  # χ²(6) 0.999 quantile
    assert len({tuple(r.tolist()) for r in idx}) == 400  # no two clients draw alike
    other_round = streams.stream_keys(0, streams.CLIENT, 1, list(range(400)))
    assert not torch.equal(keys, other_round)
    assert bool((keys >= 0).all())


def test_mix64_is_splitmix64():
    """Against SplitMix64 written with Python integers (Steele, Lea & Flood 2014)."""
    mask = (1 << 64) - 1

    def splitmix(x: int) -> int:
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    xs = [0, 1, 12345, (1 << 62) + 17, (1 << 63) - 1]
    got = streams.mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert [g & mask for g in got] == [splitmix(x) for x in xs]


# --------------------------------------------------------------------- the pool
def test_the_pool_rebinds_views_and_gathers_rows():
    gen = torch.Generator().manual_seed(0)
    clients = [
        ClientData(
            torch.randn(n, 3, generator=gen), torch.arange(n), torch.zeros(1, 3), torch.zeros(1)
        )
        for n in (4, 1, 6)
    ]
    before = [(c.x_train.clone(), c.y_train.clone()) for c in clients]
    pool = TrainPool(clients)
    for c, (x, y) in zip(clients, before, strict=True):
        assert torch.equal(c.x_train, x) and torch.equal(c.y_train, y)
        assert c.x_train._base is pool.x
    rows = pool.rows([clients[2], clients[0]])
    assert rows.tolist() == [2, 0]
    xb, yb = pool.gather(rows, torch.tensor([[5, 0], [3, 3]]))
    assert torch.equal(xb[0, 0], before[2][0][5]) and torch.equal(yb[1], torch.tensor([3, 3]))
    other = ClientData(before[0][0], before[0][1], before[0][0], before[0][1])
    assert pool.rows([clients[0], other]) is None
    # the fields hold rows, not view objects; num_train reads them; a rebound field unpools
    assert type(clients[1]._x_train) is PoolRows and clients[1].num_train == 1
    assert torch.equal(clients[0].x_test, torch.zeros(1, 3))  # its own test split is kept
    clients[1].x_train = before[1][0].clone()
    assert pool.rows([clients[1]]) is None and torch.equal(clients[1].x_train, before[1][0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.uint8, torch.int64, torch.bool, torch.bfloat16]
)
def test_a_pools_rows_are_taken_as_index_select_takes_them_and_read_no_device(dtype, threads):
    """``take_rows`` (NumPy's take on one CPU thread) gives index_select's rows, dtype and
    shape, for images and targets alike; a census counts no host read for it."""
    from fedexp.engine.clients.pool import take_rows
    from fedexp.engine.round.census import Census

    gen = torch.Generator().manual_seed(1)
    t = (torch.randn(50, 3, 4, generator=gen) * 100).to(dtype)
    flat = torch.randint(0, 50, (2, 7), generator=gen).reshape(-1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Census() as census:
            got = take_rows(t, flat)
        want = t.index_select(0, flat)
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert torch.equal(got, want)
        assert census.total_reads == 0, census.summary()
        with pytest.raises(IndexError):
            take_rows(t, torch.tensor([0, 50]))
    finally:
        torch.set_num_threads(before)


def test_the_pool_adopts_one_buffer_and_shares_a_test_split_that_is_the_training_set():
    xs, ys = torch.randn(7, 2), torch.arange(7)
    cuts = [(0, 3), (3, 7)]
    clients = [ClientData(xs[a:b], ys[a:b], xs[a:b], ys[a:b]) for a, b in cuts]
    for c in clients:  # evaluated on its own training data: one object for both splits
        c.x_test, c.y_test = c.x_train, c.y_train
    pool = TrainPool(clients)
    assert pool.x.data_ptr() == xs.data_ptr() and pool.y.data_ptr() == ys.data_ptr()  # no copy
    for c, (a, b) in zip(clients, cuts, strict=True):
        assert c._x_test is c._x_train
        assert torch.equal(c.x_test, xs[a:b]) and torch.equal(c.y_test, ys[a:b])
    assert pool.rows(clients).tolist() == [0, 1]
    # made by clients_of, the engine takes that pool; a new pool over them keeps the shared split
    made = TrainPool.clients_of(xs, ys, [3, 4])
    assert TrainPool.of(made) is made[0].pooled().pool
    again = TrainPool(made)
    assert all(c._x_test is c._x_train and c.pooled(again) is not None for c in made)


def test_every_pool_keeps_its_clients_sizes_on_the_host_too(small_cfg):
    """``TrainPool.sizes`` (the round's weights read it: no device read) equals ``size`` for
    a pool of clients, one of ``clients_of``, a run's table and a stacked group's merge."""
    from fedexp.engine.round.stacking import Stack

    made = TrainPool.clients_of(torch.randn(7, 2), torch.arange(7), [3, 4])
    pools = [TrainPool(made), made[0].pooled().pool]
    runs = [build_engine(small_cfg("num_clients=5", f"seed={k}")).pool for k in (0, 1)]
    stack = Stack.__new__(Stack)
    stack._pool = None
    merged, firsts = stack._merged_pool(runs)
    assert firsts == [0, 5] and len(merged.sizes) == 10
    for pool in (*pools, *runs, merged):
        assert pool.sizes.dtype.kind == "i" and pool.sizes.tolist() == pool.size.tolist()


# ------------------------------------------------------------- batched evaluation
@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm=fedavg",),
        ("algorithm=local",),
        ("algorithm=fedrod", "model=mlp", "model.hidden=8"),
        ("algorithm=fedavg", "dataset=synthetic", "dataset.num_classes=4", "partition=iid"),
    ],
    ids=["shared", "personal", "fedrod-predict", "multiclass"],
)
def test_batched_evaluation_equals_client_by_client(small_cfg, overrides):
    engine, _ = _run(small_cfg, *overrides, "val_fraction=0.2", rounds=2)
    out, per_client = engine.evaluate()
    ctx = engine.ctx
    fwd = lambda p, x: engine.algorithm.predict(ctx, p, x)  # noqa: E731
    val_acc = []
    for n, row in enumerate(per_client):
        params = engine.algorithm.eval_params(ctx, engine.server, engine.client_states[n], n)
        ref = ctx.evaluate(params, engine.clients[n], fwd)
        glob = engine.global_model()  # the global view, scored in the same pass
        if glob is not None:
            ref_glob = ctx.evaluate(glob, engine.clients[n], fwd)
            ref.update({f"global/{k}": v for k, v in ref_glob.items()})
        assert {k for k in set(row) if not k.startswith("gain/")} == set(ref) | {"num_test"}
        for key, value in ref.items():
            if math.isnan(value):
                assert math.isnan(row[key]), key
            else:
                assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        val_acc.append(ctx.evaluate(params, engine.clients[n].validation(), fwd)["acc"])
    assert out["val/acc/mean"] == pytest.approx(sum(val_acc) / len(val_acc), rel=1e-6)
    assert ctx.vmap_ok  # the batched path ran (no fallback)


@pytest.mark.parametrize(
    "overrides",
    [("model=logreg",), ("model=mlp", "model.hidden=8", "dataset=digits", "partition=dirichlet")],
    ids=["logreg", "mlp-10-classes"],
)
def test_personal_models_evaluated_by_the_stacked_forward_equal_vmaps(small_cfg, overrides):
    """Clients with models of their own (local training) are evaluated by the model's batched
    forward pass where it has one (``FlatModel.forward_stacked``): every figure as vmap's."""
    engine, _ = _run(small_cfg, "algorithm=local", *overrides, rounds=2)
    assert engine.ctx.model.stacks
    stacked, per_client = engine.evaluate()
    engine.ctx.model.module.stacks = False  # vmap of the algorithm's predict
    vmapped, per_client_vmapped = engine.evaluate()
    assert stacked == vmapped and per_client == per_client_vmapped


@pytest.mark.parametrize(
    "overrides",
    [
        ("optimizer=sgd", "optimizer.momentum=0.9"),
        ("algorithm=superfed", "algorithm.warmup_rounds=0", "optimizer=adam"),  # noise
    ],
    ids=["momentum", "superfed-noise"],
)
def test_a_cohort_in_slices_equals_one_slice(small_cfg, monkeypatch, overrides):
    """Cohorts above ``_CHUNK`` clients run in slices: the same draws, the same models."""
    from fedexp.engine.solver import steps as solver

    whole, _ = _run(small_cfg, *overrides)
    monkeypatch.setattr(solver, "_CHUNK", 2)
    sliced, _ = _run(small_cfg, *overrides)
    torch.testing.assert_close(sliced.server["x"], whole.server["x"], rtol=1e-5, atol=1e-6)
    for a, b in zip(whole.client_states, sliced.client_states, strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)


def test_train_losses_of_a_cohort_equal_client_by_client(small_cfg):
    """``losses.train_losses`` (padded, vmapped, in chunks) gives each client's task loss on
    its training split under each candidate; a task without ``loss_batch`` is scored client
    by client, to the same values."""
    from types import SimpleNamespace

    from fedexp.engine.solver.losses import train_losses

    engine = build_engine(small_cfg("model=mlp", "model.hidden=8"))
    ctx, data = engine.ctx, engine.clients
    torch.manual_seed(0)
    d = ctx.model.layout.numel
    params = ctx.model.initial() + 0.3 * torch.randn(len(data), 3, d)
    made = []

    def candidates(j, rows):
        made.append((j, rows))
        return params[rows, j]

    batched = train_losses(ctx, candidates, 3, data)
    assert batched.shape == (len(data), 3)
    with torch.no_grad():
        expected = [
            [float(ctx.task.loss(ctx.model(params[i, j], c.x_train), c.y_train)) for j in range(3)]
            for i, c in enumerate(data)
        ]
    torch.testing.assert_close(
        batched, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0
    )
    assert len({v for row in expected for v in row}) == 3 * len(data)
    assert sorted(j for j, _ in made) == [0, 1, 2]  # one chunk: each candidate made once
    assert ctx.model.stacks  # the MLP's own batched forward pass: vmap's bits
    ctx.model.module.stacks = False
    assert torch.equal(train_losses(ctx, lambda j, rows: params[rows, j], 3, data), batched)
    ctx.vmap_ok = False  # a model vmap cannot run: client by client
    unbatched = train_losses(ctx, lambda j, rows: params[rows, j], 3, data)
    torch.testing.assert_close(unbatched, batched, rtol=1e-5, atol=1e-7)
    ctx.vmap_ok = True
    ctx.task = SimpleNamespace(loss=ctx.task.loss)  # no loss_batch
    alone = train_losses(ctx, lambda j, rows: params[rows, j], 3, data)
    torch.testing.assert_close(alone, batched, rtol=1e-5, atol=1e-7)
    assert ctx.model.module.training  # the module's mode is restored
