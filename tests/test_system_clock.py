"""The simulated clock (issue 67): devices, links, availability, deadlines, over-selection.

Closed-form times for equal clients, a deadline dropping exactly the slowest, over-selection
keeping the fastest K, unavailable clients never sampled, the trace files read back, bad
inputs refused in one line, ``system=none`` unchanged, and the clock's figures the same after
a resume, on two processes and stacked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.system.clock import keep_first
from fedexp.system.clock import local_steps
from fedexp.system.clock import round_seconds
from fedexp.system.settings import System
from fedexp.system.trace import read_availability
from fedexp.system.trace import read_devices
from fedexp.tracking.base import NullTracker
from helpers import SMALL
from helpers import assert_resume_exact
from helpers import compose_config
from helpers import deterministic
from helpers import run_cli

CLOCK_KEYS = (
    "clock/round_s",
    "clock/cum_s",
    "clock/wasted_bytes",
    "clients/dropped",
    "clients/unavailable",
)


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _devices(tmp_path: Path, speeds: list[float], uplink: float = 1000.0) -> str:
    """A fedexp-form device file: client n at ``speeds[n]`` steps/s, 1 kB/s up, 2 kB/s down."""
    rows = "".join(f"{n},{s},{uplink},2000,0.5\n" for n, s in enumerate(speeds))
    return _write(tmp_path / "devices.csv", "client,speed,uplink,downlink,latency\n" + rows)


def _recording(engine):  # noqa: ANN001, ANN202
    """Wrap the engine's server step: the keys and weights of each round's uploads."""
    seen: list[tuple[list[int], dict[int, float]]] = []
    step = engine.algorithm.server_update

    def server_update(ctx, server, updates, weights):  # noqa: ANN001, ANN202
        seen.append((sorted(updates), dict(weights)))
        return step(ctx, server, updates, weights)

    engine.algorithm.server_update = server_update
    return seen


# ------------------------------------------------------------------ closed forms
def test_equal_clients_take_the_closed_form_time():
    cfg = compose_config(
        *SMALL,
        "system=uniform",
        "system.speed=4",
        "system.uplink=1000",
        "system.downlink=3000",
        "system.latency=0.25",
    )
    engine = build_engine(cfg)
    d = engine.x0.numel()
    # dense float32 both ways: 4 d bytes each; 5 local steps at 4 a second; latency each way
    expected = 4 * d / 3000 + 0.25 + 5 / 4 + 4 * d / 1000 + 0.25
    cum = 0.0
    for _ in range(3):
        metrics = engine.run_round()
        cum += expected
        assert metrics["clock/round_s"] == pytest.approx(expected, rel=1e-12)
        assert metrics["clock/cum_s"] == pytest.approx(cum, rel=1e-12)
        assert metrics["clients/dropped"] == 0 and metrics["clients/unavailable"] == 0
        assert metrics["clock/wasted_bytes"] == 0


def test_the_time_follows_the_ledger_bytes_of_a_compressor():
    """STC sends fewer bytes than dense: the uplink's share of the time falls by as much."""
    times = {}
    for compressor in ("none", "stc"):
        cfg = compose_config(
            *SMALL, "system=uniform", "system.latency=0", f"compressor={compressor}"
        )
        engine = build_engine(cfg)
        metrics = engine.run_round()
        up = engine.ledger.client_bytes("up", len(engine.clients))
        down = engine.ledger.client_bytes("down", len(engine.clients))
        assert up.sum() == metrics["bytes/up"] and down.sum() == metrics["bytes/down"]
        slowest = max(u / 125_000 + d / 1_250_000 for u, d in zip(up, down, strict=True))
        assert metrics["clock/round_s"] == pytest.approx(slowest + 5 / 10.0, rel=1e-12)
        times[compressor] = metrics["clock/round_s"]
    assert times["stc"] < times["none"]


def test_local_steps_at_once_are_each_clients():
    cfg = compose_config(*SMALL, "local_epochs=1.5", "batch_size=7")
    engine = build_engine(cfg)
    steps = local_steps(engine._host_sizes(), 5, 1.5, 7)
    assert steps.tolist() == [engine.ctx.steps_for(c) for c in engine.clients]
    assert local_steps(np.array([3, 10]), 5, None, 7).tolist() == [5, 5]
    assert local_steps(np.array([3, 10]), 5, 2.0, 0).tolist() == [2, 2]


