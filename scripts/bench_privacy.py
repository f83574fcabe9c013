"""Differential privacy's cost per round: no DP against privacy=central, local and adaptive.

Builds, in this process, one engine per workload and privacy setting (``privacy=none``,
``central``, ``local``, ``adaptive``: conf/privacy/*.yaml as they are but for
``privacy.sampling``, ``--sampling``; and a second no-DP engine, "none again") through the
API (``compose_config`` of tests/helpers.py, ``fedexp.engine.runner.build_engine``,
``Engine.setup``), runs ``--warmup`` untimed rounds of each, then ``gc.collect()``. Then
``--repeats`` repeats of ``--rounds`` rounds of every engine, taken round by round in turn
(none, central, local, adaptive, none again, none, ...: a burst of load on this shared
machine falls on all settings alike), each ``Engine.run_round`` timed with
``time.perf_counter``. Per repeat: each setting's mean time a round and its ratio to the
no-DP engine's; the table gives the medians over the repeats, the overhead being the median
ratio − 1 ("none again": the measurement's own noise).

The warm-up rounds also take the one-off costs out of the timed ones: the accountant's
one-round RDP curve (``privacy/epsilon``'s first call, ~90 ms, memoised per privacy plan for
the rest of the process; later calls ~0.2 ms) and lazy imports. The time spent inside the DP
mechanism (``PrivateUplink``'s ``references``, ``client_side``, ``server_side``,
``end_round``, each call timed; not ``sample``, the cohort's draw, which a run without DP
makes too) is reported per round too, with its share of the DP round (medians over the
repeats): DP's cost without the noise of comparing two timings.

Cohorts: without DP a round's cohort is a fixed sample of round(q·N) clients. ``--sampling
fixed`` (the default here) gives the DP runs the very same cohorts (``privacy.sampling=fixed``
draws them as a run without DP does), so every round is compared with the same round;
``--sampling poisson`` (conf/privacy's default) gives them Poisson samples of mean q·N, whose
sizes differ from round to round ("clients": the mean cohort of the timed rounds).

Workloads (``--workloads``; the default: all but ``digits-vgg8``, 1.5 to 2 minutes):

- ``logreg-1000``, ``logreg-1000-ditto``, ``logreg-10000``, ``logreg-10000-ditto``: logistic
  regression (d = 31: one logit) on a synthetic table of the breast-cancer table's shape (30
  features, 2 classes; the table's own 569 rows cannot give 1,000 clients the two samples
  each needs), 50 samples a client, IID, participation 0.1, FedAvg or Ditto, 5 local SGD
  steps of 32;
- ``digits-mlp``: scikit-learn's digits (1,797 8x8 images), ``model=mlp model.hidden=64``
  (docs/results.md's digits runs; d = 4,810), 100 clients (~14 training images each), IID,
  participation 0.3, FedAvg, 5 local SGD steps of 10;
- ``digits-vgg8``: the same with ``model=vgg8`` (default widths, d = 1,112,074) and lr = 0.01;
  its local DP with z = 0.001 (z = 1 sends each client's ~1,000-norm noise and the model
  diverges in round 2; the time does not depend on z > 0).

One torch thread (``--threads``), device cpu, tracker none, no checkpoints; the engines'
output folders are a temporary directory's.

    .venv/bin/python scripts/bench_privacy.py                    # the default set
    .venv/bin/python scripts/bench_privacy.py --workloads digits-vgg8 --rounds 1 --warmup 1
    .venv/bin/python scripts/bench_privacy.py --profile local --workloads logreg-1000
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

COMMON = ("progress=none", "checkpoint_every=0", "device=cpu", "tracker=none")
#: privacy setting: its overrides
MODES: dict[str, tuple[str, ...]] = {
    "none": (),
    "central": ("privacy=central",),
    "local": ("privacy=local",),
    "adaptive": ("privacy=adaptive",),
}
#: the second no-DP engine: the noise of the measurement
CONTROL = "none again"
#: what the DP part times (not ``sample``: the cohort's draw, which a run without DP makes too)
_DP_CALLS = ("references", "client_side", "server_side", "end_round")
#: the issue's goal: DP costs at most this share of a round
GOAL = 0.20


@dataclass(frozen=True)
class Workload:
    """A run's overrides, its label in the table, and overrides of some privacy settings."""

    overrides: tuple[str, ...]
    label: str
    mode_overrides: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _logreg(clients: int, algorithm: str) -> Workload:
    overrides = (
        "dataset=synthetic", f"dataset.num_samples={50 * clients}", "dataset.num_features=30",
        "model=logreg", "partition=iid", f"num_clients={clients}", "participation=0.1",
        f"algorithm={algorithm}", "local_steps=5", "batch_size=32",
    )  # fmt: skip
    name = "FedAvg" if algorithm == "fedavg" else "Ditto"
    return Workload(overrides, f"logreg, N = {clients:,}, q = 0.1, {name}")


