"""The device check (issue 40): one command on the GPU machine, every figure into ``$OUT``.

    bash scripts/gpu/check.sh                  # on the device (installs .whl/ first)
    bash scripts/gpu/check.sh --cpu            # the rehearsal here: every step, small sizes
    bash scripts/gpu/check.sh --cpu --smallest # its smallest form (tests/test_gpu_check.py)
    bash scripts/gpu/check.sh --only bench_cnn,profile --budget 200   # a rerun of some steps

Steps, in order, each in a child process of its own (a CUDA error or an out-of-memory stays
in its step) with its own time budget; ``--smallest`` runs them all in one child:

* ``env``: versions, the device, a float32 matrix product's TFLOP/s;
* ``cuda_tests``: every test that needs CUDA (``cuda_select.py``), JUnit outcomes;
* ``golden``: golden cases (``tests/golden``) on the device against their CPU recording;
* ``syncs``: host synchronisations in one round (``torch.cuda.set_sync_debug_mode``), at two
  client counts: their difference over the clients' is the syncs per client; and the next
  round's dispatched ops and host reads (``fedexp.engine.round.census``), equal at both;
  then LR rounds with the pass draws on the host against the tensor path GPU runs took
  before (``compare_draws``: syncs and round time of each); then the round census's cases
  (every algorithm, codec and privacy mode of ``tests/test_round_census.py``, 10 clients)
  on the device, each one's syncs a training round and an evaluation (``census_syncs``);
* ``bench_cnn``, ``bench_lr``, ``bench_densenet``, ``bench_unet`` and the 3-D
  ``bench_densenet3d`` (LUNA16-shaped 32³ cubes) and ``bench_unet3d`` (BraTS-shaped 4×64³
  crops), at fewer clients (``clients_3d``): client updates/s of
  fedexp's round and of the plain per-client loop (``scripts/bench_engine.py``'s) on the same
  tensors, the measured step bound (``scripts/gpu_cnn_rate.py``'s: one SGD step of one model
  on every client's minibatch at once), the FLOP bound (train FLOPs per sample × samples per
  update ÷ the chip's stated float32 peak) and peak GPU memory; fedexp's rate both eager and
  with captured rounds (CUDA graphs, ``capture=auto``: ``captured_over_eager``);
* ``profile``: one CNN round under ``torch.profiler``: the top kernels;
* ``conv_gemm``: rounds of the CNN, the U-Net and the DenseNet with their convolutions as
  vmap's grouped ones and as matrix products (the run setting ``conv_gemm``), in turn on one
  engine: client updates/s and peak memory of each; and the CNN's server state after two
  rounds of 10 clients both ways (float32, TF32 off);
* ``sweep``: a ``pfednet_tables``-style sweep (``fedexp run -m``) on the device, one job a
  run, then the same algorithms over ``sweep_seeds`` seeds with ``hydra/launcher=stacked``
  (a group of runs a cohort), and as the baseline the first ones on the CPU.

Written to ``$OUT`` (at most 5 files): ``check.json`` (every figure), ``summary.md``,
``kernels.txt``, ``cuda_tests.txt``, ``log.txt``. Both JSON and summary are rewritten after
every step, so a check stopped from outside still leaves what it had.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    #: a loss of (logits, targets)
    Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _import_paths() -> None:
    """fedexp, the tests' helpers and golden cases, the benchmark scripts: importable."""
    for path in (ROOT, ROOT / "tests", ROOT / "scripts", ROOT / "scripts" / "peers", HERE):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


STEPS = (
    "env",
    "cuda_tests",
    "golden",
    "syncs",
    "bench_cnn",
    "bench_lr",
    "bench_densenet",
    "bench_unet",
    "bench_densenet3d",
    "bench_unet3d",
    "profile",
    "conv_gemm",
    "sweep",
)

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

