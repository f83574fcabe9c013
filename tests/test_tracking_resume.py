"""MLflow records across a run's ends: a resumed run logs its data set once (again only if
the data changed) and its system metrics go on; the system-metrics monitor stops on
FINISHED, FAILED and KILLED alike."""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from fedexp.engine.runner import run
from helpers import SMALL
from helpers import compose_config
from helpers import mlflow_db

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    """One store for the module (each test its own experiment): MLflow sets a store up once."""
    return mlflow_db(tmp_path_factory.mktemp("store") / "m.db")


def _cfg(tmp, uri, experiment, *overrides):
    cfg = compose_config(*SMALL, "num_clients=3", *overrides, output_dir=tmp / "out")
    with open_dict(cfg):
        cfg.tracker.uri = uri
        cfg.tracker.experiment = experiment
        cfg.tracker.system_metrics_interval = 0.05
    return cfg


def _steps(client, run_id, key):
    return [m.step for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def _monitors_alive():
    return [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor" and t.is_alive()]


@pytest.mark.parametrize(
    ("raised", "status"), [(RuntimeError, "FAILED"), (KeyboardInterrupt, "KILLED")]
)
def test_system_metrics_stop_when_a_run_fails_or_is_killed(tmp_path, uri, raised, status):
    def stop(engine, metrics):
        raise raised("stop")

    cfg = _cfg(tmp_path, uri, status, "rounds=2")
    with open_dict(cfg):  # no sample is due before the run ends: what is logged, its end logs
        cfg.tracker.system_metrics_interval = 600
    with pytest.raises(raised):
        run(cfg, callbacks=[stop])
    assert not _monitors_alive()  # not left waiting for its next sample
    client = MlflowClient(uri)
    (r,) = client.search_runs([client.get_experiment_by_name(status).experiment_id])
    assert r.info.status == status
    assert _steps(client, r.info.run_id, "system/cpu_utilization_percentage") == [0]


def test_resume_logs_the_dataset_once_and_a_changed_one_again(tmp_path, uri, caplog):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(90, 3))
    y = (x[:, 0] > 0).astype(int)
    path = tmp_path / "d.csv"
    pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "y": y}).to_csv(path, index=False)
    overrides = ["dataset=csv", f"dataset.path={path}", "dataset.label=y", "batch_size=8"]
    cfg = _cfg(tmp_path, uri, "resumed", "rounds=1", "checkpoint_every=1", *overrides)
    first = run(cfg)
    with open_dict(cfg):
        cfg.resume = str(tmp_path / "out" / "checkpoints")
        cfg.rounds = 2
        cfg.output_dir = str(tmp_path / "out2")
    again = run(cfg)
    client = MlflowClient(cfg.tracker.uri)
    assert again.run_id == first.run_id
    (inp,) = client.get_run(first.run_id).inputs.dataset_inputs
    assert json.loads(inp.dataset.source) == {"uri": str(path)}
    assert inp.dataset.source_type == "local"
    steps = _steps(client, first.run_id, "system/cpu_utilization_percentage")
    assert len(steps) >= 2 and len(set(steps)) == len(steps)  # the resumed monitor goes on
    # the file edited between two attempts: recorded, with a warning
    frame = pd.read_csv(path)
    frame.loc[0, "a"] += 1.0
    frame.to_csv(path, index=False)
    with open_dict(cfg):
        cfg.rounds = 3
        cfg.output_dir = str(tmp_path / "out3")
    with caplog.at_level(logging.WARNING, logger="fedexp"):
        run(cfg)
    inputs = client.get_run(first.run_id).inputs.dataset_inputs
    assert len({i.dataset.digest for i in inputs}) == 2
    assert "changed since run" in caplog.text
    # three attempts, each round logged once, byte counts every round (constant ones too)
    assert _steps(client, first.run_id, "acc/mean") == [0, 1, 2, 3]
    assert _steps(client, first.run_id, "bytes/up") == [1, 2, 3]
    assert _steps(client, first.run_id, "bytes/up_cum") == [1, 2, 3]
    assert "round" not in client.get_run(first.run_id).data.metrics
