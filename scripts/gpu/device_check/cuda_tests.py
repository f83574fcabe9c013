"""Step ``cuda_tests``: every test that needs CUDA (``cuda_select.py``), JUnit outcomes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from .paths import HERE
from .paths import ROOT
from .paths import _pythonpath
from .step import Step
from .step import _tail


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
