"""Structured config for the run settings, registered in Hydra's ConfigStore.

Hydra merges ``conf/config.yaml`` onto :class:`RunConfig`, so an unknown top-level key or a
value of the wrong type fails at compose time with the key named
(``Key 'roundz' not in 'RunConfig'``). The group nodes (dataset, model, ...) are ``_target_``
nodes; their keys are checked against the target's signature by
:func:`fedexp.config.instantiate.instantiate_checked` before anything runs.

Types are Hydra's; ranges are :func:`validate`'s (OmegaConf does not call a dataclass's
``__post_init__`` on merge). The CLI calls it right after compose, before torch or the runner
is imported; :func:`fedexp.engine.runner.build_engine` calls it again with the clients' data,
which adds the checks that need the data (a batch larger than every client's training set).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING
from dataclasses import dataclass
from dataclasses import field
from dataclasses import fields
from typing import Any

from fedexp.errors import ConfigError


@dataclass
class DistributedConfig:
    """One run over several processes (``fedexp.engine.processes.launch``).

    Attributes:
        nproc: processes on this machine (on each node); each runs its share of every
            round's clients (client n on process n mod the processes). 1: one process (under
            torchrun: as many as torchrun started).
        backend: torch.distributed's backend: "auto" (NCCL with GPUs, else gloo), "gloo", "nccl".
        nodes: machines the run spans: with hydra/launcher=slurm one SLURM job of nodes ×
            nproc tasks (or torchrun on each node); 1: this machine.
    """

    nproc: int = 1
    backend: str = "auto"
    nodes: int = 1


@dataclass
class RunConfig:
    """Settings of one federated run.

    Attributes:
        rounds: communication rounds.
        num_clients: number of clients N the data are partitioned over.
        participation: fraction of clients sampled each round (at least one is sampled).
        local_steps: local SGD steps per round (used when ``local_epochs`` is null).
        local_epochs: if set, E: local steps = ceil(E * ceil(n_train / batch_size)) per client
            (E whole: E epochs of a shuffling DataLoader, the last batch of each short).
        batch_size: minibatch size of the index draws; 0 or -1 means full batch.
        sampling: how each client's minibatches are drawn: "shuffle" (successive shuffled
            passes over its data, each sample once a pass, as a shuffling DataLoader's
            epochs: the papers' local epochs) or "replacement" (uniform with replacement).
        lr: client (local) learning rate eta_l.
        seed: the root of every random stream (data split, partition, init, sampling, batches).
        device: torch device ("cpu", "cuda", "cuda:1", or "auto").
        eval_every: evaluate all clients on their test split every this many rounds (and at
            the last round).
        checkpoint_every: write a checkpoint every this many rounds (0 disables).
        divergence_factor: stop the run (DivergenceError) when a round's mean training loss
            exceeds this many times the initial model's loss (a blow-up that is still finite;
            NaN and infinity are always stopped); 0 disables the check.
        resume: a checkpoint directory of an interrupted run to continue, or null.
        resume_unsealed: accept a checkpoint without a seal (an older fedexp's), unverified.
        test_fraction: per-client test share (the paper's 80/20 split).
        val_fraction: share of each client's training data held out as a validation split
            (val/... metrics at every evaluated round, for tuning without test leakage;
            docs/tuning.md); 0 (the default) keeps every training sample for training.
        progress: "auto" (rich bar on a TTY, log lines otherwise), "bar", "log" or "none".
        output_dir: where checkpoints and result files go (null: Hydra's run folder).
        eval_participants: evaluate only the round's sampled clients at evaluated rounds
            before the last (pFedSOP's curves); the last round evaluates every client.
        eval_global: each evaluation also scores the global model on every client's test
            split (``global/acc/mean``...) and the gain of personalisation per client
            (``gain/acc/mean``, ``/worst``, ``/hurt``: the share of clients it hurts), for the
            methods with a global model (docs/protocols.md); false: the clients' own models
            alone.
        holdout_clients: fraction of the clients kept out of training (never sampled, never
            in a training metric), scored at every full evaluation as new clients: they
            receive what a new client would (the global model, or the method's rule),
            take ``holdout_steps`` local steps and are tested (``new/acc/mean``...); 0: none.
        holdout_steps: a new client's local steps before its test (null: the run's local
            steps / epochs; 0: tested as received).
        threads: torch CPU threads of this job; 0 = the cores available (CPU affinity, cgroup
            quota) over the processes sharing them: parallel sweep jobs × the run's ranks (two
            jobs each using every core stall each other's small kernels on a 2-core
            machine); a single run also leaves out the cores other processes fill (the load
            average), at the start and between rounds; logged at the start and at each
            change (fedexp/engine/threads.py). N > 0 fixes the count whatever the load.
        memory_budget: GiB a local step of the cohort may fill (its clients' activations,
            estimated from one client's step); a cohort that needs more trains in slices of
            clients, with the same results; 0 = auto: 80 % of the GPU's free memory, or half
            of the RAM available, at the start. The round logs its peak (memory/peak_mib).
        conv_gemm: a cohort's 2-D convolutions as matrix products (im2col: the receptive
            fields copied once, one batched product) instead of vmap's grouped convolutions,
            which cuDNN runs as a kernel a client: on an H200 the 2-conv CNN's rounds 1.5-1.75×
            faster, MONAI's 2-D U-Net's unchanged (docs/benchmarks.md). For the GPU: on the
            CPU a model with convolutions trains client by client and this changes nothing.
            The fields (kh·kw copies of each layer's input) count in the memory budget.
        capture: "auto": on a CUDA device a round's local steps are recorded once as a CUDA
            graph per cohort size and step count and replayed (static buffers; eager, with
            one log line, where recording fails); the CPU runs eagerly. "off": eager on
            every device.
        store: where the clients' data and states live: "memory", or "disk" (files in
            ``store_dir`` mapped into memory, so the resident memory follows the round's
            clients, not the population; CPU runs; the files go when the run ends).
        store_dir: the folder of ``store=disk``'s files (null: the system's temporary folder).
        client_table_limit: keep every client's metrics of every evaluated round (the table
            clients_rounds.csv, MLflow's per-client table, the clients plot) in runs of at
            most this many clients; larger runs write only the last round's clients.csv (a
            row per client per evaluation is gigabytes at 10^6 clients).
        figures: draw the run's figures at its end (curves.png, clients.png,
            client_models_pca.png; also MLflow artifacts); false leaves them out, the CSVs and
            metrics stay: a large sweep of small runs spends about a third of its time on
            them (docs/benchmarks.md, "Stacked runs").
    """

    rounds: int = 50
    num_clients: int = 5
    participation: float = 1.0
    local_steps: int = 5
    local_epochs: float | None = None
    batch_size: int = 32
    sampling: str = "shuffle"
    lr: float = 0.1
    seed: int = 0
    device: str = "auto"
    eval_every: int = 1
    checkpoint_every: int = 10
    divergence_factor: float = 1e4
    resume: str | None = None
    resume_unsealed: bool = False
    test_fraction: float = 0.2
    val_fraction: float = 0.0
    progress: str = "auto"
    output_dir: str | None = None
    threads: int = 0
    memory_budget: float = 0.0
    conv_gemm: bool = False
    capture: str = "auto"
    eval_participants: bool = False
    eval_global: bool = True
    holdout_clients: float = 0.0
    holdout_steps: int | None = None
    store: str = "memory"
    store_dir: str | None = None
    client_table_limit: int = 10000
    figures: bool = True
    dataset: Any = field(default_factory=dict)
    model: Any = field(default_factory=dict)
    partition: Any = field(default_factory=dict)
    algorithm: Any = field(default_factory=dict)
    compressor: Any = field(default_factory=dict)
    optimizer: Any = field(default_factory=dict)
    server_optimizer: Any = field(default_factory=dict)
    augment: Any = field(default_factory=dict)
    privacy: Any = field(default_factory=dict)
    system: Any = field(default_factory=dict)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    tracker: Any = field(default_factory=dict)


#: The allowed values of the string settings.
CHOICES: dict[str, tuple[str, ...]] = {
    "progress": ("auto", "bar", "log", "none"),
    "sampling": ("shuffle", "replacement"),
    "store": ("memory", "disk"),
    "capture": ("auto", "off"),
}

#: Algorithm keys that count other clients, so must stay below ``num_clients``, by target.
_BELOW_NUM_CLIENTS: dict[str, tuple[str, ...]] = {
    "fedexp.algorithms.pfednet.PFedNet": ("k",),  # neighbours in the k-NN similarity network
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _range_errors(get: Any) -> list[str]:
    """The messages of the out-of-range run settings (``get(key)`` reads one)."""
    errors: list[str] = []

    def need(key: str, ok: Any, expected: str, *, integer: bool = False) -> None:
        value = get(key)
        kind = int if integer else (int, float)
        if not isinstance(value, kind) or isinstance(value, bool):
            errors.append(f"{key}={value!r}: expected {'an integer' if integer else 'a number'}")
        elif not (math.isfinite(value) and ok(value)):
            errors.append(f"{key}={value!r}: expected {expected}")

    need("rounds", lambda v: v >= 1, "≥ 1", integer=True)
    need("num_clients", lambda v: v >= 1, "≥ 1", integer=True)
    need("participation", lambda v: 0 < v <= 1, "a fraction in (0, 1]")
    if get("local_epochs") is None:
        need("local_steps", lambda v: v >= 1, "≥ 1 (or set local_epochs)", integer=True)
    else:
        need("local_epochs", lambda v: v > 0, "> 0 (or null to use local_steps)")
    need(
        "batch_size",
        lambda v: v >= 1 or v in (0, -1),
        "≥ 1, or 0 / -1 for the full batch",
        integer=True,
    )
    need("lr", lambda v: v > 0, "> 0")
    need("seed", lambda v: 0 <= v < 2**63, "an integer ≥ 0", integer=True)
    need("eval_every", lambda v: v >= 1, "≥ 1", integer=True)
    need("checkpoint_every", lambda v: v >= 0, "≥ 0 (0 disables checkpoints)", integer=True)
    need("divergence_factor", lambda v: v >= 0, "≥ 0 (0 disables the check)")
    need("test_fraction", lambda v: 0 < v < 1, "a fraction in (0, 1)")
    need("val_fraction", lambda v: 0 <= v < 1, "a fraction in [0, 1) (0: no validation split)")
    need("threads", lambda v: v >= 0, "≥ 0 (0: PyTorch's default)", integer=True)
    need("memory_budget", lambda v: v >= 0, "≥ 0 GiB (0: auto, from the free memory)")
    need("holdout_clients", lambda v: 0 <= v < 1, "a fraction in [0, 1) (0: none held out)")
    if get("holdout_steps") is not None:
        need(
            "holdout_steps", lambda v: v >= 0, "≥ 0 (or null: the run's local steps)", integer=True
        )
    need("client_table_limit", lambda v: v >= 0, "≥ 0 (0: no per-client table)", integer=True)
    for key, choices in CHOICES.items():
        if get(key) not in choices:
            errors.append(f"{key}={get(key)!r}: expected one of {', '.join(choices)}")
    for key in (f.name for f in fields(RunConfig) if f.type in (bool, "bool")):
        if not isinstance(get(key), bool):
            errors.append(f"{key}={get(key)!r}: expected true or false")
    return errors


def _algorithm_errors(algorithm: Any, num_clients: Any) -> list[str]:
    """Algorithm settings bounded by the number of clients (pFedNet's k < num_clients)."""
    if not isinstance(algorithm, Mapping) or not _is_number(num_clients):
        return []
    errors = []
    for key in _BELOW_NUM_CLIENTS.get(str(algorithm.get("_target_")), ()):
        value = algorithm.get(key)
        if _is_number(value) and value >= num_clients:
            errors.append(
                f"algorithm.{key}={value}: expected < num_clients={num_clients} "
                f"(algorithm.{key}={num_clients - 1} already links every pair of clients)"
            )
    return errors


def validate(cfg: Mapping[str, Any], clients: Sequence[Any] | None = None) -> None:
    """Check the ranges of the run settings; raise one line naming every bad key.

    Cheap and free of heavy imports: the CLI calls it right after compose. With ``clients``
    (the federated :class:`fedexp.data.federated.ClientData`), it also checks the values that
    need the data: a ``batch_size`` larger than every client's training set.

    Args:
        cfg: the composed run config (a missing key counts as its :class:`RunConfig` default).
        clients: the clients' data, or None.

    Raises:
        ConfigError: ``"lr=-0.1: expected > 0"``; several bad keys are joined with ``"; "``.
    """
    defaults = {f.name: f.default for f in fields(RunConfig) if f.default is not MISSING}

    def get(key: str) -> Any:
        return cfg.get(key, defaults.get(key))

    errors = _range_errors(get)
    spread = get("distributed") or {}
    nproc, backend = spread.get("nproc", 1), spread.get("backend", "auto")
    for key, value in (("nproc", nproc), ("nodes", spread.get("nodes", 1))):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
            errors.append(f"distributed.{key}={value!r}: expected an integer in [1, 1024]")
    if backend not in ("auto", "gloo", "nccl"):
        errors.append(f"distributed.backend={backend!r}: expected auto, gloo or nccl")
    errors += _algorithm_errors(get("algorithm"), get("num_clients"))
    batch = get("batch_size")
    if clients and not errors and batch > 0:
        largest = max(c.num_train for c in clients)
        if batch > largest:
            errors.append(
                f"batch_size={batch}: larger than every client's training data (the largest "
                f"client has n_train={largest}); expected ≤ {largest}, or 0 / -1 for the "
                "full batch"
            )
    if errors:
        raise ConfigError("; ".join(errors))


def _literal(text: str) -> Any:
    """A command-line value as YAML reads a plain scalar (null, bool, int, float or text)."""
    low = text.strip().lower()
    if low in ("null", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip().strip("'\"")


#: Settings that existed once, and what to do instead (an override of one names it).
REMOVED: dict[str, str] = {
    "backend": "the setting was removed: every run takes the one path (its clients as "
    "cohorts through the local solver, docs/design.md); drop the override",
}


def override_errors(overrides: Sequence[str]) -> list[str]:
    """Range errors of plain top-level ``key=value`` overrides, before Hydra composes.

    The CLI runs this on the command line first, so that ``fedexp run lr=-1`` fails in a
    fraction of a second. Only run settings given one literal value are looked at (sweeps
    ``a,b``, interpolations, group options and config files are left to Hydra and
    :func:`validate`); every other setting counts as its default, and only messages about an
    overridden key are returned. ``local_steps`` is left to :func:`validate`: whether it is
    used depends on ``local_epochs``, which an experiment file may set. A setting that was
    removed (:data:`REMOVED`) is named with what to do instead.
    """
    names = {f.name for f in fields(RunConfig) if f.default is not MISSING}
    kinds = {f.name: str(f.type) for f in fields(RunConfig)}
    given: dict[str, Any] = {}
    removed = [
        f"{key}: {REMOVED[key]}"
        for key in dict.fromkeys(o.partition("=")[0].lstrip("+~") for o in overrides)
        if key in REMOVED
    ]
    if removed:
        return removed
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or key not in names or key == "local_steps":
            continue
        if any(c in text for c in ",()[]{}$"):
            continue
        value = _literal(text)
        if isinstance(value, int) and not isinstance(value, bool) and "float" in kinds[key]:
            value = float(value)  # as Hydra casts it: lr=-1 reads lr=-1.0
        given[key] = value
    if not given:
        return []
    defaults = {f.name: f.default for f in fields(RunConfig) if f.default is not MISSING}
    errors = _range_errors(lambda key: given.get(key, defaults.get(key)))
    return [e for e in errors if e.split("=", 1)[0] in given]


def register_configs() -> None:
    """Register :class:`RunConfig` as ``run_schema`` (the first default of config.yaml)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="run_schema", node=RunConfig)