def _digits(model: tuple[str, ...], label: str, **mode_overrides: tuple[str, ...]) -> Workload:
    overrides = (
        "dataset=digits", "partition=iid", "num_clients=100", "participation=0.3",
        "algorithm=fedavg", "local_steps=5", "batch_size=10", *model,
    )  # fmt: skip
    return Workload(overrides, f"digits, {label}, N = 100, q = 0.3, FedAvg", mode_overrides)


WORKLOADS: dict[str, Workload] = {
    "logreg-1000": _logreg(1000, "fedavg"),
    "logreg-1000-ditto": _logreg(1000, "ditto"),
    "logreg-10000": _logreg(10000, "fedavg"),
    "logreg-10000-ditto": _logreg(10000, "ditto"),
    "digits-mlp": _digits(("model=mlp", "model.hidden=64"), "MLP 64"),
    "digits-vgg8": _digits(
        ("model=vgg8", "lr=0.01"), "VGG8", local=("privacy.noise_multiplier=0.001",)
    ),
}
DEFAULT = [w for w in WORKLOADS if w != "digits-vgg8"]


class DpClock:
    """Seconds spent in an engine's ``PrivateUplink`` calls (wraps them on the instance)."""

    def __init__(self, privacy: Any) -> None:
        self.seconds = 0.0
        for name in _DP_CALLS:
            setattr(privacy, name, self._timed(getattr(privacy, name)))

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def overrides_of(workload: str, mode: str, sampling: str) -> tuple[str, ...]:
    """The overrides of ``workload`` under privacy setting ``mode`` (DP: with ``sampling``)."""
    w = WORKLOADS[workload]
    dp = (f"privacy.sampling={sampling}",) if MODES[mode] else ()
    return (*COMMON, *w.overrides, *MODES[mode], *dp, *w.mode_overrides.get(mode, ()))


def build(overrides: tuple[str, ...], out: Path, warmup: int) -> Any:
    """An engine of ``overrides``, set up, after ``warmup`` rounds (then a full collection)."""
    from fedexp.engine.runner import build_engine
    from helpers import compose_config

    engine = build_engine(compose_config(*overrides, output_dir=out))
    engine.setup()
    for _ in range(warmup):
        engine.run_round()
    gc.collect()
    return engine


def measure(
    workload: str, rounds: int, repeats: int, warmup: int, sampling: str, out: Path
) -> dict[str, Any]:
    """Each setting's time a round, its DP part and its ratio to no DP on ``workload``; d.

    A repeat runs ``rounds`` rounds of every engine, round by round in turn (none, central,
    local, adaptive, none again, none, ...: a burst of load on the machine falls on all of
    them); per repeat, each setting's mean time a round, its mean DP part, and its ratio to
    the no-DP engine's. The figures: the medians over the repeats. "none again" is a second
    no-DP engine, timed the same way: its ratio is the measurement's noise.
    """
    settings = [*MODES, CONTROL]
    engines = {
        m: build(
            overrides_of(workload, m if m in MODES else "none", sampling),
            out / workload / m,
            warmup,
        )
        for m in settings
    }
    clocks = {m: DpClock(e.privacy) for m, e in engines.items() if e.privacy is not None}
    times: dict[str, list[float]] = {m: [] for m in settings}
    dp: dict[str, list[float]] = {m: [] for m in settings}
    cohort = dict.fromkeys(settings, 0)
    for _ in range(repeats):
        took = dict.fromkeys(settings, 0.0)
        inside = {m: clock.seconds for m, clock in clocks.items()}
        for _ in range(rounds):
            for m, engine in engines.items():
                start = time.perf_counter()
                engine.run_round()
                took[m] += time.perf_counter() - start
                cohort[m] += len(engine.last_sampled)
        for m in settings:
            times[m].append(took[m] / rounds)
            dp[m].append((clocks[m].seconds - inside[m]) / rounds if m in clocks else 0.0)
    d = engines["none"].x0.numel()
    del engines, clocks
    gc.collect()
    stats = {
        m: {
            "round": statistics.median(times[m]),
            "ratio": statistics.median(t / n for t, n in zip(times[m], times["none"], strict=True)),
            "dp": statistics.median(dp[m]),
            "share": statistics.median(p / t for p, t in zip(dp[m], times[m], strict=True)),
            "clients": cohort[m] / (rounds * repeats),
        }
        for m in settings
    }
    return {"d": d, "modes": stats}


