"""FedBuff on the simulated clock (issue 67): ``system.buffer`` = K, the cohort C in flight.

With K = C and equal clients it is FedAvg figure for figure; the clients a step takes, their
staleness and the server's step match a hand simulation of the paper's algorithm; clients in
flight are never drawn again; a resumed run is the same run, on two processes too; a stacked
run is the run alone; bad settings are one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from fedexp.engine.files import checkpoint
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.system.buffer import Flight
from fedexp.system.buffer import staleness_weight
from fedexp.system.settings import System
from fedexp.tracking.base import NullTracker
from helpers import SMALL
from helpers import assert_resume_exact
from helpers import compose_config
from helpers import deterministic

ASYNC_KEYS = ("async/staleness_mean", "async/staleness_max", "async/in_flight")
#: ten clients, four a round (C = 4)
TEN = [*SMALL, "num_clients=10", "batch_size=4", "participation=0.4"]


def _devices(tmp_path: Path, speeds: list[float]) -> str:
    """A device file: client n at ``speeds[n]`` steps a second, 1 kB/s up, 2 kB/s down."""
    rows = "".join(f"{n},{s},1000,2000,0.5\n" for n, s in enumerate(speeds))
    path = tmp_path / "devices.csv"
    path.write_text("client,speed,uplink,downlink,latency\n" + rows)
    return str(path)


def test_k_equal_to_the_cohort_with_equal_clients_is_fedavg(tmp_path):
    base = [*TEN, "rounds=3", "system=uniform"]
    trackers = {k: NullTracker() for k in ("null", "4")}
    seen: dict[str, list] = {k: [] for k in trackers}
    for k, tracker in trackers.items():

        def keep(engine, metrics, into=seen[k]):  # noqa: ANN001, ANN202
            into.append((engine.last_sampled, engine.server["x"].clone()))

        cfg = compose_config(*base, f"system.buffer={k}", output_dir=tmp_path / k)
        run(cfg, tracker=tracker, callbacks=[keep])
    plain, buffered = trackers["null"], trackers["4"]
    assert set(buffered.metrics) - set(plain.metrics) == set(ASYNC_KEYS)
    for key, steps in deterministic(plain.metrics).items():
        assert buffered.metrics[key] == steps, key
    assert set(buffered.metrics["async/in_flight"].values()) == {0.0}
    assert set(buffered.metrics["async/staleness_max"].values()) == {0.0}
    assert len(seen["4"]) == 3
    for (who, x), (who_b, x_b) in zip(seen["null"], seen["4"], strict=True):
        assert who == who_b and torch.equal(x, x_b)


def _simulate(sampled, times, k):  # noqa: ANN001, ANN202
    """The paper's server by hand: per step, (taken ids, their staleness, the clock after).

    ``sampled[t]``: the clients that start in step t; ``times[n]``: client n's seconds.
    """
    flight: list[tuple[float, int, int]] = []  # (finish, client, start step)
    now, out = 0.0, []
    for t, cohort in enumerate(sampled):
        busy = {n for _, n, _ in flight}
        assert not busy & set(cohort), (t, busy, cohort)
        flight += [(now + times[n], n, t) for n in cohort]
        flight.sort()  # by finish time, then id
        taken, flight = flight[:k], flight[k:]
        now = max(now, taken[-1][0])
        ids = sorted(n for _, n, _ in taken)
        tau = {n: t - s for _, n, s in taken}
        out.append((ids, [tau[n] for n in ids], now))
    return out


def test_the_server_step_is_the_papers_by_hand(tmp_path):
    speeds = [0.5, 4.0, 1.0, 8.0, 2.0, 16.0]  # distinct: each step a different pair arrives
    cfg = compose_config(
        *SMALL,
        "rounds=6",
        "num_clients=6",
        "batch_size=4",
        "participation=0.67",  # C = round(0.67 · 6) = 4 in flight
        "algorithm.weighting=uniform",
        "system=trace",
        f"system.device_file={_devices(tmp_path, speeds)}",
        "system.buffer=2",
    )
    engine = build_engine(cfg)
    deltas: dict[tuple[int, int], torch.Tensor] = {}  # (client, start step) -> its Δ
    train = engine.algorithm.client_update

    def client_update(ctx, model_in, states, cohort):  # noqa: ANN001, ANN202
        result = train(ctx, model_in, states, cohort)
        assert torch.equal(model_in, engine.server["x"].expand_as(model_in))  # today's model
        for i, n in enumerate(cohort.clients):
            deltas[(n, ctx.round)] = result.updates[i].clone()
        return result

    engine.algorithm.client_update = client_update
    b = 4 * engine.x0.numel()  # dense float32 each way
    times = {n: b / 2000 + 0.5 + 5 / s + b / 1000 + 0.5 for n, s in enumerate(speeds)}
    sampled, heard, figures, models = [], [], [], [engine.server["x"].clone()]
    for _ in range(6):
        figures.append(engine.run_round())
        sampled.append(engine.last_sampled)
        heard.append(list(engine.ctx.senders.clients))
        models.append(engine.server["x"].clone())
    assert [len(s) for s in sampled] == [4, 2, 2, 2, 2, 2]
    expected = _simulate(sampled, times, 2)
    assert {s for _, taus, _ in expected for s in taus} > {0}  # some stale uploads
    for t, (ids, taus, now) in enumerate(expected):
        assert heard[t] == ids, t
        assert figures[t]["clock/cum_s"] == pytest.approx(now, rel=1e-12), t
        assert figures[t]["async/staleness_max"] == max(taus), t
        assert figures[t]["async/staleness_mean"] == pytest.approx(np.mean(taus)), t
        assert figures[t]["async/in_flight"] == 2.0
        step = sum(
            0.5 / np.sqrt(1.0 + tau) * deltas[(n, t - tau)]
            for n, tau in zip(ids, taus, strict=True)
        )
        torch.testing.assert_close(models[t + 1], models[t] - step, rtol=1e-6, atol=1e-7)


def test_clients_in_flight_are_not_drawn_again(tmp_path):
    cfg = compose_config(*TEN, "rounds=8", "system=lognormal", "system.buffer=2")
    engine = build_engine(cfg)
    first = build_engine(compose_config(*TEN, "system=lognormal")).clock.draw(0)
    for t in range(8):
        busy = set(engine.clock.flight.clients.tolist())
        metrics = engine.run_round()
        assert len(engine.last_sampled) == (4 if t == 0 else 2), t
        assert not busy & set(engine.last_sampled), t
        assert len(engine.clock.flight) == 2 and metrics["async/in_flight"] == 2.0
        if t == 0:
            assert engine.last_sampled == first  # the synchronous clock's round-0 draw
        assert metrics["clock/round_s"] >= 0.0


def test_a_resumed_run_is_the_same_run(tmp_path):
    cfg = compose_config(
        *[o for o in TEN if not o.startswith(("rounds", "checkpoint_every"))],
        "rounds=4",
        "checkpoint_every=1",
        "system=lognormal",
        "system.buffer=3",
        output_dir=tmp_path / "full",
    )
    assert_resume_exact(cfg, tmp_path, stop_at=2)


@pytest.mark.slow
def test_two_processes_step_as_one(tmp_path):
    """Each rank's cohort share uploads; the exchange gives every rank every row, whose
    clock then takes the same K (the rows never pre-summed: ``Engine._keeps_all``)."""
    from distributed_worker import main
    from distributed_worker import spawn_ranks

    base = [
        *(o for o in SMALL if not o.startswith("rounds=")),
        *("rounds=4", "num_clients=6", "batch_size=8", "tracker=none", "participation=0.5"),
        *("system=lognormal", "system.buffer=2", "compressor=stc"),
    ]
    spawn_ranks(main, str(tmp_path), [("fedbuff", [*base, f"output_dir={tmp_path / 'two'}"])])
    two = json.loads((tmp_path / "fedbuff.json").read_text())
    one = NullTracker()
    run(compose_config(*base, f"output_dir={tmp_path / 'one'}"), tracker=one)
    assert max(one.metrics["async/staleness_max"].values()) > 0
    for key in ("clock/cum_s", "clients/sampled", "bytes/up", *ASYNC_KEYS):
        for step, value in one.metrics[key].items():
            assert math.isclose(two[key][str(step)], value, rel_tol=1e-12), (key, step)
    for step, value in one.metrics["loss/mean"].items():
        assert math.isclose(two["loss/mean"][str(step)], value, rel_tol=1e-6), step


def _figures(folder: Path, name: str) -> pd.DataFrame:
    """A run folder's table ``name`` without its wall-clock and memory columns."""
    frame = pd.read_csv(folder / name)
    return frame[[c for c in frame.columns if not c.startswith(("time/", "system/", "memory/"))]]


