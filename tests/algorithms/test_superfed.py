"""SuPerFed against the properties its paper implies, and its penalty's gradient."""

from __future__ import annotations

import pytest
import torch

from fedexp.algorithms.superfed import LAMBDA_GRID
from fedexp.algorithms.superfed import SuPerFed
from fedexp.algorithms.superfed import cos2
from fedexp.algorithms.superfed import select_lambdas
from fedexp.engine.runner import build_engine

#: few local steps keep the file fast; no property here depends on their number
FAST = ("local_steps=2",)
#: λ ≡ 0 and no penalties: SuPerFed's global model must be FedAvg's
FEDAVG_LIKE = ("algorithm.fixed_lambda=0.0", "algorithm.mu=0.0", "algorithm.nu=0.0")


def _rounds(engine, n):
    for _ in range(n):
        metrics = engine.run_round()
    return engine, metrics


@pytest.mark.parametrize(
    "overrides",
    [("algorithm.warmup_rounds=0",), ("algorithm.warmup_rounds=1", "optimizer.momentum=0.9")],
    ids=["mixing-from-round-0", "warmup-then-mixing-momentum"],
)
def test_lambda_zero_and_no_penalties_is_fedavg(small_cfg, overrides):
    """λ ≡ 0, μ = ν = 0: the mixture is w_g and its gradient ∇f(w_g): FedAvg, bit for bit.

    With momentum, w_g's buffer also crosses the warm-up/mixing boundary unchanged.
    """
    extra = tuple(o for o in overrides if o.startswith("optimizer"))
    sup, _ = _rounds(
        build_engine(small_cfg(*FAST, "algorithm=superfed", *FEDAVG_LIKE, *overrides)), 3
    )
    avg, _ = _rounds(build_engine(small_cfg(*FAST, "algorithm=fedavg", *extra)), 3)
    assert torch.equal(sup.server["x"], avg.server["x"])
    for n, s in enumerate(sup.client_states):  # λ = 0: w_l gets no gradient
        assert torch.equal(s["local"], sup.algorithm.init_client(sup.ctx, sup.x0, n)["local"])


def test_warmup_trains_the_global_model_only(small_cfg):
    e = build_engine(small_cfg(*FAST, "algorithm=superfed", "algorithm.warmup_rounds=2"))
    init = [s["local"].clone() for s in e.client_states]
    _rounds(e, 2)
    for s, w_l in zip(e.client_states, init, strict=True):
        assert torch.equal(s["local"], w_l) and float(s["lam_eval"]) == 0.0
    e.run_round()  # round 2: mixing
    assert all(
        not torch.equal(s["local"], w_l) for s, w_l in zip(e.client_states, init, strict=True)
    )


def test_local_models_are_seeded_reinitialisations(small_cfg):
    a = build_engine(small_cfg(*FAST, "algorithm=superfed"))
    b = build_engine(small_cfg(*FAST, "algorithm=superfed"))
    locals_a = torch.stack([s["local"] for s in a.client_states])
    assert torch.equal(locals_a, torch.stack([s["local"] for s in b.client_states]))
    assert len({tuple(t.tolist()) for t in locals_a}) == 5  # one init per client
    assert not any(torch.equal(t, a.x0) for t in locals_a)
    c = build_engine(small_cfg(*FAST, "algorithm=superfed", "algorithm.local_init=x0"))
    assert all(torch.equal(s["local"], c.x0) for s in c.client_states)


