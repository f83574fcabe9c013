"""Test helpers: compose the real config (shrunk) and run the CLI."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose
from hydra import initialize_config_dir
from omegaconf import DictConfig
from omegaconf import open_dict

from fedexp.config.schema import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

register_configs()

#: Overrides that make a run tiny.
SMALL = ["rounds=3", "progress=none", "checkpoint_every=0", "device=cpu"]


def compose_config(*overrides: str, output_dir: Path | None = None) -> DictConfig:
    """The real config with ``overrides``, as ``fedexp run`` would compose it."""
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    if output_dir is not None:
        with open_dict(cfg):
            cfg.output_dir = str(output_dir)
    return cfg


def run_cli(
    *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``fedexp`` in a subprocess (the installed console script's module).

    ``env`` adds to (or overrides) this process's environment, e.g. ``{"COLUMNS": "80"}``.
    """
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, "-c", "from fedexp.cli import entry; entry()", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def deterministic(metrics: dict) -> dict:
    """``metrics`` without the wall-clock and memory ones (``time/``, ``system/``, ``memory/``),
    which no two runs share."""
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "system/", "memory/"))}


def assert_resume_exact(cfg, tmp_path: Path, stop_at: int = 3) -> None:
    """Run ``cfg`` whole, then interrupted after round ``stop_at`` and resumed from its
    checkpoint: the two metric histories must be identical (wall times aside)."""
    import pytest

    from fedexp.engine.runner import run
    from fedexp.tracking.base import NullTracker

    full = NullTracker()
    run(cfg, tracker=full)

    def stop(engine, metrics):
        if engine.round == stop_at:
            raise KeyboardInterrupt

    with open_dict(cfg):
        cfg.output_dir = str(tmp_path / "interrupted")
    part = NullTracker()
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tracker=part, callbacks=[stop])
    with open_dict(cfg):
        cfg.resume = str(tmp_path / "interrupted" / "checkpoints")
    run(cfg, tracker=part)
    for key, steps in deterministic(full.metrics).items():
        assert part.metrics[key] == steps, key


def assert_client_states_close(seq, lock) -> None:
    """Every client's state of two engines (sequential vs lockstep) has the same keys and the
    same tensors up to floating-point summation order (rtol 1e-4, atol 1e-5)."""
    import torch

    for a, b in zip(seq.client_states, lock.client_states, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)


def cohort_of(engine, clients, round_: int | None = None):  # noqa: ANN001, ANN201
    """The :class:`fedexp.contract.Cohort` of ``clients`` (ids, ascending) in ``engine``'s
    round ``round_`` (default: the round about to run): their streams as the engine gives
    them, no draws yet."""
    import torch

    from fedexp import streams
    from fedexp.contract import Cohort

    t = engine.round if round_ is None else round_
    ids = torch.tensor(list(clients), dtype=torch.int64)  # on the host, as the engine's
    return Cohort(
        clients=list(clients),
        data=[engine.clients[n] for n in clients],
        rows=ids,
        keys=streams.stream_keys(engine.seed, streams.CLIENT, t, ids),
        draws=torch.zeros(len(ids), dtype=torch.int64),
        pool=engine.pool,
    )


def solo(data, key: int = 0):  # noqa: ANN001, ANN201
    """A cohort of one client alone (its rows of the pool that holds its data, else a pool of
    its own), drawing from stream ``key`` (:class:`fedexp.engine.solver.passes.Stream`)."""
    from fedexp.engine.solver.steps import alone

    return alone(data, key)


def refused(cls: type, **kwargs: object) -> str:
    """The one-line ConfigError of a config node for ``cls`` with ``kwargs``.

    A numeric argument's range is declared once, in the constructor's signature
    (:mod:`fedexp.config.ranges`), and checked on the config node before anything is built;
    this asserts the node is refused and returns the message.
    """
    import pytest
    from omegaconf import OmegaConf

    from fedexp.config.instantiate import check_node
    from fedexp.errors import ConfigError

    node = OmegaConf.create({"_target_": f"{cls.__module__}.{cls.__qualname__}", **kwargs})
    with pytest.raises(ConfigError) as err:
        check_node(node, "algorithm")
    return str(err.value)


def mlflow_db(path: Path) -> str:
    """A new sqlite MLflow store at ``path`` (its folder made), as its URI.

    MLflow builds a new store by running its ~50 schema migrations (about 10 s on a busy
    2-core machine, in every process that opens it first); here the store is a copy of one
    migrated once per MLflow version and machine, under the temp folder, so tests that log
    to a fresh store start where a new user's first run would be after its migrations.
    """
    import shutil
    import tempfile

    import mlflow

    template = Path(tempfile.gettempdir()) / f"fedexp-tests-mlflow-{mlflow.__version__}.db"
    if not template.exists():
        from mlflow import MlflowClient

        scratch = template.with_name(f"{template.stem}.{os.getpid()}.db")
        MlflowClient(f"sqlite:///{scratch}").search_experiments()
        os.replace(scratch, template)  # whole, whichever worker finished first
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, path)
    return f"sqlite:///{path}"


def without_hydra_logging(monkeypatch) -> None:  # noqa: ANN001 - pytest's MonkeyPatch
    """Make an in-process ``fedexp run`` leave logging alone.

    Hydra's logging set-up (``logging.config.dictConfig``) closes every handler there is,
    pytest's own capture handlers included, which then fail the test at teardown ("I/O
    operation on closed file"); the run's log lines are not what such a test looks at.
    """
    import importlib

    for name in (
        "hydra.core.utils",
        "hydra.main",  # the module (``hydra.main`` as an attribute is the decorator)
        "hydra._internal.hydra",
        "hydra._internal.core_plugins.basic_launcher",
        "hydra_plugins.hydra_joblib_launcher._core",
    ):
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "configure_log", lambda *a, **k: None)


