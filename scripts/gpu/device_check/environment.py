"""Step ``env``: versions, the device, its float32 peak and a matrix product's measured rate."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from .paths import ROOT
from .step import Step
from .step import _device
from .step import _sync

#: Stated dense peaks, TFLOP/s: (float32 on the CUDA cores, TF32 on the tensor cores), by a
#: piece of the device's name (first match). NVIDIA's data sheets (SXM parts; sparsity not
#: counted). Unknown chips use the measured float32 matrix product instead.
PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 51.2, 378.0),
    ("H100 NVL", 60.0, 417.5),
    ("H100", 66.9, 494.7),
    ("H200", 66.9, 494.7),
    ("A100", 19.5, 156.0),
)


def _fp32_peak(device: torch.device, measured: float | None = None) -> tuple[float, float, str]:
    """(float32 TFLOP/s, TF32 TFLOP/s, where from) of ``device``: the stated peaks of a known
    chip, else ``measured`` (a float32 matrix product's rate; measured here when None)."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for part, fp32, tf32 in PEAKS:
            if part.lower() in name.lower():
                return fp32, tf32, f"stated for {part} (data sheet, dense)"
    if measured is None:
        measured = _matmul_tflops(device, tf32=False)
    return measured, measured, "measured: a float32 matrix product"


def _matmul_tflops(device: torch.device, tf32: bool) -> float:
    import torch

    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for _ in range(2):
            a @ b
        _sync(device)
        reps = 10 if device.type == "cuda" else 3
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def step_env(s: Step) -> None:
    """Versions, the device, the float32 matrix product's TFLOP/s."""
    import importlib.metadata as md

    import torch

    r = s.result
    r["python"] = platform.python_version()
    r["torch"] = torch.__version__
    r["torch_cuda"] = torch.version.cuda
    r["cuda_available"] = torch.cuda.is_available()
    packages = {}
    for name in ("numpy", "hydra-core", "omegaconf", "monai", "numba", "dp-accounting", "mlflow"):
        try:
            packages[name] = md.version(name)
        except md.PackageNotFoundError:
            packages[name] = None
    r["packages"] = packages
    r["commit"] = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain")
    r["dirty"] = None if dirty is None else bool(dirty.strip())
    r["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    r["cpus"] = os.cpu_count()
    dev = _device()
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        r["device"] = torch.cuda.get_device_name(dev)
        r["sms"] = p.multi_processor_count
        r["memory_gib"] = p.total_memory / 2**30
    else:
        r["device"] = f"CPU ({platform.processor() or platform.machine()}, no CUDA)"
    s.save()
    r["matmul_fp32_tflops"] = _matmul_tflops(dev, tf32=False)
    fp32, tf32, source = _fp32_peak(dev, r["matmul_fp32_tflops"])
    r["peak_fp32_tflops"], r["peak_tf32_tflops"], r["peak_source"] = fp32, tf32, source
    if dev.type == "cuda":
        r["matmul_tf32_tflops"] = _matmul_tflops(dev, tf32=True)
    s.say(
        f"{r['device']}, torch {r['torch']}, Python {r['python']}; float32 product "
        f"{r['matmul_fp32_tflops']:.3g} TFLOP/s, peak used {fp32:.3g} ({source})"
    )


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip()
