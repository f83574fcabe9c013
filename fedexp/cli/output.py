"""What ``fedexp run`` prints at the end of a run: the per-client table, or why it stopped.

:func:`print_table` is the end-of-run table; :func:`describe_stop` the one line of a run that
stopped (an error, Ctrl-C, SIGTERM) with how to go on: the resume command where a checkpoint
was kept, and after a divergence the rescue from the last healthy checkpoint with a smaller
``lr`` (:func:`rescue_hint`, :func:`rescue_lr`).
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from fedexp.errors import CheckpointError
from fedexp.errors import ConfigError
from fedexp.errors import DivergenceError
from fedexp.errors import RankDied
from fedexp.errors import Terminated

if TYPE_CHECKING:
    from omegaconf import DictConfig


#: Clients the end-of-run table lists (the rest are in clients.csv).
SHOWN_CLIENTS = 50

#: The configs ``fedexp run`` composes (``fedexp.cli.overrides.CONFIG_DIR``).
_CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"


#: The evaluation views beside a client's own model (``fedexp.engine.round.views``)
_VIEWS = ("global/", "gain/", "new/")


def _columns(per_client: list[dict[str, float]]) -> list[str]:
    """The table's metric columns: the clients' own, then the views of the headline metric.

    The task's metrics in its order (acc, bal_acc, auc / iou, label_iou, dice, acc), then
    loss; of the views (``global/``, ``gain/``, ``new/``: every one is in clients.csv and the
    tracker) the first metric's alone, so that the table keeps to a terminal's width, and
    the global model's and the gain only where personalisation changed a figure (FedAvg's
    personal model is the global one: its gains are all 0).
    """
    seen = list(dict.fromkeys(k for row in per_client for k in row if k != "num_test"))
    own = [k for k in seen if not k.startswith(_VIEWS)]
    head = own[0] if own else None
    views = [f"{v}{head}" for v in _VIEWS if head is not None and f"{v}{head}" in seen]
    gain = f"gain/{head}"
    if gain in views and all(row.get(gain, 0.0) == 0.0 for row in per_client):
        views = [v for v in views if not v.startswith(("global/", "gain/"))]
    if not own:  # (every client held out)
        views = [k for k in seen if k.startswith("new/")]
    return own + views


def print_table(result) -> None:  # noqa: ANN001 - RunResult, imported lazily
    """The per-client table of a finished run, where its results are, how to view them.

    On a terminal the table fits its width; piped to a file or a program (no terminal: rich
    would take 80 columns and wrap the row labels over lines) it is as wide as it needs.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="Per-client results on each client's own test split",
        caption="mean of best rounds: each client's best evaluated round, averaged over the "
        "clients (pFedSOP's protocol), not the best client",
    )
    keys = _columns(result.per_client)
    for col in ("client", "test n", *keys):
        table.add_column(col, justify="right")
    shown = result.per_client[:SHOWN_CLIENTS]  # a run of 10^6 clients: its first rows
    for n, row in enumerate(shown):
        cells = [f"{row[k]:.4f}" if not math.isnan(row.get(k, math.nan)) else "—" for k in keys]
        table.add_row(str(n), str(int(row["num_test"])), *cells)
    if len(result.per_client) > len(shown):
        more = len(result.per_client) - len(shown)
        table.add_row(f"… {more:,} more", "", *["" for _ in keys])
        table.caption += f"; every client's row: {Path(result.output_dir) / 'clients.csv'}"
    m = result.metrics
    # rows named for what they are (the best_mean row is no best client: the caption says
    # what it is), short enough that 80 columns hold a segmentation run's seven
    rows = (
        ("mean over clients", "mean"),
        ("weighted by test n", "weighted"),
        ("worst client", "worst"),
        ("mean of best rounds", "best_mean"),
    )
    for label, suffix in rows:
        cells = [f"{m[f'{k}/{suffix}']:.4f}" if f"{k}/{suffix}" in m else "—" for k in keys]
        table.add_row(f"[bold]{label}", "", *cells)
    console = Console()
    if not console.is_terminal:  # piped to a file: the table's own width, never wrapped
        wide = console.options.update_width(10_000)
        console = Console(width=max(console.width, console.measure(table, options=wide).maximum))
    console.print(table)
    # paths, URIs and the `fedexp ui` command: one line each, never wrapped, never markup
    console.print(f"results: {result.output_dir}", soft_wrap=True, markup=False)
    if "privacy/epsilon" in m:  # client-level DP: what the run spent (docs/privacy.md)
        eps = m["privacy/epsilon"]
        console.print(f"privacy: ε = {eps:.4g} spent at the run's privacy.delta", markup=False)
    console.print(result.tracker.describe(), soft_wrap=True, markup=False)


