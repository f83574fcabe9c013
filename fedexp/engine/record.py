"""The run's record: every round's metrics, kept, logged to the tracker and checkpointed.

A fresh run starts with an empty record; a resumed one takes its checkpoint's over, with the
engine set to the checkpoint's round (:func:`resume`), and replays into the tracker what it
lacks (:meth:`RunRecord.open`). Each round :meth:`RunRecord.record` keeps and logs the round's
metrics, :meth:`RunRecord.evaluate` the evaluated clients' rows, and
:meth:`RunRecord.checkpoint` saves the engine's state with the record. The round loop that
drives it: :func:`fedexp.engine.runner.run`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from omegaconf import OmegaConf

from fedexp.engine.files import checkpoint
from fedexp.engine.files.resume import _change_tags
from fedexp.engine.files.resume import _check_resume
from fedexp.engine.files.resume import _resume_changes
from fedexp.engine.files.resume import flatten_config
from fedexp.engine.health import _healthy
from fedexp.engine.round.engine import Engine
from fedexp.engine.round.ledger import ByteLedger
from fedexp.errors import CheckpointError
from fedexp.tracking.base import Tracker
from fedexp.tracking.provenance import run_tags

log = logging.getLogger("fedexp")

#: Keys one of which every logged step holds: round 0 always evaluates (``time/eval_s``), every
#: training round is timed (``time/round_s``). A resumed run asks the tracker for their last
#: step to know what it already holds (``round`` itself is the step, never a metric).
_STEP_KEYS = ("time/round_s", "time/eval_s")

#: What a run's checkpoint must hold to be resumed from.
_RESUME_KEYS = ("round", "config", "ledger", "run_id", "history")


def loggable(row: dict[str, float], previous: dict[str, float] | None) -> dict[str, float]:
    """What of a round's metrics goes to the tracker: everything but ``round`` (the step).

    Every round's byte counts too, constant ones included (a dense run's ``bytes/up`` is the
    same every round): logged only when they changed, MLflow drew them as single dots. A pure
    function of the round's row, so a resumed run logs what an uninterrupted one does.

    Args:
        row: the round's metrics (as kept in the history and in rounds.csv).
        previous: the previous round's row (None for the first); not needed any more, kept
            for the callers.
    """
    del previous  # every round is logged whole
    return {k: v for k, v in row.items() if k != "round"}


def _last_logged(tracker: Tracker) -> int | None:
    """The last step the tracker holds (see :data:`_STEP_KEYS`); None if none."""
    steps = [s for s in (tracker.last_step(k) for k in _STEP_KEYS) if s is not None]
    return max(steps, default=None)


@dataclass
class Past:
    """What a run starts from: its checkpoint's record when resumed, else nothing.

    Attributes:
        ckpt_dir: where the run's checkpoints go (a resumed run's: its checkpoint's folder).
        run_id: the tracker's run to reopen; None for a fresh run.
        history: every round's metrics so far.
        client_history: every evaluated client's metrics so far, a row each.
        changes: the settings changed on resume, every resume's so far.
    """

    ckpt_dir: Path
    run_id: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    client_history: list[dict[str, float]] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)


def resume(cfg: DictConfig, engine: Engine, out_dir: Path) -> Past:
    """Set the engine to ``cfg.resume``'s checkpoint; its record (a fresh run's: empty).

    Raises:
        CheckpointError: the checkpoint is unreadable, unsealed (without ``resume_unsealed``)
            or lacks what a resume reads.
        ConfigError: a setting changed that may not change on resume.
    """
    if not cfg.resume:
        return Past(out_dir / "checkpoints")
    unsealed = bool(cfg.get("resume_unsealed", False))
    tree, meta = checkpoint.load(cfg.resume, engine.ctx.device, allow_unsealed=unsealed)
    missing = [k for k in _RESUME_KEYS if k not in meta]
    if missing:
        raise CheckpointError(
            f"resume={cfg.resume}: the checkpoint's metadata lacks {', '.join(missing)} "
            "(not written by a fedexp run); resume from a run's checkpoints folder"
        )
    _check_resume(cfg, meta["config"])
    engine.load_state_tree(tree, meta["round"], ByteLedger.from_meta(meta["ledger"]))
    new = _resume_changes(cfg, meta["config"], meta["round"])
    if new:
        said = ", ".join(f"{c['key']} {c['from']} -> {c['to']}" for c in new)
        log.info("resuming after round %d with changed settings: %s", meta["round"], said)
    path = Path(cfg.resume)
    return Past(
        ckpt_dir=path if path.is_dir() else path.parent,
        run_id=meta["run_id"],
        history=meta["history"],
        client_history=meta.get("client_history", []),
        changes=[*meta.get("changes", []), *new],
    )


def _tags(
    cfg: DictConfig, engine: Engine, tags: dict[str, str] | None, changes: list[dict[str, Any]]
) -> dict[str, str]:
    """The tracker's tags: provenance, the caller's, the settings changed on resume, DP's."""
    out = {**run_tags(engine.ctx.device), **(tags or {}), **_change_tags(changes)}
    if cfg.resume:  # (a rescue's record names it: fedexp.tracking.mlflow_tracker)
        out["fedexp.resumed_after_round"] = str(engine.round)
    if engine.privacy is not None:
        out["fedexp.privacy"] = engine.privacy.describe()
        log.info("%s", out["fedexp.privacy"])
    return out


