"""pytest plugin of the device check: keep only the tests that need CUDA (issue 40).

    python -m pytest -p cuda_select tests/...      # scripts/gpu on PYTHONPATH

A test needs CUDA when it is marked ``cuda``, when a ``skipif`` of it names CUDA or a GPU in
its reason (``@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")``, the
project's way), or when one of its parameters is a CUDA device (``DEVICES = ["cpu", "cuda"]``).
The others are deselected. Without a GPU the kept tests skip, as they do in the suite.
"""

from __future__ import annotations

import re

import pytest

_NAMES = re.compile(r"\bcuda\b|\bgpu\b", re.IGNORECASE)


def _param_is_cuda(value: object) -> bool:
    return (
        isinstance(value, str)
        and value.lower().startswith("cuda")
        or (getattr(value, "type", None) == "cuda")
    )


def needs_cuda(item: pytest.Item) -> bool:
    """Whether ``item`` is one of the CUDA tests (see the module docstring)."""
    if item.get_closest_marker("cuda") is not None:
        return True
    for mark in item.iter_markers("skipif"):
        if _NAMES.search(str(mark.kwargs.get("reason", ""))):
            return True
    spec = getattr(item, "callspec", None)
    return spec is not None and any(_param_is_cuda(v) for v in spec.params.values())


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``cuda`` marker (for tests that choose to carry it)."""
    config.addinivalue_line("markers", "cuda: the test needs a CUDA device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect every test that does not need CUDA."""
    kept = [item for item in items if needs_cuda(item)]
    dropped = [item for item in items if not needs_cuda(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