def test_cos2_gradient_matches_autograd():
    """d cos²/da = 2c b / (AB) − 2c² a / (A² B), c = ⟨a, b⟩, A = ‖a‖², B = ‖b‖²."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(7, generator=gen, dtype=torch.float64).requires_grad_(True)
    b = torch.randn(7, generator=gen, dtype=torch.float64).requires_grad_(True)
    ga, gb = torch.autograd.grad(cos2(a, b), (a, b))
    a, b = a.detach(), b.detach()
    c, na, nb = a @ b, a @ a, b @ b
    torch.testing.assert_close(ga, 2 * c * b / (na * nb) - 2 * c**2 * a / (na**2 * nb))
    torch.testing.assert_close(gb, 2 * c * a / (na * nb) - 2 * c**2 * b / (na * nb**2))
    torch.testing.assert_close(cos2(a, b), (c / (na.sqrt() * nb.sqrt())) ** 2)
    assert float(cos2(a, 3 * a)) == pytest.approx(1.0) and float(cos2(a, torch.zeros(7))) == 0.0


def test_mixing_gradient_is_the_chain_rule(small_cfg):
    """∇_g = (1 − λ)∇f(m) + 2μ(g − g^t) + ν∂_g cos², ∇_l = λ∇f(m) + ν∂_l cos², m the mixture."""
    lam, mu, nu = 0.3, 0.7, 2.0
    e = build_engine(
        small_cfg(
            *FAST,
            "algorithm=superfed",
            f"algorithm.fixed_lambda={lam}",
            f"algorithm.mu={mu}",
            f"algorithm.nu={nu}",
        )
    )
    ctx, alg, data = e.ctx, e.algorithm, e.clients[0]
    anchor = e.x0
    g = anchor + 0.1 * torch.randn(anchor.shape, generator=torch.Generator().manual_seed(1))
    w_l = e.client_states[0]["local"]
    _, grad, _ = ctx.loss_grad_post(
        alg.mixing_objective(ctx, anchor), torch.cat([g, w_l]), data.x_train, data.y_train, None
    )
    mixed = SuPerFed.mixture(ctx, g, w_l, lam)
    _, grad_m, _ = ctx.loss_grad_post(
        ctx.model_objective(), mixed, data.x_train, data.y_train, None
    )
    a, b = g.clone().requires_grad_(True), w_l.clone().requires_grad_(True)
    ca, cb = torch.autograd.grad(cos2(a, b), (a, b))
    d = g.numel()
    torch.testing.assert_close(grad[:d], (1 - lam) * grad_m + 2 * mu * (g - anchor) + nu * ca)
    torch.testing.assert_close(grad[d:], lam * grad_m + nu * cb)
    # a fixed λ draws no noise (the minibatches stay FedAvg's); a random one draws u[0] a step
    assert alg.mixing_objective(ctx, anchor).noise == 0
    assert SuPerFed().mixing_objective(ctx, anchor).noise == 1


def test_evaluation_lambda(small_cfg):
    e, _ = _rounds(
        build_engine(small_cfg(*FAST, "algorithm=superfed", "algorithm.warmup_rounds=1")),
        2,
    )
    ctx, s = e.ctx, e.client_states[0]
    lam = float(s["lam_eval"])
    assert min(abs(lam - t) for t in LAMBDA_GRID) < 1e-6  # a grid point (stored in float32)
    params = e.algorithm.eval_params(ctx, e.server, s, 0)
    torch.testing.assert_close(params, (1 - lam) * e.server["x"] + lam * s["local"])
    # the selection is the grid's lowest training loss
    g, w_l = e.server["x"], s["local"]
    chosen = select_lambdas(ctx, g[None], w_l[None], [e.clients[0]])[0]
    losses = {
        t: float(
            ctx.task.loss(
                ctx.model(SuPerFed.mixture(ctx, g, w_l, t), e.clients[0].x_train),
                e.clients[0].y_train,
            )
        )
        for t in LAMBDA_GRID
    }
    assert losses[chosen] == min(losses.values())
    fixed, _ = _rounds(
        build_engine(
            small_cfg(
                *FAST,
                "algorithm=superfed",
                "algorithm.warmup_rounds=1",
                "algorithm.eval_lambda=0.25",
            )
        ),
        2,
    )
    assert all(float(s["lam_eval"]) == 0.25 for s in fixed.client_states)


@pytest.mark.parametrize(
    "overrides",
    [(), ("model=mlp", "model.hidden=8"), ("model=mlp", "model.hidden=8", "model.norm=batch")],
    ids=["logreg", "mlp", "mlp-batchnorm"],
)
def test_runs_and_evaluates(small_cfg, overrides):
    e, metrics = _rounds(
        build_engine(
            small_cfg(*FAST, "algorithm=superfed", "algorithm.warmup_rounds=1", *overrides)
        ),
        2,
    )
    out, per_client = e.evaluate()
    assert 0.0 <= out["acc/mean"] <= 1.0 and len(per_client) == 5
    assert 0.0 <= metrics["train/lam_eval"] <= 1.0
    if e.ctx.model.has_buffers:  # one set of statistics, w_g's, trained and averaged
        n = e.ctx.model.layout.num_params
        assert not torch.equal(e.server["x"][n:], e.x0[n:])
        for s in e.client_states:
            params = e.algorithm.eval_params(e.ctx, e.server, s, 0)
            assert torch.equal(params[n:], e.server["x"][n:])


@pytest.mark.parametrize(
    "overrides",
    [
        ("model=logreg",),
        ("dataset=synthetic", "dataset.num_classes=3", "partition=iid", "model=mlp"),
    ],
    ids=["one-logit", "three-classes"],
)
def test_the_cohorts_evaluation_lambdas_at_once_equal_client_by_client(small_cfg, overrides):
    """``select_lambdas`` (padded, vmapped, in chunks) picks, for each client, the first grid λ
    of the lowest training loss, computed client by client, one input a forward pass."""
    engine = build_engine(small_cfg(*overrides))
    ctx, data = engine.ctx, engine.clients
    torch.manual_seed(0)
    d = ctx.model.layout.numel
    g = ctx.model.initial().expand(len(data), d) + 0.5 * torch.randn(len(data), d)
    local = torch.randn(len(data), d)
    ctx.model.module.eval()
    alone = []
    with torch.no_grad():
        for i, c in enumerate(data):
            losses = []
            for lam in LAMBDA_GRID:
                params = SuPerFed.mixture(ctx, g[i], local[i], lam)
                logits = torch.cat([ctx.model(params, x) for x in c.x_train.split(1)])
                losses.append(float(ctx.task.loss(logits, c.y_train)))
            alone.append(LAMBDA_GRID[losses.index(min(losses))])
    ctx.model.module.train()
    together = select_lambdas(ctx, g, local, data)
    assert together == alone
    assert len(set(alone)) > 1  # the clients' choices differ: the comparison can fail
