"""The ``fedexp`` command: ``fedexp run [overrides]`` (Hydra main, version_base 1.3).

Examples:
    fedexp report --experiment NAME --rows choice.algorithm --cols partition.delta
    fedexp run
    fedexp run algorithm=local rounds=20
    fedexp run -m algorithm=fedavg,local seed=0,1,2 partition=label_imbalance \
        partition.delta=1,2,4 hydra/launcher=parallel
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedexp.errors import CheckpointError, ConfigError, DivergenceError, FedexpError, Terminated

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Hydra, OmegaConf, torch and the runner are imported where they are used: ``fedexp --help``
# and ``fedexp report --help`` import none of them (tests/test_startup.py).

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "conf")
log = logging.getLogger("fedexp")


def _print_table(result) -> None:  # noqa: ANN001 - RunResult, imported lazily
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Per-client results on each client's own test split")
    # the task's metrics in its order (acc, bal_acc, auc / iou, label_iou, dice, acc), then loss
    keys = [k for k in result.per_client[0] if k != "num_test"]
    for col in ("client", "test n", *keys):
        table.add_column(col, justify="right")
    for n, row in enumerate(result.per_client):
        cells = ["—" if math.isnan(row[k]) else f"{row[k]:.4f}" for k in keys]
        table.add_row(str(n), str(int(row["num_test"])), *cells)
    m = result.metrics
    rows = (("mean", "mean"), ("weighted", "weighted"), ("worst", "worst"), ("best", "best_mean"))
    for label, suffix in rows:
        cells = [f"{m[f'{k}/{suffix}']:.4f}" if f"{k}/{suffix}" in m else "—" for k in keys]
        table.add_row(f"[bold]{label}", "", *cells)
    console = Console()
    console.print(table)
    console.print(f"results: {result.output_dir}")
    console.print(result.tracker.describe())


def _set_threads(threads: int, hc: DictConfig) -> None:
    """Cap torch's CPU threads: ``threads``, or cores / parallel jobs in a parallel sweep."""
    import os

    import torch
    from hydra.types import RunMode

    if threads <= 0 and hc.mode == RunMode.MULTIRUN:
        jobs = hc.launcher.get("n_jobs") if hc.launcher is not None else None
        cores = os.cpu_count() or 1
        if jobs is not None and jobs != 1:
            threads = max(1, cores // (cores if jobs < 0 else jobs))
    if threads > 0:
        torch.set_num_threads(threads)


def _describe_stop(exc: BaseException, cfg: DictConfig, hc: DictConfig) -> str:
    """One line on why the run stopped and, where a checkpoint exists, how to resume it."""
    text = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"error: {exc}"
    if isinstance(exc, Terminated):
        text = "terminated (SIGTERM)"
    if isinstance(exc, CheckpointError):
        return text  # the checkpoint itself is unusable: no resume hint
    folder = Path(cfg.resume) if cfg.resume else Path(cfg.output_dir) / "checkpoints"
    if isinstance(exc, DivergenceError):
        return text + _rescue_hint(cfg, hc, folder)
    if (folder / "last.safetensors").exists() or folder.name == "last.safetensors":
        overrides = " ".join(o for o in hc.overrides.task if not o.startswith("resume="))
        text += f"; checkpoint kept: fedexp run {overrides} resume={folder}".replace("  ", " ")
    return text


def _rescue_hint(cfg: DictConfig, hc: DictConfig, folder: Path) -> str:
    """How to go on after a divergence: the same command with lr / 10.

    It resumes from the checkpoint where one was kept (lr may change on resume; the runner
    records the change in the checkpoint and in MLflow tags), else it starts the run again.
    """
    lr = f"lr={cfg.lr / 10:g}"
    keep = [o for o in hc.overrides.task if o.lstrip("+~").split("=", 1)[0] not in ("lr", "resume")]
    if (folder / "last.safetensors").exists() or folder.name == "last.safetensors":
        command = shlex.join(["fedexp", "run", *keep, f"resume={folder}", lr])
        return f"; checkpoint kept, resume it with a smaller lr: {command}"
    command = shlex.join(["fedexp", "run", *keep, lr])
    return f"; no checkpoint yet: run it again with a smaller lr: {command}"


#: Parts of a ``hydra.*`` key, and words in its value, that make Hydra import and call code
#: before fedexp sees the config (callbacks, launcher/sweeper targets, logging classes).
_HYDRA_CODE_WORDS = ("_target_", "_args_", "callbacks", "class", "()")
_HYDRA_CODE_VALUE = re.compile(r"_target_|_args_|callbacks|(\bclass|\(\))\s*:")


def _hydra_code_override(args: list[str]) -> str | None:
    """The key of the first command-line override that makes Hydra run code, or None."""
    for arg in args:
        if "=" not in arg or arg.startswith("-"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key == "hydra" or key.startswith("hydra."):
            if any(w in key.split(".") for w in _HYDRA_CODE_WORDS) or _HYDRA_CODE_VALUE.search(
                value
            ):
                return key
    return None


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def _hydra_run(cfg: DictConfig) -> float:
    """One job of ``fedexp run``: the task function of :func:`_hydra_main`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from fedexp.config.instantiate import check_targets
    from fedexp.config.schema import validate

    hc = HydraConfig.get()
    try:
        check_targets(cfg, "")  # fedexp's own classes only, refused before any import
        validate(cfg)  # the ranges, before torch and the runner are imported
    except ConfigError as exc:
        print(f"fedexp: error: {exc}", file=sys.stderr)
        if hc.mode == RunMode.MULTIRUN:
            return math.nan  # one bad job of a sweep does not stop the others
        sys.exit(1)
    from fedexp.engine.runner import run

    _set_threads(cfg.threads, hc)
    tags: dict[str, str] = {
        f"choice.{k}": str(v) for k, v in hc.runtime.choices.items() if not k.startswith("hydra")
    }
    run_name = None
    with open_dict(cfg):
        if cfg.output_dir is None:
            cfg.output_dir = hc.runtime.output_dir
        if hc.mode == RunMode.MULTIRUN:
            sweep = Path(hc.sweep.dir).as_posix().replace("/", "_")
            if "experiment" in cfg.tracker and cfg.tracker.experiment is None:
                cfg.tracker.experiment = f"fedexp/{sweep}"  # one experiment per sweep
            tags.update({"sweep": sweep, "sweep.overrides": " ".join(hc.overrides.task)})
            tags.update(
                {
                    f"sweep.{o.split('=', 1)[0]}": o.split("=", 1)[1]
                    for o in hc.overrides.task
                    if "=" in o
                }
            )
            run_name = ",".join(hc.overrides.task) or None
    try:  # SIGTERM stops the run like Ctrl-C: tracker run KILLED, checkpoint kept
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        result = run(cfg, run_name=run_name, tags=tags)
    except (FedexpError, KeyboardInterrupt) as exc:
        print(f"fedexp: {_describe_stop(exc, cfg, hc)}", file=sys.stderr)
        if hc.mode == RunMode.MULTIRUN and not isinstance(exc, KeyboardInterrupt):
            return math.nan  # one bad job of a sweep does not stop the others
        code = 128 + signal.SIGTERM if isinstance(exc, Terminated) else 130
        sys.exit(code if isinstance(exc, KeyboardInterrupt) else 1)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    _print_table(result)
    headline = next(iter(result.per_client[0]), "acc")  # the task's first metric: acc or iou
    return float(result.metrics.get(f"{headline}/mean", math.nan))


def _hydra_main() -> Callable[[], Any]:
    """The Hydra app around :func:`_hydra_run` (version_base 1.3), built on first use."""
    import hydra

    from fedexp.config.instantiate import register_resolvers
    from fedexp.config.schema import register_configs

    register_configs()
    register_resolvers()
    return hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(_hydra_run)


def main() -> None:
    """Entry point: ``fedexp run [hydra overrides]``."""
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args else 2)
    if args[0] == "report":
        from fedexp.report import main as report

        report(args[1:])
        return
    if args[0] != "run":
        print(f"fedexp: unknown command {args[0]!r} (expected: run or report)", file=sys.stderr)
        sys.exit(2)
    bad = _hydra_code_override(args[1:])
    if bad:
        print(
            f"fedexp: error: {bad}: Hydra settings that name code (callbacks, _target_, "
            "logging classes) cannot be overridden; only fedexp's own classes can be configured",
            file=sys.stderr,
        )
        sys.exit(1)
    from fedexp.config.schema import override_errors

    early = override_errors(args[1:])  # lr=-1: one line before Hydra composes anything
    if early:
        print(f"fedexp: error: {'; '.join(early)}", file=sys.stderr)
        sys.exit(1)
    sys.argv = [sys.argv[0], *args[1:]]
    _hydra_main()()


def __getattr__(name: str) -> Any:
    """``fedexp.cli.OmegaConf``, imported on first use (module attribute, PEP 562)."""
    if name == "OmegaConf":
        from omegaconf import OmegaConf

        return OmegaConf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["main"]  # fedexp.cli.OmegaConf still resolves (__getattr__)

if __name__ == "__main__":  # python -m fedexp.cli ...
    main()
