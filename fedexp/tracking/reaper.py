"""Ending the MLflow runs that their process left RUNNING (SIGKILL, the OOM killer).

Every run is tagged with its host, pid and the pid's start time (``fedexp.host``,
``fedexp.pid``, ``fedexp.pid_started``); every run that starts or resumes ends KILLED the
RUNNING runs of the whole store (every experiment) left by a process of this host that is gone
(no such pid, a zombie, or the pid reused by a later process), tags them ``fedexp.reaped`` and
says why in the run's description. :class:`Reaper` is the part of
:class:`fedexp.tracking.mlflow_tracker.MLflowTracker` that does it.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from datetime import UTC
from datetime import datetime
from typing import Any

from mlflow.entities import RunTag

log = logging.getLogger("fedexp")

#: Run tags naming the machine and the process that run it (to find runs left by SIGKILL).
HOST_TAG, PID_TAG, REAPED_TAG = "fedexp.host", "fedexp.pid", "fedexp.reaped"
#: Run tag: when the process of ``fedexp.pid`` started (seconds since the epoch, psutil's
#: ``create_time``), which tells it from a later process that got the same pid.
STARTED_TAG = "fedexp.pid_started"
#: MLflow's run description (shown on the run's page).
NOTE_TAG = "mlflow.note.content"
#: At most this many RUNNING runs are examined when a run starts.
_MAX_REAP = 500
#: Experiments searched for runs to reap: this many a query, the newest this many in all.
_REAP_EXPERIMENTS_PER_SEARCH, _MAX_REAP_EXPERIMENTS = 500, 5000
#: Seconds two start times of one pid may differ and still be one process (clock-tick rounding
#: and the jitter of Linux's boot time); a pid reused that soon would escape the reaper.
_START_TOLERANCE_S = 2.0
#: The most characters MLflow keeps of a tag's value.
_MAX_TAG_CHARS = 8000


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts; unsure: alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user
        return True
    return True


def _started(pid: int) -> str:
    """When process ``pid`` started, for :data:`STARTED_TAG`; "unknown" if psutil cannot tell."""
    try:
        import psutil

        return f"{psutil.Process(pid).create_time():.2f}"
    except Exception:  # noqa: BLE001 - no such process, no access, no psutil: unknown
        return "unknown"


def _gone(pid: int, started: str | None) -> str | None:
    """How the process that tagged a run with ``pid`` and ``started`` is gone from this host.

    Gone: no process ``pid`` exists, or it is a zombie (killed, not yet waited for), or it
    started at another time than ``started`` says (the pid was reused by a later process).
    A run without a start time (an older fedexp's), or one psutil cannot check, is judged by
    the pid alone; unsure means not gone.

    Returns:
        None if the process may still be there, else how it is gone, in words
        ("no longer exists", with the detail for a zombie or a reused pid).
    """
    if not _alive(pid):
        return "no longer exists"
    try:
        import psutil

        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "no longer exists (a zombie: killed, not yet waited for)"
        if started is None or started == "unknown":
            return None
        now = proc.create_time()
        if abs(now - float(started)) <= _START_TOLERANCE_S:
            return None
    except Exception:  # noqa: BLE001 - psutil cannot tell (access, a race): not gone
        return None
    later = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"no longer exists (its pid now names another process, started {later})"


class Reaper:
    """Reaping for a tracker with ``client``, ``uri``, ``run_id`` and a locked ``_call``."""

    client: Any
    uri: str
    run_id: str | None

    def _call(self, fn, *args, **kwargs):  # noqa: ANN001, ANN202 - the tracker's retry wrapper
        raise NotImplementedError

    def _experiment_batches(self, first: str | None) -> Iterator[list[str]]:
        """The store's active experiments' ids, newest first, a batch a search; ``first`` leads.

        At most :data:`_MAX_REAP_EXPERIMENTS` experiments (and ``first``, however old). A
        store that cannot list its experiments yields ``first`` alone.
        """
        token, listed = None, 0
        while True:
            try:
                page = self._call(
                    self.client.search_experiments,
                    max_results=_REAP_EXPERIMENTS_PER_SEARCH,
                    order_by=["creation_time DESC"],
                    page_token=token,
                )
            except Exception as exc:  # noqa: BLE001 - then at least the run's own experiment
                log.debug("could not list the experiments of %s: %s", self.uri, exc)
                if first is not None:
                    yield [first]
                return
            ids = [e.experiment_id for e in page]
            if first is not None:
                ids = [first, *(i for i in ids if i != first)]
                first = None
            if ids:
                yield ids
            listed += len(page)
            token = page.token
            if not token or listed >= _MAX_REAP_EXPERIMENTS:
                return

    def _reap(self, experiment_id: str | None = None) -> None:
        """End KILLED the store's RUNNING runs left by processes of this host that are gone.

        SIGKILL (``kill -9``, the OOM killer, a lost node) or power loss ends a process with
        its run still RUNNING, in whatever experiment. Every experiment of the store is
        searched (newest first, ``experiment_id`` first: one query for up to 500 experiments,
        at most ``_MAX_REAP`` runs examined) for RUNNING runs tagged with this host; one whose
        process is gone (:func:`_gone`: no such pid, a zombie, or the pid now names a process
        started at another time) is ended KILLED, tagged ``fedexp.reaped`` and given a
        description (``mlflow.note.content``) saying why, when, and which run found it.
        Runs of other hosts, runs without the tags and runs of live processes are left alone.
        Never raises (a debug line instead).
        """
        host = socket.gethostname()
        quoted = host.replace("'", "")  # hostnames hold no quotes; the check below is exact
        query = f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{quoted}'"
        runs: dict[str, Any] = {}
        try:
            for ids in self._experiment_batches(experiment_id):
                found = self._call(
                    self.client.search_runs,
                    ids,
                    filter_string=query,
                    max_results=_MAX_REAP - len(runs),
                )
                runs.update((r.info.run_id, r) for r in found)
                if len(runs) >= _MAX_REAP:
                    break
        except Exception as exc:  # noqa: BLE001 - reaping must never fail a run
            log.debug("could not look for runs left RUNNING by dead processes: %s", exc)
            return
        for run_id, other in runs.items():
            tags = other.data.tags
            pid = tags.get(PID_TAG, "")
            if run_id == self.run_id or tags.get(HOST_TAG) != host:
                continue
            gone = _gone(int(pid), tags.get(STARTED_TAG)) if pid.isdigit() and int(pid) else None
            if gone is None:
                continue
            why = f"process {pid} on {host} {gone}, found by run {self.run_id}"
            try:
                if self._call(self._end_orphan, run_id, tags, why, gone):
                    log.info("run %s: %s; ended KILLED", run_id, why)
            except Exception as exc:  # noqa: BLE001 - reaping must never fail a run
                log.debug("could not end run %s (%s): %s", run_id, why, exc)

    def _end_orphan(self, run_id: str, seen: dict[str, str], why: str, gone: str = "") -> bool:
        """End KILLED a run found orphaned, if it still is (one locked write); whether it was.

        A run made RUNNING again since the search (resumed, re-tagged by its new process) is
        left alone.
        """
        run = self.client.get_run(run_id)
        tags = run.data.tags
        same = all(tags.get(k) == seen.get(k) for k in (HOST_TAG, PID_TAG, STARTED_TAG))
        if run.info.status != "RUNNING" or not same:
            return False
        when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        detail = gone.partition(" (")[2].rstrip(")")
        note = (
            f"**Ended by fedexp, not by its own process.** Process {seen[PID_TAG]} on host "
            f"{seen[HOST_TAG]} ended without closing this run: it was killed before it could "
            "(SIGKILL, the OOM killer, a lost node or power loss). Marked KILLED at "
            f"{when} by run {self.run_id}, which found the process gone"
            + (f" ({detail})." if detail else ".")
        )
        before = tags.get(NOTE_TAG, "").strip()
        note = (f"{note}\n\n{before}" if before else note)[:_MAX_TAG_CHARS]
        self.client.set_terminated(run_id, "KILLED")
        self.client.log_batch(run_id, tags=[RunTag(REAPED_TAG, why), RunTag(NOTE_TAG, note)])
        return True
