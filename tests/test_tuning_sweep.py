"""Tuning through ``fedexp run -m hparams_search=...``: Hydra's Optuna sweeper maximises the
validation metric the runs log, and a failed job is a failed trial, not the end of the study.

These run the real CLI; they need the three pieces that wire tuning in (conf/config.yaml's
``- hparams_search: null`` default, the runner's ``federate(..., val_fraction=...)`` and the
CLI's task function returning :func:`fedexp.tuning.objective.objective_value`).
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import yaml
from hydra import compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from helpers import CONF
from helpers import run_cli

pytestmark = pytest.mark.slow  # several processes or whole CLI runs: make test-slow

SMALL = ("num_clients=3", "progress=none", "checkpoint_every=0", "device=cpu")


def _sweep(tmp_path, *args):
    proc = run_cli(
        "run",
        "-m",
        *args,
        *SMALL,
        f"hydra.sweep.dir={tmp_path}/sweep",
        cwd=tmp_path,
    )
    results = tmp_path / "sweep" / "optimization_results.yaml"
    assert results.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, yaml.safe_load(results.read_text())


def _trial_runs(tmp_path) -> list:
    """The MLflow runs of the sweep's trials (those that logged a validation metric)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    exp = client.get_experiment_by_name("fedexp/tuning-test")
    runs = client.search_runs([exp.experiment_id])
    return [r for r in runs if "val/acc/mean" in r.data.metrics]


def test_lr_search_maximises_the_logged_validation_accuracy(tmp_path):
    proc, results = _sweep(
        tmp_path,
        "hparams_search=lr",
        "rounds=1",
        "hydra.sweeper.n_trials=2",
        f"tracker.uri=sqlite:///{tmp_path}/m.db",
        "tracker.experiment=fedexp/tuning-test",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = _trial_runs(tmp_path)
    assert len(runs) == 2
    for r in runs:
        assert r.data.params["val_fraction"] == "0.2"
    best = max(runs, key=lambda r: r.data.metrics["val/acc/mean"])
    assert results["best_value"] == pytest.approx(best.data.metrics["val/acc/mean"], abs=1e-12)
    assert results["best_params"]["lr"] == pytest.approx(float(best.data.params["lr"]))
    lrs = sorted(float(r.data.params["lr"]) for r in runs)
    assert lrs[0] != lrs[1] and 1e-4 <= lrs[0] and lrs[1] <= 1  # drawn from the log interval


def test_a_failed_job_is_a_failed_trial_and_the_study_goes_on(tmp_path):
    # lr=-1 fails the range check: its job returns NaN. TPE's seeded start-up draws (seed 0 in
    # conf/hparams_search/lr.yaml) try 0.1, -1, 0.1: the failed trial is in the middle, and
    # the third trial shows the study went on. No MLflow here (faster): the finished jobs'
    # rounds.csv hold what they logged.
    proc, results = _sweep(
        tmp_path,
        "hparams_search=lr",
        "rounds=1",
        "lr=choice(-1,0.1)",
        "hydra.sweeper.n_trials=3",
        "tracker=none",
    )
    assert "lr=-1.0: expected > 0" in proc.stderr
    assert "returned NaN: a failed trial" in proc.stdout + proc.stderr
    ran = sorted((tmp_path / "sweep").rglob("rounds.csv"))
    assert len(ran) == 2 and "2 ok, 1 failed" in proc.stdout  # trials 0 and 2; 1 failed
    rounds = ran[-1]
    last = pd.read_csv(rounds).iloc[-1]
    assert yaml.safe_load((rounds.parent / "config.yaml").read_text())["lr"] == 0.1
    assert results["best_params"] == {"lr": 0.1}
    assert results["best_value"] == pytest.approx(last["val/acc/mean"], abs=1e-12)
    assert not math.isnan(results["best_value"])


@pytest.mark.parametrize(
    ("search", "algorithm", "keys"),
    [
        ("lr", "fedavg", ["lr"]),
        ("lr_grid", "local", ["lr"]),
        ("fedprox", "fedprox", ["lr", "algorithm.mu"]),
        ("ditto", "ditto", ["lr", "algorithm.lam"]),
        ("pfednet", "pfednet", ["lr", "algorithm.lam"]),
    ],
)
def test_hparams_search_configs(search, algorithm, keys):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[f"hparams_search={search}", f"algorithm={algorithm}"],
            return_hydra_config=True,
        )
    sweeper = cfg.hydra.sweeper
    assert list(sweeper.params) == keys
    if search == "lr_grid":  # a plain grid: Hydra's basic sweeper, every value once
        assert sweeper._target_.endswith("BasicSweeper")
        assert sweeper.params.lr == "1,0.1,0.01,0.001,0.0001"  # pFedSOP §V's grid
        assert cfg.val_fraction == 0.2
        return
    assert sweeper._target_.endswith("OptunaSweeper")
    assert sweeper.direction == "maximize" and sweeper.study_name and sweeper.n_trials >= 5
    assert sweeper.max_failure_rate == 1.0 and sweeper.storage is None
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler"
    assert sweeper.sampler.seed == 0
    for key in keys:  # every searched key exists in the composed run config
        assert OmegaConf.select(cfg, key) is not None, key
    assert cfg.val_fraction == 0.2
    assert cfg.hydra.callbacks.nan_trials_fail._target_ == "fedexp.tuning.objective.NaNTrialsFail"