@pytest.mark.slow
def test_a_two_process_run_resumed_is_the_uninterrupted_one(tmp_path):
    """``distributed.nproc=2``, stopped by Ctrl-C on rank 0 after round 2 of 4 and resumed
    on two processes: the uninterrupted run's figures, exactly, and its last checkpoint
    tensor for tensor (the server, every rank's clients and channel memories, the clients in
    flight with their uploads: SCAFFOLD's two parts, STC's error feedback both ways)."""
    base = [
        *(o for o in SMALL if not o.startswith(("rounds=", "checkpoint_every="))),
        *("rounds=4", "checkpoint_every=1", "num_clients=6", "batch_size=8", "tracker=none"),
        *("participation=0.5", "system=lognormal", "system.buffer=2", "compressor=stc"),
        *("algorithm=scaffold", "distributed.nproc=2"),
    ]
    full, part = tmp_path / "full", tmp_path / "part"
    run(compose_config(*base, output_dir=full), tracker=NullTracker())

    def stop(engine, metrics):  # noqa: ANN001, ANN202 - the runner's callback (rank 0's)
        if engine.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(compose_config(*base, output_dir=part), tracker=NullTracker(), callbacks=[stop])
    assert checkpoint.peek(part / "checkpoints" / "last.safetensors")["round"] == 2
    resume = f"resume={part / 'checkpoints'}"
    run(compose_config(*base, resume, output_dir=part), tracker=NullTracker())
    for name in ("rounds.csv", "clients.csv", "clients_rounds.csv"):
        pd.testing.assert_frame_equal(_figures(part, name), _figures(full, name), check_exact=True)
    rounds = _figures(full, "rounds.csv")
    assert len(rounds) == 5 and rounds["async/staleness_max"].max() > 0  # stale uploads
    assert (rounds["async/in_flight"].dropna() > 0).all()  # some in flight at every stop
    ends = [load_file(str(f / "checkpoints" / "last.safetensors")) for f in (full, part)]
    assert ends[0].keys() == ends[1].keys()
    assert {"clock/flight/clients", "clock/flight/p:dy", "clock/flight/p:dc"} <= ends[0].keys()
    for key, value in ends[0].items():
        assert torch.equal(ends[1][key], value), key


