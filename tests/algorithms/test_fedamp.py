"""FedAMP / HeurFedAMP against the properties of Huang et al. (AAAI 2021)."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.algorithms.fedamp import FedAMP
from fedexp.algorithms.fedamp import attention
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.tracking.base import NullTracker
from helpers import assert_eval_stack_is_eval_params
from helpers import assert_resume_exact


def _rounds(engine, n):
    engine.setup()
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


def _naive_xi(W, alpha_k, sigma, heuristic, self_attention):
    n = W.shape[0]
    xi = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        if heuristic:
            e = {
                j: math.exp(sigma * float(torch.nn.functional.cosine_similarity(W[i], W[j], dim=0)))
                for j in range(n)
                if j != i
            }
            for j, v in e.items():
                xi[i, j] = (1 - self_attention) * v / sum(e.values())
            xi[i, i] = self_attention
        else:
            for j in range(n):
                if j != i:
                    d = float(((W[i] - W[j]) ** 2).sum())
                    xi[i, j] = alpha_k * math.exp(-d / sigma) / sigma
            xi[i, i] = 1 - xi[i].sum()
    return xi


@pytest.mark.parametrize("heuristic", [False, True], ids=["fedamp", "heurfedamp"])
def test_xi_rows_sum_to_one_and_match_a_double_loop(heuristic):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(6, 7, generator=g, dtype=torch.float64)
    alpha_k, sigma = (0.3, 0.5) if heuristic else (0.1, 20.0)
    rows = torch.arange(6)
    xi = attention(W, rows, alpha_k, sigma, heuristic, self_attention=0.2)
    torch.testing.assert_close(xi.sum(dim=1), torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(xi, _naive_xi(W, alpha_k, sigma, heuristic, 0.2))
    assert (xi.diagonal() < 1).all() and (xi > 0).all()  # every client passes messages
    # a subset of rows gives the same rows; u_i = Σ_j ξ_ij w_j
    algo = FedAMP(alpha_k=alpha_k, sigma=sigma, heuristic=heuristic, self_attention=0.2)
    sub = torch.tensor([4, 1])
    torch.testing.assert_close(algo.xi(W, sub), xi[sub])
    torch.testing.assert_close(algo.cloud_models(W, sub), xi[sub] @ W)


def test_similar_clients_get_more_attention():
    W = torch.tensor([[0.0, 0.0], [0.1, 0.0], [3.0, 0.0]])
    xi = attention(W, torch.tensor([0]), alpha_k=0.5, sigma=1.0)[0]
    assert xi[1] > 100 * xi[2]


def test_alpha_to_zero_cloud_model_is_the_own_model(small_cfg):
    """α_k → 0: ξ is the identity, u_i = w_i (λ = μα_k keeps the local prox weight μ = 1)."""
    e, _ = _rounds(
        build_engine(
            small_cfg("algorithm=fedamp", "algorithm.alpha_k=1e-12", "algorithm.lam=1e-12")
        ),
        3,
    )
    W = e.server["W"]
    assert not torch.allclose(W[0], W[1])  # the models did train apart
    for i in range(W.shape[0]):
        torch.testing.assert_close(e.algorithm.downlink(e.ctx, e.server, i), W[i])


def test_alpha_to_zero_and_lambda_zero_is_local_training(small_cfg):
    amp, _ = _rounds(
        build_engine(small_cfg("algorithm=fedamp", "algorithm.alpha_k=1e-12", "algorithm.lam=0")),
        3,
    )
    local, _ = _rounds(build_engine(small_cfg("algorithm=local")), 3)
    for i, s in enumerate(local.client_states):
        torch.testing.assert_close(amp.server["W"][i], s["theta"], rtol=1e-5, atol=1e-6)


def test_server_writes_only_the_clients_that_reported(small_cfg):
    e = build_engine(small_cfg("algorithm=fedamp", "participation=0.6"))
    e.setup()
    before = e.server["W"].clone()
    e.run_round()
    sampled = set(e.last_sampled)
    assert 0 < len(sampled) < len(e.clients)
    for i in range(len(e.clients)):
        assert torch.equal(e.server["W"][i], before[i]) != (i in sampled)


@pytest.mark.parametrize(
    "overrides", [(), ("model=mlp", "model.hidden=8", "algorithm.heuristic=true")]
)
def test_runs(small_cfg, overrides):
    result = run(small_cfg("algorithm=fedamp", "rounds=1", *overrides), tracker=NullTracker())
    assert result is not None


def test_resume_is_exact(small_cfg, tmp_path):
    cfg = small_cfg("algorithm=fedamp", "rounds=5", "checkpoint_every=2", "participation=0.6")
    assert_resume_exact(cfg, tmp_path)


@pytest.mark.parametrize("heuristic", [False, True])
def test_the_cohorts_cloud_models_at_once_equal_client_by_client(heuristic):
    """``downlinks`` (one computation, a stack) gives each client its ``downlink``."""
    torch.manual_seed(0)
    W = torch.randn(7, 5)
    algo = FedAMP(alpha_k=0.5, sigma=2.0 if not heuristic else 0.3, heuristic=heuristic)
    server = {"W": W}
    clients = [0, 2, 3, 6]
    together = algo.downlinks(None, server, clients)
    assert list(together) == clients
    for n in clients:
        alone = algo.downlink(None, server, n)
        torch.testing.assert_close(together[n], alone, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(together[0], together[6])  # the messages differ per client


def _two_group_csv(path, per_site: int = 60, sites: int = 6, seed: int = 0) -> None:
    """Sites 0..k−1 label by x0 > 0, sites k..N−1 by x0 < 0 (k = sites // 2); x0 keeps away
    from 0 (|x0| ≥ 1) so that each group's rule is learnt in a few rounds."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(sites * per_site, 4))
    x[:, 0] = np.sign(x[:, 0]) * (1.0 + 0.5 * np.abs(x[:, 0]))
    site = np.repeat(np.arange(sites), per_site)
    y = np.where(site < sites // 2, x[:, 0] > 0, x[:, 0] < 0).astype(int)
    frame = pd.DataFrame(x, columns=[f"x{i}" for i in range(4)])
    frame["site"] = [f"s{s}" for s in site]
    frame["y"] = y
    frame.to_csv(path, index=False)


def test_default_attention_prefers_the_clients_of_the_same_group(small_cfg, tmp_path):
    """Two groups of 3 clients with opposite labelling rules, FedAMP's default α_k, σ, λ: after 5
    rounds every client gives each client of its own group more than twice the attention ξ_ij
    of any client of the other group (the earlier α_k = 1e3, σ = 1e5 gave all ξ_ij ≈ 0.01
    within 1e-6 of each other)."""
    path = tmp_path / "two_groups.csv"
    _two_group_csv(path)
    e, _ = _rounds(
        build_engine(
            small_cfg(
                "algorithm=fedamp",
                "dataset=csv",
                f"dataset.path={path}",
                "dataset.label=y",
                "dataset.group=site",
                "partition=natural",
                "num_clients=6",
            )
        ),
        5,
    )
    # each client's group from its own data (features are rescaled to [-1, 1], so not by the
    # sign of x0: by which class has the larger x0)
    group = []
    for data in e.clients:
        x0, y = data.x_train[:, 0], data.y_train
        group.append(bool(x0[y == 1].mean() > x0[y == 0].mean()))
    assert sorted(group) == [False] * 3 + [True] * 3
    W = e.server["W"]
    xi = e.algorithm.xi(W, torch.arange(len(group)))
    for i, gi in enumerate(group):
        own = [float(xi[i, j]) for j, gj in enumerate(group) if gj == gi and j != i]
        other = [float(xi[i, j]) for j, gj in enumerate(group) if gj != gi]
        assert min(own) > 2 * max(other), (i, own, other)


def test_refuses_an_alpha_k_that_lets_xi_ii_go_negative(small_cfg):
    """(N − 1)α_k/σ > 1 would give ξ_ii < 0 for near models: FedAMP refuses it, HeurFedAMP (whose
    ξ ignores α_k) does not."""
    from fedexp.errors import ConfigError

    too_big = ("algorithm=fedamp", "algorithm.alpha_k=0.1", "algorithm.sigma=0.3")  # 4·0.1/0.3
    with pytest.raises(ConfigError, match=r"\(N − 1\)α_k/σ = 1.333"):
        build_engine(small_cfg(*too_big)).setup()
    build_engine(small_cfg(*too_big, "algorithm.heuristic=true")).setup()
    build_engine(small_cfg("algorithm=fedamp", "algorithm.alpha_k=0.075")).setup()  # = 1: kept


def test_eval_stack_is_eval_params_client_by_client(small_cfg):
    engine, _ = _rounds(build_engine(small_cfg("algorithm=fedamp", "participation=0.6")), 2)
    assert_eval_stack_is_eval_params(engine, personal=False)
