"""CER (docs/compression.md): exact solver against KKT, the paper's ADMM and a generic solver."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedexp.comm.cer import CERTransform
from fedexp.comm.cer import cer_admm_reference
from fedexp.comm.cer import cer_update
from fedexp.comm.cer import difference
from fedexp.comm.cer import prox_tv_tail0
from fedexp.comm.runs import RunLengthCodec
from fedexp.comm.runs import count_runs


def _kkt_violation(u: np.ndarray, w: np.ndarray, tau: float) -> tuple[float, float]:
    """(max |z| - tau, max |z_i - tau sign((Lambda w)_i)| where (Lambda w)_i != 0).

    z solves Lambda^T z = u - w, i.e. z_i - z_{i-1} = (u - w)_i: z = cumsum(u - w).
    """
    z = np.cumsum(u - w)
    lw = difference(w)
    active = lw != 0
    box = float(np.abs(z).max() - tau)
    sign = float(np.abs(z[active] - tau * np.sign(lw[active])).max()) if active.any() else 0.0
    return box, sign


def _signals(rng: np.random.Generator, d: int) -> list[np.ndarray]:
    steps = np.repeat(rng.normal(size=max(d // 20, 1)), 20)[:d]
    steps = np.pad(steps, (0, d - steps.size))
    return [
        rng.normal(size=d),
        np.cumsum(rng.normal(size=d)),
        steps + 0.1 * rng.normal(size=d),
        rng.standard_cauchy(size=d),
    ]


def test_gamma_zero_returns_g_exactly() -> None:
    g = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    out = cer_update(g, 0.0, 0.1)
    assert torch.equal(out, g) and out.data_ptr() != g.data_ptr()
    x, metrics = CERTransform(gamma=0.0, eta=0.3)(g)
    assert torch.equal(x, g) and metrics["cer/runs"] == count_runs(g)
    gn = g.numpy().astype(np.float64)
    assert np.array_equal(cer_update(gn, 0.0, 7.0), gn)


@pytest.mark.parametrize("d", [1, 2, 3, 10, 257, 5000])
def test_kkt_conditions_hold(d: int) -> None:
    rng = np.random.default_rng(d)
    for u in _signals(rng, d):
        for tau in [1e-3, 0.1, 1.0, 10.0, 1e3]:
            w = prox_tv_tail0(u, tau)
            box, sign = _kkt_violation(u, w, tau)
            scale = 1e-9 * max(1.0, float(np.abs(u).sum()))
            assert box <= scale and sign <= scale, (d, tau, box, sign)


def test_kkt_through_cer_update() -> None:
    rng = np.random.default_rng(1)
    g = rng.normal(size=400)
    gamma, eta = 0.7, 0.05
    grad = cer_update(g, gamma, eta)
    u, w, tau = -eta * g, -eta * grad, eta * gamma
    box, sign = _kkt_violation(u, w, tau)
    assert box <= 1e-12 and sign <= 1e-12


def test_d1_is_soft_threshold_and_large_gamma_gives_zero() -> None:
    for u in [3.0, -3.0, 0.5, -0.5]:
        np.testing.assert_allclose(
            prox_tv_tail0(np.array([u]), 1.0), [np.sign(u) * max(abs(u) - 1, 0)]
        )
    rng = np.random.default_rng(2)
    g = rng.normal(size=300)
    edge = float(np.abs(np.cumsum(g)).max())  # w = 0 iff |cumsum(u)| <= tau everywhere
    assert not np.any(cer_update(g, edge * (1 + 1e-9), 0.5))
    assert np.any(cer_update(g, edge * 0.99, 0.5))


def test_matches_paper_admm_reference() -> None:
    rng = np.random.default_rng(3)
    for gamma in [0.05, 0.5, 3.0]:
        g = rng.normal(size=50)
        exact = cer_update(g, gamma, 0.1)
        admm = cer_admm_reference(g, gamma, 0.1, rho=1.0, iters=5000)
        np.testing.assert_allclose(admm, exact, rtol=0, atol=1e-6)


def test_matches_generic_solver_on_tiny_problems() -> None:
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(4)
    for d in [1, 2, 4, 7, 12]:
        lam_t = np.eye(d) - np.eye(d, k=-1)  # Lambda^T
        for tau in [0.05, 0.4, 2.0]:
            u = rng.normal(size=d)
            # dual: min_z 1/2 ||u - Lambda^T z||^2 s.t. |z| <= tau, then w = u - Lambda^T z
            res = optimize.lsq_linear(lam_t, u, bounds=(-tau, tau), method="bvls", tol=1e-14)
            w_ref = u - lam_t @ res.x
            np.testing.assert_allclose(prox_tv_tail0(u, tau), w_ref, rtol=0, atol=1e-9)


def test_eta_only_rescales_the_problem() -> None:
    g = np.random.default_rng(5).normal(size=1000)
    a = cer_update(g, 0.3, 1.0)
    for eta in [1e-3, 0.1, 10.0]:
        np.testing.assert_allclose(cer_update(g, 0.3, eta), a, rtol=0, atol=1e-12)


def test_runs_do_not_increase_with_gamma() -> None:
    rng = np.random.default_rng(6)
    gammas = np.concatenate([[0.0], np.geomspace(1e-3, 30.0, 40)])
    for g in _signals(rng, 2000):
        runs, sparsity = [], []
        for gamma in gammas:
            out, metrics = CERTransform(gamma=float(gamma), eta=0.1)(torch.from_numpy(g))
            runs.append(metrics["cer/runs"])
            sparsity.append(metrics["cer/sparsity"])
            assert metrics["cer/runs"] == count_runs(out)
        assert all(a >= b for a, b in zip(runs, runs[1:], strict=False)), runs
        assert all(a <= b for a, b in zip(sparsity, sparsity[1:], strict=False)), sparsity
        assert runs[0] == g.size and runs[-1] < g.size / 5


def test_transform_keeps_dtype_device_shape_and_feeds_runlength() -> None:
    g = torch.randn(5000, generator=torch.Generator().manual_seed(7)) * 1e-2
    out, metrics = CERTransform(gamma=0.05, eta=0.1)(g)
    assert out.dtype == torch.float32 and out.shape == g.shape and out.device == g.device
    lam_out = difference(out)
    assert metrics["cer/sparsity"] == pytest.approx(float((lam_out == 0).float().mean()))
    runs = int(metrics["cer/runs"])
    assert runs < 500
    codec = RunLengthCodec()
    payload = codec.encode(out)
    assert torch.equal(codec.decode(payload, g.numel()), out)
    assert len(payload) < 4 * runs + runs + 16  # about one float32 plus a short length a run


def test_per_tensor_scope_solves_each_block() -> None:
    rng = np.random.default_rng(8)
    sizes = [30, 1, 200, 7]
    g = torch.from_numpy(rng.normal(size=sum(sizes)))
    expected = torch.cat([cer_update(part, 0.4, 0.2) for part in torch.split(g, sizes)])
    shapes = [("a.weight", (5, 6)), ("a.bias", (1,)), ("b.weight", (10, 20)), ("b.bias", (7,))]

    # like fedexp.models.flat.Layout: names, shapes, offsets, numel
    layout_like = SimpleNamespace(
        names=tuple(n for n, _ in shapes), shapes=tuple(s for _, s in shapes), numel=sum(sizes)
    )
    layouts = [sizes, shapes, dict(shapes), [torch.empty(s) for _, s in shapes], layout_like]
    for layout in layouts:
        out, metrics = CERTransform(gamma=0.4, eta=0.2, scope="per_tensor", layout=layout)(g)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-14)
        lam = difference(out, sizes)
        assert metrics["cer/sparsity"] == pytest.approx(float((lam == 0).double().mean()))
    with pytest.raises(ValueError):
        CERTransform(gamma=0.4, eta=0.2, scope="per_tensor")
    with pytest.raises(ValueError):
        CERTransform(gamma=0.4, eta=0.2, scope="per_tensor", layout=[3])(g)
    with pytest.raises(ValueError):
        CERTransform(gamma=-1.0, eta=0.2)


def test_a_large_input_meets_the_optimality_conditions() -> None:
    """100,000 coordinates (a small model's update): exact still (its speed is measured by
    the benchmarks, never asserted: a loaded machine would fail a timing assert)."""
    rng = np.random.default_rng(9)
    g = torch.from_numpy(rng.normal(size=100_000).astype(np.float32))
    out, metrics = CERTransform(gamma=0.5, eta=0.1)(g)
    assert 1 <= metrics["cer/runs"] < g.numel()
    box, sign = _kkt_violation(-0.1 * g.double().numpy(), -0.1 * out.double().numpy(), 0.05)
    assert box < 1e-5 and sign < 1e-5  # float32 output: KKT up to float32 rounding


def test_transform_acts_on_the_gradient_scale() -> None:
    """CER of ``s·g`` at scale ``s`` is ``s`` × CER of ``g``: one γ for every algorithm."""
    g = torch.randn(300, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    t = CERTransform(gamma=0.05)
    on_gradient, _ = t(g.float())
    on_step, _ = t(0.1 * g.float(), 0.1)
    torch.testing.assert_close(on_step, 0.1 * on_gradient, rtol=1e-5, atol=1e-7)
    weaker, _ = t(0.1 * g.float())  # the old reading: γ on the step, 10× stronger relatively
    assert (weaker[1:] != weaker[:-1]).sum() < (on_step[1:] != on_step[:-1]).sum()


def test_fedavg_and_pfednet_get_the_same_cer(small_cfg) -> None:
    """FedAvg sends lr × the pseudo-gradient pFedNet sends; with CER on both, pFedNet with
    nothing personal is still FedAvg (uniform weights): γ means the same for both."""
    from fedexp.engine.runner import build_engine

    cer = (
        "compressor=cer",
        "compressor.uplink.transforms.0.gamma=0.02",
        "model=mlp",
        "model.hidden=8",
    )
    p = build_engine(small_cfg("algorithm=pfednet", "model.personal=[]", *cer))
    f = build_engine(small_cfg("algorithm=fedavg", "algorithm.weighting=uniform", *cer))
    p.setup()
    for _ in range(3):
        mp, mf = p.run_round(), f.run_round()
    assert mf["train/cer/runs"] == mp["train/cer/runs"] < 0.9 * p.x0.numel()
    torch.testing.assert_close(p.server["x"], f.server["x"], rtol=1e-5, atol=1e-6)