class RunRecord:
    """The run's rounds: kept (:attr:`history`), logged to the tracker, checkpointed.

    Every process keeps the record (the ranks after 0 log to a null tracker); rank 0 (or the
    only process) alone writes the checkpoints.

    Attributes:
        history: every round's metrics, round 0's evaluation first.
        client_history: every evaluated client's metrics, a row each (none past
            ``client_table_limit`` clients).
        per_client: every client's metrics at the last evaluation, when it was of them all
            (else empty).
        run_id: the tracker's run.
        leader: whether this process writes the checkpoints and the run's files.
    """

    def __init__(
        self, cfg: DictConfig, engine: Engine, tracker: Tracker, past: Past, run_id: str
    ) -> None:
        self.cfg, self.engine, self.tracker, self.run_id = cfg, engine, tracker, run_id
        self.history, self.client_history = past.history, past.client_history
        self.per_client: list[dict[str, float]] = []
        self.leader = engine.ranks is None or engine.ranks.leader
        self._past = past
        self._logged: int | None = None  # resumed: the last round the tracker holds already
        self._config_yaml = OmegaConf.to_yaml(cfg, resolve=True)

    @classmethod
    def start(
        cls,
        cfg: DictConfig,
        engine: Engine,
        tracker: Tracker,
        past: Past,
        run_name: str | None,
        tags: dict[str, str] | None,
    ) -> RunRecord:
        """Open the tracker's run (``past``'s again on resume) with the config and the tags."""
        name = run_name or f"{type(engine.algorithm).__name__}-seed{cfg.seed}"
        tags = _tags(cfg, engine, tags, past.changes)
        run_id = tracker.start(name, flatten_config(cfg), tags, past.run_id)
        return cls(cfg, engine, tracker, past, run_id)

    def open(self, dataset: Any) -> None:
        """Log the data set and, in a resumed run, the rounds the tracker lacks.

        Args:
            dataset: rank 0's description of the data set; None in the other processes.
        """
        if dataset is not None:  # rank 0's: once, a resumed run that holds it adds nothing
            self.tracker.log_dataset(dataset)
        if not self._past.run_id:
            return
        # The tracker may differ from the first run's (README: it may change on resume): a
        # run it does not hold comes back new, and rounds logged while another tracker was
        # used are missing; replay the checkpoint's history into it up to its round.
        logged = _last_logged(self.tracker)
        for i, row in enumerate(self.history):
            if logged is None or row["round"] > logged:
                previous = self.history[i - 1] if i else None
                self.tracker.log_metrics(loggable(row, previous), int(row["round"]))
        self._logged = _last_logged(self.tracker)

    def record(self, metrics: dict[str, float]) -> None:
        """Keep a round's metrics, with the mean round time so far, and log those not logged."""
        if "time/round_s" in metrics:  # the mean time a round so far (pFedSOP's Table II)
            times = [h["time/round_s"] for h in self.history if "time/round_s" in h]
            times.append(metrics["time/round_s"])
            metrics["time/round_mean_s"] = sum(times) / len(times)
        step = int(metrics["round"])
        if self._logged is None or step > self._logged:
            previous = self.history[-1] if self.history else None
            self.tracker.log_metrics(loggable(metrics, previous), step)
        self.history.append(metrics)

    def evaluate(self, t: int, clients: list[int] | None = None) -> dict[str, float]:
        """Evaluate, time it, and keep every client's metrics of round ``t``.

        Args:
            t: the round.
            clients: whom to evaluate; None: every client (then also :attr:`per_client`).

        Returns:
            The evaluation's aggregates, with its time (``time/eval_s``).
        """
        engine = self.engine
        started = time.perf_counter()
        agg, rows = engine.evaluate(clients)
        agg["time/eval_s"] = time.perf_counter() - started
        who = range(len(engine.clients)) if clients is None else clients
        if len(engine.clients) <= self.cfg.get("client_table_limit", 10000):
            for n, row in zip(who, rows, strict=True):
                self.client_history.append({"round": float(t), "client": float(n), **row})
        self.per_client = rows if clients is None else []
        return agg

    def checkpoint(self, t: int) -> None:
        """Save the engine's state and the record after round ``t`` where a checkpoint is due.

        Due every ``checkpoint_every`` rounds (0: never) and after the last round. Over
        several processes the state is gathered from every rank (a collective) and rank 0
        writes it. A healthy round's checkpoint is the folder's good one too
        (:func:`_healthy`).
        """
        cfg, engine, ckpt_dir = self.cfg, self.engine, self._past.ckpt_dir
        every = cfg.checkpoint_every
        if not (every and (t % every == 0 or t == cfg.rounds)):
            return
        healthy = _healthy(cfg, self.history, self.client_history)
        meta = {
            "round": t,
            "run_id": self.run_id,
            "ledger": engine.ledger.to_meta(),
            "history": self.history,
            "client_history": self.client_history,
            "config": self._config_yaml,  # a later resume compares with these settings
            "changes": self._past.changes,
            # the folder's good checkpoint, a rescue's start: this one if healthy
            "good_round": t if healthy else checkpoint.good_round(ckpt_dir, t),
        }
        tree = engine.state_tree()  # (over several ranks: rank 0's, the others None)
        if self.leader:
            checkpoint.save(ckpt_dir, tree, meta)
        if healthy and self.leader:  # good.safetensors: a hard link, not a second write
            checkpoint.promote(ckpt_dir)
