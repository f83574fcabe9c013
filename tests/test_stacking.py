"""Stacked runs (issue 41): runs whose client work is one cohort end as the runs alone.

Each run of a group is a thread with its :class:`fedexp.engine.round.stacking.Member` (what
``hydra/launcher=stacked`` does); the group's client work runs as one ``client_update`` call.
Every client draws from its own (seed, round, client) stream, so a run's figures do not depend
on the cohort it was trained in: accuracies equal, losses and states within float tolerance.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from fedexp.engine.round import stacking
from fedexp.engine.round.stacking import Stack
from fedexp.engine.runner import run
from fedexp.tracking.base import NullTracker
from helpers import CONF
from helpers import SMALL
from helpers import compose_config
from helpers import needs

pytestmark = pytest.mark.usefixtures("one_thread")

ALGORITHMS = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))


def run_stacked(cfgs, callbacks=None):
    """Each config a thread of one stack; (results or errors, the stack)."""
    stack = Stack(len(cfgs))
    out: list = [None] * len(cfgs)

    def go(i: int) -> None:
        stacking.current.set(stack.members[i])
        try:
            extra = {} if callbacks is None else {"callbacks": callbacks[i]}
            out[i] = run(cfgs[i], tracker=NullTracker(), **extra)
        except BaseException as exc:  # noqa: BLE001 - compared by the test
            out[i] = exc
        finally:
            stack.members[i].leave()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(cfgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stacked run hangs"
    return out, stack


def _configs(tmp_path, name, overrides, seeds):
    return [
        compose_config(*SMALL, *overrides, f"seed={s}", output_dir=tmp_path / name / f"{i}")
        for i, s in enumerate(seeds)
    ]


def _same(stacked, alone, what):
    for a, b in zip(stacked, alone, strict=True):
        assert not isinstance(a, BaseException), f"{what}: {a!r}"
        for key, value in b.metrics.items():
            got = a.metrics[key]
            if key.startswith(("time/", "memory/")):
                continue
            if "acc" in key or key.startswith(("bytes/", "clients/")):
                assert got == value or (math.isnan(got) and math.isnan(value)), (what, key)
            else:
                assert got == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (what, key)


def _servers(n):
    """Callbacks keeping each run's server state after its last round."""
    kept: list[dict] = [{} for _ in range(n)]

    def keep(i):
        def callback(engine, metrics):
            kept[i].clear()
            kept[i].update(
                {
                    k: v.detach().clone()
                    for k, v in engine.server.items()
                    if isinstance(v, torch.Tensor)
                }
            )

        return [callback]

    return kept, [keep(i) for i in range(n)]


def test_four_seeds_stacked_end_as_alone(tmp_path):
    overrides = ["algorithm=fedavg", "participation=0.6"]
    cfgs = _configs(tmp_path, "stacked", overrides, range(4))
    kept, callbacks = _servers(4)
    stacked, stack = run_stacked(cfgs, callbacks)
    alone_kept, alone_cbs = _servers(4)
    alone = [
        run(c, tracker=NullTracker(), callbacks=alone_cbs[i])
        for i, c in enumerate(_configs(tmp_path, "alone", overrides, range(4)))
    ]
    _same(stacked, alone, "fedavg")
    for a, b in zip(kept, alone_kept, strict=True):
        assert a.keys() == b.keys() and a
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert stack.calls == 3  # one merged call a round for the four runs
    assert stack.clients == 3 * 4 * 3  # 3 of 5 clients a run, four runs, three rounds
    # the runs' figures differ (a stack that gave every run the first one's would pass above
    # only if the seeds did not matter)
    assert (
        len({r.metrics["acc/mean"] for r in alone}) > 1
        or len({float(s["x"].sum()) for s in alone_kept}) == 4
    )


