"""A round's work does not grow with its cohort: ops and host reads counted (issue 39).

What decides a round's speed on a GPU is checkable on the CPU (``fedexp.engine.round.census``):
the tensor operations a round dispatches (each a kernel launch) and the times it reads the
device from the host (each waits for every queued kernel). For every algorithm of the
registry, every codec and every privacy mode, the second round of a run is counted at a
small and a large cohort (every client every round, equal clients, logistic regression, or
an MLP with a head for the algorithms that need one) and the two counts must be equal: a
per-client select, clone or host read would show as a difference of hundreds.

The second round, since the first writes every client's state and the codecs' memories (the
first round of a client reads its initial state: the same ops, but other branches).

An algorithm or codec not yet written over stacks is listed in :data:`GROWING` with its
reason; its case is a strict xfail, so that it fails the day it stops growing (and must leave
the list). The 1,000-client cases are marked slow (a minute); 10 against 100 run in
``make test``.
"""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.round.census import Census
from fedexp.engine.runner import build_engine
from helpers import compose_config

#: the algorithms whose personal part is a head (logistic regression is all head)
HEADED = ["model=mlp", "model.hidden=16"]
SETTINGS: dict[str, list[str]] = {
    "fedper": HEADED,
    "fedrep": HEADED,
    "fedrod": HEADED,
    "pfednet": HEADED,
    "tdpfed": HEADED,
    "fedbn": [*HEADED, "model.norm=batch"],
    "fedamp": ["algorithm.alpha_k=0.0001"],  # (N − 1)α_k/σ ≤ 1 at N = 1,000
}
ALGORITHMS = [
    "fedavg",
    "fedprox",
    "local",
    "ditto",
    "fedavg_ft",
    "fedprox_ft",
    "fedamp",
    "fpfc",
    "l2gd",
    "fedper",
    "fedrep",
    "apfl",
    "fedrod",
    "pfedsop",
    "pfedme",
    "feddwa",
    "ifca",
    "superfed",
    "tdpfed",
    "fedala",
    "pfednet",
    "fedbn",
]
CODECS = ["stc", "stc_twomean", "topk", "topk_zlib", "randk", "sar", "cer", "cer_runs", "cer_stc"]
PRIVACY = ["central", "local", "adaptive"]

#: not yet over stacks: case -> why it grows (a strict xfail: it must leave when it stops)
GROWING: dict[str, str] = {
    "fedavg_ft": "reads per-client states row by row",
    "fedprox_ft": "reads per-client states row by row",
    "fedamp": "cloud models and updates per client",
    "fpfc": "per-client centres (downlink) and pairs",
    "l2gd": "reads per-client states row by row",
    "pfedsop": "per-client states and server rows",
    "fedper": "per-client heads read row by row",
    "fedrep": "per-client heads read row by row",
    "feddwa": "per-client personal models and distances",
    "apfl": "per-client mixtures read row by row",
    "ifca": "per-client cluster choice read on the host",
    "fedrod": "per-client heads read row by row",
    "pfednet": "per-client personal parts; ADMM iterations depend on the data",
    "fedbn": "per-client norm layers",
    "tdpfed": "per-client factors read row by row",
    "fedala": "per-client adaptive aggregation, a loop per client",
    "compressor=stc": "residuals read and written per client",
    "compressor=stc_twomean": "residuals per client",
    "compressor=topk": "residuals per client",
    "compressor=topk_zlib": "encoded client by client",
    "compressor=randk": "encoded client by client",
    "compressor=sar": "encoded client by client",
    "compressor=cer": "a transform: message by message",
    "compressor=cer_runs": "a transform: message by message",
    "compressor=cer_stc": "a transform: message by message",
}


def census(case: str, clients: int, extra: list[str]) -> Census:
    """The ops and host reads of the second round of ``case`` at ``clients`` clients."""
    algorithm = case if case in ALGORITHMS else "fedavg"
    overrides = [
        "dataset=synthetic",
        f"dataset.num_samples={20 * clients}",
        f"num_clients={clients}",
        "participation=1.0",
        f"algorithm={algorithm}",
        "local_steps=2",
        "batch_size=5",
        "progress=none",
        "device=cpu",
        "checkpoint_every=0",
        "rounds=3",
        *SETTINGS.get(algorithm, []),
        *extra,
    ]
    torch.manual_seed(0)
    engine = build_engine(compose_config(*overrides))
    engine.setup()
    engine.run_round()
    with Census() as counted:
        engine.run_round()
    return counted


def _cases() -> list:
    cases = [(a, []) for a in ALGORITHMS]
    cases += [(f"compressor={c}", [f"compressor={c}"]) for c in CODECS]
    cases += [(f"privacy={p}", [f"privacy={p}", "privacy.noise_multiplier=1.0"]) for p in PRIVACY]
    out = []
    for big in (100, 1000):
        for name, extra in cases:
            marks = [pytest.mark.slow] if big == 1000 else []
            if name in GROWING:
                marks.append(pytest.mark.xfail(reason=GROWING[name], strict=True))
            out.append(pytest.param(name, extra, big, marks=marks, id=f"{name}-{big}"))
    return out


@pytest.mark.parametrize(("case", "extra", "big"), _cases())
def test_a_round_dispatches_as_many_ops_and_host_reads_for_any_cohort(case, extra, big):
    small, large = census(case, 10, extra), census(case, big, extra)
    assert large.total_ops == small.total_ops, (
        f"{case}: {small.total_ops} ops at 10 clients, {large.total_ops} at {big}; "
        f"at {big}: {large.summary()}"
    )
    assert large.total_reads == small.total_reads, (
        f"{case}: {small.total_reads} host reads at 10 clients, {large.total_reads} at {big}: "
        f"{large.summary()}"
    )