#: Golden figures on another device: float order differs (kernels, reductions), so the
#: continuous tolerance is ten times the CPU test's (tests/test_golden.py: rel 1e-5, abs 1e-6
#: for tensors, 1e-7 for metrics); counts must match exactly, discrete figures within what
#: near ties allow (tests/golden/ties.py). TF32 is switched off for the comparison.
GOLDEN_RTOL, GOLDEN_ATOL, GOLDEN_METRIC_ATOL = 1e-4, 1e-5, 1e-6


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each step is in one mode of the check.

    Attributes:
        total_s: wall-clock budget of all steps together.
        budgets: each step's own budget, seconds (never beyond what ``total_s`` leaves).
        inline: every step in one child process (the smallest form, quick to start).
        threads: torch CPU threads (0: torch's default).
        clients: client counts of the benchmark.
        clients_3d: client counts of the 3-D workloads (a cube is 32-64 slices).
        warmup: rounds before the timed ones.
        rounds: timed rounds at most (fewer when the cell's time runs out).
        plain_s: seconds of the plain loop's timing a cell.
        bound_reps: timed steps of the measured bound.
        bound_cap: samples in the measured bound's batch at most (the rate is per sample).
        golden: golden cases, in order.
        test_files: CUDA test files to run at most (0: all).
        sync_clients: the two client counts of ``syncs``.
        profile_clients: clients of the profiled CNN round.
        sweep_algorithms: the sweep's algorithms (one delta, one seed).
        sweep_rounds: rounds of each sweep job.
        sweep_cpu: algorithms of the CPU baseline sweep (the first ones), 0: none.
        sweep_seeds: seeds of the stacked sweep (each algorithm a group of that many runs).
        gemm_cells: (workload, clients) of ``conv_gemm``, in order.
        workloads: (samples a client, steps, batch) of the imaging models, where smaller than
            :data:`WORKLOADS` (a CPU takes seconds a DenseNet step).
    """

    total_s: float
    budgets: dict[str, float]
    inline: bool
    threads: int
    clients: tuple[int, ...]
    clients_3d: tuple[int, ...]
    warmup: int
    rounds: int
    plain_s: float
    bound_reps: int
    bound_cap: int
    golden: tuple[str, ...]
    test_files: int
    sync_clients: tuple[int, int]
    profile_clients: int
    sweep_algorithms: tuple[str, ...]
    sweep_rounds: int
    sweep_cpu: int
    sweep_seeds: int = 2
    gemm_cells: tuple[tuple[str, int], ...] = (("cnn", 2),)
    workloads: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)

    def workload(self, model: str) -> tuple[int, int, int]:
        """(samples a client, local steps, batch) of ``model`` in this mode."""
        return self.workloads.get(model, WORKLOADS[model])


def _budgets(*seconds: float) -> dict[str, float]:
    """Each step's budget, in the order of :data:`STEPS`."""
    return dict(zip(STEPS, seconds, strict=True))


SIZES: dict[str, Sizes] = {
    "gpu": Sizes(
        total_s=520,
        budgets=_budgets(15, 25, 35, 45, 40, 30, 65, 45, 45, 45, 15, 40, 75),
        inline=False,
        threads=0,
        clients=(100, 1000),
        clients_3d=(10, 100),
        warmup=2,
        rounds=10,
        plain_s=6.0,
        bound_reps=20,
        bound_cap=4096,
        golden=(
            "fedavg",
            "fedprox-cnn",
            "fedavg-stc-partial",
            "fedbn-batchnorm",
            "pfednet",
            "ditto",
        ),
        test_files=0,
        sync_clients=(10, 100),
        profile_clients=100,
        sweep_algorithms=("fedavg", "ditto", "fedper", "fedrep", "apfl", "local"),
        sweep_rounds=10,
        sweep_cpu=2,
        sweep_seeds=4,
        gemm_cells=(("cnn", 100), ("cnn", 1000), ("unet", 100), ("densenet", 100)),
    ),
    "cpu": Sizes(
        total_s=310,
        budgets=_budgets(15, 35, 25, 20, 20, 20, 40, 25, 25, 20, 15, 20, 30),
        inline=False,
        threads=1,
        clients=(4, 8),
        clients_3d=(2, 4),
        warmup=1,
        rounds=2,
        plain_s=1.0,
        bound_reps=2,
        bound_cap=64,
        golden=("fedavg", "fedprox-cnn"),
        test_files=0,
        sync_clients=(2, 4),
        profile_clients=4,
        sweep_algorithms=("fedavg", "local"),
        sweep_rounds=2,
        sweep_cpu=1,
        gemm_cells=(("cnn", 4), ("unet", 4)),
        workloads={
            "densenet": (10, 1, 2),
            "unet": (10, 1, 4),
            "densenet3d": (5, 1, 2),
            "unet3d": (10, 1, 2),
        },
    ),
    "smallest": Sizes(
        total_s=100,
        budgets=_budgets(10, 30, 15, 10, 10, 10, 10, 10, 10, 10, 10, 10, 30),
        inline=True,
        threads=1,
        clients=(2,),
        clients_3d=(2,),
        warmup=1,
        rounds=1,
        plain_s=0.2,
        bound_reps=1,
        bound_cap=16,
        golden=("fedavg",),
        test_files=1,
        sync_clients=(2, 3),
        profile_clients=2,
        sweep_algorithms=("fedavg",),
        sweep_rounds=1,
        sweep_cpu=0,
        sweep_seeds=1,
        workloads={
            "densenet": (5, 1, 2),
            "unet": (5, 1, 2),
            "densenet3d": (5, 1, 2),
            "unet3d": (5, 1, 2),
        },
    ),
}

#: Benchmark workloads: samples a client (80/20 train/test split for the config ones), local
#: steps, batch. ``cnn`` is issue 14's (scripts/peers/common.py), built by gpu_cnn_rate.py.
WORKLOADS: dict[str, tuple[int, int, int]] = {
    "lr": (50, 5, 16),  # scripts/bench_engine.py's
    "cnn": (64, 2, 16),
    "densenet": (40, 2, 16),  # LUNA16-shaped 1x32x32 patches, conf/model/densenet.yaml
    "unet": (20, 2, 8),  # BraTS-shaped 4x64x64 patches and masks, conf/model/unet.yaml
    # the 3-D ones (dataset.dims=3): LUNA16-shaped 1x32x32x32 cubes with a thinner DenseNet
    # (block_config [4,4,4]: 1 GiB a client's step against 7 GiB for the 2-D one's 16-16-16),
    # BraTS-shaped 4x64x64x64 crops with the U-Net (about 120 MiB a client's step at batch 2)
    "densenet3d": (20, 2, 8),
    "unet3d": (10, 2, 2),
}

#: Overrides of the 3-D workloads' models (see :data:`WORKLOADS`).
MODEL_3D = {"densenet3d": ("model.block_config=[4,4,4]",), "unet3d": ()}


# ====================================================================== child-side helpers
class Step:
    """What a step function gets: its sizes, deadline, folders, result dict and a saver."""

    def __init__(self, name: str, sizes: Sizes, deadline: float, out: Path, work: Path) -> None:
        self.name, self.sizes, self.deadline = name, sizes, deadline
        self.out, self.work = out, work  # $OUT (files that come back), scratch
        self.result_file = work / f"{name}.json"
        self.result: dict[str, Any] = {}

    def left(self) -> float:
        """Seconds to this step's deadline."""
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """Write what the step has so far (a step stopped from outside keeps it)."""
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=_jsonable))
        tmp.replace(self.result_file)

    def say(self, line: str) -> None:
        """A progress line."""
        print(f"  [{self.name}] {line}", flush=True)


