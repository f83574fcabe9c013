"""What a Hydra sweeper maximises when it tunes a run (``hparams_search``, docs/tuning.md).

The value of a run is its headline metric, mean over clients, at the last round: on the
clients' validation splits (``val/<headline>/mean``) when ``val_fraction > 0``, else on their
test splits, which leaks the test data into the choice of hyperparameters (a warning says so,
once per process). The headline is the task's first metric: IoU for segmentation, Dice (the
mean over the regions) for all BraTS regions at once, accuracy for classification.

A failed job of a sweep returns NaN (the CLI's task function). The Optuna sweeper cannot take
it (hydra-optuna-sweeper 1.3 passes the NaN on when it records the failure, and Optuna refuses:
the whole study stops); :class:`NaNTrialsFail`, a Hydra callback that the ``hparams_search``
configs install, turns such a job into a failed Hydra job, which the sweeper records as a
failed trial before going on.

A search space the Optuna sweeper would refuse is caught before Hydra runs by
:func:`fedexp.tuning.search_space.search_space_errors`.

The same callback, in the process that runs the study, writes Optuna's log lines without
colour codes where stderr is no terminal (a log file, a pipe: :func:`plain_optuna_logs`), and
at the end of the study warns, one line per parameter, when the best value lies at the edge of
its search range (:func:`edge_warnings`: the optimum may lie beyond it). A trial's job line
shows the objective first (:func:`job_metrics`).

No torch or MLflow import: the CLI imports this module after Hydra, to return a job's value.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from fedexp.errors import FedexpError

log = logging.getLogger("fedexp")

#: Headline metrics by precedence: a segmentation run has both IoU and pixel accuracy, and
#: IoU is its headline; a run of all BraTS regions has Dice (their mean) and pixel accuracy,
#: and Dice is its headline; a classification run has accuracy.
HEADLINES = ("iou", "dice", "acc")

#: Prefix of the validation split's metrics (``fedexp.engine.round.engine.Engine.evaluate``).
VAL_PREFIX = "val/"

#: A best value within this share of its search range (of its logarithm on a log scale) from
#: one end lies "at the edge" of the range (:func:`edge_warnings`).
EDGE_SHARE = 0.05

#: Optuna's own log line format (``optuna.logging``), kept with or without colour.
OPTUNA_FORMAT = "[%(levelname)1.1s %(asctime)s] %(message)s"

_warned = False


def headline(metrics: Mapping[str, float]) -> str:
    """The headline metric among ``metrics``: ``iou``, else ``dice`` (all regions), else ``acc``."""
    for name in HEADLINES:
        if f"{name}/mean" in metrics or f"{VAL_PREFIX}{name}/mean" in metrics:
            return name
    return HEADLINES[-1]


def objective_key(cfg: Mapping[str, Any], metrics: Mapping[str, float]) -> str:
    """The metric :func:`objective_value` returns: ``val/acc/mean``, ``acc/mean``, ...."""
    prefix = VAL_PREFIX if _val_fraction(cfg) > 0 else ""
    return f"{prefix}{headline(metrics)}/mean"


def objective_value(cfg: Mapping[str, Any], metrics: Mapping[str, float]) -> float:
    """The value a Hydra sweeper maximises for one finished run.

    Args:
        cfg: the run's config (``val_fraction`` is read; missing means 0).
        metrics: the run's final metrics (the last evaluated round's aggregates).

    Returns:
        ``val/<headline>/mean`` when ``val_fraction > 0``; otherwise the test split's
        ``<headline>/mean``, with a warning (logged once per process where a sweeper
        optimises the value) that tuning on the test split leaks. NaN when the metric is
        missing or not finite, which Optuna records as a failed trial.
    """
    key = objective_key(cfg, metrics)
    if not key.startswith(VAL_PREFIX):
        _warn_test_leak(key)
    value = metrics.get(key)
    if value is None:
        log.warning("the run has no %s: its objective value is NaN (a failed trial)", key)
        return math.nan
    value = float(value)
    return value if math.isfinite(value) else math.nan


def job_metrics(cfg: Mapping[str, Any], metrics: Mapping[str, float]) -> dict[str, float]:
    """What a sweep job's line shows: the objective first where a sweeper optimises it.

    ``{"val/acc/mean": 0.91, "acc/mean": 0.88}`` in a tuning sweep (the objective, then the
    headline test metric); ``{"acc/mean": 0.88}`` in a plain grid sweep, where nothing is
    optimised. Metrics the run lacks are left out.

    Args:
        cfg: the run's config (``val_fraction``).
        metrics: the run's final metrics.
    """
    out: dict[str, float] = {}
    if _optimised():
        key = objective_key(cfg, metrics)
        if key in metrics:
            out[key] = float(metrics[key])
    test = f"{headline(metrics)}/mean"
    if test in metrics:
        out.setdefault(test, float(metrics[test]))
    return out


def plain_optuna_logs() -> None:
    """Optuna's log lines with colour codes on a terminal only, never in a file or a pipe.

    Optuna's own handler colours every line (colorlog, whatever the stream); this replaces it
    with one on stderr whose formatter drops the codes when stderr is no terminal (and with
    ``NO_COLOR`` set). Idempotent.
    """
    import colorlog
    import optuna

    logger = logging.getLogger("optuna")
    if any(getattr(h, "fedexp_plain", False) for h in logger.handlers):
        return
    optuna.logging.disable_default_handler()
    handler = logging.StreamHandler()  # sys.stderr, as Optuna's
    handler.setFormatter(
        colorlog.ColoredFormatter(f"%(log_color)s{OPTUNA_FORMAT}", stream=handler.stream)
    )
    handler.fedexp_plain = True  # type: ignore[attr-defined]
    logger.addHandler(handler)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def edge_of(distribution: Any, value: Any) -> tuple[str, float, str] | None:
    """Where ``value`` lies at the edge of an Optuna ``distribution``, or None.

    Returns:
        ``("upper", 1.0, "[0.0001, 1] (log scale)")``: which end, its value and the range as
        text. A numeric range (an interval, a range, an int): within :data:`EDGE_SHARE` of
        its width from an end (of its logarithm's, on a log scale); numeric choices, three or
        more: the smallest or the largest (with two, every value is an end: no warning).
    """
    v = _number(value)
    if v is None:
        return None
    choices = getattr(distribution, "choices", None)
    if choices is not None:
        numbers = sorted({n for n in map(_number, choices) if n is not None})
        if len(numbers) < 3 or len(numbers) != len(set(choices)):
            return None
        text = "{" + ", ".join(f"{n:g}" for n in numbers) + "}"
        if v == numbers[0]:
            return "lower", numbers[0], text
        if v == numbers[-1]:
            return "upper", numbers[-1], text
        return None
    low, high = (
        _number(getattr(distribution, "low", None)),
        _number(getattr(distribution, "high", None)),
    )
    if low is None or high is None or not low < high:
        return None
    log = bool(getattr(distribution, "log", False)) or "Log" in type(distribution).__name__
    text = f"[{low:g}, {high:g}]" + (" (log scale)" if log else "")
    if log and low > 0 and v > 0:
        share = (math.log(v) - math.log(low)) / (math.log(high) - math.log(low))
    else:
        share = (v - low) / (high - low)
    if share <= EDGE_SHARE:
        return "lower", low, text
    if share >= 1 - EDGE_SHARE:
        return "upper", high, text
    return None


def edge_warnings(distributions: Mapping[str, Any], best: Mapping[str, Any]) -> list[str]:
    """One line per parameter whose best value lies at the edge of its search range."""
    lines = []
    for name, value in best.items():
        if name not in distributions:
            continue
        edge = edge_of(distributions[name], value)
        if edge is None:
            continue
        side, end, text = edge
        lines.append(
            f"the best {name}={value:g} lies at the {side} end ({end:g}) of its search range "
            f"{text}: the optimum may lie beyond it; widen the range and tune again"
        )
    return lines


def search_space(config: Any) -> dict[str, Any]:
    """The Optuna sweeper's distributions of a sweep's config, as the sweeper builds them.

    ``hydra.sweeper.params`` then the command line's overrides (which win), through the
    plugin's own conversion; empty where another sweeper ran or the plugin is missing.
    """
    from omegaconf import OmegaConf

    if not _optuna_sweep(config):
        return {}
    try:
        from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
    except ImportError:
        return {}
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
    words = (
        [f"{k}={v}" for k, v in (OmegaConf.to_container(params) or {}).items()] if params else []
    )
    words += [str(o) for o in OmegaConf.select(config, "hydra.overrides.task", default=[]) or []]
    try:
        distributions, _ = create_params_from_overrides(words)
    except Exception:  # noqa: BLE001 - the sweep itself already parsed them; nothing to warn
        return {}
    return distributions


def _optuna_sweep(config: Any) -> bool:
    """Whether the sweep's sweeper is Hydra's Optuna sweeper."""
    from omegaconf import OmegaConf

    target = str(OmegaConf.select(config, "hydra.sweeper._target_", default="") or "")
    return "optuna" in target.lower()


def _best_params(sweep_dir: str | Path) -> dict[str, Any]:
    """``best_params`` of ``<sweep dir>/optimization_results.yaml`` (empty when absent)."""
    import yaml

    path = Path(sweep_dir) / "optimization_results.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    best = data.get("best_params") if isinstance(data, dict) else None
    return dict(best) if isinstance(best, dict) else {}


class NaNTrialsFail(Callback):
    """Hydra callback: a job that returned NaN is a failed job (so a failed Optuna trial).

    Installed by ``conf/hparams_search/*.yaml`` (``hydra.callbacks.nan_trials_fail``). Hydra
    calls :meth:`on_job_end` right after the task function, before the launcher hands the
    job's result to the sweeper; the job's status becomes FAILED with a
    :class:`~fedexp.errors.FedexpError` saying why, which the Optuna sweeper records as a
    failed trial (``max_failure_rate: 1.0`` in the configs: the study goes on).

    In the process that runs the study, :meth:`on_multirun_start` makes Optuna's log lines
    plain where stderr is no terminal (:func:`plain_optuna_logs`) and :meth:`on_multirun_end`
    warns on stderr, one line per parameter, when the best value lies at the edge of its
    search range (:func:`edge_warnings`).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Optuna's log lines without colour codes in files and pipes."""
        if _optuna_sweep(config):
            plain_optuna_logs()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Warn about best values at the edge of their search range."""
        distributions = search_space(config)
        if not distributions:
            return
        for line in edge_warnings(distributions, _best_params(config.hydra.sweep.dir)):
            print(f"fedexp: warning: {line}", file=sys.stderr, flush=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        """Mark a job that returned NaN as failed."""
        value = job_return._return_value  # the getter raises for a failed job
        if job_return.status != JobStatus.COMPLETED or not isinstance(value, float):
            return
        if math.isnan(value):
            job_return.status = JobStatus.FAILED
            job_return.return_value = FedexpError(
                "the run failed or diverged (its error is above) and returned NaN: a failed trial"
            )


def _val_fraction(cfg: Mapping[str, Any]) -> float:
    value = cfg.get("val_fraction", 0.0)
    return float(value) if value is not None else 0.0


def _warn_test_leak(key: str) -> None:
    """Warn once per process that the objective is a test metric (where it is optimised)."""
    global _warned
    if _warned or not _optimised():
        return
    _warned = True
    log.warning(
        "val_fraction=0: the sweep's objective is the test split's %s, so tuning on it leaks "
        "the test data into the choice of hyperparameters; set val_fraction > 0 (the "
        "hparams_search configs set 0.2) to tune on a validation split (docs/tuning.md)",
        key,
    )


def _optimised() -> bool:
    """False where nothing optimises the returned value: a single run, or a plain grid sweep.

    Outside Hydra (the Python API) the caller asked for an objective: True.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return True
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return False
    target = str((hc.get("sweeper") or {}).get("_target_", ""))
    return not target.endswith("BasicSweeper")