def profile(workload: str, mode: str, rounds: int, sampling: str, out: Path) -> None:
    """``rounds`` rounds of ``workload`` under ``mode`` in cProfile, the DP calls alone."""
    engine = build(overrides_of(workload, mode, sampling), out / "profile", 2)
    prof = cProfile.Profile()

    def profiled(call: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*args: Any, **kwargs: Any) -> Any:
            prof.enable()
            try:
                return call(*args, **kwargs)
            finally:
                prof.disable()

        return inner

    for name in _DP_CALLS:
        setattr(engine.privacy, name, profiled(getattr(engine.privacy, name)))
    start = time.perf_counter()
    for _ in range(rounds):
        engine.run_round()
    took = time.perf_counter() - start
    print(
        f"{rounds} rounds of {workload} with privacy={mode}: {took / rounds * 1e3:.2f} ms a round"
    )
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown table of ``measure``'s results."""
    lines = [
        "| workload | d | no DP: ms / round (clients) | DP | ms / round (clients) | overhead "
        "| DP part: ms / round (share of the round) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for w, res in results.items():
        none = res["modes"]["none"]
        for m in ("central", "local", "adaptive", CONTROL):
            r = res["modes"][m]
            head = ["", "", ""]
            if m == "central":
                base = f"{none['round'] * 1e3:.2f} ({none['clients']:.0f})"
                head = [WORKLOADS[w].label, f"{res['d']:,}", base]
            cells = [
                *head,
                m,
                f"{r['round'] * 1e3:.2f} ({r['clients']:.0f})",
                f"{100 * (r['ratio'] - 1):+.1f} %",
                f"{r['dp'] * 1e3:.2f} ({100 * r['share']:.1f} %)" if m in MODES else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    """Parse the options, time every workload's settings, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds a repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds of each engine")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--sampling",
        choices=["fixed", "poisson"],
        default="fixed",
        help="privacy.sampling of the DP runs (fixed: the no-DP run's cohorts)",
    )
    parser.add_argument(
        "--profile",
        choices=[m for m in MODES if m != "none"],
        help="instead: cProfile of this setting's DP calls on the first workload",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fedexp.engine.solver import passes

    passes.use_compiled_passes()  # the steady state: the CPU's pass kernel from the start
    results = {}
    with tempfile.TemporaryDirectory(prefix="fedexp-bench-privacy-") as tmp:
        if args.profile:
            profile(args.workloads[0], args.profile, args.rounds, args.sampling, Path(tmp))
            return
        for w in args.workloads:
            started = time.perf_counter()
            results[w] = measure(
                w, args.rounds, args.repeats, args.warmup, args.sampling, Path(tmp)
            )
            print(f"# {w}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    python = Path(sys.executable)
    if python.is_relative_to(ROOT):
        python = python.relative_to(ROOT)
    print("    " + shlex.join([str(python), *sys.argv]))
    print(
        f"\nmedians of {args.repeats} repeats of {args.rounds} rounds (interleaved round by "
        f"round), after {args.warmup} warm-up round(s) of each engine; {args.threads} torch "
        f"thread(s); privacy.sampling={args.sampling}; overhead: DP / no DP - 1\n"
    )
    print("\n".join(table(results)))
    worst = max(
        (r["share"], w, m)
        for w, res in results.items()
        for m, r in res["modes"].items()
        if m in MODES and m != "none"
    )
    met = "met" if worst[0] <= GOAL else "not met"
    print(
        f"\nlargest DP part: {100 * worst[0]:.1f} % of a round ({worst[1]}, {worst[2]}); "
        f"goal <= {100 * GOAL:.0f} %: {met}"
    )


if __name__ == "__main__":
    main()
