"""Steps ``bench_*``: client updates/s of fedexp's round (eager and captured), of the plain
per-client loop, the measured step bound and the FLOP bound, peak memory."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    #: a loss of (logits, targets)
    Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

from .environment import _fp32_peak
from .sizes import Sizes
from .step import Step
from .step import _device
from .step import _free
from .step import _peak_mib
from .step import _reset_peak
from .step import _sync
from .summary import _f
from .workloads import _example_batch
from .workloads import _lr_module_and_loss
from .workloads import _train_flops
from .workloads import _workload


def bench(s: Step, model: str) -> None:
    """One workload at each client count: fedexp, plain loop, bounds, memory."""
    dev = _device()
    z = s.sizes
    env = _env_figures(s.work)
    fp32, tf32 = env.get("peak_fp32_tflops"), env.get("peak_tf32_tflops")
    if fp32 is None:
        fp32, tf32, _ = _fp32_peak(dev)
    samples, steps, batch = s.sizes.workload(model)
    s.result.update(
        model=model,
        samples_per_client=samples,
        steps=steps,
        batch=batch,
        peak_fp32_tflops=fp32,
        peak_tf32_tflops=tf32,
        cells={},
    )
    tmp = Path(tempfile.mkdtemp(prefix=f"{model}-", dir=s.work))  # (the check removes it too)
    try:
        counts = z.clients_3d if model.endswith("3d") else z.clients
        for i, n in enumerate(counts):
            cell_end = time.monotonic() + s.left() / (len(counts) - i)
            cell: dict[str, Any] = {"clients": n}
            s.result["cells"][str(n)] = cell
            try:
                _bench_cell(s, model, n, dev, tmp, cell, cell_end)
            except Exception as exc:  # an out-of-memory at 1,000 clients, say: the next cell
                cell["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                s.say(f"{n} clients: {cell['error']}")
            finally:
                _free(dev)
            s.save()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _bench_cell(
    s: Step, model: str, n: int, dev: torch.device, tmp: Path, cell: dict, cell_end: float
) -> None:
    """One cell of :func:`bench`: ``n`` clients of ``model``, until ``cell_end``."""
    import bench_engine

    z = s.sizes
    samples, steps, batch = s.sizes.workload(model)
    _reset_peak(dev)
    start = time.monotonic()
    engine, module, loss_fn, lr, shape = _workload(model, n, dev, tmp, (samples, steps, batch))
    cell["build_s"] = time.monotonic() - start
    if module is None:
        module, loss_fn = _lr_module_and_loss(shape)
    module = module.to(dev)
    # FLOPs of one sample's training step, on a minibatch
    x, y = _example_batch(model, shape, batch, dev)
    flops = _train_flops(module, loss_fn, x, y) / batch
    cell["train_gflop_per_sample"] = flops / 1e9
    per_update = flops * steps * batch
    flop_bound = s.result["peak_fp32_tflops"] * 1e12 / per_update
    tf32_bound = s.result["peak_tf32_tflops"] * 1e12 / per_update
    cell["flop_bound_updates_per_s"] = flop_bound
    # fedexp, the plain loop, the measured bound: each in turn, whatever the others did (an
    # out-of-memory of the cohort's slices, say)
    rate = _capture_modes(engine, n, z, dev, cell, cell_end)
    if rate is not None:
        cell.update(fedexp_updates_per_s=rate, peak_gpu_mib=_peak_mib(dev))
        cell["fraction_of_flop_bound"] = rate / flop_bound
        cell["fraction_of_tf32_peak"] = rate / tf32_bound
        cell["achieved_tflops"] = rate * per_update / 1e12
    s.save()
    _reset_peak(dev)
    plain_s = max(0.05, min(z.plain_s, (cell_end - time.monotonic()) / 2))
    plain = _guarded(
        cell,
        "plain",
        lambda: (
            n
            * bench_engine.plain_loop(
                engine,
                1000,
                steps,
                batch,
                model=module if model != "lr" else None,
                loss_fn=loss_fn if model != "lr" else None,
                lr=lr,
                budget_s=plain_s,
            )
        ),
    )
    if plain is not None:
        cell.update(plain_updates_per_s=plain, plain_peak_gpu_mib=_peak_mib(dev))
        if rate is not None:
            cell["fedexp_over_plain"] = rate / plain
    s.save()
    engine = None  # (its clients' tensors freed before the bound's batch)
    _free(dev)
    # the measured bound: one step of one model on every client's minibatch at once
    bound = _guarded(
        cell, "bound", lambda: _step_bound(model, module, loss_fn, lr, shape, n, z, dev)
    )
    if bound is not None:
        cell["step_bound_updates_per_s"] = bound
        if rate is not None:
            cell["fraction_of_step_bound"] = rate / bound
    s.say(
        f"{n} clients: fedexp {_f(rate)} updates/s (eager "
        f"{_f(cell.get('fedexp_eager_updates_per_s'))}, captured "
        f"{_f(cell.get('fedexp_captured_updates_per_s'))}: "
        f"{_f(cell.get('captured_over_eager'), '.2f')}x), plain {_f(plain)} "
        f"({_f(cell.get('fedexp_over_plain'), '.1f')}x); "
        f"{_f(cell.get('fraction_of_flop_bound'), '.2%')} of the FLOP bound, "
        f"{_f(cell.get('fraction_of_step_bound'), '.1%')} of the step bound; peak "
        f"{_f(cell.get('peak_gpu_mib'))} MiB"
        + "".join(f"; {k}: {v}" for k, v in cell.items() if k.endswith("_error"))
    )


def _guarded(cell: dict, name: str, measure: Callable[[], float]) -> float | None:
    """``measure()``, or None with ``cell[name + "_error"]`` said."""
    try:
        return measure()
    except Exception as exc:
        cell[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return None


def _capture_modes(
    engine: Any, n: int, z: Sizes, dev: torch.device, cell: dict, cell_end: float
) -> float | None:
    """fedexp's rate with eager rounds, then with captured ones (issue 69), on one engine.

    The captured solver records each (cohort size, step count)'s local steps as a CUDA graph
    in its first (warm-up) round and replays it (``fedexp/engine/solver/capture.py``; on the
    CPU the same static-buffer steps, eagerly; not measured where the model's gradients go
    row by row, which the captured solver hands to the eager one). Each mode gets a third of
    what is left of the cell (the plain loop and the bound the rest). Returns the captured
    rate (the default, ``capture=auto``, on a GPU), else the eager one.
    """
    from fedexp.engine.solver.capture import CapturedSolver
    from fedexp.engine.solver.steps import rowwise
    from fedexp.engine.solver.steps import train

    captured = CapturedSolver(graphs=dev.type == "cuda")
    modes: tuple[tuple[str, Any], ...] = (("eager", train), ("captured", captured))
    if rowwise(engine.ctx, engine.ctx.model_objective()):  # (the CPU's convolutions): the
        modes = modes[:1]  # captured solver would hand every call to the eager one
    rates: dict[str, float | None] = {"captured": None}
    for name, solver in modes:
        engine.ctx.solver = solver
        end = time.monotonic() + (cell_end - time.monotonic()) / 3
        rates[name] = _guarded(
            cell, f"fedexp_{name}", lambda end=end: _fedexp_rate(engine, n, z, dev, end)
        )
        cell[f"fedexp_{name}_updates_per_s"] = rates[name]
    cell["captured_keys"] = len(captured.cache)
    cell["captured_graphs"] = sum(e.graph is not None for e in captured.cache.values())
    if rates["eager"] and rates["captured"]:
        cell["captured_over_eager"] = rates["captured"] / rates["eager"]
    return rates["captured"] if rates["captured"] is not None else rates["eager"]


def _fedexp_rate(engine: Any, n: int, z: Sizes, dev: torch.device, cell_end: float) -> float:
    """Client updates/s of whole rounds after warm-up ones, half the cell's time at most."""
    warm_end = time.monotonic() + (cell_end - time.monotonic()) / 4
    for _ in range(z.warmup):  # (one round at least, more while a quarter of the cell lasts)
        engine.run_round()
        _sync(dev)
        if time.monotonic() > warm_end:
            break
    fedexp_end = time.monotonic() + (cell_end - time.monotonic()) / 2
    t0, done = time.perf_counter(), 0
    while done < z.rounds and (done == 0 or time.monotonic() < fedexp_end):
        engine.run_round()
        done += 1
    _sync(dev)
    return n * done / (time.perf_counter() - t0)


def _step_bound(
    model: str,
    module: nn.Module,
    loss_fn: Loss,
    lr: float,
    shape: tuple[int, ...],
    n: int,
    z: Sizes,
    dev: torch.device,
) -> float:
    """Client updates/s at one SGD step of ``module`` on every client's minibatch at once: at
    most ``bound_cap`` samples, halved while they do not fit (the rate is per sample)."""
    import gpu_cnn_rate
    import torch

    _, steps, batch = z.workload(model)
    size = min(n * batch, z.bound_cap)
    while True:
        try:
            x, y = _example_batch(model, shape, size, dev)
            step_s = gpu_cnn_rate.step_seconds(
                module, x, y, loss_fn, lr, reps=z.bound_reps, warmup=1
            )
            return size / batch / (steps * step_s)
        except torch.OutOfMemoryError:
            x = y = None
            _free(dev)
            if size <= batch:
                raise
            size //= 2


def _env_figures(work: Path) -> dict[str, Any]:
    """The ``env`` step's figures, where it ran first."""
    file = work / "env.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
