"""Shared fixtures for the data_prep tests: synthetic releases in the official layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep import synthetic


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def tree():
    """Relative path -> size of every file under a folder (to detect stray writes)."""
    return _tree


@pytest.fixture
def luna_root(tmp_path: Path) -> tuple[Path, list[synthetic.LunaStudy]]:
    root = tmp_path / "luna_raw"
    return root, synthetic.write_luna16(root, n_studies=4, seed=3)


@pytest.fixture(scope="session")
def mri_studies() -> list[synthetic.MRIStudy]:
    return synthetic.make_mri_studies(n_studies=3, seed=5)