def _jsonable(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def _device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device: torch.device) -> float | None:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return None


def _free(device: torch.device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


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


# ====================================================================== step: env
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


# ====================================================================== step: cuda_tests
def cuda_test_files() -> list[Path]:
    """The test files that mention CUDA (the others hold no CUDA test; not collecting them
    keeps the step short, and free of imports the device lacks, e.g. mlflow's)."""
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    return [f for f in files if "cuda" in f.read_text(encoding="utf-8", errors="replace")]


def step_cuda_tests(s: Step) -> None:
    """Every CUDA test (``cuda_select.py``), its outcome from the JUnit report."""
    import xml.etree.ElementTree as ET

    files = cuda_test_files()
    if s.sizes.test_files:
        files = files[: s.sizes.test_files]
    r = s.result
    r["files"] = [str(f.relative_to(ROOT)) for f in files]
    junit = s.work / "junit.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), _pythonpath()])}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "cuda_select",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-rA",
        f"--junitxml={junit}",
        *map(str, files),
    ]
    s.say(f"pytest on {len(files)} files")
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(5, s.left())
        )
        text, r["exit_code"] = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        r["exit_code"] = "timeout"
    (s.out / "cuda_tests.txt").write_text(text)
    tests: dict[str, str] = {}
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome = "passed"
            for kind in ("failure", "error", "skipped"):
                if case.find(kind) is not None:
                    outcome = {"failure": "failed"}.get(kind, kind)
            tests[name] = outcome
        junit.unlink()
    r["tests"] = tests
    r["counts"] = dict(Counter(tests.values()))
    r["summary_line"] = _tail(text, 1)
    s.say(f"{r['counts']} (exit {r['exit_code']}): {r['summary_line']}")
    bad = [k for k, v in tests.items() if v in ("failed", "error")]
    if bad or r["exit_code"] not in (0, 5):  # 5: nothing collected (no CUDA test left)
        raise RuntimeError(f"{len(bad)} CUDA tests failed (exit {r['exit_code']}): {bad[:5]}")


def _pythonpath() -> str:
    return os.environ.get("PYTHONPATH", "")


# ====================================================================== step: golden
def step_golden(s: Step) -> None:
    """Golden cases on this device against their CPU recording (tolerance: GOLDEN_*)."""
    import torch
    from golden.golden import metrics_path, run_case, state_path
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


# ====================================================================== step: syncs
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


