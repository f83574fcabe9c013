"""Fast to start (issue 12): the help paths import nothing heavy. No timing asserts.

The figures are in docs/benchmarks.md ("Start-up", ``scripts/bench_startup.py``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Packages the help paths must not import (``fedexp --help`` not even Hydra).
HEAVY = ("torch", "mlflow", "pandas", "numpy", "sklearn", "matplotlib", "monai", "numba")


def _modules_after(args: list[str]) -> tuple[int, list[str], str]:
    """Exit code, heavy packages in ``sys.modules`` and stdout of ``fedexp <args>`` in a child."""
    code = textwrap.dedent(
        f"""
        import sys
        from fedexp.cli import main
        sys.argv = ["fedexp", *{args!r}]
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        loaded = sorted({{m.split(".")[0] for m in sys.modules}})
        print("RESULT", code, *loaded)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
    exit_code, *loaded = result.split()[1:]
    return int(exit_code), loaded, proc.stdout


@pytest.mark.parametrize(
    ("args", "usage"),
    [(["--help"], "fedexp run"), (["report", "--help"], "usage: fedexp report")],
    ids=["fedexp --help", "fedexp report --help"],
)
def test_help_imports_nothing_heavy(args, usage):
    exit_code, loaded, out = _modules_after(args)
    assert exit_code == 0
    assert usage in out
    heavy = sorted(set(loaded) & set(HEAVY))
    assert heavy == [], f"fedexp {' '.join(args)} imported {heavy}"


def test_top_level_help_imports_no_hydra():
    """``fedexp --help`` prints the module docstring: not even Hydra/OmegaConf is needed."""
    _, loaded, _ = _modules_after(["--help"])
    assert "hydra" not in loaded and "omegaconf" not in loaded


def test_module_runs_as_a_script():
    """``python -m fedexp --help`` (the importtime check of the issue) prints the usage."""
    proc = subprocess.run(
        [sys.executable, "-m", "fedexp", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fedexp run" in proc.stdout


@pytest.mark.parametrize("ending", ["returns", "exits"])
def test_the_program_freezes_its_objects_before_python_exits(monkeypatch, ending):
    """``fedexp`` (:func:`fedexp.cli.entry`) ends with :func:`gc.freeze`, whether its command
    returns or exits (a sweep exits 1 when a job failed): the interpreter's finalisation then
    skips the garbage collections over torch's objects (half a second of every exit)."""
    import gc

    from fedexp import cli

    calls: list[str] = []

    def command() -> None:
        calls.append("main")
        if ending == "exits":
            sys.exit(1)

    monkeypatch.setattr(cli, "main", command)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    if ending == "exits":
        with pytest.raises(SystemExit):
            cli.entry()
    else:
        cli.entry()
    assert calls == ["main", "freeze"]
    scripts = (ROOT / "pyproject.toml").read_text()
    assert 'fedexp = "fedexp.cli:entry"' in scripts  # the console script
    assert "entry()" in (ROOT / "fedexp" / "__main__.py").read_text()  # python -m fedexp


def test_omegaconf_attribute_still_resolves():
    """``fedexp.cli.OmegaConf`` (formerly imported at module level) resolves on first use."""
    from omegaconf import OmegaConf

    import fedexp.cli

    assert fedexp.cli.OmegaConf is OmegaConf


def test_the_default_run_imports_no_compiler_and_no_scikit_learn(tmp_path):
    """What the default run (FedAvg, logistic regression, breast cancer) must not pay for at
    its start (docs/benchmarks.md, "Start-up"): ``torch._dynamo``, which functorch's gradient
    transform imported at the first local step (1.2 s; the solver now takes the cohort's
    gradients with one plain backward pass, ``steps._vmapped``), numba (0.6 s to import and
    load the pass kernel, which a short run's draws do not repay: ``rng._compiled``), and
    scikit-learn (1.5 s; the default data set is read from the CSV it ships)."""
    code = textwrap.dedent(
        f"""
        import sys
        from fedexp.cli import main
        sys.argv = ["fedexp", "run", "rounds=1", "tracker=none", "figures=false",
                    "hydra.run.dir={tmp_path / "run"}"]
        try:
            main()
        except SystemExit as exc:
            assert not exc.code, exc.code
        heavy = ("torch._dynamo", "sklearn", "numba")
        print("LOADED", *sorted(m for m in sys.modules if m.startswith(heavy)))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LOADED"))
    assert line.split()[1:] == [], line
    assert (tmp_path / "run" / "rounds.csv").exists()
