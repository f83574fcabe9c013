"""Where figures are drawn (:mod:`fedexp.figures.drawer`): the run's thread or a helper process.

The helper draws the PNG bytes the thread draws; a dead helper leaves the figures to the
thread; only the ``fedexp`` program starts one, where a core is idle; a process whose
figures the helper draws never imports matplotlib or loads torch into the helper.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedexp.engine.threads import available_cores
from fedexp.engine.threads import choose_threads
from fedexp.figures import drawer
from fedexp.figures import plots


def _rounds(n: int) -> list[dict[str, float]]:
    return [
        {
            "round": float(t),
            "acc/mean": 0.5 + 0.01 * t,
            "acc/worst": 0.4,
            "train/train_loss": 1.0 / (1 + t),
            "bytes/up_cum": 100.0 * t,
        }
        for t in range(n)
    ]


def _draw_all(folder: Path) -> dict[str, bytes]:
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    models = torch.randn(6, 40, generator=gen)
    edges = torch.tensor([[0, 1], [1, 2], [3, 4]])
    rows = [
        {"round": float(t), "client": float(c), "acc": 0.5 + 0.02 * c * t}
        for t in range(4)
        for c in range(6)
    ]
    plots.plot_rounds(_rounds(8), folder / "curves.png")
    plots.plot_clients(rows, folder / "clients.png")
    plots.plot_client_models(models, folder / "pca.png", edges)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def helper():
    """A helper for this test alone (the suite's own figures stay in its thread)."""
    drawer.start_helper()
    try:
        yield drawer._helper
    finally:
        drawer.stop_helper()


def test_the_helper_draws_the_bytes_the_thread_draws(tmp_path, helper):
    assert helper is not None
    by_helper = _draw_all(tmp_path / "helper")
    drawer.stop_helper()
    by_thread = _draw_all(tmp_path / "thread")
    assert by_helper.keys() == {"clients.png", "curves.png", "pca.png"}
    assert by_helper == by_thread


def test_an_error_of_the_drawing_is_raised_in_the_run(tmp_path, helper):
    with pytest.raises(FileNotFoundError):
        plots.plot_rounds(_rounds(3), tmp_path / "no such folder" / "curves.png")
    assert drawer._helper is helper  # the helper still draws


def test_a_dead_helper_leaves_the_figures_to_the_thread(tmp_path, helper, caplog):
    helper.submit(int).result()  # started
    for process in list(helper._processes.values()):
        process.kill()
        process.join()
    with caplog.at_level(logging.WARNING, logger="fedexp.figures.drawer"):
        assert plots.plot_rounds(_rounds(3), tmp_path / "c.png") == tmp_path / "c.png"
    assert (tmp_path / "c.png").stat().st_size > 0
    assert drawer._helper is None and "helper process ended" in caplog.text


def test_figures_asked_together_are_drawn_without_a_wait_each(monkeypatch, tmp_path):
    """Inside ``together`` each figure is asked for at once; the block's end waits, aside."""
    import threading

    from fedexp.figures import canvas

    gate = threading.Event()
    drawn: list[str] = []

    def slow(name: str) -> str:
        gate.wait(30)
        drawn.append(name)
        return name

    monkeypatch.setattr(canvas, "slow", slow, raising=False)
    waits: list[int] = []

    class Aside:
        def __enter__(self):
            waits.append(len(drawn))  # nothing drawn yet: the block did not wait
            gate.set()

        def __exit__(self, *exc):
            waits.append(len(drawn))

    with drawer.together(aside=Aside) as results:
        assert drawer.draw("slow", "a") is None
        assert drawer.draw("slow", "b") is None
        assert results == []
    assert results == ["a", "b"] and drawn == ["a", "b"]
    assert waits == [0, 2]  # one wait, inside ``aside``, for every figure
    assert drawer.draw("slow", "c") == "c"  # outside the block: the result


def test_an_error_of_a_figure_asked_together_is_raised_at_the_end(tmp_path):
    with pytest.raises(FileNotFoundError):
        with drawer.together() as results:
            plots.plot_rounds(_rounds(3), tmp_path / "no such folder" / "curves.png")
            plots.plot_rounds(_rounds(3), tmp_path / "curves.png")
    assert results == []


def test_idle_cores_are_those_beyond_one_a_process():
    assert choose_threads(2).idle == 1  # a single run on two cores
    assert choose_threads(2, jobs=2).idle == 0  # two parallel jobs
    assert choose_threads(2, ranks=2).idle == 0  # two ranks
    assert choose_threads(16, jobs=3, ranks=2).idle == 10
    assert choose_threads(1).idle == 0
    assert choose_threads(2, override=4).idle == 1  # threads=N changes no process count


def test_only_the_program_allows_a_helper(monkeypatch):
    monkeypatch.delenv(drawer.HELPER_ENV, raising=False)
    assert not drawer.helper_allowed()  # a library user, a test
    drawer.allow_helper()
    assert drawer.helper_allowed() and os.environ[drawer.HELPER_ENV] == "1"
    monkeypatch.setenv(drawer.HELPER_ENV, "0")
    drawer.allow_helper()  # the user's "0" stands
    assert not drawer.helper_allowed()


def test_a_run_whose_figures_the_helper_draws_never_imports_matplotlib(tmp_path):
    """The program's single run on two cores: its figures by the helper, the same bytes as
    with ``FEDEXP_FIGURE_HELPER=0``; the run's own process imports no matplotlib."""
    if available_cores() < 2:
        pytest.skip("one core: no idle core, no helper")
    code = textwrap.dedent(
        """
        import sys
        from fedexp.cli import entry
        sys.argv = ["fedexp", "run", "rounds=2", "tracker=none", "output_dir=" + sys.argv[1]]
        try:
            entry()
        finally:
            print("MATPLOTLIB", "matplotlib" in sys.modules, file=sys.stderr)
        """
    )
    seen = {}
    for helper in ("1", "0"):
        env = {**os.environ, drawer.HELPER_ENV: helper, "PYTHONWARNINGS": "ignore"}
        env.pop("MLFLOW_TRACKING_URI", None)
        out = tmp_path / f"helper-{helper}"
        proc = subprocess.run(
            [sys.executable, "-c", code, str(out)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"MATPLOTLIB {helper == '0'}" in proc.stderr, proc.stderr[-3000:]
        seen[helper] = {p.name: p.read_bytes() for p in sorted(out.glob("*.png"))}
    assert len(seen["1"]) == 3 and seen["1"] == seen["0"]


@pytest.mark.parametrize(
    ("args", "env", "started"),
    [
        (["rounds=2"], {}, True),  # a single run: before Hydra composes and torch loads
        (["-m", "seed=0,1"], {}, False),  # a sweep's jobs start theirs where a core is idle
        (["rounds=2"], {"LOCAL_RANK": "0"}, False),  # a torchrun rank
        (["rounds=2"], {drawer.HELPER_ENV: "0"}, False),
    ],
    ids=["single-run", "sweep", "torchrun-rank", "turned-off"],
)
def test_a_single_run_starts_its_helper_before_anything_loads(monkeypatch, args, env, started):
    from fedexp import cli

    calls = []
    monkeypatch.setattr(drawer, "start_helper", lambda: calls.append(True))
    monkeypatch.setattr("fedexp.engine.threads.available_cores", lambda: 2)
    monkeypatch.setenv(drawer.HELPER_ENV, "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cli._early_helper(args)
    assert calls == ([True] if started else [])