# ====================================================================== step: bench
def imaging_folder(
    kind: str,
    clients: int,
    per_client: int,
    root: Path,
    dims: int = 2,
    side: int | None = None,
    regions: bool = False,
) -> Path:
    """A prepared LUNA16 or BraTS folder (``data_prep``'s layout) of random patches.

    Cubes with ``dims=3``; ``side`` voxels a side (default the converters': 32 and 64);
    BraTS masks of the three regions with ``regions`` (``--labels regions``), else whole
    tumour. Only their shapes matter (benchmarks, memory estimates).
    """
    import numpy as np

    rng = np.random.default_rng(0)
    n = clients * per_client
    side = side or (32 if kind == "luna16" else 64)
    folder = root / f"{kind}-{dims}d-{side}-{'r' if regions else 'w'}-{clients}"
    folder.mkdir(parents=True, exist_ok=True)
    block = min(n, 509)  # random patches, repeated: only their shapes matter (and it is quick)
    spatial = (side,) * dims
    if kind == "luna16":
        x = np.resize(rng.random((block, 1, *spatial), dtype=np.float32), (n, 1, *spatial))
        np.save(folder / "labels.npy", rng.integers(0, 2, n).astype(np.int64))
        column, groups = "seriesuid", [f"s{i % 997}" for i in range(n)]
    else:
        x = np.resize(rng.random((block, 4, *spatial), dtype=np.float32), (n, 4, *spatial))
        channels = (3,) if regions else ()
        shape = (*channels, *spatial)
        masks = np.resize(rng.random((block, *shape)) < 0.2, (n, *shape))
        np.save(folder / "masks.npy", masks.astype(np.uint8))
        column, groups = "patient", [f"p{i % 997}" for i in range(n)]
    np.save(folder / "images.npy", x)
    (folder / "manifest.csv").write_text(column + "\n" + "\n".join(groups) + "\n")
    return folder


def _workload(
    model: str, n: int, dev: torch.device, tmp: Path, spec: tuple[int, int, int]
) -> tuple[Any, nn.Module | None, Loss | None, float, tuple[int, ...]]:
    """(engine, plain-loop module, loss, lr, input shape) of one benchmark cell; ``spec``:
    (samples a client, local steps, batch)."""
    import bench_engine
    import common
    import gpu_cnn_rate

    from fedexp.engine.runner import build_engine
    from fedexp.models.builder import build_model
    from helpers import compose_config

    samples, steps, batch = spec
    if model == "cnn":
        engine = gpu_cnn_rate.engine(n, dev)
        return engine, common.make_model("cnn", 0), common.loss_fn, 0.1, (1, 32, 32)
    if model == "lr":
        engine = bench_engine.build(n, steps, batch, dev.type)
        return engine, None, None, 0.1, tuple(engine.clients[0].x_train.shape[1:])
    kind = "luna16" if model.startswith("densenet") else "brats"
    dims = 3 if model.endswith("3d") else 2
    folder = imaging_folder(kind, n, samples, tmp, dims)
    cfg = compose_config(
        f"dataset={kind}",
        f"dataset.path={folder}",
        f"dataset.dims={dims}",
        f"model={model.removesuffix('3d')}",
        *MODEL_3D.get(model, ()),
        "partition=iid",
        f"num_clients={n}",
        f"local_steps={steps}",
        f"batch_size={batch}",
        "lr=0.05",
        f"device={dev.type}",
        "tracker=none",
    )
    engine = build_engine(cfg)
    shape = tuple(engine.clients[0].x_train.shape[1:])
    module, _ = build_model(cfg.model, shape, 2, 0)
    return engine, module, common.loss_fn, 0.05, shape


