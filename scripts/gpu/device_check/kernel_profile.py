"""Step ``profile``: one CNN round under ``torch.profiler``, its top kernels."""

from __future__ import annotations

import time
from typing import Any

from .step import Step
from .step import _device
from .step import _sync
from .summary import _f


def step_profile(s: Step) -> None:
    """One CNN round under the profiler: the top kernels (``kernels.txt``), their count."""
    import gpu_cnn_rate
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    dev = _device()
    n = s.sizes.profile_clients
    engine = gpu_cnn_rate.engine(n, dev)
    for _ in range(2):
        engine.run_round()
    _sync(dev)
    # the round's wall time unprofiled: the profiler's start and its collection of the trace
    # at the end took seconds on the H200 (2026-11-29: a "6.4 s" round of 48 ms on the CPU)
    start = time.perf_counter()
    engine.run_round()
    _sync(dev)
    wall = time.perf_counter() - start
    activities = [ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.run_round()
        _sync(dev)
        profiled = time.perf_counter() - start
    averages = prof.key_averages()
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    try:
        table = averages.table(sort_by=key, row_limit=30)
    except (AttributeError, KeyError, ValueError):
        key = "self_device_time_total" if dev.type == "cuda" else key
        table = averages.table(sort_by=key, row_limit=30)
    cpu_table = averages.table(sort_by="cpu_time_total", row_limit=20)
    header = f"One round of the CNN workload, {n} clients, {dev} (torch {torch.__version__})\n"
    (s.out / "kernels.txt").write_text(
        f"{header}\nBy self {'device' if dev.type == 'cuda' else 'CPU'} time:\n{table}\n\n"
        f"By total CPU time:\n{cpu_table}\n"
    )
    kernels = _kernels(prof) if dev.type == "cuda" else {}
    launched = sum(calls for calls, _ in kernels.values())
    busy = sum(us for _, us in kernels.values()) / 1e6
    s.result.update(
        clients=n,
        round_s=wall,
        profiled_round_s=profiled,
        kernels=launched,
        kernels_per_client=launched / n,
        device_busy_s=busy if dev.type == "cuda" else None,
        device_busy_fraction=busy / wall if dev.type == "cuda" and wall else None,
    )
    if kernels:  # the kernels themselves, by their summed time
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
        s.result["top"] = [
            {"name": k[:120], "calls": c, "device_ms": us / 1e3} for k, (c, us) in ranked[:12]
        ]
    else:  # no device: the operators by their own CPU time
        ranked_ops = sorted(averages, key=lambda e: -e.self_cpu_time_total)
        s.result["top"] = [
            {"name": e.key[:120], "calls": e.count, "cpu_ms": e.self_cpu_time_total / 1e3}
            for e in ranked_ops[:12]
        ]
    busy_text = _f(s.result["device_busy_fraction"], ".1%")
    s.say(
        f"{n} clients: round {wall * 1e3:.1f} ms ({profiled * 1e3:.1f} profiled), "
        f"{launched} kernels ({launched / n:.1f} a client), device busy {busy_text}"
    )


def _kernels(prof: Any) -> dict[str, tuple[int, float]]:
    """Each device kernel's (launches, microseconds) in the profile ``prof``."""
    out: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        if not str(getattr(e, "device_type", "")).upper().endswith("CUDA"):
            continue
        us = float(e.time_range.elapsed_us())
        calls, total = out.get(e.name, (0, 0.0))
        out[e.name] = (calls + 1, total + us)
    return out
