"""Build a run from its config and live its life: resume, rounds, tracking, checkpoints, files.

After the build the run's life goes in stages (:func:`_run`): resumed from its checkpoint or
fresh, its record opened in the tracker, the rounds, the files. The record (kept, logged,
checkpointed, taken over on resume): :mod:`fedexp.engine.record`; when a round blew up or is
sound: :mod:`fedexp.engine.health`; the run's settings compared on resume and recorded when
changed: :mod:`fedexp.engine.files.resume`; the files it leaves:
:mod:`fedexp.engine.files.outputs`.
"""

from __future__ import annotations

import logging
import shutil
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from omegaconf import OmegaConf

from fedexp import streams
from fedexp.algorithms.base import Algorithm
from fedexp.comm.channel import Channel
from fedexp.config.groups import check_channel_keys
from fedexp.config.instantiate import fresh_dir
from fedexp.config.instantiate import instantiate_checked
from fedexp.config.instantiate import resumed_run_dir
from fedexp.config.schema import validate
from fedexp.data.augment import NoAugmentation
from fedexp.data.dataset import ArrayDataset
from fedexp.data.federated import clients_for_batch
from fedexp.data.federated import federate
from fedexp.engine.clients.states import scratch_folder
from fedexp.engine.config_check import check_groups
from fedexp.engine.files.outputs import CLIENT_TABLE
from fedexp.engine.files.outputs import _table_rows
from fedexp.engine.files.outputs import _write_outputs
from fedexp.engine.files.progress import RoundProgress
from fedexp.engine.health import _check_blowup
from fedexp.engine.health import _healthy as _healthy  # (imported from here too)
from fedexp.engine.memory import keep_freed_memory
from fedexp.engine.memory import resolve_budget
from fedexp.engine.processes import launch
from fedexp.engine.processes.ranks import Ranks
from fedexp.engine.processes.shared_data import load_dataset
from fedexp.engine.record import RunRecord
from fedexp.engine.record import loggable as loggable  # (imported from here too)
from fedexp.engine.record import resume
from fedexp.engine.round import stacking
from fedexp.engine.round.engine import Engine
from fedexp.engine.round.engine import RoundCallback
from fedexp.engine.round.views import held_out
from fedexp.engine.solver.capture import solver_for
from fedexp.engine.solver.context import Context
from fedexp.engine.solver.server_optim import ServerOptimizer
from fedexp.engine.solver.server_optim import ServerSGD
from fedexp.errors import ConfigError
from fedexp.models.builder import build_model
from fedexp.models.flat import FlatModel
from fedexp.models.task import check_model_fits
from fedexp.models.task import task_for
from fedexp.privacy.uplink import PrivateUplink
from fedexp.system.settings import SystemModel
from fedexp.tracking.base import NullTracker
from fedexp.tracking.base import Tracker
from fedexp.tracking.dataset_input import describe_dataset

log = logging.getLogger("fedexp")


@dataclass
class RunResult:
    """What a finished run leaves: final aggregates, per-client table, where things are."""

    metrics: dict[str, float]
    per_client: list[dict[str, float]]
    run_id: str
    output_dir: Path
    tracker: Tracker


