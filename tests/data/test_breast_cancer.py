"""The default data set: scikit-learn's shipped breast-cancer table, read without importing
scikit-learn, equals what scikit-learn's own loader gives (and falls back to it)."""

from __future__ import annotations

import numpy as np

from fedexp.data import tabular


def _from_sklearn():
    from sklearn.datasets import load_breast_cancer

    bunch = load_breast_cancer()
    x = tabular.scale_to_unit_interval(bunch.data.astype(np.float64)).astype(np.float32)
    return x, (bunch.target == 0).astype(np.int64), [str(n) for n in bunch.feature_names]


def test_the_shipped_table_equals_scikit_learns_loader():
    x, y, names = _from_sklearn()
    data = tabular.breast_cancer()
    np.testing.assert_array_equal(data.x, x)
    np.testing.assert_array_equal(data.y, y)
    assert list(data.feature_names) == names
    assert int(data.y.sum()) == 212  # malignant, the positive class


def test_without_the_file_it_is_scikit_learns_loader(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    tabular._breast_cancer.cache_clear()
    try:
        data = tabular.breast_cancer()
    finally:
        tabular._breast_cancer.cache_clear()
    x, y, _ = _from_sklearn()
    np.testing.assert_array_equal(data.x, x)
    np.testing.assert_array_equal(data.y, y)


def test_a_run_gets_its_own_arrays():
    a, b = tabular.breast_cancer(), tabular.breast_cancer()
    a.x[0, 0] = 99.0
    assert b.x[0, 0] != 99.0
