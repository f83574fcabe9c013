"""IFCA against the properties its paper implies, and the multi-part message contract."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedexp.algorithms.ifca import IFCA
from fedexp.contract import CohortStates
from fedexp.engine.clients.pool import TrainPool
from fedexp.engine.runner import build_engine
from fedexp.engine.solver import losses as losses_module
from fedexp.engine.solver.losses import train_losses
from fedexp.engine.solver.optim import SGD
from helpers import cohort_of
from helpers import refused
from helpers import solo

MLP = ("model=mlp", "model.hidden=8")


def _rounds(engine, n):
    for _ in range(n):
        metrics = engine.run_round()
    return metrics


def _losses(engine, clusters, data):
    """F_n(θ_j) recomputed by hand: the task loss of each cluster model on the train split."""
    ctx = engine.ctx
    ctx.model.module.eval()
    with torch.no_grad():
        return torch.stack(
            [ctx.task.loss(ctx.model(t, data.x_train), data.y_train) for t in clusters]
        )


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.k=1",),
        ("algorithm.k=1", "optimizer.momentum=0.9", "participation=0.6", *MLP),
    ],
    ids=["logreg", "mlp-momentum-partial"],
)
def test_one_cluster_is_fedavg_bit_for_bit(small_cfg, overrides):
    common = [o for o in overrides if not o.startswith("algorithm.")]
    ifca = build_engine(small_cfg("algorithm=ifca", *overrides))
    avg = build_engine(small_cfg("algorithm=fedavg", *common))
    assert torch.equal(ifca.server["clusters"][0], avg.server["x"])  # starts at x0
    _rounds(ifca, 3)
    _rounds(avg, 3)
    assert torch.equal(ifca.server["clusters"][0], avg.server["x"])
    for a, b in zip(ifca.client_states, avg.client_states, strict=True):
        for key in b:  # the same optimiser state (momentum) as FedAvg's clients
            assert torch.equal(a[key], b[key])


def test_initial_clusters_are_seeded_draws_of_the_initialiser(small_cfg):
    """θ_0 = x0; θ_j permutes each parameter tensor of x0; running statistics stay."""
    engine = build_engine(small_cfg("algorithm=ifca", "algorithm.k=3", *MLP, "model.norm=batch"))
    ctx, x0, layout = engine.ctx, engine.x0, engine.ctx.model.layout
    clusters = engine.server["clusters"]
    again = IFCA(k=3).init_server(ctx, x0)["clusters"]
    assert torch.equal(clusters, again)  # derived from the seed alone
    assert torch.equal(clusters[0], x0)
    assert not torch.equal(clusters[1], clusters[2])
    for name, shape, off in zip(layout.names, layout.shapes, layout.offsets, strict=True):
        size = int(torch.Size(shape).numel())
        ref = x0[off : off + size]
        for j in (1, 2):
            part = clusters[j, off : off + size]
            assert torch.equal(part.sort().values, ref.sort().values), name
            if off >= layout.num_params or bool((ref == ref[0]).all()):
                assert torch.equal(part, ref), name  # statistics, constant tensors
    flat = IFCA(k=3, init_scale=0.0).init_server(ctx, x0)["clusters"]
    assert torch.equal(flat, x0.expand(3, -1))
    half = IFCA(k=3, init_scale=0.5).init_server(ctx, x0)["clusters"]
    torch.testing.assert_close(half, (clusters + x0) / 2)
    other = IFCA(k=3).init_server(dataclasses.replace(ctx, seed=1), x0)["clusters"]
    assert not torch.equal(other[1], clusters[1]) and not torch.equal(other[1], x0)


def test_clients_choose_their_lowest_loss_cluster_and_bytes_are_k_models(small_cfg):
    k = 3
    engine = build_engine(small_cfg("algorithm=ifca", f"algorithm.k={k}", *MLP))
    d, m = engine.x0.numel(), len(engine.clients)
    for _ in range(2):
        sent = engine.server["clusters"].clone()
        metrics = engine.run_round()
        chosen = []
        for n, data in enumerate(engine.clients):
            losses = _losses(engine, sent, data)
            j = int(engine.client_states[n]["cluster"][0])
            assert j == int(torch.argmin(losses))
            assert float(losses[j]) < float(losses.max())  # a real choice, not a tie
            chosen.append(j)
            params = engine.algorithm.eval_params(
                engine.ctx, engine.server, {"cluster": torch.tensor([j])}, n
            )
            assert torch.equal(params, engine.server["clusters"][j])
        counts = torch.bincount(torch.tensor(chosen), minlength=k).float()
        assert torch.equal(engine.server["counts"], counts)
        assert metrics[f"ifca/clients_{chosen[0]}"] == float(counts[chosen[0]])
        assert metrics["bytes/down"] == metrics["bytes/down/clusters"] == 4 * k * d * m
        assert metrics["bytes/up/update"] == 4 * d * m
        assert metrics["bytes/up/cluster"] == 4 * m
        assert metrics["bytes/up"] == 4 * d * m + 4 * m
    agg, _ = engine.evaluate()
    assert 0.0 <= agg["acc/mean"] <= 1.0

    # The momentum is kept while the client stays in its cluster, restarted when it moves.
    ctx = dataclasses.replace(engine.ctx, optimizer=SGD(momentum=0.9))
    clusters, data = engine.server["clusters"], engine.clients[0]
    j = int(torch.argmin(_losses(engine, clusters, data)))
    junk = {"opt.momentum": torch.full_like(engine.x0, 5.0)}

    def update(prev, extra):
        state = {"cluster": torch.tensor([prev]), **extra}
        out = engine.algorithm.client_update(
            ctx, {"clusters": clusters[None]}, CohortStates.of_rows([state]), solo(data)
        )
        return out.updates["update"][0]

    fresh = update(-1, {})
    assert torch.equal(update((j + 1) % k, junk), fresh)
    assert not torch.allclose(update(j, junk), fresh)


@pytest.mark.parametrize("budget", [None, 200], ids=["one-run", "runs-of-clients"])
def test_the_pooled_estimate_equals_each_clients_own_loss(small_cfg, monkeypatch, budget):
    """Unequal training splits gathered from the pool (padding: repeated rows) score as each
    client's own loss on its split alone, in one run of clients or in several."""
    engine = build_engine(small_cfg("algorithm=ifca", "algorithm.k=3", *MLP))
    sizes = {d.num_train for d in engine.clients}
    assert len(sizes) > 1  # some padding
    if budget is not None:  # runs of about 2 clients (input elements: budget × features)
        row = engine.clients[0].x_train[0].numel()
        monkeypatch.setattr(losses_module, "_ELEMENTS", budget * row)
    ctx = engine.ctx
    clusters = engine.server["clusters"].expand(len(engine.clients), -1, -1)
    cohort = cohort_of(engine, range(len(engine.clients)))
    assert ctx.model.module.training
    pooled = train_losses(ctx, lambda j, rows: clusters[rows, j], 3, cohort.data)
    assert ctx.model.module.training  # the module's mode restored
    ctx.model.module.eval()
    with torch.no_grad():
        alone = torch.tensor(
            [
                [
                    float(ctx.task.loss(ctx.model(clusters[i, j], d.x_train), d.y_train))
                    for j in range(3)
                ]
                for i, d in enumerate(cohort.data)
            ],
            dtype=torch.float64,
        )
    assert pooled.shape == (len(engine.clients), 3)
    torch.testing.assert_close(pooled, alone, rtol=1e-6, atol=1e-7)


