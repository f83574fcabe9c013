"""One run over two processes (torch.distributed, gloo, CPU) logs what one process does
(issue: beyond one process), for every algorithm config, with and without DP, and resumes on
another number of processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedexp.engine.runner import run
from fedexp.tracking.base import NullTracker
from helpers import CONF
from helpers import SMALL
from helpers import compose_config
from helpers import needs

pytestmark = pytest.mark.slow  # several processes or whole CLI runs: make test-slow

ALGORITHMS = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))
DP_CENTRAL = ("fedavg", "ditto", "fedamp", "feddwa", "ifca")
#: adaptive clipping (its count summed over the ranks), local DP (participations counted)
DP_OTHER = {
    "fedavg+adaptive": ["privacy=adaptive", "privacy.count_stddev=1"],
    "ditto+local": ["privacy=local"],
    "fedamp+fixed": ["privacy=central", "privacy.sampling=fixed"],
}
#: rounds in slices of one client over the ranks (every client each round: three a rank)
SLICED = {
    "fedavg+sliced": ["participation=1"],
    "ditto+stc+sliced": ["participation=1", "compressor=stc"],
}
#: two rounds: the second starts from state the first left on every rank (a third adds time,
#: not coverage: ~30 runs on one process and on two)
BASE = [
    *(o for o in SMALL if not o.startswith("rounds=")),
    *("rounds=2", "num_clients=6", "batch_size=8", "tracker=none", "participation=0.5"),
]


def _overrides(algorithm: str, out: Path, *extra: str) -> list[str]:
    k = ["algorithm.k=2"] if algorithm == "pfednet" else []
    return [*BASE, f"algorithm={algorithm}", *k, *needs(algorithm), *extra, f"output_dir={out}"]


def _one_client_budget(algorithm: str, *extra: str) -> float:
    """A ``memory_budget`` (GiB) whose round slices hold one client (``Engine._round_slices``)."""
    from fedexp.engine.round import engine as round_engine
    from fedexp.engine.runner import build_engine

    x0 = build_engine(compose_config(*_overrides(algorithm, Path("unused"), *extra))).x0
    return 1.5 * round_engine._ROUND_COPIES * x0.numel() * x0.element_size() / 2**30


def _two_ranks(jobs: list[tuple[str, list[str]]], out: Path) -> dict[str, dict]:
    """Run ``jobs`` over two spawned ranks; rank 0's metrics of each, by name."""
    from distributed_worker import main
    from distributed_worker import spawn_ranks

    spawn_ranks(main, str(out), jobs)
    return {name: json.loads((out / f"{name}.json").read_text()) for name, _ in jobs}


def _one_rank(overrides: list[str], vectors: dict | None = None) -> dict:
    """One process's logged metrics of ``overrides`` (and into ``vectors["v"]`` every
    client's evaluated model after the last round)."""
    from distributed_worker import last_vectors

    tracker = NullTracker()
    cfg = compose_config(*overrides)
    run(
        cfg,
        tracker=tracker,
        callbacks=[last_vectors(cfg.rounds, {} if vectors is None else vectors)],
    )
    return {k: {str(s): v for s, v in steps.items()} for k, steps in tracker.metrics.items()}


def _differences(one: dict, two: dict) -> list[str]:
    bad = []
    for key, steps in one.items():
        if key.startswith(("time/", "system/", "memory/")):
            continue
        for step, a in steps.items():
            b = two.get(key, {}).get(step)
            same = b is not None and (a == b or (math.isnan(a) and math.isnan(b)))
            if not same and not (b is not None and math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)):
                bad.append(f"{key}@{step}: {a} vs {b}")
    return bad


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[dict, dict, dict]:
    """Every algorithm config (and a few with central DP) on one process and on two."""
    root = tmp_path_factory.mktemp("distributed")
    jobs = [(a, _overrides(a, root / "runs" / a)) for a in ALGORITHMS]
    jobs += [
        (f"{a}+dp", _overrides(a, root / "runs" / f"{a}+dp", "privacy=central")) for a in DP_CENTRAL
    ]
    for name, extra in DP_OTHER.items():
        algorithm = name.split("+")[0]
        jobs.append((name, _overrides(algorithm, root / "runs" / name, *extra)))
    for name, extra in SLICED.items():
        algorithm = name.split("+")[0]
        budget = f"memory_budget={_one_client_budget(algorithm, *extra)}"
        jobs.append((name, _overrides(algorithm, root / "runs" / name, *extra, budget)))
    two = _two_ranks(jobs, root)
    one, vectors = {}, {}
    for name, o in jobs:
        vectors[name] = {}
        one[name] = _one_rank([*o[:-1], f"output_dir={root / 'one' / name}"], vectors[name])
    for name, _ in jobs:  # every client's evaluated model: one process's, then two's
        vectors[name] = (vectors[name]["v"], load_file(str(root / f"{name}.safetensors"))["v"])
    return one, two, dict(jobs), vectors