def resolve_device(name: str) -> torch.device:
    """The torch device of ``name`` ("auto": CUDA when available); unavailable ones fail."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r}: CUDA is not available on this machine")
    return dev


def build_channel(node: DictConfig, path: str) -> Channel:
    """A :class:`Channel` from a ``compressor.uplink``/``downlink`` node."""
    check_channel_keys(node, path)
    transforms = [
        instantiate_checked(t, f"{path}.transforms[{i}]")
        for i, t in enumerate(node.get("transforms") or [])
    ]
    ef = node.get("error_feedback", False)
    return Channel(instantiate_checked(node.codec, f"{path}.codec"), transforms, ef)


def _choice(node: DictConfig) -> str:
    """A group node's name for messages: its target's last part (``unet``, ``digits``)."""
    return str(node.get("_target_", "?")).rsplit(".", 1)[-1]


def build_engine(cfg: DictConfig) -> Engine:
    """Data, partition, model, algorithm and channels from the config."""
    return _build(cfg)[0]


def _build(cfg: DictConfig, ranks: Ranks | None = None) -> tuple[Engine, ArrayDataset]:
    """:func:`build_engine`, and the data set as loaded (before it is partitioned).

    ``ranks``: this process's place in a run over several (None: one process); its table and
    its clients' states hold its own clients only (``ranks.share``).
    """
    validate(cfg)  # every setting, before the data are read (the CLI has checked them too)
    check_groups(cfg)
    device = resolve_device(cfg.device)
    data = load_dataset(cfg.dataset, ranks, cfg.get("store_dir"))  # (over ranks: once)
    partition = instantiate_checked(cfg.partition, "partition")
    store = scratch_folder(cfg.get("store", "memory"), cfg.get("store_dir"), device)
    clients = federate(
        data,
        partition,
        cfg.num_clients,
        cfg.test_fraction,
        cfg.seed,
        device,
        val_fraction=cfg.get("val_fraction", 0.0),
        folder=store,
        share=None if ranks is None else ranks.share,
    )
    try:
        validate(cfg, clients)  # the run settings' ranges, and batch_size against the data
    except ConfigError as exc:  # batch_size against the data: and how many clients would do
        raise ConfigError(f"{exc}{_fewer_clients(cfg, data, partition)}") from None
    module, personal_patterns = build_model(
        cfg.model, data.x.shape[1:], data.num_classes, streams.derive_seed(cfg.seed, streams.INIT)
    )
    check_model_fits(module, data, _choice(cfg.model), _choice(cfg.dataset))
    model = FlatModel(module, device, conv_gemm=bool(cfg.get("conv_gemm", False)))
    personal = model.layout.matched(personal_patterns, "model.personal", device)
    shared_mask = torch.ones(model.layout.numel, dtype=torch.bool, device=device)
    shared_mask[personal] = False
    ctx = Context(
        model=model,
        task=task_for(data),
        num_clients=cfg.num_clients,
        lr=cfg.lr,
        local_steps=cfg.local_steps,
        local_epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        sampling=cfg.get("sampling", "shuffle"),
        seed=cfg.seed,
        personal_idx=personal,
        shared_idx=torch.nonzero(shared_mask).flatten(),
        optimizer=instantiate_checked(cfg.optimizer, "optimizer"),
        server_optimizer=_server_optimizer(cfg),
        solver=solver_for(cfg.get("capture", "auto"), device),
        memory_budget=resolve_budget(float(cfg.get("memory_budget") or 0.0), device),
        augment=_augment(cfg, data),
    )
    algorithm = instantiate_checked(cfg.algorithm, "algorithm")
    privacy = _privacy(cfg, algorithm)
    engine = Engine(
        ctx=ctx,
        algorithm=algorithm,
        clients=clients,
        uplink=build_channel(cfg.compressor.uplink, "compressor.uplink"),
        downlink=build_channel(cfg.compressor.downlink, "compressor.downlink"),
        seed=cfg.seed,
        participation=cfg.participation,
        x0=model.initial(),
        privacy=privacy,
        system=_system(cfg),
        store=None if store is None else store / "states",
        ranks=ranks,
        eval_global=bool(cfg.get("eval_global", True)),
        holdout=_holdout(cfg, privacy),
        holdout_steps=cfg.get("holdout_steps"),
    )
    if store is not None:  # the files go with the engine (or at exit)
        weakref.finalize(engine, shutil.rmtree, store, True)
    return engine, data


def _holdout(cfg: DictConfig, privacy: PrivateUplink | None) -> tuple[int, ...]:
    """The clients ``holdout_clients`` keeps out of training (``fedexp.engine.round.views``).

    Raises:
        ConfigError: with client-level DP, whose sampler draws from every client.
    """
    fraction = float(cfg.get("holdout_clients", 0.0) or 0.0)
    if fraction > 0 and privacy is not None:
        raise ConfigError(
            f"holdout_clients={fraction:g}: not with privacy (its sampler and accountant count "
            "every client); set holdout_clients=0 or privacy=none"
        )
    return held_out(cfg.seed, cfg.num_clients, fraction)


def _server_optimizer(cfg: DictConfig) -> ServerOptimizer:
    """The ``server_optimizer`` node's step (FedAvg's, ``sgd``, where the config has none)."""
    node = cfg.get("server_optimizer")
    if not node:
        return ServerSGD()
    return instantiate_checked(node, "server_optimizer")


def _augment(cfg: DictConfig, data: ArrayDataset) -> Any:
    """The ``augment`` node's transform, refused on inputs it cannot transform."""
    node = cfg.get("augment")
    if not node:
        return NoAugmentation()
    augment = instantiate_checked(node, "augment")
    augment.check(data.name, tuple(data.x.shape[1:]))
    return augment