def _example_batch(
    model: str, shape: tuple[int, ...], size: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    x = torch.randn(size, *shape, device=dev)
    if model == "lr":
        return x, torch.randint(0, 2, (size,), device=dev).float()
    if model.startswith("unet"):
        return x, torch.randint(0, 2, (size, *shape[1:]), device=dev)
    return x, torch.randint(0, 2, (size,), device=dev)


def _train_flops(module: nn.Module, loss_fn: Loss, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward + backward FLOPs of ``module`` on ``x`` (matrix products and convolutions)."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    m = copy.deepcopy(module)
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(m(x), y).backward()
    return float(counter.get_total_flops())


def _lr_module_and_loss(shape: tuple[int, ...]) -> tuple[nn.Module, Loss]:
    from torch import nn

    bce = nn.BCEWithLogitsLoss()
    return nn.Linear(shape[0], 1), lambda z, y: bce(z[:, 0], y.float())


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
    from fedexp.engine.solver.steps import rowwise, train

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


# ====================================================================== step: profile
def step_profile(s: Step) -> None:
    """One CNN round under the profiler: the top kernels (``kernels.txt``), their count."""
    import gpu_cnn_rate
    import torch
    from torch.profiler import ProfilerActivity, profile

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


# ====================================================================== step: conv_gemm
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


# ====================================================================== step: sweep
class _Sweep:
    """``fedexp run -m +experiment=pfednet_tables`` over ``algorithms`` (δ = 1, seed 0), its
    output read as it comes (each job's line timed) until :meth:`finish`."""

    def __init__(
        self,
        sizes: Sizes,
        device: str,
        algorithms: tuple[str, ...],
        root: Path,
        seeds: int = 1,
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="sweep-", dir=root))
        # (one process: the merge itself, not processes side by side)
        stacked = ["hydra/launcher=stacked", "hydra.launcher.n_jobs=1"] if seeds > 1 else []
        cmd = [
            sys.executable,
            "-c",
            "from fedexp.cli import entry; entry()",
            "run",
            "-m",
            "+experiment=pfednet_tables",
            "tracker=none",
            f"device={device}",
            f"rounds={sizes.sweep_rounds}",
            f"algorithm={','.join(algorithms)}",
            "partition.delta=1",
            f"seed={','.join(str(k) for k in range(seeds))}",
            *stacked,
            f"hydra.sweep.dir={self.tmp / 'multirun'}",
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), _pythonpath()])}
        env.pop("MLFLOW_TRACKING_URI", None)
        self.row: dict[str, Any] = {
            "device": device,
            "algorithms": list(algorithms),
            "seeds": seeds,
            "launcher": "stacked" if stacked else "basic",
            "jobs": {},
            "total": len(algorithms) * seeds,
        }
        self.lines: list[str] = []
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,  # (in the step's process group: stopped with the step)
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            now = time.monotonic() - self.start
            if line.startswith("sweep:"):
                self.first = now
            m = re.match(r"\[job (\d+)\]\s+(.*?)\s+(\S+=\S+)\s*$", line)
            if m:
                self.row["jobs"][f"{m.group(1)} {m.group(2)}"] = m.group(3).strip()
                self.last = now

    def finish(self, deadline: float) -> dict[str, Any]:
        """Its figures once it ends, or is stopped at ``deadline`` (monotonic)."""
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()  # (Hydra's basic launcher runs the jobs in this one process)
            self.proc.wait()
        self.reader.join(timeout=5)
        row = self.row
        row["exit_code"] = self.proc.returncode
        row["wall_s"] = time.monotonic() - self.start
        row["done"] = len(row["jobs"])
        if self.first is not None and self.last is not None and row["done"]:
            row["s_per_job"] = (self.last - self.first) / row["done"]
        if self.proc.returncode:
            row["output_tail"] = _tail("".join(self.lines))
        shutil.rmtree(self.tmp, ignore_errors=True)
        return row


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def step_sweep(s: Step) -> None:
    """The sweep on this device (one job a run, then stacked), then the CPU's (the baseline)."""
    dev = _device()
    z = s.sizes
    cpu_share = 0.25 if z.sweep_cpu and dev.type == "cuda" else 0.0
    s.result["rounds"] = z.sweep_rounds
    sweep = _Sweep(z, dev.type, z.sweep_algorithms, s.work)
    row = sweep.finish(time.monotonic() + s.left() * 0.35)
    s.result["device"] = row
    s.save()
    s.say(f"{dev.type}: {row['done']} jobs in {row['wall_s']:.1f} s, {row.get('s_per_job')} s/job")
    if z.sweep_seeds > 1:
        sweep = _Sweep(z, dev.type, z.sweep_algorithms, s.work, seeds=z.sweep_seeds)
        row = sweep.finish(time.monotonic() + s.left() * (1 - cpu_share))
        s.result["stacked"] = row
        s.save()
        s.say(
            f"{dev.type} stacked: {row['done']} jobs in {row['wall_s']:.1f} s, "
            f"{row.get('s_per_job')} s/job"
        )
    if cpu_share:
        sweep = _Sweep(z, "cpu", z.sweep_algorithms[: z.sweep_cpu], s.work)
        row = sweep.finish(s.deadline)
        s.result["cpu"] = row
        s.say(f"cpu: {row['done']} jobs in {row['wall_s']:.1f} s, {row.get('s_per_job')} s/job")
    rows = (s.result["device"], s.result.get("stacked"), s.result.get("cpu"))
    failed = [r for r in rows if r and r["exit_code"] > 0]
    if failed:  # (a sweep stopped at its time, -9, keeps the jobs it finished)
        raise RuntimeError(f"the sweep exited {failed[0]['exit_code']}: {failed[0]['output_tail']}")


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


