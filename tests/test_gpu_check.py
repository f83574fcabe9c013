"""The device check (issue 40, scripts/gpu/check.sh) cannot rot: its smallest rehearsal runs
every step here, and the parts only a GPU reaches (sync counting, kernel tallies, the CUDA test
selection) run on stand-ins."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.slow  # several processes or whole CLI runs: make test-slow

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


check = _load("check")
cuda_select = _load("cuda_select")


def test_smallest_rehearsal_runs_every_step(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PY": sys.executable, "PYTHONWARNINGS": "ignore"}
    env.pop("OUT", None)
    proc = subprocess.run(
        # --stretch: the steps' budgets are the device's; a busy CI machine may need more
        ["bash", str(GPU / "check.sh"), "--cpu", "--smallest", "--stretch", "4", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    # what comes back from the device: at most 8 files, plain names, no folders
    files = sorted(p.name for p in out.iterdir())
    assert files == ["check.json", "cuda_tests.txt", "kernels.txt", "log.txt", "summary.md"]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    doc = json.loads((out / "check.json").read_text())
    assert {k: v["status"] for k, v in doc["steps"].items()} == dict.fromkeys(check.STEPS, "ok")
    for model in ("cnn", "lr", "densenet", "unet"):
        for cell in doc["steps"][f"bench_{model}"]["cells"].values():
            for key in ("fedexp_updates_per_s", "plain_updates_per_s", "step_bound_updates_per_s"):
                assert cell[key] > 0, (model, key)
            assert 0 < cell["fraction_of_flop_bound"] < 10
    assert doc["steps"]["golden"]["ok"]
    assert doc["steps"]["sweep"]["device"]["done"] == 1
    summary = (out / "summary.md").read_text()
    assert "## Client updates per second" in summary and "| unet | 2 |" in summary
    assert "[check" in proc.stdout and summary.strip() in proc.stdout


def test_sizes_name_what_exists():
    from golden.cases import CASES

    from helpers import CONF

    algorithms = {p.stem for p in (CONF / "algorithm").glob("*.yaml")}
    for mode, sizes in check.SIZES.items():
        assert list(sizes.budgets) == list(check.STEPS), mode
        assert max(sizes.budgets.values()) <= sizes.total_s, mode
        assert set(sizes.golden) <= set(CASES), mode
        assert set(sizes.sweep_algorithms) <= algorithms, mode
        assert set(sizes.workloads) <= set(check.WORKLOADS), mode
    # every step gets its whole budget; the device check fits its 580 s call (8 2/3 minutes of
    # steps, the wheels' installation and the last step's grace besides)
    for mode in ("gpu", "cpu"):
        assert sum(check.SIZES[mode].budgets.values()) <= check.SIZES[mode].total_s
    assert check.SIZES["gpu"].total_s <= 520


def test_sync_counting_reads_the_debug_mode_warnings(monkeypatch):
    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def a_round():
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)

    count, sites = check.count_syncs(a_round)
    assert count == 3 and sum(sites.values()) == 3
    assert modes == ["warn", 0]


def test_kernel_tally_sums_each_device_kernel():
    def event(name, device, us):
        return SimpleNamespace(
            name=name,
            device_type=f"DeviceType.{device}",
            time_range=SimpleNamespace(elapsed_us=lambda: us),
        )

    prof = SimpleNamespace(
        events=lambda: [
            event("gemm", "CUDA", 5.0),
            event("gemm", "CUDA", 7.0),
            event("aten::mm", "CPU", 100.0),
            event("copy", "CUDA", 1.0),
        ]
    )
    assert check._kernels(prof) == {"gemm": (2, 12.0), "copy": (1, 1.0)}


def _item(reason=None, params=None, marked=False):
    marks = [SimpleNamespace(kwargs={"reason": reason})] if reason else []
    return SimpleNamespace(
        get_closest_marker=lambda name: object() if marked and name == "cuda" else None,
        iter_markers=lambda name: marks if name == "skipif" else [],
        callspec=None if params is None else SimpleNamespace(params=params),
    )


@pytest.mark.parametrize(
    ("item", "needs"),
    [
        (_item(reason="needs CUDA"), True),
        (_item(reason="no CUDA device"), True),
        (_item(reason="needs a GPU"), True),
        (_item(params={"device": "cuda"}), True),
        (_item(marked=True), True),
        (_item(params={"device": "cpu"}), False),
        (_item(reason="needs numba"), False),
        (_item(), False),
    ],
)
def test_cuda_selection(item, needs):
    assert cuda_select.needs_cuda(item) is needs


def test_summary_of_a_partial_check():
    """A check stopped after its first step still gives a summary."""
    doc = {
        "mode": "gpu",
        "budget_s": 420,
        "wall_s": 12.0,
        "steps": {
            "env": {"status": "ok", "device": "NVIDIA H100 80GB HBM3", "seconds": 3.0},
            "bench_densenet": {
                "status": "timeout",
                "cells": {
                    "1000": {
                        "clients": 1000,
                        "fedexp_error": "OutOfMemoryError: CUDA out of memory",
                        "plain_updates_per_s": 40.0,
                    }
                },
            },
        },
    }
    text = check.summary(doc)
    assert text.startswith("# fedexp device check: NVIDIA H100 80GB HBM3")
    assert "| env | ok | 3.0 |" in text and "| bench_densenet | timeout |" in text
    assert "| densenet | 1000 | – | 40 |" in text
    assert "- densenet, 1000 clients, fedexp_error: OutOfMemoryError" in text
