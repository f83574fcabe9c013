"""SCAFFOLD against the properties its paper implies (Karimireddy et al. 2020, option II)."""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.runner import build_engine
from helpers import FIXED_POINT
from helpers import stationarity

pytestmark = pytest.mark.usefixtures("one_thread")


def _rounds(engine, n):
    for _ in range(n):
        engine.run_round()
    return engine.server["x"]


def test_the_first_round_with_zero_control_variates_is_fedavgs(small_cfg):
    """c = c_n = 0: the corrected steps are plain steps, and x moves as FedAvg's."""
    scaffold = _rounds(build_engine(small_cfg("algorithm=scaffold")), 1)
    fedavg = _rounds(build_engine(small_cfg("algorithm=fedavg", "algorithm.weighting=uniform")), 1)
    assert torch.equal(scaffold, fedavg)


def test_control_variates_follow_option_ii(small_cfg):
    """After a round: c_n = (x − y_n)/(K η_l) for the sampled clients, 0 for the others, and
    c = (|S|/N) mean_S Δc_n, i.e. the mean of every client's c_n."""
    engine = build_engine(small_cfg("algorithm=scaffold", "participation=0.6", "local_steps=3"))
    engine.setup()
    x0 = engine.server["x"].clone()
    engine.run_round()
    sampled = engine.last_sampled
    assert 0 < len(sampled) < len(engine.clients)
    cs = torch.stack([s["c"] for s in engine.client_states])
    for n in range(len(engine.clients)):
        if n not in sampled:
            assert not cs[n].any()
    # every sampled client's y: x0 minus K steps; recovered from x (uniform mean of y)
    mean_y = x0 - (x0 - engine.server["x"])  # η_g = 1: x = mean_S y_n
    torch.testing.assert_close(cs[sampled].mean(0), (x0 - mean_y) / (3 * engine.ctx.lr))
    torch.testing.assert_close(engine.server["c"], cs.mean(0))


def test_the_fixed_point_is_the_global_optimum_where_fedavg_drifts(small_cfg):
    """FedAvg's fixed point is not a stationary point of (1/N) Σ f_n; SCAFFOLD's is (its
    corrections remove the client drift: the paper's Theorem III, here on a convex problem)."""
    norms = {}
    for alg in ("scaffold", "fedavg"):
        engine = build_engine(
            small_cfg(f"algorithm={alg}", "algorithm.weighting=uniform", *FIXED_POINT)
        )
        _rounds(engine, 80)
        norms[alg] = stationarity(engine)
    assert norms["scaffold"] < 1e-3
    assert norms["fedavg"] > 10 * norms["scaffold"]


def test_both_parts_cross_the_wire_both_ways(small_cfg):
    engine = build_engine(small_cfg("algorithm=scaffold"))
    engine.setup()
    d = engine.server["x"].numel()
    m = len(engine.clients)
    engine.run_round()
    assert engine.ledger.total["up"] == 2 * 4 * d * m
    assert engine.ledger.total["down"] == 2 * 4 * d * m