def test_cluster_ids_cross_a_lossy_uplink_exactly(small_cfg):
    """With STC both ways the update is compressed, the id is one dense float32."""
    engine = build_engine(small_cfg("algorithm=ifca", "compressor=stc", *MLP))
    d, m = engine.x0.numel(), len(engine.clients)
    for _ in range(2):
        metrics = engine.run_round()
        ids = torch.tensor([int(s["cluster"][0]) for s in engine.client_states])
        assert torch.equal(engine.server["counts"], torch.bincount(ids, minlength=2).float())
        assert metrics["bytes/up/cluster"] == 4 * m
        assert metrics["bytes/up"] == metrics["bytes/up/update"] + 4 * m
        assert metrics["bytes/up/update"] < d * m  # compressed: well under 4 bytes an entry
        assert metrics["bytes/down"] == metrics["bytes/down/clusters"] < 2 * d * m


def test_server_moves_each_cluster_with_its_own_clients_only():
    """Hand computation: weights renormalised within each cluster; unchosen clusters stay."""
    alg = IFCA(k=3, server_lr=0.5)
    clusters = torch.arange(12.0).reshape(3, 4)
    deltas = {n: torch.full((4,), float(n + 1)) for n in range(4)}
    ids = {0: 2, 1: 0, 2: 2, 3: 0}
    weights = {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.4}
    updates = {n: {"update": deltas[n], "cluster": torch.tensor([float(ids[n])])} for n in ids}
    out = alg.server_update(
        None, {"clusters": clusters, "counts": torch.zeros(3)}, updates, weights
    )
    mean0 = (0.2 * deltas[1] + 0.4 * deltas[3]) / 0.6
    mean2 = (0.1 * deltas[0] + 0.3 * deltas[2]) / 0.4
    torch.testing.assert_close(out["clusters"][0], clusters[0] - 0.5 * mean0)
    assert torch.equal(out["clusters"][1], clusters[1])
    torch.testing.assert_close(out["clusters"][2], clusters[2] - 0.5 * mean2)
    assert torch.equal(out["counts"], torch.tensor([2.0, 0.0, 2.0]))
    bad = {0: {"update": deltas[0], "cluster": torch.tensor([3.0])}}
    with pytest.raises(ValueError, match="sent cluster 3"):
        alg.server_update(None, {"clusters": clusters, "counts": torch.zeros(3)}, bad, {0: 1.0})


