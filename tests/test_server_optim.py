"""Server optimisers (FedOpt: Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

Each adaptive step against the paper's rules written out in numpy over three rounds; the
ALGORITHMS.md check (β₁ = 0, Adagrad with τ large and η = τ: FedAvg's step to first order);
``sgd`` as FedAvg's, FedPer's and IFCA's servers bit for bit; the moments in the server state,
through a checkpoint; an adaptive optimiser refused, in one line, for a method without a
global model.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedexp.algorithms.fedavg import FedAvg
from fedexp.config.instantiate import locate_target
from fedexp.contract import weighted_mean
from fedexp.engine.config_check import check_groups
from fedexp.engine.runner import build_engine
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.server_optim import ServerAdagrad
from fedexp.engine.solver.server_optim import ServerAdam
from fedexp.engine.solver.server_optim import ServerSGD
from fedexp.engine.solver.server_optim import ServerYogi
from fedexp.engine.solver.server_optim import steps_global_model
from fedexp.errors import ConfigError
from helpers import CONF
from helpers import assert_resume_exact
from helpers import compose_config
from helpers import run_cli

D = 7


def _ctx(buffers: torch.Tensor | None = None) -> SimpleNamespace:
    """What the step reads of the context: the model's running-statistics mask."""
    model = SimpleNamespace(has_buffers=buffers is not None, buffer_mask=buffers)
    return SimpleNamespace(model=model)


def _means(rounds: int = 3, seed: int = 0) -> list[np.ndarray]:
    """Mean uploads ū = mean(x − θ_n) of a few rounds, some entries zero and some large."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rounds):
        u = rng.normal(0, 0.05, D)
        u[0] = 0.0
        u[1] = 3.0
        out.append(u)
    return out


def _paper(rule: str, x, means, lr, b1, b2, tau, v0):
    """Algorithm 2 of the paper in numpy (float64): Δ_t = mean(θ_n − x) = −ū."""
    x = np.array(x, dtype=np.float64)
    m, v = np.zeros_like(x), np.full_like(x, v0)
    for u in means:
        delta = -u
        m = b1 * m + (1 - b1) * delta
        if rule == "adagrad":
            v = v + delta**2
        elif rule == "adam":
            v = b2 * v + (1 - b2) * delta**2
        else:  # yogi
            v = v - (1 - b2) * delta**2 * np.sign(v - delta**2)
        x = x + lr * m / (np.sqrt(v) + tau)
    return x, m, v


def _run_steps(opt, x0: np.ndarray, means: list[np.ndarray], ctx=None) -> dict:
    server = {"x": torch.tensor(x0, dtype=torch.float32)}
    for u in means:
        server = opt.step(ctx or _ctx(), server, "x", torch.tensor(u, dtype=torch.float32), 1.0)
    return server


@pytest.mark.parametrize(
    "rule,make",
    [
        ("adagrad", lambda: ServerAdagrad(lr=0.1, beta1=0.9, tau=1e-3)),
        ("adam", lambda: ServerAdam(lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)),
        ("yogi", lambda: ServerYogi(lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)),
        ("yogi", lambda: ServerYogi(lr=0.05, beta1=0.5, beta2=0.9, tau=1e-2, initial_v=0.0)),
    ],
    ids=["adagrad", "adam", "yogi", "yogi-v0-zero"],
)
def test_three_rounds_follow_the_papers_rules(rule, make):
    opt = make()
    x0 = np.linspace(-1, 1, D)
    means = _means()
    server = _run_steps(opt, x0, means)
    b2 = getattr(opt, "beta2", 0.0)
    v0 = opt.initial_v
    x, m, v = _paper(rule, x0, means, opt.lr, opt.beta1, b2, opt.tau, v0)
    np.testing.assert_allclose(server["x"].numpy(), x, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(server["sopt.m.x"].numpy(), m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(server["sopt.v.x"].numpy(), v, rtol=1e-5, atol=1e-9)


def test_v_starts_at_tau_squared():
    """Algorithm 2: v₋₁ ≥ τ²; the default is τ² (a zero upload leaves x and v there)."""
    opt = ServerAdam(tau=1e-2)
    server = _run_steps(opt, np.ones(D), [np.zeros(D)])
    assert torch.allclose(server["sopt.v.x"], torch.full((D,), 0.99 * 1e-4 + 0.0))
    assert torch.equal(server["x"], torch.ones(D))


def test_the_pseudo_gradient_points_from_x_to_the_clients():
    """FedAvg's uploads are x − θ_n: a positive mean upload moves x down, as FedAvg does."""
    for opt in (ServerAdagrad(), ServerAdam(), ServerYogi()):
        server = _run_steps(opt, np.zeros(D), [np.full(D, 0.5)])
        assert bool((server["x"] < 0).all()), opt.name