# ------------------------------------------------------ deadlines, over-selection
def test_a_deadline_drops_exactly_the_slowest(tmp_path):
    speeds = [0.5, 1.0, 2.0, 4.0, 8.0]  # client 0: 10 s of compute, the next 5 s at most
    devices = _devices(tmp_path, speeds)
    cfg = compose_config(
        *SMALL, "system=trace", f"system.device_file={devices}", "system.deadline=9"
    )
    engine = build_engine(cfg)
    seen = _recording(engine)
    metrics = engine.run_round()
    kept, weights = seen[0]
    assert kept == [1, 2, 3, 4]
    assert sum(weights.values()) == pytest.approx(1.0)
    assert metrics["clients/dropped"] == 1 and metrics["clients/sampled"] == 5
    assert metrics["clock/round_s"] == 9.0  # the server waited until the deadline
    b = 4 * engine.x0.numel()
    assert metrics["clock/wasted_bytes"] == 2 * b  # client 0's download and upload
    assert metrics["bytes/up"] == 5 * b  # every upload still crossed the wire
    assert engine.ctx.senders.clients == [1, 2, 3, 4]


def test_over_selection_keeps_the_fastest_k(tmp_path):
    speeds = [1.0 + n for n in range(10)]  # the higher the id, the faster
    devices = _devices(tmp_path, speeds)
    cfg = compose_config(
        *SMALL,
        "num_clients=10",
        "batch_size=4",
        "participation=0.3",
        "system=trace",
        f"system.device_file={devices}",
        "system.over_select=1.0",
    )
    engine = build_engine(cfg)
    seen = _recording(engine)
    for _ in range(3):
        metrics = engine.run_round()
        sampled = engine.last_sampled
        assert len(sampled) == 6 and metrics["clients/sampled"] == 6  # ⌈3 · 2⌉
        kept, _ = seen[-1]
        assert kept == sorted(sampled)[-3:]  # the three fastest
        assert metrics["clients/dropped"] == 3
        b = 4 * engine.x0.numel()
        slowest_kept = b / 2000 + 0.5 + 5 / speeds[kept[0]] + b / 1000 + 0.5
        assert metrics["clock/round_s"] == pytest.approx(slowest_kept, rel=1e-12)


def test_keep_first_and_round_seconds_by_hand():
    times = np.array([3.0, 1.0, 2.0, 1.0])
    clients = np.array([0, 1, 2, 3])
    assert keep_first(times, clients, 2, None).tolist() == [False, True, False, True]
    assert keep_first(times, clients, 4, 2.5).tolist() == [False, True, True, True]
    kept = keep_first(times, clients, 4, 2.5)
    assert round_seconds(times, kept, 4, 2.5) == 2.5  # someone late: until the deadline
    kept = keep_first(times, clients, 2, None)
    assert round_seconds(times, kept, 2, None) == 1.0  # the second to report
    kept = keep_first(times, clients, 4, None)
    assert round_seconds(times, kept, 4, None) == 3.0  # the last one
    none = np.zeros(0)
    assert round_seconds(none, none.astype(bool), 1, None) == 0.0


# ------------------------------------------------------------------ availability
def test_unavailable_clients_are_never_sampled():
    cfg = compose_config(
        *SMALL,
        "rounds=12",
        "num_clients=20",
        "batch_size=4",
        "participation=0.3",
        "system=uniform",
        "system.availability=0.5",
    )
    engine = build_engine(cfg)
    off_seen = 0
    for t in range(12):
        on = engine.clock.available(t, engine.clock.elapsed)
        metrics = engine.run_round()
        assert all(on[n] for n in engine.last_sampled), t
        assert metrics["clients/unavailable"] == float((~on).sum())
        off_seen += int((~on).sum())
    assert off_seen > 0  # (a coin that never came up off would test nothing)


def test_a_trace_keeps_clients_off_until_their_interval(tmp_path):
    # client 0 on from 0 s; the others from 100 s; each trace repeats every 1000 s
    rows = "client_id,active,inactive,finish_time\n0,0,1000,1000\n"
    rows += "".join(f"{n},100,1000,1000\n" for n in range(1, 5))
    behave = _write(tmp_path / "behave.csv", rows)
    cfg = compose_config(
        *SMALL,
        "rounds=4",
        "system=trace",
        "system.device_file=null",
        f"system.availability_file={behave}",
        "system.latency=20",  # 40 s a round: rounds 0-2 before 100 s, round 3 after
    )
    engine = build_engine(cfg)
    sampled = []
    for _ in range(4):
        metrics = engine.run_round()
        sampled.append(engine.last_sampled)
    assert sampled[:3] == [[0], [0], [0]]
    assert sampled[3] == [0, 1, 2, 3, 4]
    assert metrics["clients/unavailable"] == 0


