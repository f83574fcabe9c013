"""The steps' child process: each step's function, run in order to its deadline."""

from __future__ import annotations

import os
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

from .bench import bench
from .conv_gemm import step_conv_gemm
from .cuda_tests import step_cuda_tests
from .environment import step_env
from .golden_cases import step_golden
from .kernel_profile import step_profile
from .sizes import SIZES
from .step import Step
from .step import _tail
from .sweep import step_sweep
from .syncs import step_syncs

STEP_FUNCTIONS: dict[str, Callable[[Step], None]] = {
    "env": step_env,
    "cuda_tests": step_cuda_tests,
    "golden": step_golden,
    "syncs": step_syncs,
    "bench_cnn": lambda s: bench(s, "cnn"),
    "bench_lr": lambda s: bench(s, "lr"),
    "bench_densenet": lambda s: bench(s, "densenet"),
    "bench_unet": lambda s: bench(s, "unet"),
    "bench_densenet3d": lambda s: bench(s, "densenet3d"),
    "bench_unet3d": lambda s: bench(s, "unet3d"),
    "profile": step_profile,
    "conv_gemm": step_conv_gemm,
    "sweep": step_sweep,
}


def run_child(steps: list[str], mode: str, deadlines: list[float], out: Path, work: Path) -> None:
    """The child: run ``steps`` in order, each to its (monotonic) deadline."""
    import torch

    parent = os.getppid()

    def orphaned() -> None:  # the check was stopped: stop too (the GPU is needed again)
        while True:
            time.sleep(2)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=orphaned, daemon=True).start()

    sizes = SIZES[mode]
    if sizes.threads:
        torch.set_num_threads(sizes.threads)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name, deadline in zip(steps, deadlines, strict=True):
        step = Step(name, sizes, deadline, out, work)
        started = time.monotonic()
        try:
            STEP_FUNCTIONS[name](step)
            step.result["status"] = "ok"
        except Exception as exc:
            step.result["status"] = "failed"
            step.result["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            step.result["traceback"] = _tail(traceback.format_exc(), 12)
            step.say(f"FAILED: {step.result['error']}")
        step.result["seconds"] = time.monotonic() - started
        step.save()
