"""CP factors (TDPFed §III-IV): Table I's ranks, composition, ALS and the factor layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedexp.models.cp import CPLayout
from fedexp.models.cp import als
from fedexp.models.cp import compose
from fedexp.models.cp import cp_rank
from fedexp.models.flat import Layout

#: TDPFed Table I: layer dimensions and the CP ranks R1 (x1.5) and R2 (x2).
TABLE_I = [
    ("DNN fc1", (784, 100), 59, 44),
    ("DNN fc2", (100, 10), 6, 5),
    ("VGG8 conv1", (3, 32, 3, 3), 14, 11),
    ("VGG8 conv2", (32, 64, 3, 3), 120, 90),
    ("VGG8 conv3", (64, 128, 3, 3), 248, 186),
    ("VGG8 conv4", (128, 256, 3, 3), 504, 378),
    ("VGG8 conv5", (256, 256, 3, 3), 759, 569),
    ("VGG8 fc1", (256, 256), 85, 64),
    ("VGG8 fc2", (256, 256), 85, 64),
    ("VGG8 fc3", (256, 10), 6, 5),
]


@pytest.mark.parametrize(("layer", "shape", "r1", "r2"), TABLE_I, ids=[t[0] for t in TABLE_I])
def test_table_i_ranks(layer, shape, r1, r2):
    assert cp_rank(shape, 1.5) == r1
    assert cp_rank(shape, 2.0) == r2
    # the order of the dimensions (PyTorch's (out, in, kh, kw)) does not matter
    assert cp_rank(tuple(reversed(shape)), 2.0) == r2


def test_table_i_through_the_models_layout():
    """The same ranks read off the layouts of the two networks as PyTorch builds them."""
    dnn = nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 10))
    ranks = CPLayout(Layout.of(dnn), 1.5).ranks
    assert ranks == {"0.weight": 59, "2.weight": 6}
    convs = [nn.Conv2d(i, o, 3) for i, o in [(3, 32), (32, 64), (64, 128), (128, 256), (256, 256)]]
    fcs = [nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 10)]
    vgg = nn.Sequential(*convs, *fcs)
    assert list(CPLayout(Layout.of(vgg), 2.0).ranks.values()) == [r2 for *_, r2 in TABLE_I[2:]]


def test_compose_is_the_sum_of_outer_products_and_batches():
    g = torch.Generator().manual_seed(0)
    factors = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (4, 5, 2, 3)]
    expected = torch.zeros(4, 5, 2, 3, dtype=torch.float64)
    for r in range(3):
        a, b, c, d = (f[:, r] for f in factors)
        expected += torch.einsum("i,j,k,l->ijkl", a, b, c, d)
    torch.testing.assert_close(compose(factors), expected)
    # a matrix: A1 A2ᵀ (TDPFed eq. 4)
    torch.testing.assert_close(compose(factors[:2]), factors[0] @ factors[1].T)
    batched = [torch.stack([f, 2 * f]) for f in factors]
    out = compose(batched)
    torch.testing.assert_close(out[0], expected)
    torch.testing.assert_close(out[1], 16 * expected)


def test_als_recovers_a_rank_r_tensor_from_a_random_start():
    g = torch.Generator().manual_seed(1)
    truth = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (5, 6, 4)]
    tensor = compose(truth)
    start = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (5, 6, 4)]
    before = (compose(start) - tensor).norm() / tensor.norm()
    fitted = als(tensor, start, sweeps=1000)  # ALS can crawl through a swamp first
    after = (compose(fitted) - tensor).norm() / tensor.norm()
    assert before > 0.5 and after < 1e-8


def test_als_sweeps_never_increase_the_error():
    """Each ALS update is an exact least-squares solve: the error is monotone."""
    g = torch.Generator().manual_seed(2)
    tensor = torch.randn(6, 5, 4, generator=g, dtype=torch.float64)  # not low rank
    factors = [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (6, 5, 4)]
    errors = []
    for _ in range(6):
        factors = als(tensor, factors, sweeps=1)
        errors.append(float((compose(factors) - tensor).norm()))
    assert all(b <= a + 1e-9 for a, b in zip(errors, errors[1:], strict=False))


def test_factor_gradient_matches_tdpfed_eq_15():
    """∂/∂A⁽ⁿ⁾ (λ/2)‖θ − [[A]]‖² = λ(A⁽ⁿ⁾Vₙ − θ₍ₙ₎(⊙_{m≠n} A⁽ᵐ⁾)) (eqs. 15-16, with the
    sign of the data term and the factor λ on both terms, as the derivative gives)."""
    g = torch.Generator().manual_seed(3)
    lam = 2.5
    theta = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    factors = [
        torch.randn(n, 2, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 3, 5)
    ]
    loss = 0.5 * lam * ((theta - compose(factors)) ** 2).sum()
    grads = torch.autograd.grad(loss, factors)
    a, b, c = (f.detach() for f in factors)
    # mode-1: θ₍₁₎ (C ⊙ B) and V₁ = BᵀB * CᵀC
    mttkrp = torch.einsum("ijk,jr,kr->ir", theta, b, c)
    v1 = (b.T @ b) * (c.T @ c)
    torch.testing.assert_close(grads[0], lam * (a @ v1 - mttkrp))
    mttkrp3 = torch.einsum("ijk,ir,jr->kr", theta, a, b)
    v3 = (a.T @ a) * (b.T @ b)
    torch.testing.assert_close(grads[2], lam * (c @ v3 - mttkrp3))


def test_layout_compose_decompose_round_trip():
    """Biases are carried as they are; an exactly low-rank weight is recovered by ALS."""
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    layout = Layout.of(model)
    cp = CPLayout(layout, 2.0)
    assert cp.ranks == {"0.weight": 1, "2.weight": 1}
    assert cp.numel == (6 + 5) * 1 + 5 + (5 + 2) * 1 + 2
    assert cp.num_factor_entries == 11 + 7
    g = torch.Generator().manual_seed(4)
    factors = torch.randn(cp.numel, generator=g, dtype=torch.float64)
    full = cp.compose(factors)
    assert full.shape == (layout.numel,)
    # weight (5, 6) = a1 a2ᵀ with a1 the 5 entries, then a2 the 6 (factor order = dims order)
    torch.testing.assert_close(full[:30].view(5, 6), torch.outer(factors[:5], factors[5:11]))
    refit = cp.decompose(full, sweeps=50, generator=g)
    torch.testing.assert_close(cp.compose(refit), full)
    batched = cp.compose(torch.stack([factors, factors]))
    torch.testing.assert_close(batched[1], full)
    dense = cp.dense_mask()
    torch.testing.assert_close(factors[dense], torch.cat([full[30:35], full[45:47]]))