def test_a_round_with_nobody_on_waits_for_the_first(tmp_path):
    behave = _write(tmp_path / "behave.csv", "client_id,active,inactive,finish_time\n0,50,60,100\n")
    cfg = compose_config(
        *SMALL,
        "system=trace",
        "system.device_file=null",
        f"system.availability_file={behave}",
        "system.latency=0",
    )
    engine = build_engine(cfg)
    metrics = engine.run_round()
    assert engine.last_sampled == [0, 1, 2, 3, 4]  # every client follows the one trace
    assert metrics["clock/round_s"] > 50.0  # 50 s waiting, then the round's work


# ------------------------------------------------------------------ profiles
def test_lognormal_draws_are_keyed_by_client():
    system = System(profile="lognormal", speed=10.0, speed_spread=0.7, uplink_spread=0.3)
    five, ten = system.build(5, 0, 32), system.build(10, 0, 32)
    assert np.array_equal(five.speed, ten.speed[:5])  # a client's device, whatever N
    assert np.array_equal(five.uplink, ten.uplink[:5])
    assert np.all(five.downlink == 1_250_000.0)  # no spread: the median for everyone
    other = system.build(5, 1, 32)
    assert not np.array_equal(five.speed, other.speed)  # the seed's own devices
    assert not np.array_equal(five.speed, five.uplink / 12_500.0)  # independent quantities
    many = system.build(20_000, 0, 32).speed
    assert np.median(many) == pytest.approx(10.0, rel=0.03)
    assert np.log(many).std() == pytest.approx(0.7, rel=0.03)


def test_uniform_with_everyone_on_samples_what_none_does(tmp_path):
    base = [*SMALL, "num_clients=10", "batch_size=4", "participation=0.4", "rounds=3"]
    plain, timed = NullTracker(), NullTracker()
    run(compose_config(*base, output_dir=tmp_path / "plain"), tracker=plain)
    run(compose_config(*base, "system=uniform", output_dir=tmp_path / "timed"), tracker=timed)
    timed_keys = set(timed.metrics) - set(plain.metrics)
    assert timed_keys == set(CLOCK_KEYS)
    for key, steps in deterministic(plain.metrics).items():
        assert timed.metrics[key] == steps, key


def test_system_none_adds_no_key(tmp_path):
    tracker = NullTracker()
    run(compose_config(*SMALL, output_dir=tmp_path), tracker=tracker)
    assert not any(k.startswith("clock/") for k in tracker.metrics)
    assert "clients/dropped" not in tracker.metrics
    assert "clients/unavailable" not in tracker.metrics


# ------------------------------------------------------------------ trace files
def test_a_device_file_reads_back(tmp_path):
    rng = np.random.default_rng(0)
    ids = np.array([7, 3, 11])
    values = rng.uniform(1, 100, size=(3, 4))
    text = "client,speed,uplink,downlink,latency\n" + "".join(
        f"{i}," + ",".join(repr(float(x)) for x in v) + "\n"
        for i, v in zip(ids, values, strict=True)
    )
    read = read_devices(_write(tmp_path / "d.csv", text), 32)
    order = np.argsort(ids)
    assert read.ids.tolist() == [3, 7, 11]
    assert np.array_equal(read.speed, values[order, 0])
    assert np.array_equal(read.uplink, values[order, 1])
    assert np.array_equal(read.downlink, values[order, 2])
    assert np.array_equal(read.latency, values[order, 3])
    system = System(profile="trace", device_file=str(tmp_path / "d.csv"), latency=0.0)
    model = system.build(5, 0, 32)  # clients 0..4 take the file's rows 3, 7, 11, 3, 7
    assert np.array_equal(model.speed, values[order, 0][[0, 1, 2, 0, 1]])


def test_fedscale_device_form_is_converted(tmp_path):
    text = "client_id,computation,communication\n432802,162.0,5648.1\n5,10,8000\n"
    read = read_devices(_write(tmp_path / "d.csv", text), 32)
    assert read.ids.tolist() == [5, 432802]
    # FedScale: 3 · batch · ms a sample per step; kbit/s → bytes/s
    assert read.speed.tolist() == [1000 / (3 * 32 * 10.0), 1000 / (3 * 32 * 162.0)]
    assert read.uplink.tolist() == [8000 * 1000 / 8, 5648.1 * 1000 / 8]
    assert np.array_equal(read.uplink, read.downlink) and read.latency is None


