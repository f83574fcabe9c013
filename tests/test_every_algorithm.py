"""Every algorithm of conf/algorithm runs end to end: on the default data, and with a DenseNet
with BatchNorm on the synthetic LUNA16 release (issue: contract v2, done-when)."""

from __future__ import annotations

import math

import pytest

from fedexp.engine.runner import run
from fedexp.tracking.base import NullTracker
from helpers import CONF
from helpers import needs

ALGORITHMS = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_runs_on_the_default_data(small_cfg, algorithm):
    cfg = small_cfg(f"algorithm={algorithm}", "rounds=2", *needs(algorithm))
    result = run(cfg, tracker=NullTracker())
    assert math.isfinite(result.metrics["acc/mean"])
    assert len(result.per_client) == 5


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_runs_with_a_batchnorm_densenet_on_luna16(prepared, small_cfg, algorithm):
    cfg = small_cfg(
        "dataset=luna16",
        f"dataset.path={prepared.luna}",
        "model=densenet",
        "model.norm=batch",
        "model.growth_rate=4",
        "model.block_config=[2,2]",
        "partition=iid",
        f"algorithm={algorithm}",
        *(["algorithm.k=2"] if algorithm == "pfednet" else []),  # k < num_clients
        "rounds=1",
        "num_clients=3",
        "local_steps=2",
        "batch_size=8",
        "lr=0.05",
    )
    result = run(cfg, tracker=NullTracker())
    assert math.isfinite(result.metrics["acc/mean"])