def describe_stop(exc: BaseException, cfg: DictConfig, hc: DictConfig) -> str:
    """One line on why the run stopped and, where a checkpoint exists, how to resume it."""
    text = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"error: {exc}"
    if isinstance(exc, Terminated):
        text = "terminated (SIGTERM)"
    if isinstance(exc, RankDied):  # "rank 1 died (signal 9, SIGKILL) in round 17"
        text = str(exc)
    if isinstance(exc, CheckpointError | ConfigError):
        # the checkpoint itself is unusable, or the command's setting was refused (the line
        # says which to change): no resume hint, which would be the refused command itself
        return text
    # resume= names a checkpoints folder or a file in one (last.safetensors, good.safetensors)
    path = Path(cfg.resume) if cfg.resume else Path(cfg.output_dir) / "checkpoints"
    is_file = path.suffix == ".safetensors" and not path.is_dir()
    folder = path.parent if is_file else path
    if isinstance(exc, DivergenceError):
        return text + rescue_hint(cfg, hc, folder, exc)
    if (folder / "last.safetensors").exists() or is_file:
        # resumed from a file: that file again (the good one is the last one's state while
        # the run stays healthy; before this run's first checkpoint, last.safetensors may
        # still be the diverged run's)
        overrides = " ".join(o for o in hc.overrides.task if not o.startswith("resume="))
        where = path if is_file else folder
        text += f"; checkpoint kept: fedexp run {overrides} resume={where}".replace("  ", " ")
    return text


def _without(overrides: list[str], keys: tuple[str, ...]) -> list[str]:
    """``overrides`` less those setting one of ``keys`` (``lr=``, ``+lr=``, ``~lr``, ...)."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in keys]


def default_lr(overrides: list[str]) -> float | None:
    """The lr the run's config has without the command line's ``lr``: its default.

    The config composed as ``fedexp run`` composes it from ``overrides`` less ``lr`` and
    ``resume`` (an experiment's or a sweep's settings stay: their lr is the default); None
    when it cannot be composed.
    """
    from hydra import compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    keep = _without([o for o in overrides if not o.startswith("hydra.")], ("lr", "resume"))
    try:
        if GlobalHydra.instance().is_initialized():  # inside `fedexp run`: Hydra's own loader
            cfg = compose(config_name="config", overrides=keep)
        else:
            with initialize_config_dir(str(_CONFIG_DIR), version_base="1.3"):
                cfg = compose(config_name="config", overrides=keep)
        value = float(cfg.lr)
    except Exception:  # noqa: BLE001 - no default to offer: the caller falls back to lr / 10
        return None
    return value if math.isfinite(value) and value > 0 else None


def rescue_lr(lr: float, overrides: list[str]) -> float:
    """The lr a rescue after a divergence offers: the default lr, or ``lr / 10`` below it.

    The config's default lr when the failing ``lr`` is above it, else ``lr / 10``. The default
    (:func:`default_lr`: ``conf/config.yaml``'s, or the experiment's; what the project's runs
    and golden tests train with) is a point known to train that dataset, model and algorithm,
    however far above it the failing lr was, whereas ``lr / 10`` after a run that diverged in
    round 1 at ``lr=1e38``, ``1e6`` (logistic regression) or ``1e4`` (MLP) is still orders of
    magnitude too large and diverged again every time (issue 44, item 7). At or below the
    default (the default itself diverged): a decade lower, as before.
    """
    default = default_lr(overrides)
    if default is not None and lr > default:
        return default
    return lr / 10


def rescue_hint(cfg: DictConfig, hc: DictConfig, folder: Path, exc: BaseException) -> str:
    """How to go on after a divergence: the same command with a smaller lr (:func:`rescue_lr`).

    It resumes from the last checkpoint whose round was healthy
    (:func:`fedexp.engine.files.checkpoint.rescue_point`: the folder, when its last checkpoint is
    healthy, else its ``good.safetensors``; lr may change on resume, and the runner records
    the change in the checkpoint and in MLflow tags), and says from which round; with no
    healthy checkpoint it starts the run again.
    """
    from fedexp.engine.files.checkpoint import rescue_point

    lr = f"lr={rescue_lr(float(cfg.lr), list(hc.overrides.task)):g}"
    keep = _without(list(hc.overrides.task), ("lr", "resume"))
    point = rescue_point(folder)
    if point.resume is None:
        command = shlex.join(["fedexp", "run", *keep, lr])
        if point.kind == "unhealthy":
            return (
                "; no healthy checkpoint (each was taken after the loss had blown up): "
                f"run it again with a smaller lr: {command}"
            )
        return f"; no checkpoint yet: run it again with a smaller lr: {command}"
    command = shlex.join(["fedexp", "run", *keep, f"resume={point.resume}", lr])
    if point.round is None:  # an older fedexp's checkpoint (no health recorded)
        return f"; checkpoint kept, resume it with a smaller lr: {command}"
    where = f"round {point.round}"
    diverged = re.search(r"\bround (\d+)", str(exc))  # "by round 7", "in round 7"
    if diverged and int(diverged.group(1)) - point.round > 1:  # far back: say how far
        where += f", {int(diverged.group(1)) - point.round} rounds before the divergence"
    if point.kind == "good":
        after = "" if point.last_round is None else f" (to round {point.last_round})"
        return (
            f"; checkpoint kept, but the last ones{after} were taken as the loss blew up: "
            f"resume the last healthy one ({where}) with a smaller lr: {command}"
        )
    return f"; checkpoint kept ({where}), resume it with a smaller lr: {command}"