def test_an_availability_file_reads_back(tmp_path):
    text = "client_id,active,inactive,finish_time\n9,10,20,100\n9,50,60,100\n2,0,5,10\n"
    trace = read_availability(_write(tmp_path / "a.csv", text))
    assert trace.ids.tolist() == [2, 9] and trace.finish.tolist() == [10.0, 100.0]
    # client 0 follows id 2 (on 0-5 every 10 s), client 1 follows id 9
    assert trace.available(3.0, 2).tolist() == [True, False]
    assert trace.available(15.0, 2).tolist() == [True, True]
    assert trace.available(57.0, 3).tolist() == [False, True, False]
    assert trace.available(155.0, 2).tolist() == [True, True]  # repeating


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("client,speed,uplink,downlink\n0,1,2,3\n1,abc,2,3\n", "row 3, column 'speed': 'abc'"),
        ("client,speed,uplink,downlink\n0,1,2,-3\n", "row 2, column 'downlink': '-3'"),
        ("client,speed,uplink,downlink\n0,1,2,nan\n", "row 2, column 'downlink': 'nan'"),
        ("client,speed,uplink\n0,1,2\n", "row 1 (the header), no column 'downlink'"),
        ("client,speed,uplink,downlink\n0,1,2,3\n0,1,2,3\n", "row 3, column 'client': client 0"),
        ("client,speed,uplink,downlink\n0.5,1,2,3\n", "row 2, column 'client': '0.5'"),
        ("client_id,computation,communication\n0,0,5\n", "row 2, column 'computation': '0'"),
        ("client,speed,uplink,downlink\n", "no rows"),
    ],
)
def test_a_bad_device_file_is_one_line(tmp_path, text, said):
    path = _write(tmp_path / "bad.csv", text)
    with pytest.raises(ConfigError) as caught:
        read_devices(path, 32)
    message = str(caught.value)
    assert said in message and path in message and "\n" not in message


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("client_id,active,inactive,finish_time\n0,5,2,10\n", "row 2, column 'inactive': '2'"),
        ("client_id,active,inactive,finish_time\n0,5,20,10\n", "row 2, column 'inactive': '20'"),
        (
            "client_id,active,inactive,finish_time\n0,1,2,10\n0,3,4,11\n",
            "row 3, column 'finish_time'",
        ),
        ("client_id,active,inactive\n0,1,2\n", "no column 'finish_time'"),
    ],
)
def test_a_bad_availability_file_is_one_line(tmp_path, text, said):
    path = _write(tmp_path / "bad.csv", text)
    with pytest.raises(ConfigError) as caught:
        read_availability(path)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="system.speed_spread=0.5: a spread"):
        System(profile="uniform", speed_spread=0.5)
    with pytest.raises(ValueError, match="system=trace only"):
        System(profile="uniform", device_file="x.csv")
    with pytest.raises(ValueError, match="choose a profile"):
        System(profile="none", deadline=3.0)
    with pytest.raises(ConfigError, match=r"system.deadline=nan"):
        build_engine(compose_config(*SMALL, "system=uniform", "system.deadline=nan"))
    with pytest.raises(ConfigError, match="privacy=central"):
        build_engine(
            compose_config(*SMALL, "system=uniform", "system.deadline=3", "privacy=central")
        )


def test_the_cli_refuses_a_bad_trace_in_one_line_without_a_folder(tmp_path):
    bad = _write(tmp_path / "devices.csv", "client,speed,uplink,downlink\n0,1,2,3\n1,0,2,3\n")
    done = run_cli("run", "system=trace", f"system.device_file={bad}", "tracker=none", cwd=tmp_path)
    assert done.returncode != 0
    lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1, done.stderr
    assert "row 3, column 'speed': '0'" in lines[0] and bad in lines[0]
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.csv"))
    assert not list((tmp_path).glob("outputs/*/*"))


# ------------------------------------------------------ resume, processes, stacks
def test_a_resumed_run_keeps_its_clock(tmp_path):
    cfg = compose_config(
        *[o for o in SMALL if not o.startswith(("rounds", "checkpoint_every"))],
        "rounds=5",
        "checkpoint_every=1",
        "system=lognormal",
        "system.over_select=0.5",
        "participation=0.6",
        output_dir=tmp_path / "full",
    )
    assert_resume_exact(cfg, tmp_path, stop_at=3)