def _fewer_clients(cfg: DictConfig, data: ArrayDataset, partition: Any) -> str:
    """``", or num_clients ≤ 79 to keep batch_size=8"``: the other way out of a large batch.

    Empty when no number of clients gives one client ``batch_size`` training samples.
    """
    most = clients_for_batch(
        data,
        partition,
        cfg.batch_size,
        cfg.num_clients,
        cfg.test_fraction,
        cfg.seed,
        cfg.get("val_fraction", 0.0),
    )
    if most is None:
        return ""
    return f", or num_clients ≤ {most} to keep batch_size={cfg.batch_size}"


def _pca_fits(engine: Engine, cfg: DictConfig) -> bool:
    """Whether the run gathers every client's evaluated model ``[N, d]`` for its PCA figure.

    Not with ``figures=false``, nor in one process when the stack would not fit the memory
    budget (1,000 ResNet-18 clients: 45 GB); the log says so. Over several processes every
    rank takes part in the gathering, so each would have to decide alike: it is gathered.
    """
    if not cfg.get("figures", True):
        return False
    size = len(engine.clients) * engine.x0.numel() * engine.x0.element_size()
    budget = engine.ctx.memory_budget
    if engine.ranks is not None or budget <= 0 or size <= budget:
        return True
    log.info(
        "client_models_pca.png not drawn: every client's model is %.1f GiB, over the memory "
        "budget's %.1f GiB",
        size / 2**30,
        budget / 2**30,
    )
    return False


def _system(cfg: DictConfig) -> SystemModel | None:
    """Every client's device and links (``system`` group), or None without a clock."""
    node = cfg.get("system")
    if not node:
        return None
    settings = instantiate_checked(node, "system")
    model = settings.build(cfg.num_clients, cfg.seed, cfg.batch_size)
    if model is not None:
        log.info("%s", settings.describe())
    return model