# ====================================================================== the orchestrator
class Check:
    """Runs the steps' children, keeps the log, writes ``check.json`` and ``summary.md``."""

    def __init__(self, mode: str, steps: list[str], total_s: float, out: Path) -> None:
        self.mode, self.steps, self.out = mode, steps, out
        self.sizes = SIZES[mode]
        self.start = time.monotonic()
        self.end = self.start + total_s
        self.total_s = total_s
        self.results: dict[str, dict[str, Any]] = {}
        self.proc: subprocess.Popen | None = None
        self.work = Path(tempfile.mkdtemp(prefix="fedexp-check-work-"))  # the steps' JSON
        self.log = open(out / "log.txt", "a", buffering=1)

    def say(self, line: str) -> None:
        """A progress line, to stdout and the log."""
        stamp = f"[check {time.monotonic() - self.start:6.1f}s]"
        print(f"{stamp} {line}", flush=True)
        self.log.write(f"{stamp} {line}\n")

    def run(self) -> int:
        """Every step (or group), then the summary; 0 unless a step failed."""
        self.say(
            f"mode {self.mode}, steps {', '.join(self.steps)}; budget {self.total_s:.0f} s; "
            f"out {self.out}"
        )
        groups = [self.steps] if self.sizes.inline else [[s] for s in self.steps]
        try:
            for group in groups:
                self._run_group(group)
                self.write()
        finally:
            if self.proc is not None and self.proc.poll() is None:
                _kill_group(self.proc)
            self.write()
            shutil.rmtree(self.work, ignore_errors=True)
            self.say(f"done in {time.monotonic() - self.start:.1f} s; {self.out / 'summary.md'}")
            print("\n" + (self.out / "summary.md").read_text(), flush=True)
            self.log.close()
        failed = [s for s, r in self.results.items() if r.get("status") != "ok"]
        return 1 if failed else 0

    def _run_group(self, group: list[str]) -> None:
        now = time.monotonic()
        left = self.end - now
        deadlines, at = [], now
        for name in group:
            at = min(at + self.sizes.budgets[name], self.end)
            deadlines.append(at)
        if left < 3:
            for name in group:
                self.results[name] = {"status": "skipped", "error": "no time left"}
                self.say(f"{name}: skipped, no time left")
            return
        self.say(f"{', '.join(group)}: start ({deadlines[-1] - now:.0f} s)")
        # the child's deadlines, as its own monotonic clock reads them (the same clock)
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            ",".join(group),
            "--mode",
            self.mode,
            "--out",
            str(self.out),
            "--work",
            str(self.work),
            "--deadlines",
            ",".join(f"{d:.3f}" for d in deadlines),
        ]
        grace = 15 if self.mode == "gpu" else 5
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            process_group=0,  # its own group (killed with it), in this session (ended with it)
        )
        self.proc = proc
        err_lines: list[str] = []
        readers = [
            threading.Thread(target=self._pump, args=(proc.stdout, True, None), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, False, err_lines), daemon=True),
        ]
        for t in readers:
            t.start()
        try:
            proc.wait(timeout=max(1.0, deadlines[-1] - time.monotonic() + grace))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            proc.wait()
        for t in readers:
            t.join(timeout=5)
        for name in group:
            file = self.work / f"{name}.json"
            try:
                result = json.loads(file.read_text())
            except (OSError, ValueError):
                result = {}
            if result.get("status") is None:
                why = "timeout" if timed_out else f"child exited {proc.returncode}"
                result["status"] = "timeout" if timed_out else "crashed"
                result["error"] = why + (": " + _tail("".join(err_lines), 8) if err_lines else "")
            self.results[name] = result
            self.say(f"{name}: {result['status']} ({result.get('seconds', 0):.1f} s)")

    def _pump(self, stream: Any, echo: bool, keep: list[str] | None) -> None:
        for line in stream:
            self.log.write(line if echo else f"  (stderr) {line}")
            if echo:
                print(line, end="", flush=True)
            if keep is not None:
                keep.append(line)
                del keep[:-40]

    def write(self) -> None:
        """``check.json`` and ``summary.md`` from what the steps have so far."""
        results = dict(self.results)
        for name in self.steps:  # a step still running: its partial figures
            if name not in results:
                with contextlib.suppress(OSError, ValueError):
                    part = json.loads((self.work / f"{name}.json").read_text())
                    results[name] = {**part, "status": part.get("status", "running")}
        doc = {
            "mode": self.mode,
            "budget_s": self.total_s,
            "wall_s": time.monotonic() - self.start,
            "sizes": dataclasses.asdict(self.sizes),
            "steps": results,
        }
        (self.out / "check.json").write_text(json.dumps(doc, indent=1, default=_jsonable))
        (self.out / "summary.md").write_text(summary(doc))