def assert_eval_stack_is_eval_params(engine, clients: list[int] | None = None, personal=True):
    """``eval_stack`` of ``clients`` (default: every client, in reverse order) equals
    ``eval_params`` client by client, bitwise; returns the stack.

    ``eval_params`` is the stack of one client (``Algorithm.eval_params``): each row must not
    depend on which other clients, or in which order, share the cohort.

    ``personal``: the first two rows must differ too (a mix-up of clients would show).
    """
    import torch

    alg, ctx, server, states = engine.algorithm, engine.ctx, engine.server, engine.client_states
    who = list(range(len(engine.clients)))[::-1] if clients is None else clients
    stack = alg.eval_stack(ctx, server, states.rows(who), who)
    assert stack.dim() == 2 and stack.shape[0] == len(who)
    if personal:
        assert not torch.equal(stack[0], stack[1])
    for row, n in zip(stack, who, strict=True):
        assert torch.equal(row, alg.eval_params(ctx, server, states[n], n))
    return stack


def vmapped_round_ops(monkeypatch, cfgs) -> list[int]:  # noqa: ANN001 - pytest's MonkeyPatch
    """Ops dispatched by the second round of each config's engine, convolutions vmapped.

    On the CPU a convolutional model's gradients go channels-last row by row; on CUDA they are
    vmapped over the cohort. This forces the CUDA way on the CPU (``channels_last=False``), so
    that an op count at two cohort sizes shows whether anything still works client by client
    (``fedexp.engine.round.census``).
    """
    from fedexp.engine.round.census import Census
    from fedexp.engine.runner import build_engine
    from fedexp.models.flat import FlatModel

    made = FlatModel.__init__

    def vmapped(self, module, device, channels_last=None, conv_gemm=False):  # noqa: ANN001, ANN202
        made(self, module, device, channels_last=False, conv_gemm=conv_gemm)

    monkeypatch.setattr(FlatModel, "__init__", vmapped)
    ops = []
    for cfg in cfgs:
        engine = build_engine(cfg)
        engine.setup()
        engine.run_round()
        with Census() as census:
            engine.run_round()
        assert engine.ctx.vmap_ok and not engine.ctx.model.channels_last
        ops.append(census.ops)
    return ops


def global_gradient(engine, x):  # noqa: ANN001, ANN201
    """∇ (1/N) Σ_n f_n(x), each f_n the client's mean loss on its whole training split."""
    import torch

    ctx, grads = engine.ctx, []
    for data in engine.clients:
        p = x.detach().clone().requires_grad_(True)
        loss = ctx.task.loss(ctx.model(p, data.x_train), data.y_train)
        grads.append(torch.autograd.grad(loss, p)[0])
    return torch.stack(grads).mean(0)


#: a strongly convex problem (weight decay λ: a finite optimum, where the logistic loss on
#: nearly separable data has none), full batches and many local steps on label-skewed clients
FIXED_POINT = ("batch_size=0", "local_steps=10", "lr=0.1", "optimizer.weight_decay=0.05",
               "partition=label_imbalance")  # fmt: skip


def stationarity(engine) -> float:  # noqa: ANN001
    """‖∇ (1/N) Σ_n f_n(x) + λx‖ at the server's model: 0 at the global optimum."""
    x = engine.server["x"]
    return float((global_gradient(engine, x) + 0.05 * x).norm())


#: what an algorithm needs beyond the tests' default model: a body below a head (MOON's
#: representation, FedBABU's frozen head), where the default logistic regression is all head
#: (both refuse it with one line)
NEEDS: dict[str, list[str]] = {
    "moon": ["model=mlp", "model.hidden=8"],
    "fedbabu": ["model=mlp", "model.hidden=8"],
}


def needs(algorithm: str) -> list[str]:
    """The settings ``algorithm`` needs on the tests' default data (:data:`NEEDS`)."""
    return list(NEEDS.get(algorithm, []))


def assert_same_run_files(one: Path, other: Path) -> None:
    """Two run folders' per-round and per-client CSVs equal but for wall-clock columns.

    The figures a run on one process and the same run on several (torchrun, node agents, a
    SLURM step) write; ``time/``, ``system/`` and ``memory/`` columns measure the machine.
    """
    import pandas as pd

    def table(path: Path) -> pd.DataFrame:
        frame = pd.read_csv(path)
        kept = [c for c in frame.columns if not c.startswith(("time/", "system/", "memory/"))]
        return frame[kept]

    for name in ("rounds.csv", "clients.csv", "clients_rounds.csv"):
        pd.testing.assert_frame_equal(
            table(one / name), table(other / name), check_exact=False, rtol=1e-4, atol=1e-6
        )


def cli_env() -> dict[str, str]:
    """This process's environment for a ``fedexp`` subprocess: no warnings, no MLflow URI."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


_clock = itertools.count(1_700_000_000_000, 1000)


def log_finished_run(client, experiment: str, algorithm: str, seed: int, **metrics) -> str:  # noqa: ANN001
    """A FINISHED run as fedexp logs it: choice.algorithm, params, one value per metric."""
    from mlflow.entities import Metric
    from mlflow.entities import Param

    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    rid = client.create_run(
        exp_id, start_time=next(_clock), tags={"choice.algorithm": algorithm}
    ).info.run_id
    params = {"lr": 0.1, "seed": seed, "algorithm._target_": f"fedexp.algorithms.{algorithm}.X"}
    ms = [Metric(k, float(v), next(_clock), 3) for k, v in metrics.items()]
    client.log_batch(rid, metrics=ms, params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(rid, "FINISHED")
    return rid
