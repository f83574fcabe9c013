"""The block-wise ``synthetic_tabular`` builds bit for bit the table of the one-shot build."""

from __future__ import annotations

import numpy as np
import pytest

from fedexp.data import tabular
from fedexp.data.tabular import synthetic_tabular


def _scale_reference(x: np.ndarray) -> np.ndarray:
    """``scale_to_unit_interval`` as it was before the block-wise build."""
    lo, hi = x.min(axis=0), x.max(axis=0)
    span = np.where(hi > lo, hi - lo, 1.0)
    return (2.0 * (x - lo) / span - 1.0) * (hi > lo)


def _reference(
    num_samples: int,
    num_features: int,
    num_classes: int,
    num_sites: int,
    heterogeneity: float,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The one-shot build of ``synthetic_tabular`` (verbatim): its ``x``, ``y`` and ``groups``."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(num_features, num_classes))
    sites = rng.integers(0, num_sites, size=num_samples)
    shift = rng.normal(scale=heterogeneity, size=(num_sites, num_features))
    w_site = w[None] + heterogeneity * rng.normal(size=(num_sites, num_features, num_classes))
    x = rng.normal(size=(num_samples, num_features)) + shift[sites]
    logits = np.einsum("nf,nfc->nc", x, w_site[sites]) + rng.gumbel(size=(num_samples, num_classes))
    y = logits.argmax(axis=1).astype(np.int64)
    x = _scale_reference(x).astype(np.float32)
    return x, y, sites.astype(str)


CASES = [
    # (num_samples, num_features, num_classes, num_sites, heterogeneity, seed)
    (1, 1, 2, 1, 1.0, 0),
    (2, 3, 2, 1, 1.0, 1),
    (6, 4, 5, 3, 0.5, 2),
    (7, 4, 2, 3, 1.0, 3),
    (8, 20, 2, 10, 1.0, 0),
    (50, 5, 5, 4, 0.0, 4),
    (333, 20, 2, 10, 1.0, 5),
    (1000, 30, 5, 7, 2.5, 6),
    (2000, 20, 2, 10, 1.0, 0),
    (4099, 30, 3, 100, 1.0, 7),
]


def _check(case: tuple[int, int, int, int, float, int]) -> None:
    data = synthetic_tabular(*case)
    x, y, groups = _reference(*case)
    assert data.x.dtype == np.float32 and data.y.dtype == np.int64
    assert data.groups is not None and data.groups.dtype.kind == groups.dtype.kind == "U"
    assert np.array_equal(data.x, x)
    assert np.array_equal(data.y, y)
    assert np.array_equal(data.groups, groups)
    assert data.num_classes == case[2]


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("case", CASES)
def test_small_blocks_equal_one_shot(
    monkeypatch: pytest.MonkeyPatch, case: tuple[int, int, int, int, float, int], rows: int
) -> None:
    """Many blocks, and blocks that do not divide the rows, change no value."""
    monkeypatch.setattr(tabular, "SYNTHETIC_CHUNK_ROWS", rows)
    _check(case)


@pytest.mark.parametrize("case", CASES)
def test_default_blocks_equal_one_shot(case: tuple[int, int, int, int, float, int]) -> None:
    """With the default block size (one block for these sizes) the table is the same."""
    _check(case)


def test_byte_budget_shrinks_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte budget below one row's site models still gives blocks of one row, same values."""
    monkeypatch.setattr(tabular, "SYNTHETIC_CHUNK_BYTES", 1)
    _check((37, 6, 5, 4, 1.0, 8))


def test_several_default_blocks_equal_one_shot() -> None:
    """Rows beyond one default block (uneven last block) match the one-shot build."""
    n = tabular.SYNTHETIC_CHUNK_ROWS * 2 + 123
    _check((n, 3, 2, 5, 1.0, 9))