def test_runs_of_different_splits_stack(tmp_path):
    """δ differs (the partition, so the pools differ in size): still the runs alone."""

    def configs(where: str) -> list:
        return [
            compose_config(
                *SMALL,
                "algorithm=ditto",
                "partition=label_imbalance",
                f"partition.delta={d}",
                f"seed={s}",
                output_dir=tmp_path / where / f"{d}-{s}",
            )
            for d in (1, 2)
            for s in (0, 1)
        ]

    stacked, stack = run_stacked(configs("stacked"))
    alone = [run(c, tracker=NullTracker()) for c in configs("alone")]
    _same(stacked, alone, "ditto by delta")
    assert stack.calls >= 3


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_stacked_ends_as_alone(tmp_path, algorithm):
    overrides = [f"algorithm={algorithm}", "rounds=2", *needs(algorithm)]
    cfgs = _configs(tmp_path, "stacked", overrides, [0, 1])
    stacked, stack = run_stacked(cfgs)
    alone = [run(c, tracker=NullTracker()) for c in _configs(tmp_path, "alone", overrides, [0, 1])]
    _same(stacked, alone, algorithm)
    from fedexp.engine.runner import _build

    merges = getattr(type(_build(cfgs[0], None)[0].algorithm), "stacks", True)
    assert (stack.calls > 0) == merges, (algorithm, stack.calls)  # merged where it may be


def test_a_failing_run_fails_alone(tmp_path):
    """A run that diverges fails; the other runs of its stack finish as they would alone."""
    good = compose_config(*SMALL, "algorithm=fedavg", output_dir=tmp_path / "good")
    bad = compose_config(*SMALL, "algorithm=fedavg", "lr=1e30", output_dir=tmp_path / "bad")
    out, _ = run_stacked([good, bad])
    assert isinstance(out[1], Exception)
    assert not isinstance(out[0], BaseException)
    alone = run(
        compose_config(*SMALL, "algorithm=fedavg", output_dir=tmp_path / "alone"),
        tracker=NullTracker(),
    )
    _same([out[0]], [alone], "the good run")


def test_a_stopped_stack_stops_every_run(tmp_path):
    cfgs = _configs(tmp_path, "stop", ["algorithm=fedavg", "rounds=50"], [0, 1])
    stops = []

    def stop_after_two(engine, metrics):
        if engine.round == 2 and not stops:
            stops.append(engine.round)
            stack_ref[0].stop()

    stack_ref: list = []
    stack = Stack(2)
    stack_ref.append(stack)
    out: list = [None, None]

    def go(i):
        stacking.current.set(stack.members[i])
        try:
            out[i] = run(cfgs[i], tracker=NullTracker(), callbacks=[stop_after_two])
        except BaseException as exc:  # noqa: BLE001
            out[i] = exc
        finally:
            stack.members[i].leave()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(o, KeyboardInterrupt) for o in out), out


def test_a_run_waiting_aside_lets_the_others_take_their_turns():
    """A run that waits on its figures (``stacking.aside``) lets go of the group's turn."""
    stack = Stack(2)
    order: list[str] = []
    entered = threading.Event()

    def first():
        stacking.current.set(stack.members[0])
        with stack.members[0].turns():
            order.append("0 starts")
            with stacking.aside():
                entered.set()
                other.join(timeout=30)  # the other run's whole turn happens meanwhile
            order.append("0 ends")

    def second():
        entered.wait(30)
        with stack.members[1].turns():
            order.append("1 runs")

    other = threading.Thread(target=second)
    one = threading.Thread(target=first)
    other.start()
    one.start()
    one.join(timeout=60)
    assert order == ["0 starts", "1 runs", "0 ends"]
    with stacking.aside():  # a thread of no group: nothing to let go
        pass


def test_the_merged_work_takes_the_runs_threads_and_each_run_one(tmp_path, monkeypatch):
    """``threads=2``: the merged client work runs on the stack's thread at 2, each run at 1.

    OpenMP gives each thread that enters a parallel region a team of its own; twenty runs at
    two threads each made twenty teams on two cores (stacking's docstring).
    """
    from fedexp.algorithms.fedavg import FedAvg

    seen: list[tuple[str, int]] = []
    update = FedAvg.client_update

    def recording(self, ctx, *args):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return update(self, ctx, *args)

    monkeypatch.setattr(FedAvg, "client_update", recording)
    cfgs = _configs(tmp_path, "threads", ["algorithm=fedavg", "rounds=2", "threads=2"], [0, 1])
    own: list[int] = []
    callbacks = [[lambda engine, metrics: own.append(torch.get_num_threads())]] * 2
    out, stack = run_stacked(cfgs, callbacks)
    assert not any(isinstance(o, BaseException) for o in out), out
    assert stack.calls == 2  # one merged call a round
    assert seen == [("fedexp-stack_0", 2)] * 2
    assert own == [1] * 4  # each run's own steps, after each round