@pytest.mark.usefixtures("one_thread")
def test_buffered_runs_stacked_end_as_alone(tmp_path):
    """Two seeds' FedBuff runs as one stacked group (``hydra/launcher=stacked``: their
    client work merged): each run's clock, staleness, bytes and accuracies are its own alone,
    its losses and its model and uploads in flight within stacking's float tolerance."""
    from test_stacking import run_stacked

    from fedexp.sweep.stacked import stack_key
    from fedexp.sweep.stacked import stackable

    base = [*SMALL, "system=lognormal", "system.buffer=3"]  # C = all 5 clients, K = 3

    def configs(where: str) -> list:
        out = tmp_path / where
        return [compose_config(*base, f"seed={s}", output_dir=out / f"{s}") for s in (0, 1)]

    assert stackable(configs("x")[0])  # the launcher stacks them: only the seeds differ
    assert stack_key([*base, "seed=0"]) == stack_key([*base, "seed=1"])
    ends: dict[str, list[dict]] = {"stacked": [{}, {}], "alone": [{}, {}]}

    def keep(into: dict):  # noqa: ANN202 - a run callback: the server's model, the flight
        def callback(engine, metrics) -> None:  # noqa: ANN001
            into.update(x=engine.server["x"].clone(), **engine.clock.flight.state())

        return [callback]

    stacked, stack = run_stacked(configs("stacked"), [keep(e) for e in ends["stacked"]])
    alone = [
        run(c, tracker=NullTracker(), callbacks=keep(e))
        for c, e in zip(configs("alone"), ends["alone"], strict=True)
    ]
    assert stack.calls > 0  # the runs' client work was merged
    for got, want in zip(stacked, alone, strict=True):
        assert not isinstance(got, BaseException), got
        figures, expected = got.tracker.metrics, deterministic(want.tracker.metrics)
        assert figures.keys() >= expected.keys()
        for key, steps in expected.items():
            if key.startswith(("clock/", "async/", "clients/", "bytes/")) or "acc" in key:
                assert figures[key] == steps, key
            else:
                assert figures[key] == pytest.approx(steps, rel=1e-4, abs=1e-6, nan_ok=True), key
    assert max(alone[0].tracker.metrics["async/staleness_max"].values()) > 0
    assert alone[0].tracker.metrics["clock/cum_s"] != alone[1].tracker.metrics["clock/cum_s"]
    for got, want in zip(ends["stacked"], ends["alone"], strict=True):
        assert got.keys() == want.keys() and {"x", "clients", "p:"} <= got.keys()
        for key in ("clients", "rounds", "start", "seconds"):
            assert torch.equal(got[key], want[key]), key
        for key in ("x", "p:"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_the_flight_reads_back_from_its_state():
    flight = Flight()
    parts = {"": torch.arange(6.0).reshape(3, 2), "c": torch.ones(3, 1)}
    flight.add(np.array([5, 1, 3]), 2, 1.5, np.array([3.0, 1.0, 1.0]), parts)
    back = Flight.of_state(flight.state(), "cpu")
    taken = back.take(2)  # 1 and 3 arrive together at 2.5 s; then 5
    assert taken.clients.tolist() == [1, 3] and back.clients.tolist() == [5]
    assert torch.equal(taken.parts[""], torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    assert staleness_weight(np.array([0, 3])).tolist() == [1.0, 0.5]


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["system.buffer=5"], "system.buffer=5: more than the 4 clients in flight"),
        (["system.buffer=2", "algorithm=ifca"], "IFCA's server does not step a global model"),
        (["system.buffer=2", "algorithm=l2gd"], "L2GD's server does not step a global model"),
        (["system.buffer=2", "system.deadline=3"], "system.deadline=3 with system.buffer=2"),
        (
            ["system.buffer=2", "system.over_select=1"],
            "system.over_select=1 with system.buffer=2: FedBuff keeps",
        ),
        (["system.buffer=2", "privacy=central"], "system.buffer=2 with privacy=central"),
        (["system.buffer=2", "algorithm=pfedme"], "PFedMe trains every client each round"),
        (["system.buffer=0"], "system.buffer=0: expected ≥ 1"),
    ],
)
def test_bad_buffers_are_one_line(overrides, said):
    with pytest.raises(ConfigError) as caught:
        build_engine(compose_config(*TEN, "system=uniform", *overrides))
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_a_buffer_needs_a_clock():
    with pytest.raises(ValueError, match="system.buffer=2: FedBuff's clients finish"):
        System(profile="none", buffer=2)