# ====================================================================== the summary
def _f(value: object, fmt: str = ",.0f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, int | float):
        return format(value, fmt)
    return str(value)


def summary(doc: dict[str, Any]) -> str:
    """The Markdown summary of ``check.json``'s document."""
    steps = doc["steps"]
    env = steps.get("env", {})
    lines = [
        f"# fedexp device check: {env.get('device', '?')}",
        "",
        f"Mode `{doc['mode']}`, {env.get('date', '?')}, commit {env.get('commit') or '?'}"
        f"{' (with changes)' if env.get('dirty') else ''}; torch {env.get('torch', '?')}, "
        f"Python {env.get('python', '?')}; {doc['wall_s']:.0f} s of a {doc['budget_s']:.0f} s "
        "budget.",
        "",
        "| step | status | s | note |",
        "|---|---|---:|---|",
    ]
    for name in STEPS:
        if name in steps:
            r = steps[name]
            note = r.get("error", "") or ""
            lines.append(
                f"| {name} | {r.get('status')} | {_f(r.get('seconds'), '.1f')} | "
                f"{note[:120].replace('|', '/').replace(chr(10), ' ')} |"
            )
    if env.get("peak_fp32_tflops"):
        lines += [
            "",
            f"Peak used for the FLOP bound: {env['peak_fp32_tflops']:.3g} TFLOP/s float32 "
            f"({env.get('peak_source')}); TF32 {env.get('peak_tf32_tflops'):.3g}; a float32 "
            f"product measured {_f(env.get('matmul_fp32_tflops'), '.3g')} TFLOP/s"
            + (
                f", TF32 {_f(env.get('matmul_tf32_tflops'), '.3g')}"
                if env.get("matmul_tf32_tflops")
                else ""
            )
            + ".",
        ]
    rows, errors = [], []
    for model in ("cnn", "lr", "densenet", "unet", "densenet3d", "unet3d"):
        r = steps.get(f"bench_{model}", {})
        for n, c in r.get("cells", {}).items():
            errors += [f"- {model}, {n} clients, {k}: {v}" for k, v in c.items() if "error" in k]
            rows.append(
                f"| {model} | {n} | {_f(c.get('fedexp_updates_per_s'))} | "
                f"{_f(c.get('plain_updates_per_s'))} | {_f(c.get('fedexp_over_plain'), '.1f')}x | "
                f"{_f(c.get('step_bound_updates_per_s'))} | "
                f"{_f(c.get('fraction_of_step_bound'), '.1%')} | "
                f"{_f(c.get('flop_bound_updates_per_s'))} | "
                f"{_f(c.get('fraction_of_flop_bound'), '.2%')} | "
                f"{_f(c.get('peak_gpu_mib'))} | "
                f"{_f(c.get('fedexp_eager_updates_per_s'))} | "
                f"{_f(c.get('fedexp_captured_updates_per_s'))} | "
                f"{_f(c.get('captured_over_eager'), '.2f')} |"
            )
    if rows:
        lines += [
            "",
            "## Client updates per second",
            "",
            "fedexp: the captured rate where it ran, else the eager one (eager: the solver "
            "step by step; captured: a round's local steps replayed as CUDA graphs, "
            "capture=auto). "
            "Step bound: one SGD step of one model on every client's minibatch at once "
            "(scripts/gpu_cnn_rate.py's). FLOP bound: train FLOPs per sample (convolutions and "
            "matrix products, forward + backward) × samples per update ÷ the float32 peak.",
            "",
            "| model | clients | fedexp | plain loop | fedexp / plain | step bound | of it | "
            "FLOP bound | of it | peak GPU MiB | eager | captured | captured / eager |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            *([""] + errors if errors else []),
        ]
    sy = steps.get("syncs", {})
    if any(k in sy for k in ("cnn", "lr")):
        lines += ["", "## Host synchronisations in a round", ""]
        for w in ("cnn", "lr"):
            row = sy.get(w, {})
            counts = ", ".join(
                f"{n} clients: {v.get('syncs')} ({v.get('ops')} ops, {v.get('host_reads')} reads)"
                for n, v in row.items()
                if isinstance(v, dict)
            )
            lines.append(f"- {w}: {counts}; per client {_f(row.get('per_client'), '.2f')}")
            for n, v in row.items():
                if isinstance(v, dict) and v.get("sites"):
                    top = "; ".join(f"{k} ×{c}" for k, c in list(v["sites"].items())[:5])
                    lines.append(f"  - at {n} clients: {top}")
        dr = sy.get("draws")
        if dr:
            ms, sc = dr.get("round_ms", {}), dr.get("syncs", {})
            lines.append(
                f"- pass draws, LR: host kernel {_f(ms.get('host'), '.2f')} ms a round "
                f"({sc.get('host')} syncs), tensor path {_f(ms.get('tensor'), '.2f')} ms "
                f"({sc.get('tensor')} syncs): tensor / host {_f(dr.get('tensor_over_host'), '.2f')}"
            )
        cs = sy.get("census") or {}
        if cs:
            lines.append(
                "- syncs by case at 10 clients, training round / evaluation (the CPU's census "
                "reads in brackets): "
                + "; ".join(
                    f"{k} {v.get('train')}/{v.get('eval')} ({v.get('cpu_reads')})"
                    for k, v in cs.items()
                )
            )
    ct = steps.get("cuda_tests", {})
    if ct.get("counts") is not None:
        failed = [k for k, v in ct.get("tests", {}).items() if v in ("failed", "error")]
        lines += [
            "",
            f"## CUDA tests: {ct['counts']} (exit {ct.get('exit_code')})",
            *(f"- failed: {k}" for k in failed),
        ]
    g = steps.get("golden", {})
    if g.get("cases"):
        lines += [
            "",
            f"## Golden cases on `{g.get('device')}` against the CPU recording "
            f"(rel. {g.get('rtol')}, abs. {g.get('atol')}; TF32 off)",
            "",
        ]
        for name, c in g["cases"].items():
            if "ok" not in c:
                lines.append(f"- {name}: {c.get('status')}")
                continue
            lines.append(
                f"- {name}: {'within' if c['ok'] else 'OUTSIDE'} (worst {c['worst_ratio']:.3g} "
                f"of the tolerance, at {c['worst'] or '–'}; largest state gap "
                f"{c['max_abs_gap']:.2e})"
                + (f"; {'; '.join(c['problems'][:3])}" if c.get("problems") else "")
            )
    p = steps.get("profile", {})
    if p.get("top"):
        lines += [
            "",
            f"## One CNN round profiled ({p.get('clients')} clients)",
            "",
            f"{p.get('kernels')} kernels ({_f(p.get('kernels_per_client'), '.1f')} a client), "
            f"round {_f(p.get('round_s', 0) * 1e3, '.1f')} ms, device busy "
            f"{_f(p.get('device_busy_fraction'), '.1%')}; the top kernels (CPU: operators; "
            "kernels.txt has the profiler's tables):",
            "",
            *(
                f"- {e['name']}: {e['calls']} calls, "
                + (f"{e['device_ms']:.2f} ms" if "device_ms" in e else f"{e['cpu_ms']:.2f} ms CPU")
                for e in p["top"][:8]
            ),
        ]
    cg = steps.get("conv_gemm", {})
    if cg.get("cells"):
        lines += [
            "",
            "## Convolutions as matrix products (`conv_gemm`) against vmap's grouped ones",
            "",
            f"CNN, 10 clients, two rounds: server states {_f(cg.get('cnn_state_gap'), '.2e')} "
            "apart (relative to the largest entry; float32, TF32 off).",
            "",
            "| model | clients | grouped | products | ratio | peak MiB grouped | products |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {c['model']} | {c['clients']} | {_f(c.get('grouped'))} | "
                f"{_f(c.get('gemm'))} | {_f(c.get('ratio'), '.2f')}x | "
                f"{_f(c.get('grouped_peak_mib'))} | {_f(c.get('gemm_peak_mib'))} |"
                + (f" {c['error'][:80]}" if c.get("error") else "")
                for c in cg["cells"].values()
            ),
        ]
    sw = steps.get("sweep", {})
    if sw.get("device"):
        lines += ["", f"## Sweep (pfednet_tables-style, {sw.get('rounds')} rounds a job)", ""]
        for key in ("device", "stacked", "cpu"):
            row = sw.get(key)
            if isinstance(row, dict):
                lines.append(
                    f"- {row['device']}, {row.get('launcher', 'basic')} launcher, "
                    f"{row.get('seeds', 1)} seed(s): {row['done']} of "
                    f"{row.get('total', len(row['algorithms']))} jobs, "
                    f"{_f(row.get('s_per_job'), '.2f')} s a job, {row['wall_s']:.1f} s in all "
                    f"(exit {row.get('exit_code')})"
                )
    return "\n".join(lines) + "\n"


