"""FedNova against the properties its paper implies: FedAvg when every client takes the same
steps; with unequal steps, the server's step as the paper writes it from the clients' local
models; the gain a_n of the local solver; and the point of the paper, that the weighted
optimum is (to first order in the step size) a fixed point of FedNova and not of FedAvg."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.algorithms.fednova import FedNova
from fedexp.algorithms.fednova import gain
from fedexp.engine.runner import build_engine
from fedexp.engine.solver.optim import SGD
from fedexp.errors import ConfigError
from helpers import refused


def _rounds(engine, n):
    for _ in range(n):
        engine.run_round()
    return engine.server["x"]


@pytest.mark.parametrize(
    ("nova", "avg"),
    [
        ((), ("algorithm=fedavg",)),
        (("participation=0.6",), ("algorithm=fedavg", "participation=0.6")),
        (("optimizer.momentum=0.9",),
         ("algorithm=fedavg", "optimizer.momentum=0.9", "optimizer.persistent=false")),
        (("optimizer.momentum=0.5", "optimizer.nesterov=true"),
         ("algorithm=fedavg", "optimizer.momentum=0.5", "optimizer.nesterov=true",
          "optimizer.persistent=false")),
        (("algorithm.mu=0.5",), ("algorithm=fedprox", "algorithm.mu=0.5")),
    ],
    ids=["sgd", "partial", "momentum", "nesterov", "proximal"],
)  # fmt: skip
def test_equal_steps_are_fedavg(small_cfg, nova, avg):
    """Every client takes local_steps=5 steps: a_n = a for all, τ_eff Σ ω_n d_n = Σ ω_n Δ_n,
    so three rounds give FedAvg's model (FedProx's with μ; momentum restarted each round)."""
    a = _rounds(build_engine(small_cfg("algorithm=fednova", *nova)), 3)
    b = _rounds(build_engine(small_cfg(*avg)), 3)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("momentum", "model"),
    [(0.0, ()), (0.9, ()), (0.5, ("model=mlp", "model.hidden=8", "model.norm=batch"))],
    ids=["sgd", "momentum", "batchnorm"],
)
def test_unequal_steps_take_the_papers_server_step(small_cfg, monkeypatch, momentum, model):
    """local_epochs=1 on clients of different sizes: τ_n differ. From the clients' local
    models θ_n (FedAvg's uploads Δ_n = x − θ_n: the same draws and steps), the server's new
    model is x − τ_eff Σ p_n Δ_n / a_n with a_n the closed form of τ_n steps, and it is not
    FedAvg's x − Σ p_n Δ_n. Running statistics (BatchNorm's) are FedAvg's average."""
    opt = [f"optimizer.momentum={momentum}", "optimizer.persistent=false", *model]
    avg = build_engine(small_cfg("algorithm=fedavg", "local_epochs=1", *opt))
    seen = {}
    real = avg.algorithm.server_update

    def spy(ctx, server, updates, weights):
        seen.update(updates=dict(updates), weights=dict(weights))
        return real(ctx, server, updates, weights)

    monkeypatch.setattr(avg.algorithm, "server_update", spy)
    x = avg.server["x"].clone()
    avg.run_round()
    nova = build_engine(small_cfg("algorithm=fednova", "local_epochs=1", *opt))
    nova.run_round()

    steps = {n: avg.ctx.steps_for(avg.clients[n]) for n in seen["updates"]}
    assert len(set(steps.values())) > 1
    rho = momentum
    a = {n: sum((1 - rho**k) / (1 - rho) for k in range(1, t + 1)) for n, t in steps.items()}
    w = seen["weights"]
    tau_eff = sum(w[n] * a[n] for n in a)
    expected = x - tau_eff * sum(w[n] * seen["updates"][n] / a[n] for n in a)
    p = avg.ctx.model.layout.num_params
    expected[p:] = x[p:] - sum(w[n] * seen["updates"][n][p:] for n in a)
    assert (p < len(x)) == bool(model)
    torch.testing.assert_close(nova.server["x"], expected, rtol=1e-5, atol=1e-6)
    assert float(nova.server["tau_eff"][0]) == pytest.approx(tau_eff, rel=1e-6)
    assert (nova.server["x"] - avg.server["x"]).norm() > 0.01 * (avg.server["x"] - x).norm()


def test_the_gain_crosses_exactly_through_a_lossy_uplink(small_cfg, monkeypatch):
    """With STC on the uplink and partial participation, the server still reads each
    sender's a_n = τ_n exactly (an "exact" part), and the round's τ_eff from them."""
    engine = build_engine(
        small_cfg("algorithm=fednova", "local_epochs=1", "compressor=stc", "participation=0.6")
    )
    seen = []
    real = engine.algorithm.server_update

    def spy(ctx, server, updates, weights):
        seen.append((dict(updates), dict(weights)))
        return real(ctx, server, updates, weights)

    monkeypatch.setattr(engine.algorithm, "server_update", spy)
    for _ in range(2):
        engine.run_round()
    updates, weights = seen[-1]
    for n, up in updates.items():
        assert float(up["a"].reshape(-1)[0]) == engine.ctx.steps_for(engine.clients[n])
    tau_eff = sum(weights[n] * float(up["a"].reshape(-1)[0]) for n, up in updates.items())
    assert float(engine.server["tau_eff"][0]) == pytest.approx(tau_eff, rel=1e-6)