@pytest.mark.parametrize("name", [*ALGORITHMS, *(f"{a}+dp" for a in DP_CENTRAL), *DP_OTHER])
def test_two_processes_log_what_one_does(both, name):
    one, two, _, _ = both
    assert one[name].keys() <= two[name].keys()
    assert not _differences(one[name], two[name])
    assert "acc/mean" in two[name] and "bytes/up_cum" in two[name]


@pytest.mark.parametrize("name", sorted(SLICED))
def test_two_processes_slice_their_rounds_to_the_memory_budget_as_one_does(both, name):
    """Each rank goes through its own clients in slices of the budget, summing their weighted
    uploads as it goes, and the ranks add their sums: what one process logs running the same
    rounds whole (the bytes exactly, the rest up to the order of the sums)."""
    one, two, jobs, _ = both
    assert two[name]["test/round_slices"] == {"0": 1.0}  # (rank 0 sliced its rounds)
    whole = [o for o in jobs[name] if not o.startswith(("memory_budget", "output_dir"))]
    alone = _one_rank([*whole, f"output_dir={Path(jobs[name][-1].split('=', 1)[1]).parent}/w"])
    assert alone.keys() <= two[name].keys()
    assert not _differences(alone, two[name])
    assert not _differences(one[name], two[name])


@pytest.mark.parametrize("name", ALGORITHMS)
def test_two_processes_evaluate_the_same_client_models(both, name):
    """Each rank computes its own clients' evaluated models (IFCA's estimate and the
    fine-tuning baselines from their training rows, which only that rank holds): gathered,
    they are one process's."""
    one, two = both[3][name]
    assert one.shape == two.shape and one.shape[0] == 6
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-6)


def test_a_run_checkpointed_by_two_processes_resumes_on_one(both, tmp_path):
    """Checkpoints hold every rank's clients: two processes stop after round 1, one process
    resumes to round 2 and logs what one process did all along."""
    one, _, jobs, _ = both
    first = tmp_path / "first"
    overrides = [o for o in jobs["ditto"] if not o.startswith(("output_dir", "rounds"))]
    _two_ranks(
        [("part", [*overrides, "rounds=1", "checkpoint_every=1", f"output_dir={first}"])], tmp_path
    )
    resumed = _one_rank(
        [*overrides, "rounds=2", f"resume={first / 'checkpoints'}", f"output_dir={first}"]
    )
    assert not _differences({k: v for k, v in one["ditto"].items()}, {**resumed})


def test_checkpoints_move_between_one_process_and_two(tmp_path):
    """Every client's states and channel memories (Ditto; STC with error feedback both ways)
    cross a checkpoint whatever the number of processes: one process checkpoints round 1,
    two resume it to round 2 (each keeps its own clients of it) and checkpoint, one resumes
    that to round 3 and logs what one process running three rounds does."""
    base = [o for o in BASE if not o.startswith(("rounds", "checkpoint_every", "participation"))]
    base += ["participation=1", "algorithm=ditto", "compressor=stc", "checkpoint_every=1"]
    base += ["compressor.uplink.codec.q=0.2", "compressor.downlink.codec.q=0.2"]
    straight = _one_rank([*base, "rounds=3", f"output_dir={tmp_path / 'straight'}"])
    hops = tmp_path / "hops"
    resume = f"resume={hops / 'checkpoints'}"
    _one_rank([*base, "rounds=1", f"output_dir={hops}"])
    _two_ranks([("hop", [*base, "rounds=2", resume, f"output_dir={hops}"])], tmp_path)
    resumed = _one_rank([*base, "rounds=3", resume, f"output_dir={hops}"])
    assert not _differences(straight, resumed)
    assert straight["bytes/up_cum"] == resumed["bytes/up_cum"]
