"""Fixtures shared by the tests (helpers live in tests/helpers.py)."""

from __future__ import annotations

import pytest

from helpers import SMALL, compose_config


@pytest.fixture
def small_cfg(tmp_path):
    """Compose a tiny run writing into tmp_path."""

    def make(*overrides: str):
        return compose_config(*SMALL, *overrides, output_dir=tmp_path / "out")

    return make