# ====================================================================== command line
def main() -> int:
    """Parse the arguments; the orchestrator, or (``--child``) the steps' process."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the rehearsal on this machine")
    p.add_argument("--smallest", action="store_true", help="the rehearsal's smallest form")
    p.add_argument("--only", default="", help="comma-separated steps (default: all)")
    p.add_argument("--budget", type=float, default=0, help="total seconds (default: the mode's)")
    p.add_argument("--out", default="", help="output folder (default: $OUT, else a temp one)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadlines", default="", help=argparse.SUPPRESS)
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    _import_paths()
    if args.child:
        deadlines = [float(d) for d in args.deadlines.split(",")]
        run_child(args.child.split(","), args.mode, deadlines, Path(args.out), Path(args.work))
        return 0
    mode = "smallest" if args.smallest else "cpu" if args.cpu else "gpu"
    steps = [s.strip() for s in args.only.split(",") if s.strip()] or list(STEPS)
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        p.error(f"unknown steps {unknown}; the steps are {', '.join(STEPS)}")
    steps = [s for s in STEPS if s in steps]
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="fedexp-check-"))
    out.mkdir(parents=True, exist_ok=True)
    check = Check(mode, steps, args.budget or SIZES[mode].total_s, out)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the summary still gets written
    return check.run()


if __name__ == "__main__":
    sys.exit(main())
