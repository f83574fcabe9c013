"""Step ``syncs``: host synchronisations, dispatched ops and host reads of a round on the device."""

from __future__ import annotations

import os
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .paths import ROOT
from .step import Step
from .step import _device
from .step import _free
from .step import _sync


def count_syncs(fn: Callable[[], object]) -> tuple[int | None, Counter]:
    """Host synchronisations while ``fn`` runs (None without CUDA), by fedexp call site."""
    import torch

    if not torch.cuda.is_available():
        fn()
        return None, Counter()
    sites: Counter = Counter()
    count = 0
    root = str(ROOT) + os.sep
    package = str(ROOT / "fedexp") + os.sep

    def show(message: Warning | str, *_: object) -> None:  # warnings.showwarning's place
        nonlocal count
        if "synchroniz" not in str(message):
            return
        count += 1
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(package)]
        site = frames[-1] if frames else None  # the innermost line of fedexp's
        label = f"{site.filename[len(root) :]}:{site.lineno} {site.name}" if site else "?"
        sites[label] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        old_show = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old_show
    torch.cuda.synchronize()
    return count, sites


def step_syncs(s: Step) -> None:
    """Syncs in one round (after warm-up) at two client counts, CNN and LR workloads; the
    next round's dispatched ops and host reads (``fedexp.engine.round.census``)."""
    import bench_engine
    import gpu_cnn_rate

    from fedexp.engine.round.census import Census

    dev = _device()
    lo, hi = s.sizes.sync_clients
    builders = {
        "cnn": lambda n: gpu_cnn_rate.engine(n, dev),
        "lr": lambda n: bench_engine.build(n, 5, 16, dev.type),
    }
    for workload, build in builders.items():
        row: dict[str, Any] = {}
        for n in (lo, hi):
            if s.left() < 2:
                break
            engine = build(n)
            for _ in range(2):
                engine.run_round()
            _sync(dev)
            count, sites = count_syncs(engine.run_round)
            with Census() as census:  # the same round's ops and host reads (issue 39)
                engine.run_round()
            row[str(n)] = {
                "syncs": count,
                "sites": dict(sites.most_common(12)),
                "ops": census.total_ops,
                "host_reads": census.total_reads,
            }
            del engine
            _free(dev)
        a, b = row.get(str(lo), {}).get("syncs"), row.get(str(hi), {}).get("syncs")
        row["per_client"] = None if a is None or b is None else (b - a) / (hi - lo)
        s.result[workload] = row
        s.save()
        s.say(
            f"{workload}: syncs a round {a} at {lo} clients, {b} at {hi} "
            f"(per client {row['per_client']}); ops a round "
            f"{row.get(str(lo), {}).get('ops')} and {row.get(str(hi), {}).get('ops')}"
        )
    if s.left() > 10:
        s.result["draws"] = compare_draws(builders["lr"](hi), dev, s)
        s.save()
        s.say(f"pass draws, LR at {hi} clients: {s.result['draws']}")
    census_syncs(dev, s)


def census_syncs(dev: torch.device, s: Step, clients: int = 10) -> None:
    """The round census's cases on the device: each one's syncs in its second training round
    and in the evaluation after it, and where (``tests/test_round_census.py``: every
    algorithm, codec and privacy mode, whose CPU host reads ``READS`` pins), in order while
    the step's time lasts; on the CPU (no syncs to count) its first case only."""
    import test_round_census as census

    from fedexp.engine.runner import build_engine
    from fedexp.engine.solver import passes
    from helpers import compose_config

    rows: dict[str, Any] = {}
    s.result["census"] = rows
    for name, extra in census.cases()[: None if dev.type == "cuda" else 1]:
        if s.left() < 4:
            break
        passes.use_compiled_passes()
        engine = build_engine(compose_config(*census.overrides(name, clients, extra, dev.type)))
        engine.setup()
        engine.run_round()
        engine.evaluate()
        _sync(dev)
        train, where = count_syncs(engine.run_round)
        evaluation, _ = count_syncs(engine.evaluate)
        rows[name] = {
            "train": train,
            "eval": evaluation,
            "cpu_reads": census.READS.get(name),
            "sites": dict(where.most_common(6)),
        }
        del engine
        _free(dev)
        s.save()
    s.say(f"syncs by case at {clients} clients: {len(rows)} of {len(census.cases())} counted")


def compare_draws(engine: Any, dev: torch.device, s: Step, rounds: int = 5) -> dict:
    """Rounds with the pass draws on the host (``passes.pass_indices_host``, since 2026-11-30;
    the cohort's keys and counters on the host too, no read at all, since the eighteenth
    session) against the tensor path GPU runs took before (``passes.pass_indices_tensor`` on
    the device: its cycle walks read back), alternated in blocks on one engine: each's host
    syncs in one round and its median round time (the same indices either way, so the same
    rounds)."""
    from fedexp.engine.solver import passes
    from fedexp.transfer import to_device

    def on_device(keys, draws, size, num, device=None):  # noqa: ANN001, ANN202
        at = keys.device if device is None else device
        keys, draws, num = (to_device(t, at) for t in (keys, draws, num))
        return passes.pass_indices_tensor(keys, draws, size, num)

    host = passes.pass_indices_host
    paths = {"host": host, "tensor": on_device}
    times: dict[str, list[float]] = {k: [] for k in paths}
    syncs: dict[str, int | None] = {}
    for _ in range(2):
        engine.run_round()
    try:
        for block in range(3):
            for name, path in paths.items():
                passes.pass_indices_host = path
                if block == 0:
                    syncs[name] = count_syncs(engine.run_round)[0]
                _sync(dev)
                start = time.perf_counter()
                for _ in range(rounds):
                    engine.run_round()
                _sync(dev)
                times[name].append((time.perf_counter() - start) / rounds)
            if s.left() < 5:
                break
    finally:
        passes.pass_indices_host = host
    ms = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"round_ms": ms, "syncs": syncs, "tensor_over_host": ms["tensor"] / ms["host"]}
