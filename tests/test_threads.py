"""A run's torch threads: the cores over the processes sharing them, ``threads=N`` overrides,
one log line (fedexp/engine/threads.py; issue 43: ``make demo-imaging`` set no thread count).

That ``fedexp run`` logs the line at its start, applies the choice and records it in the
run's config.yaml: tests/test_resume_folder.py (its two runs, one test for both issues).
"""

from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from fedexp.engine import threads as th
from fedexp.engine.threads import busy_note, choose_threads, launcher_jobs


@pytest.mark.parametrize(
    ("cores", "jobs", "ranks", "override", "threads", "reason"),
    [
        (2, 1, 1, 0, 2, "2 cores, one process"),
        (2, 2, 1, 0, 1, "2 cores shared by 2 sweep jobs"),
        (2, 1, 2, 0, 1, "2 cores shared by 2 ranks"),
        (16, 2, 4, 0, 2, "16 cores shared by 2 sweep jobs × 4 ranks"),
        (2, 1, 4, 0, 1, "2 cores shared by 4 ranks"),  # never 0
        (1, 1, 1, 0, 1, "1 core, one process"),
        (8, 3, 1, 0, 2, "8 cores shared by 3 sweep jobs"),
        (2, 2, 1, 3, 3, "threads=3; 2 cores shared by 2 sweep jobs"),
        (0, 0, 0, 0, 1, "1 core, one process"),
    ],
)
def test_the_choice_divides_the_cores_among_the_processes(
    cores, jobs, ranks, override, threads, reason
):
    choice = choose_threads(cores, jobs, ranks, override)
    assert (choice.threads, choice.reason) == (threads, reason)
    assert choice.line() == f"threads: {threads} ({reason})"


def test_the_launcher_jobs_joblibs_negative_counts_and_the_cgroup_quota():
    assert [launcher_jobs(n, 8) for n in (None, 0, 1, 2, -1, -2)] == [1, 1, 1, 2, 8, 7]
    assert launcher_jobs(-4, 2) == 1
    assert th._quota_cores("max 100000") is None
    assert th._quota_cores("150000 100000\n") == 2
    assert th._quota_cores("junk") is None
    assert 1 <= th.available_cores() <= (torch.get_num_threads() + 64)


def test_a_busy_machine_is_named_in_the_line_without_changing_the_choice():
    assert busy_note(None, 2, 2) == busy_note(1.0, 2, 2) == busy_note(9.0, 2, 1) == ""
    assert "load 4.1 on 2 cores): threads=1" in busy_note(4.1, 2, 2)


def test_a_parallel_sweep_job_takes_its_share_and_says_so(monkeypatch, caplog):
    """The CLI's glue: hydra/launcher=parallel (n_jobs=2) on 2 cores gives each job one
    thread, recorded in the job's config (so ranks it starts take it too)."""
    from hydra.types import RunMode

    from fedexp.cli import _set_threads

    monkeypatch.setattr(th, "available_cores", lambda: 2)
    monkeypatch.setattr(th.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    cfg = OmegaConf.create({"threads": 0, "distributed": {"nproc": 1}})
    hc = OmegaConf.create({"mode": RunMode.MULTIRUN, "launcher": {"n_jobs": 2}})
    with caplog.at_level(logging.INFO, logger="fedexp"):
        _set_threads(cfg, hc)
    assert caplog.messages == ["threads: 1 (2 cores shared by 2 sweep jobs)"]
    assert torch.get_num_threads() == 1 and cfg.threads == 1
    cfg = OmegaConf.create({"threads": 0, "distributed": {"nproc": 2}})
    hc = OmegaConf.create({"mode": RunMode.RUN, "launcher": {"n_jobs": 2}})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedexp"):
        _set_threads(cfg, hc)
    assert caplog.messages == ["threads: 1 (2 cores shared by 2 ranks)"]


def test_the_runner_applies_a_set_thread_count(small_cfg):
    """``run`` applies ``cfg.threads`` itself: a rank a ``distributed.nproc`` run starts
    gets the CLI's choice through its config (it used to keep torch's default)."""
    from fedexp.engine.runner import run

    torch.set_num_threads(2)
    run(small_cfg("rounds=1", "tracker=none", "threads=1"))
    assert torch.get_num_threads() == 1