@pytest.mark.parametrize("initial_v,lr_over_tau", [(0.0, 1.0), (None, 2.0)])
def test_adagrad_without_momentum_and_large_tau_is_fedavg_to_first_order(initial_v, lr_over_tau):
    """ALGORITHMS.md: β₁ = 0, Adagrad with τ large and η = τ ⇒ FedAvg's step to first order.

    η/(√v + τ) with v = v₋₁ + Δ²: η = τ makes it 1 − O(|Δ|/τ) when v₋₁ = 0 (Flower's start);
    with the paper's v₋₁ = τ², √v ≈ τ, so η = 2τ is FedAvg's step (η_s = 1).
    """
    means = _means(1)
    x0 = np.linspace(-1, 1, D)
    fedavg = x0 - means[0]
    square = float(np.max(means[0] ** 2))
    for tau in (1e2, 1e3, 1e4):
        opt = ServerAdagrad(lr=lr_over_tau * tau, beta1=0.0, tau=tau, initial_v=initial_v)
        got = _run_steps(opt, x0, means)["x"].double().numpy()
        error = np.abs(got - fedavg).max()
        assert error <= 1.01 * square / tau + 1e-6, (tau, error)  # |Δ| · |Δ|/τ at most
    far = ServerAdagrad(lr=lr_over_tau * 1e-2, beta1=0.0, tau=1e-2, initial_v=initial_v)
    assert np.abs(_run_steps(far, x0, means)["x"].double().numpy() - fedavg).max() > 1.0


def test_sgd_is_fedavgs_server_bit_for_bit():
    """The default: x − η_s ū exactly, the same operations as FedAvg's server always took."""
    torch.manual_seed(0)
    x = torch.randn(D)
    updates = {n: torch.randn(D) for n in range(3)}
    weights = {0: 0.2, 1: 0.5, 2: 0.3}
    ctx = SimpleNamespace(server_optimizer=ServerSGD(), model=_ctx().model)
    new = FedAvg(server_lr=0.7).server_update(ctx, {"x": x}, updates, weights)
    mean = sum(weights[n] * updates[n] for n in updates)
    assert torch.equal(new["x"], x - 0.7 * weighted_mean(updates, weights))
    torch.testing.assert_close(new["x"], x - 0.7 * mean)
    assert sorted(new) == ["x"]  # no optimiser state
    assert isinstance(Context.__dataclass_fields__["server_optimizer"].default_factory(), ServerSGD)


def test_sgd_is_fedpers_and_ifcas_server_bit_for_bit():
    """The body's coordinates (FedPer) and the chosen clusters' rows (IFCA), as before."""
    torch.manual_seed(1)
    x, mean = torch.randn(D), torch.randn(4)
    idx = torch.tensor([0, 2, 3, 6])
    got = ServerSGD().step(_ctx(), {"x": x}, "x", mean, 0.5, idx=idx)["x"]
    want = x.clone()
    want[idx] = want[idx] - 0.5 * mean
    assert torch.equal(got, want)
    clusters, means = torch.randn(3, D), torch.randn(3, D)
    counts = torch.tensor([2, 0, 1])
    got = ServerSGD().step(_ctx(), {"clusters": clusters}, "clusters", means, 0.5, rows=counts > 0)
    want = torch.where((counts > 0)[:, None], clusters - 0.5 * means, clusters)
    assert torch.equal(got["clusters"], want)


def test_only_the_moved_coordinates_and_rows_keep_moments():
    """FedPer's body: moments of the body's size, the head untouched; IFCA: a cluster nobody
    chose keeps x, m and v; running statistics take the mean and keep their moments."""
    opt = ServerAdam()
    x, idx = torch.zeros(D), torch.tensor([1, 4])
    out = opt.step(_ctx(), {"x": x}, "x", torch.ones(2), 1.0, idx=idx)
    assert out["sopt.m.x"].shape == (2,) and bool((out["x"][idx] < 0).all())
    assert int(torch.count_nonzero(out["x"])) == 2
    clusters = torch.zeros(3, D)
    rows = torch.tensor([True, False, True])
    out = opt.step(_ctx(), {"clusters": clusters}, "clusters", torch.ones(3, D), 1.0, rows=rows)
    assert torch.equal(out["clusters"][1], torch.zeros(D))
    assert torch.equal(out["sopt.m.clusters"][1], torch.zeros(D))
    assert torch.equal(out["sopt.v.clusters"][1], torch.full((D,), 1e-6))
    assert bool((out["sopt.m.clusters"][[0, 2]] != 0).all())
    buffers = torch.zeros(D, dtype=torch.bool)
    buffers[-2:] = True
    out = opt.step(_ctx(buffers), {"x": torch.ones(D)}, "x", torch.full((D,), 0.25), 1.0)
    assert torch.equal(out["x"][-2:], torch.full((2,), 0.75))  # x − 1 · ū
    assert torch.equal(out["sopt.m.x"][-2:], torch.zeros(2))


