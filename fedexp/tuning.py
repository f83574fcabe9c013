"""What a Hydra sweeper maximises when it tunes a run (``hparams_search``, docs/tuning.md).

The value of a run is its headline metric, mean over clients, at the last round: on the
clients' validation splits (``val/<headline>/mean``) when ``val_fraction > 0``, else on their
test splits, which leaks the test data into the choice of hyperparameters (a warning says so,
once per process). The headline is the task's first metric: IoU for segmentation, accuracy for
classification.

A failed job of a sweep returns NaN (the CLI's task function). The Optuna sweeper cannot take
it (hydra-optuna-sweeper 1.3 passes the NaN on when it records the failure, and Optuna refuses:
the whole study stops); :class:`NaNTrialsFail`, a Hydra callback that the ``hparams_search``
configs install, turns such a job into a failed Hydra job, which the sweeper records as a
failed trial before going on.

A search space the Optuna sweeper would refuse is caught before Hydra runs by
:func:`fedexp.search_space.search_space_errors`.

No torch or MLflow import: the CLI imports this module after Hydra, to return a job's value.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from fedexp.errors import FedexpError

log = logging.getLogger("fedexp")

#: Headline metrics by precedence: a segmentation run has both IoU and pixel accuracy, and
#: IoU is its headline; a classification run has accuracy.
HEADLINES = ("iou", "acc")

#: Prefix of the validation split's metrics (``fedexp.engine.engine.Engine.evaluate``).
VAL_PREFIX = "val/"

_warned = False


def headline(metrics: Mapping[str, float]) -> str:
    """The task's headline metric among ``metrics``: ``iou`` for segmentation, else ``acc``."""
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


class NaNTrialsFail(Callback):
    """Hydra callback: a job that returned NaN is a failed job (so a failed Optuna trial).

    Installed by ``conf/hparams_search/*.yaml`` (``hydra.callbacks.nan_trials_fail``). Hydra
    calls :meth:`on_job_end` right after the task function, before the launcher hands the
    job's result to the sweeper; the job's status becomes FAILED with a
    :class:`~fedexp.errors.FedexpError` saying why, which the Optuna sweeper records as a
    failed trial (``max_failure_rate: 1.0`` in the configs: the study goes on).
    """

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
