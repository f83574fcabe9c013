"""Step ``conv_gemm``: convolutions as vmap's grouped ones against matrix products."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from .bench import _fedexp_rate
from .step import Step
from .step import _device
from .step import _free
from .step import _peak_mib
from .step import _reset_peak
from .workloads import _workload


def step_conv_gemm(s: Step) -> None:
    """Grouped convolutions against matrix products (``conv_gemm``), cell by cell."""
    import torch

    dev = _device()
    s.result.update(cells={})
    tmp = Path(tempfile.mkdtemp(prefix="gemm-", dir=s.work))
    try:
        # the same server state both ways (float32: TF32 off for the grouped convolutions)
        torch.backends.cudnn.allow_tf32 = False
        states = []
        for gemm in (False, True):
            engine = _workload("cnn", 10, dev, tmp, s.sizes.workload("cnn"))[0]
            if gemm:
                engine.ctx.model.use_conv_gemm()
            engine.run_round()
            engine.run_round()
            states.append(
                torch.cat([v.detach().double().cpu().reshape(-1) for v in engine.server.values()])
            )
        torch.backends.cudnn.allow_tf32 = True
        gap = float((states[0] - states[1]).abs().max() / states[0].abs().max())
        s.result["cnn_state_gap"] = gap
        s.say(f"cnn, 10 clients, two rounds: server states {gap:.2e} apart (relative)")
        s.save()
        cells = s.sizes.gemm_cells
        for i, (model, n) in enumerate(cells):
            cell_end = time.monotonic() + s.left() / (len(cells) - i)
            cell: dict[str, Any] = {"model": model, "clients": n}
            s.result["cells"][f"{model}_{n}"] = cell
            try:
                engine = _workload(model, n, dev, tmp, s.sizes.workload(model))[0]
                for variant in ("grouped", "gemm"):
                    if variant == "gemm":  # as conv_gemm=true: its fields in the estimate
                        engine.ctx.model.use_conv_gemm()
                        engine.ctx.step_bytes.clear()
                    _reset_peak(dev)
                    end = time.monotonic() + (cell_end - time.monotonic()) / (
                        2 if variant == "grouped" else 1
                    )
                    cell[variant] = _fedexp_rate(engine, n, s.sizes, dev, end)
                    cell[f"{variant}_peak_mib"] = _peak_mib(dev)
                cell["ratio"] = cell["gemm"] / cell["grouped"]
                s.say(
                    f"{model}, {n} clients: grouped {cell['grouped']:,.0f} updates/s, "
                    f"products {cell['gemm']:,.0f} ({cell['ratio']:.2f}x)"
                )
            except Exception as exc:  # an out-of-memory, say: the next cell
                cell["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                s.say(f"{model}, {n} clients: {cell['error']}")
            finally:
                engine = None
                _free(dev)
            s.save()
    finally:
        torch.backends.cudnn.allow_tf32 = True
        shutil.rmtree(tmp, ignore_errors=True)