# ------------------------------------------------------------------ end to end
FAST = ["rounds=3", "progress=none", "checkpoint_every=0", "device=cpu", "tracker=none"]


def _engine(*overrides: str):
    engine = build_engine(compose_config(*FAST, *overrides))
    engine.setup()
    return engine


@pytest.mark.parametrize(
    "overrides,key",
    [
        ((), "x"),
        (("algorithm=fedper", "model=mlp", "model.hidden=8"), "x"),
        (("algorithm=ifca", "model=mlp", "model.hidden=8"), "clusters"),
        (("algorithm=pfedme",), "x"),
    ],
    ids=["fedavg", "fedper", "ifca", "pfedme"],
)
def test_the_moments_live_in_the_server_state_across_rounds(overrides, key):
    engine = _engine("server_optimizer=adam", *overrides)
    assert isinstance(engine.ctx.server_optimizer, ServerAdam)
    engine.run_round()
    m1 = engine.server[f"sopt.m.{key}"].clone()
    v1 = engine.server[f"sopt.v.{key}"].clone()
    assert bool(m1.abs().sum() > 0) and bool((v1 > 0).all())
    engine.run_round()
    assert not torch.equal(engine.server[f"sopt.m.{key}"], m1)  # carried and moved on
    assert torch.isfinite(engine.server[key]).all()


@pytest.mark.slow
def test_resume_continues_the_moments_exactly(tmp_path):
    cfg = compose_config(
        *FAST, "rounds=5", "checkpoint_every=1", "server_optimizer=yogi", "participation=0.6",
        output_dir=tmp_path / "out",
    )  # fmt: skip
    assert_resume_exact(cfg, tmp_path, stop_at=2)


def test_sgd_runs_hold_no_optimiser_state():
    engine = _engine()
    engine.run_round()
    assert isinstance(engine.ctx.server_optimizer, ServerSGD)
    assert not any(k.startswith("sopt.") for k in engine.server)


# ------------------------------------------------------------------ refusals
WITH_GLOBAL_MODEL = [
    "fedavg", "fedprox", "ditto", "apfl", "fedrod", "fedala", "fedavg_ft", "fedprox_ft",
    "fedper", "fedbn", "fedrep", "ifca", "pfedme", "superfed", "scaffold", "fednova", "moon",
    "perfedavg", "perfedavg_hf", "fedbabu",
]  # fmt: skip
#: FedDyn's x is mean θ_n − h/α, not a step on the mean upload
WITHOUT = ["local", "pfednet", "fedamp", "fpfc", "feddwa", "l2gd", "pfedsop", "tdpfed", "feddyn"]


def test_every_algorithm_config_is_placed():
    """A new method decides whether its server takes ``server_optimizer`` (a test fails until)."""
    assert sorted(WITH_GLOBAL_MODEL + WITHOUT) == sorted(
        p.stem for p in (CONF / "algorithm").glob("*.yaml")
    )


def _algorithm_class(option: str) -> type:
    text = (CONF / "algorithm" / f"{option}.yaml").read_text()
    target = next(line.split(":", 1)[1].strip() for line in text.splitlines() if "_target_" in line)
    return locate_target(target, "algorithm._target_")


@pytest.mark.parametrize("option", WITH_GLOBAL_MODEL + WITHOUT)
def test_which_methods_take_an_adaptive_server_optimiser(option):
    assert steps_global_model(_algorithm_class(option)) == (option in WITH_GLOBAL_MODEL)


@pytest.mark.parametrize("option", ["local", "fedamp", "l2gd"])
def test_an_adaptive_optimiser_is_refused_without_a_global_model(option):
    cfg = compose_config(*FAST, f"algorithm={option}", "server_optimizer=adagrad")
    with pytest.raises(ConfigError, match=r"server_optimizer=adagrad: .*\(algorithm\)"):
        check_groups(cfg)
    check_groups(compose_config(*FAST, f"algorithm={option}"))  # sgd: the method's own server


@pytest.mark.slow
def test_the_cli_refuses_it_in_one_line_with_exit_2(tmp_path):
    proc = run_cli("run", *FAST, "algorithm=local", "server_optimizer=adam", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "server_optimizer=adam" in line]
    assert len(lines) == 1 and "LocalOnly" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.csv"))


@pytest.mark.parametrize(
    "override,needle",
    [
        ("server_optimizer.tau=0", "server_optimizer.tau=0"),
        ("server_optimizer.beta1=1.0", "server_optimizer.beta1=1.0"),
        ("server_optimizer.lr=-1", "server_optimizer.lr=-1"),
    ],
)
def test_bad_values_are_refused_naming_the_key(override, needle):
    cfg = compose_config(*FAST, "server_optimizer=adam", override)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        check_groups(cfg)
