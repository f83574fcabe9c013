"""Golden figures (issue 22): every algorithm config, 3 rounds at several settings, reproduces
the server state, every client state, the channel's residuals and replicas and each round's
metrics recorded on main before the one-path refactor (``tests/golden/record.py``).

Tolerance rel. 1e-5: the refactor moved code, not arithmetic; the recording ran the cohort
path where it existed and the per-client hooks elsewhere (BatchNorm models, clients whose step
counts differ), which the one path now runs as a cohort of rows or in sub-cohorts.
"""

from __future__ import annotations

import json

import pytest
import torch
from golden.cases import CASES
from golden.golden import metrics_path, run_case, state_path

pytestmark = pytest.mark.usefixtures("one_thread")

_EXACT = ("bytes/", "clients/", "messages/")


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(metrics_path().read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_reproduces_the_recording(name, recorded, tmp_path):
    from safetensors.torch import load_file

    state, history = run_case(name, tmp_path)
    want = load_file(state_path(name))
    assert sorted(state) == sorted(want), "the state tree's entries changed"
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert len(history) == len(recorded[name])
    for t, (got, old) in enumerate(zip(history, recorded[name], strict=True)):
        assert sorted(got) == sorted(old), f"round {t}: the metrics' names changed"
        for key, value in old.items():
            if key.startswith(_EXACT):
                assert got[key] == value, f"round {t}: {key}"
            else:
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7, nan_ok=True), (
                    f"round {t}: {key}"
                )


def test_every_algorithm_config_has_cases():
    from golden.cases import ALGORITHMS

    from helpers import CONF

    assert sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml")) == ALGORITHMS
    for alg in ALGORITHMS:
        assert {f"{alg}-stc-partial", f"{alg}-batchnorm"} <= set(CASES)