def test_ifca_separates_two_groups_with_opposite_labels(small_cfg):
    """Six clients, labels flipped on every other one: k = 2 finds the two groups."""

    def flipped(*overrides):
        engine = build_engine(small_cfg("partition=iid", "num_clients=6", *overrides))
        engine.clients = list(engine.clients)  # (a ClientTable makes each client when read)
        for n in range(0, 6, 2):
            c = engine.clients[n]
            engine.clients[n] = dataclasses.replace(c, y_train=1 - c.y_train, y_test=1 - c.y_test)
        engine.pool = TrainPool.of(engine.clients)  # minibatches come from the pool
        _rounds(engine, 3)
        return engine

    ifca = flipped("algorithm=ifca", "algorithm.k=2")
    ids = [int(s["cluster"][0]) for s in ifca.client_states]
    assert ids[0::2] == [ids[0]] * 3 and ids[1::2] == [1 - ids[0]] * 3
    avg = flipped("algorithm=fedavg")
    acc_ifca = ifca.evaluate()[0]["acc/mean"]
    acc_avg = avg.evaluate()[0]["acc/mean"]
    assert acc_ifca > acc_avg + 0.1


def test_runs_and_evaluates_with_batchnorm(small_cfg):
    """Cluster models carry running statistics (logreg and the MLP run in the tests above)."""
    engine = build_engine(small_cfg("algorithm=ifca", *MLP, "model.norm=batch"))
    metrics = _rounds(engine, 2)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    agg, per_client = engine.evaluate()
    assert len(per_client) == len(engine.clients) and 0.0 <= agg["acc/mean"] <= 1.0
    p = engine.ctx.model.layout.num_params  # the chosen clusters' statistics moved
    chosen = {int(s["cluster"][0]) for s in engine.client_states}
    for j in range(2):
        moved = not torch.equal(engine.server["clusters"][j, p:], engine.x0[p:])
        assert moved == (j in chosen)


def test_invalid_arguments_are_refused():
    assert refused(IFCA, k=0) == "algorithm.k=0: expected ≥ 1"
    with pytest.raises(ValueError, match="weighting"):
        IFCA(weighting="median")
    assert refused(IFCA, init_scale=-1.0).startswith("algorithm.init_scale=-1.0: expected ≥ 0")