@pytest.mark.parametrize("steps", [1, 2, 7, 30])
def test_the_gain_is_the_papers_and_the_solvers(steps):
    """a_n: τ (SGD); Σ_{k=1..τ} (1 − ρ^k)/(1 − ρ) (momentum, summed directly);
    (1 − (1 − ημ)^τ)/(ημ) (proximal). And, whatever the combination, the solver's own SGD step
    taken τ times on a loss of constant gradient g plus (μ/2)‖θ − x‖² from x moves it by η a g."""
    assert gain(steps) == steps
    for rho in (0.5, 0.9):
        direct = sum((1 - rho**k) / (1 - rho) for k in range(1, steps + 1))
        assert gain(steps, rho) == pytest.approx(direct, rel=1e-12)
    lr, mu = 0.1, 0.5
    closed = (1 - (1 - lr * mu) ** steps) / (lr * mu)
    assert gain(steps, lr_mu=lr * mu) == pytest.approx(closed, rel=1e-12)
    g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    for rho, nesterov, m in [(0.0, False, 0.0), (0.9, False, 0.0), (0.6, True, 0.0),
                             (0.0, False, mu), (0.9, False, mu), (0.6, True, mu)]:  # fmt: skip
        opt = SGD(momentum=rho, nesterov=nesterov)
        x = torch.zeros(3, dtype=torch.float64)
        theta, state = x.clone(), opt.init(x)
        for _ in range(steps):
            theta, state = opt.step(theta, g + m * (theta - x), state, lr)
        a = gain(steps, rho, nesterov, lr * m)
        torch.testing.assert_close((x - theta) / lr, a * g, rtol=1e-10, atol=1e-12)
    if steps > 1:  # a differs from τ once momentum or μ acts: the test can fail
        assert gain(steps, 0.9) > steps > gain(steps, lr_mu=lr * mu)


def _weighted_optimum(engine, wd: float) -> torch.Tensor:
    """argmin Σ p_n (f_n(x) + (wd/2)‖x‖²), p_n = n_n/n: L-BFGS on the pooled clients' data."""
    ctx, clients = engine.ctx, engine.clients
    n = sum(c.num_train for c in clients)
    x = engine.server["x"].clone().requires_grad_(True)
    opt = torch.optim.LBFGS([x], lr=1, max_iter=500, tolerance_grad=1e-10,
                            tolerance_change=1e-14, line_search_fn="strong_wolfe")  # fmt: skip

    def closure():
        opt.zero_grad()
        loss = sum(
            c.num_train / n * ctx.task.loss(ctx.model(x, c.x_train), c.y_train) for c in clients
        )
        loss = loss + 0.5 * wd * (x * x).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return x.detach()


def test_the_weighted_optimum_is_fednovas_fixed_point_not_fedavgs(small_cfg, monkeypatch):
    """The paper's objective inconsistency. Full-batch local GD (deterministic) with τ_n of 1
    to 12 steps (systems heterogeneity: set per client), strongly convex local objectives
    (logistic loss plus L2). At the optimum x* of Σ p_n F_n, FedAvg's round moves x by about
    η Σ p_n τ_n ∇F_n(x*) ≠ 0 (its fixed point weighs client n by p_n τ_n); FedNova's by
    η τ_eff Σ p_n ∇F_n(x*) = 0 up to O(η²): a far smaller step."""
    wd, lr = 0.1, 0.002
    moved = {}
    for algorithm in ("fedavg", "fednova"):
        engine = build_engine(
            small_cfg(f"algorithm={algorithm}", "batch_size=0", f"lr={lr}",
                      f"optimizer.weight_decay={wd}")
        )  # fmt: skip
        sizes = {id(c): 1 + 11 * (n % 2) + n // 2 for n, c in enumerate(engine.clients)}
        monkeypatch.setattr(engine.ctx, "steps_for", lambda data, s=sizes: s[id(data)])
        x_star = _weighted_optimum(engine, wd)
        engine.server["x"] = x_star.clone()
        engine.run_round()
        moved[algorithm] = float((engine.server["x"] - x_star).norm())
    assert moved["fedavg"] > 5e-5  # FedAvg leaves the optimum: the test can fail
    assert moved["fednova"] < 0.05 * moved["fedavg"], moved


def test_adam_and_bad_settings_are_refused_with_one_line(small_cfg):
    with pytest.raises(ConfigError, match="optimizer=adam has none: use optimizer=sgd"):
        build_engine(small_cfg("algorithm=fednova", "optimizer=adam"))
    assert "mu=-1" in refused(FedNova, mu=-1)
    assert "server_lr=0" in refused(FedNova, server_lr=0)
    assert math.isfinite(gain(3, lr_mu=1.5))
