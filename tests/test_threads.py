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
from fedexp.engine.threads import LoadFollower
from fedexp.engine.threads import busy_note
from fedexp.engine.threads import choose_threads
from fedexp.engine.threads import fit_to_load
from fedexp.engine.threads import launcher_jobs


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

    from fedexp.cli.job import _set_threads

    monkeypatch.setattr(th, "available_cores", lambda: 2)
    monkeypatch.setattr(th, "load_average", lambda: 0.0)
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


@pytest.mark.parametrize(
    ("share", "cores", "others", "threads"),
    [
        (2, 2, None, 2),  # no load average: the cores' share
        (2, 2, 0.0, 2),
        (2, 2, 0.49, 2),
        (2, 2, 0.5, 1),  # half a core busy: OpenMP's teams would wait on it
        (2, 2, 4.1, 1),  # never 0
        (16, 16, 3.2, 13),
        (4, 16, 3.2, 4),  # never above the share
        (2, 2, -1.5, 2),  # (the run's own threads idle part of the time)
    ],
)
def test_the_load_takes_its_cores_from_a_single_processs_share(share, cores, others, threads):
    assert fit_to_load(share, cores, others) == threads


def _single(monkeypatch, load: float | None, cores: int = 2) -> None:
    monkeypatch.setattr(th, "available_cores", lambda: cores)
    monkeypatch.setattr(th, "machine_cores", lambda: cores)
    monkeypatch.setattr(th, "load_average", lambda: load)


def test_a_single_run_on_a_busy_machine_takes_one_thread_and_says_so(monkeypatch, caplog):
    """Issue 70, item 1: the line said the machine was busy and that threads=1 would help,
    then kept 2 threads (``make demo-imaging``: no round in 11 minutes). It now acts on the
    load it read, in the same one line; ``threads=N`` still decides."""
    from hydra.types import RunMode

    from fedexp.cli.job import _set_threads

    hc = OmegaConf.create({"mode": RunMode.RUN, "launcher": {"n_jobs": None}})
    _single(monkeypatch, 4.1)
    cfg = OmegaConf.create({"threads": 0, "distributed": {"nproc": 1}})
    with caplog.at_level(logging.INFO, logger="fedexp"):
        _set_threads(cfg, hc)
    assert caplog.messages == [
        "threads: 1 (2 cores, one process; load 4.1 on 2 cores: 1 thread, rechecked between rounds)"
    ]
    assert torch.get_num_threads() == 1 and cfg.threads == 1
    assert th.round_callbacks()[0].threads == 1  # the rounds go on following it
    caplog.clear()
    cfg = OmegaConf.create({"threads": 2, "distributed": {"nproc": 1}})  # set: it decides
    with caplog.at_level(logging.INFO, logger="fedexp"):
        _set_threads(cfg, hc)
    assert torch.get_num_threads() == 2 and cfg.threads == 2 and th.round_callbacks() == []
    assert caplog.messages[0].startswith("threads: 2 (threads=2; 2 cores, one process; the ")
    caplog.clear()
    _single(monkeypatch, 0.2)  # an idle machine: the cores, as before
    cfg = OmegaConf.create({"threads": 0, "distributed": {"nproc": 1}})
    with caplog.at_level(logging.INFO, logger="fedexp"):
        _set_threads(cfg, hc)
    assert caplog.messages == ["threads: 2 (2 cores, one process)"] and cfg.threads == 2
    # the load average counts the whole machine: a share of it (affinity, a container's
    # quota) does not follow it, and ranks keep their share; both name the load
    _single(monkeypatch, 4.1)
    monkeypatch.setattr(th, "machine_cores", lambda: 64)
    cfg = OmegaConf.create({"threads": 0, "distributed": {"nproc": 1}})
    assert th.apply_threads(cfg).threads == 2 and th.round_callbacks() == []
    _single(monkeypatch, 9.0, cores=4)
    cfg = OmegaConf.create({"threads": 0, "distributed": {"nproc": 2}})
    choice = th.apply_threads(cfg)
    assert choice.threads == 2 and "the machine is busy (load 9.0 on 4 cores)" in choice.reason


def test_between_rounds_the_threads_follow_the_load_at_most_once_a_minute(caplog):
    """The follower: the load less the run's own threads; a change waits a minute (the load
    average's time constant) after the last; a raise needs a margin. Load and clock are
    injected: the test does not read the machine's."""
    loads, now = [4.0], [0.0]
    follower = LoadFollower(2, 2, lambda: loads[0], clock=lambda: now[0])
    torch.set_num_threads(2)

    def round_(t: int, load: float, at: float) -> int:
        loads[0], now[0] = load, at
        follower(None, {"round": float(t)})
        return torch.get_num_threads()

    with caplog.at_level(logging.INFO, logger="fedexp"):
        assert round_(1, 4.0, 30.0) == 2  # within a minute of the start: not yet
        assert round_(2, 4.0, 61.0) == 1  # others fill a core (4.0 less its own 2)
        assert round_(3, 0.0, 90.0) == 1  # they stopped, but the last change is too recent
        assert round_(4, 1.3, 130.0) == 1  # 0.3 besides its own 1: within the margin
        assert round_(5, 1.1, 200.0) == 2  # 0.1 besides its own: the cores again
        assert round_(6, 2.4, 230.0) == 2
    assert caplog.messages == [
        "threads: 2 -> 1 after round 2 (load 4.0 on 2 cores)",
        "threads: 1 -> 2 after round 5 (load 1.1 on 2 cores)",
    ]
    follower.read_load = lambda: None  # no load average (not Linux): left as it is
    now[0] = 400.0
    follower(None, {"round": 7.0})
    assert torch.get_num_threads() == 2


def test_a_run_calls_the_follower_between_its_rounds(small_cfg, monkeypatch, caplog):
    """The CLI gives ``run`` the follower as a round callback: the threads change between
    rounds of a real run (the injected load rises after the start), never inside one."""
    from fedexp.engine.runner import run

    _single(monkeypatch, 0.0)
    cfg = small_cfg("rounds=3", "tracker=none", "threads=0")
    th.apply_threads(cfg)
    (follower,) = th.round_callbacks()
    follower.read_load, follower.clock = (lambda: 5.0), (lambda: 1e9)
    seen = []
    with caplog.at_level(logging.INFO, logger="fedexp"):
        run(
            cfg,
            callbacks=[*th.round_callbacks(), lambda e, m: seen.append(torch.get_num_threads())],
        )
    assert (
        seen == [1, 1, 1]
        and caplog.messages.count("threads: 2 -> 1 after round 1 (load 5.0 on 2 cores)") == 1
    )
