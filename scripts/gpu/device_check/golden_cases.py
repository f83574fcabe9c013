"""Step ``golden``: golden cases (``tests/golden``) on the device against their CPU recording."""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from .step import Step
from .step import _device

#: Golden figures on another device: float order differs (kernels, reductions), so the
#: continuous tolerance is ten times the CPU test's (tests/test_golden.py: rel 1e-5, abs 1e-6
#: for tensors, 1e-7 for metrics); counts must match exactly, discrete figures within what
#: near ties allow (tests/golden/ties.py). TF32 is switched off for the comparison.
GOLDEN_RTOL, GOLDEN_ATOL, GOLDEN_METRIC_ATOL = 1e-4, 1e-5, 1e-6


def step_golden(s: Step) -> None:
    """Golden cases on this device against their CPU recording (tolerance: GOLDEN_*)."""
    import torch
    from golden.golden import metrics_path
    from golden.golden import run_case
    from golden.golden import state_path
    from safetensors.torch import load_file

    dev = _device()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    recorded = json.loads(metrics_path().read_text())
    s.result.update(
        device=str(dev),
        rtol=GOLDEN_RTOL,
        atol=GOLDEN_ATOL,
        metric_atol=GOLDEN_METRIC_ATOL,
        tf32=False,
        cases={},
    )
    for name in s.sizes.golden:
        if s.left() < 3:
            s.result["cases"][name] = {"status": "not run (time)"}
            continue
        start = time.monotonic()
        try:
            with tempfile.TemporaryDirectory(dir=s.work) as tmp:
                # tracker=none: the default names MLflow's tracker, the device need not have it
                got = run_case(name, Path(tmp), f"device={dev.type}", "tracker=none")
            case = _golden_gaps(*got, load_file(state_path(name)), recorded[name])
        except Exception as exc:  # this case; the next ones still run
            case = {"ok": False, "worst_ratio": math.inf, "worst": "", "max_abs_gap": math.inf}
            case["problems"] = [f"{type(exc).__name__}: {str(exc)[:300]}"]
        case["seconds"] = time.monotonic() - start
        s.result["cases"][name] = case
        s.save()
        s.say(
            f"{name}: {'ok' if case['ok'] else 'OUTSIDE'} (worst {case['worst_ratio']:.3g} of the "
            f"tolerance at {case['worst'] or '–'}; largest state gap {case['max_abs_gap']:.2e})"
        )
    s.result["ok"] = all(c.get("ok", False) for c in s.result["cases"].values())
    outside = [k for k, c in s.result["cases"].items() if "ok" in c and not c["ok"]]
    if outside:
        raise RuntimeError(f"outside the tolerance: {', '.join(outside)}")


def _golden_gaps(
    state: dict[str, torch.Tensor],
    history: list[dict[str, float]],
    ties: Any,
    want: dict[str, torch.Tensor],
    old_rounds: list[dict[str, float]],
) -> dict[str, Any]:
    """Each figure's gap over its tolerance (≤ 1: within), the worst of them.

    Args:
        state, history, ties: :func:`golden.golden.run_case`'s flat state tree, per-round
            metrics and near-tie allowance (``golden.ties.Allowance``) of the run here.
        want, old_rounds: the recording's state tree and per-round metrics.
    """
    worst, where, gap_max, problems = 0.0, "", 0.0, []

    def note(ratio: float, key: str) -> None:
        nonlocal worst, where
        if ratio > worst:
            worst, where = ratio, key

    if sorted(state) != sorted(want):
        problems.append("the state tree's entries differ")
    for key, value in want.items():
        if key not in state:
            continue
        got, value = state[key].double(), value.double()
        if not got.isnan().equal(value.isnan()):
            problems.append(f"{key}: NaNs differ")
        gap = (got - value).abs().nan_to_num(0.0)
        limit = GOLDEN_ATOL + GOLDEN_RTOL * value.abs().nan_to_num(0.0)
        allowed = ties.state(key)
        if allowed is not None:
            limit = limit + allowed.double()
        if gap.numel():
            note(float((gap / limit).max()), key)
            gap_max = max(gap_max, float(gap.max()))
    if len(history) != len(old_rounds):
        problems.append("round count differs")
    for t, (got, old) in enumerate(zip(history, old_rounds, strict=False)):
        for key, value in old.items():
            if key not in got:
                problems.append(f"round {t}: {key} missing")
                continue
            if key.startswith(("bytes/", "clients/", "messages/")):
                if got[key] != value:
                    problems.append(f"round {t}: {key} {got[key]} != {value}")
                continue
            if math.isnan(value) and math.isnan(got[key]):
                continue
            limit = GOLDEN_METRIC_ATOL + ties.metric(t, key) + GOLDEN_RTOL * abs(value)
            note(abs(got[key] - value) / limit, f"round {t}: {key}")
    return {
        "ok": worst <= 1 and not problems,
        "worst_ratio": worst,
        "worst": where,
        "max_abs_gap": gap_max,
        "problems": problems[:10],
    }