@pytest.mark.slow
def test_two_processes_and_a_stack_keep_one_clock(tmp_path):
    from distributed_worker import main
    from distributed_worker import spawn_ranks
    from test_stacking import run_stacked

    base = [
        *(o for o in SMALL if not o.startswith("rounds=")),
        *("rounds=3", "num_clients=6", "batch_size=8", "tracker=none", "participation=0.5"),
        "system=lognormal",
        "system.over_select=1",
        "compressor=stc",
    ]
    jobs = [("clock", [*base, f"output_dir={tmp_path / 'two'}"])]
    spawn_ranks(main, str(tmp_path), jobs)
    two = json.loads((tmp_path / "clock.json").read_text())
    one = NullTracker()
    run(compose_config(*base, f"output_dir={tmp_path / 'one'}"), tracker=one)
    assert sum(one.metrics["clients/dropped"].values()) > 0  # (drops on both sides)
    for key in CLOCK_KEYS:
        for step, value in one.metrics[key].items():
            assert math.isclose(two[key][str(step)], value, rel_tol=1e-12), (key, step)
    for step, value in one.metrics["loss/mean"].items():  # the same uploads kept
        assert math.isclose(two["loss/mean"][str(step)], value, rel_tol=1e-4), step
    cfgs = [compose_config(*base, f"seed={s}", f"output_dir={tmp_path / f's{s}'}") for s in (0, 1)]
    stacked, _ = run_stacked(cfgs)
    alone = NullTracker()
    run(compose_config(*base, "seed=0", f"output_dir={tmp_path / 'alone'}"), tracker=alone)
    for key in CLOCK_KEYS:
        assert stacked[0].tracker.metrics[key] == alone.metrics[key], key


# ------------------------------------------------------------------ reading it
class _History:
    """A tracking client over NullTrackers' metrics (what ``reach_runs`` reads)."""

    def __init__(self, trackers: dict[str, NullTracker]) -> None:
        self.trackers = trackers

    def get_metric_history(self, run_id: str, metric: str) -> list:
        from types import SimpleNamespace

        steps = self.trackers[run_id].metrics.get(metric, {})
        return [SimpleNamespace(step=s, value=v, timestamp=0) for s, v in steps.items()]


def test_reach_gives_rounds_and_simulated_seconds(tmp_path):
    from fedexp.report.collect import Run
    from fedexp.report.reach import reach_plot
    from fedexp.report.reach import reach_runs
    from fedexp.report.reach import reach_table

    trackers = {}
    for name in ("none", "stc"):
        trackers[name] = NullTracker()
        cfg = compose_config(
            *SMALL,
            "rounds=4",
            "system=uniform",
            f"compressor={name}",
            "system.uplink=100",
            output_dir=tmp_path / name,
        )
        run(cfg, tracker=trackers[name])
    runs = [Run(n, 0, params={"compressor": n}) for n in trackers]
    target = min(max(t.metrics["acc/mean"].values()) for t in trackers.values())
    groups = reach_runs(_History(trackers), runs, "acc/mean", target, ["compressor"])
    for name, tracker in trackers.items():
        (row,) = groups[(name,)]
        hit = min(s for s, v in tracker.metrics["acc/mean"].items() if v >= target)
        assert row["round"] == hit
        assert row["time"] == (tracker.metrics["clock/cum_s"][hit] if hit else 0.0)
        assert row["curve_time"][-1] == tracker.metrics["clock/cum_s"][4]
    table = reach_table(groups, "compressor", target, "acc/mean")
    assert "KiB down to reach | rounds to reach | simulated s to reach |" in table
    assert len(table.splitlines()[2].split("|")) == len(table.splitlines()[0].split("|"))
    shown = reach_plot(groups, str(tmp_path / "reach.png"), "acc/mean")
    assert set(shown["time_lines"]) == {"none", "stc"}
    assert (tmp_path / "reach.png").is_file()


def test_a_dp_run_is_timed_too(tmp_path):
    tracker = NullTracker()
    cfg = compose_config(
        *SMALL,
        "num_clients=10",
        "batch_size=4",
        "participation=0.5",
        "privacy=central",
        "system=uniform",
        output_dir=tmp_path,
    )
    run(cfg, tracker=tracker)
    assert sorted(tracker.metrics["clock/cum_s"]) == [1, 2, 3]
    assert all(v == 0 for v in tracker.metrics["clients/dropped"].values())