def _privacy(cfg: DictConfig, algorithm: Algorithm) -> PrivateUplink | None:
    """The run's DP mechanism (``privacy`` group), or None without one.

    Raises:
        ConfigError: a setting the algorithm or the run cannot meet (adaptive clipping on a
            server that reads each upload, an unreachable ``target_epsilon``).
    """
    node = cfg.get("privacy")
    if node is None:
        return None
    settings = instantiate_checked(node, "privacy")
    if not settings.enabled:
        return None
    try:
        return PrivateUplink(
            settings,
            algorithm.server_reads,
            algorithm.uplink_parts,
            cfg.num_clients,
            cfg.participation,
            cfg.rounds,
            cfg.seed,
            sketch=type(algorithm).client_sketch is not Algorithm.client_sketch,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def run(
    cfg: DictConfig,
    *,
    tracker: Tracker | None = None,
    callbacks: Iterable[RoundCallback] = (),
    run_name: str | None = None,
    tags: dict[str, str] | None = None,
) -> RunResult:
    """Run (or resume) one federated experiment.

    What the tracker receives: the resolved config as params; provenance tags (git commit,
    package versions, device, host: :mod:`fedexp.tracking.provenance`) under ``tags``; the
    data set as an input (:mod:`fedexp.tracking.dataset_input`); each round's metrics at step
    = round (:func:`loggable`: ``round`` is the step, every other metric is logged every
    round); at the end the files of :func:`~fedexp.engine.files.outputs._write_outputs` as
    artifacts and the per-client table as ``clients_rounds.json``
    (:data:`~fedexp.engine.files.outputs.CLIENT_TABLE`).

    ``cfg.threads`` > 0 sets torch's intra-op threads first (the CLI records its choice
    there, :mod:`fedexp.engine.threads`, so the ranks a ``distributed.nproc`` run starts take
    it too); 0 leaves them as the caller set them. A run of a stacked group gives them to its
    group's merged client work and takes one for its own steps
    (:mod:`fedexp.engine.round.stacking`). A resumed run (``cfg.resume``) writes into
    the checkpoint's run folder unless ``cfg.output_dir`` names another (:func:`_out_dir`).

    Args:
        cfg: the composed run config.
        tracker: overrides ``cfg.tracker`` (tests).
        callbacks: called after every round with the engine and the round's metrics.
        run_name: MLflow run name.
        tags: extra MLflow tags (e.g. the sweep's overrides); they win over provenance tags.
    """
    keep_freed_memory()  # the rounds' large tensors reuse the freed ones' memory
    threads = int(cfg.get("threads") or 0)  # the CLI's choice, in every rank it starts too
    member = stacking.current.get()  # a run of a stacked sweep (hydra/launcher=stacked)
    if member is not None:  # the merged client work takes them, the run's own steps one
        member.stack.use_threads(threads)  # (fedexp.engine.round.stacking)
        torch.set_num_threads(1)
    elif threads > 0:
        torch.set_num_threads(threads)
    nodes = cfg.get("distributed", {}).get("nodes", 1)
    if nodes > 1 and Ranks.current() is None:  # the CLI starts them: torchrun or SLURM
        raise ConfigError(f"distributed.nodes={nodes}: no process group spans the nodes")
    if tracker is None:  # first: an unreachable tracking server fails before anything is built
        tracker = instantiate_checked(cfg.tracker, "tracker")
    ranks, procs = Ranks.current(), []  # this process's rank (torchrun, a started rank)
    out_dir = _out_dir(cfg) if ranks is None and _nproc(cfg) > 1 else None
    if out_dir is not None:  # the others start now and build their share meanwhile
        ranks, procs = launch.start(cfg, str(out_dir), _rank_entry)
    failed = True
    engine: Engine | None = None
    try:
        engine, data = _build(cfg, ranks)
        engine.stack = member
        dataset = None  # what rank 0 logs of the data set
        if ranks is None or ranks.leader:
            dataset = describe_dataset(data, OmegaConf.to_container(cfg.dataset, resolve=True))
        del data  # the clients hold their own copies
        out_dir = out_dir or _out_dir(cfg)
        result = _run(cfg, engine, dataset, out_dir, tracker, callbacks, run_name, tags)
        failed = False
        return result
    except RuntimeError as exc:  # a collective: a started rank died? one line, not gloo's
        ended = launch.lost(exc, procs, engine)
        if ended is None:
            raise
        raise ended from None
    finally:
        if member is not None:  # the stack's other runs go on without this one
            member.leave()
        if procs:  # the other ranks: waited for, or ended when this one failed
            launch.stop(procs, failed=failed)


def _nproc(cfg: DictConfig) -> int:
    return int(cfg.get("distributed", {}).get("nproc", 1))


def _out_dir(cfg: DictConfig) -> Path:
    """The run's folder: ``output_dir``, else (the API) a resumed run's or a fresh one.

    A resumed run's own folder: :func:`~fedexp.config.instantiate.resumed_run_dir`; a fresh
    one is never reused.
    """
    if cfg.output_dir:
        return Path(cfg.output_dir)
    resumed = resumed_run_dir(cfg.get("resume"))
    if resumed is not None:
        return Path(resumed)
    return Path(fresh_dir(f"outputs/{time.strftime('%Y-%m-%d/%H-%M-%S')}"))


def _rank_entry(rank: int, size: int, port: int, config: str, backend: str) -> None:
    """Rank ``rank`` ≥ 1 of a ``distributed.nproc`` run.

    Started by :func:`fedexp.engine.processes.launch.start`.
    """
    launch.rank_main(rank, size, port, config, backend, lambda c: run(c, tracker=NullTracker()))


def _run(
    cfg: DictConfig,
    engine: Engine,
    dataset: Any,
    out_dir: Path,
    tracker: Tracker,
    callbacks: Iterable[RoundCallback],
    run_name: str | None,
    tags: dict[str, str] | None,
) -> RunResult:
    """:func:`run` once the engine is built (and, over several processes, the ranks joined).

    The run's life after its build, stage by stage: resumed from its checkpoint (or fresh),
    its record opened in the tracker, the rounds (:func:`_rounds`), the files
    (:func:`_finish`); the tracker's run ends FINISHED, KILLED (Ctrl-C) or FAILED (with the
    error as a tag). Rank 0 (or the only process) keeps the tracker, the progress display,
    the checkpoints and the run's files; the others take part in every round and evaluation.
    """
    past = resume(cfg, engine, out_dir)  # the engine at the checkpoint's round, its record
    rec = RunRecord.start(cfg, engine, tracker, past, run_name, tags)
    try:
        rec.open(dataset)  # the data set; resumed, the rounds the tracker lacks
        _rounds(cfg, engine, rec, callbacks)
        final = dict(rec.history[-1]) if rec.history else {}
        per_client = _finish(cfg, engine, rec, out_dir)
        tracker.end("FINISHED")
    except KeyboardInterrupt:
        tracker.end("KILLED")
        raise
    except BaseException as exc:
        tracker.set_tags({"error": f"{type(exc).__name__}: {exc}"})
        tracker.end("FAILED")
        raise
    return RunResult(final, per_client, rec.run_id, out_dir, tracker)


def _rounds(
    cfg: DictConfig, engine: Engine, rec: RunRecord, callbacks: Iterable[RoundCallback]
) -> None:
    """The rounds from the engine's to ``cfg.rounds``; a fresh run evaluates round 0 first.

    Each round is checked for a blow-up before anything keeps it, evaluated where due
    (:func:`_evaluated`), recorded, shown, checkpointed, and handed to the callbacks.
    """
    if engine.round == 0 and not rec.history:
        setup = engine.setup()
        rec.record({"round": 0.0, **setup, **rec.evaluate(0)})
    shown = cfg.progress if rec.leader else "none"
    with RoundProgress(cfg.rounds, engine.round, shown) as progress:
        while engine.round < cfg.rounds:
            metrics = engine.run_round()
            t = engine.round
            _check_blowup(cfg, rec.history, metrics, t)  # before it is logged or checkpointed
            metrics.update(_evaluated(cfg, engine, rec, t))
            metrics["round"] = float(t)
            rec.record(metrics)
            progress.update(t, metrics)
            rec.checkpoint(t)
            for callback in callbacks:
                callback(engine, metrics)


def _evaluated(cfg: DictConfig, engine: Engine, rec: RunRecord, t: int) -> dict[str, float]:
    """Round ``t``'s evaluation where due, its aggregates ({} elsewhere).

    Every client after the last round; every ``eval_every`` rounds every client, or the
    round's participants alone with ``eval_participants``.
    """
    if t == cfg.rounds:
        return rec.evaluate(t)
    if t % cfg.eval_every:
        return {}
    return rec.evaluate(t, engine.last_sampled if cfg.eval_participants else None)


def _finish(
    cfg: DictConfig, engine: Engine, rec: RunRecord, out_dir: Path
) -> list[dict[str, float]]:
    """The run's files (rank 0's), each logged as an artifact, and the per-client table.

    Returns every client's final metrics: the last evaluation's when it was of every client,
    else an evaluation now.
    """
    per_client = rec.per_client or engine.evaluate()[1]
    # every client's evaluated model, [N, d], for the PCA figure only (over several
    # ranks, each computes its own)
    models = engine.every_eval_vector() if _pca_fits(engine, cfg) else None
    history, client_history = rec.history, rec.client_history
    written = (
        []
        if not rec.leader
        else _write_outputs(out_dir, cfg, per_client, history, engine, client_history, models)
    )
    for path in written:
        rec.tracker.log_artifact(path)
    if client_history:  # clients_rounds.csv again, as a table MLflow's UI shows as one
        rec.tracker.log_table(_table_rows(client_history), CLIENT_TABLE)
    return per_client
