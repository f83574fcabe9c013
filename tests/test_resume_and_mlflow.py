"""MLflow records and checkpoint/resume: an interrupted run resumed ends exactly like an
uninterrupted one, in the same MLflow run."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from fedexp.engine.runner import run
from helpers import deterministic
from helpers import mlflow_db
from helpers import run_cli


def _mlflow_cfg(make, tmp_path, *overrides):
    cfg = make(*overrides)
    with open_dict(cfg):
        cfg.tracker.uri = mlflow_db(tmp_path / "mlflow.db")
    return cfg


def _history(client, run_id):
    run = client.get_run(run_id)
    out = {}
    for key in run.data.metrics:
        out[key] = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    return out


def test_mlflow_holds_params_metrics_and_artifacts(small_cfg, tmp_path):
    res = run(_mlflow_cfg(small_cfg, tmp_path, "rounds=4", "algorithm=fedavg"))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    r = client.get_run(res.run_id)
    assert r.info.status == "FINISHED"
    assert r.data.params["rounds"] == "4"
    assert r.data.params["algorithm._target_"] == "fedexp.algorithms.fedavg.FedAvg"
    assert r.data.params["partition.delta"] == "2.0"
    steps = [m.step for m in client.get_metric_history(res.run_id, "acc/weighted")]
    assert steps == [0, 1, 2, 3, 4]
    up = client.get_metric_history(res.run_id, "bytes/up")
    assert [m.step for m in up] == [1, 2, 3, 4]  # every round, constant or not (a curve, not a dot)
    assert {m.value for m in up} == {5 * 4 * 31}
    arts = {a.path for a in client.list_artifacts(res.run_id)}
    assert {"config.yaml", "clients.csv", "rounds.csv", "curves.png"} <= arts
    # MLflow 3 opens untagged experiments in its GenAI view; this tag selects the ML view
    exp = client.get_experiment(r.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.parametrize("algorithm", ["fedavg", "local"])
def test_resume_after_interruption_equals_uninterrupted_run(small_cfg, tmp_path, algorithm):
    overrides = (
        "rounds=7",
        "checkpoint_every=2",
        f"algorithm={algorithm}",
        "participation=0.6",
        "batch_size=16",
    )
    full = run(_mlflow_cfg(small_cfg, tmp_path / "a", *overrides))

    def interrupt(engine, metrics):
        if engine.round == 5:  # checkpoint at round 4; round 5 is logged, then a "crash"
            raise KeyboardInterrupt

    cfg = _mlflow_cfg(small_cfg, tmp_path / "b", *overrides)
    with open_dict(cfg):
        cfg.output_dir = str(tmp_path / "b" / "out")
    with pytest.raises(KeyboardInterrupt):
        run(cfg, callbacks=[interrupt])
    client_b = MlflowClient(f"sqlite:///{tmp_path}/b/mlflow.db")
    (killed,) = client_b.search_runs([client_b.get_experiment_by_name("fedexp").experiment_id])
    assert killed.info.status == "KILLED"
    with open_dict(cfg):
        cfg.resume = str(tmp_path / "b" / "out" / "checkpoints")
        cfg.output_dir = str(tmp_path / "b" / "out2")
    resumed = run(cfg)
    assert resumed.run_id == killed.info.run_id
    client_a = MlflowClient(f"sqlite:///{tmp_path}/a/mlflow.db")
    ha = deterministic(_history(client_a, full.run_id))
    hb = deterministic(_history(client_b, resumed.run_id))
    assert ha.keys() == hb.keys()
    for key in ha:
        assert ha[key] == hb[key], key
    assert client_b.get_run(resumed.run_id).info.status == "FINISHED"
    assert resumed.per_client == full.per_client


def test_resume_with_changed_settings_is_refused(small_cfg, tmp_path):
    cfg = small_cfg("rounds=2", "checkpoint_every=1", "tracker=none")
    run(cfg)
    with open_dict(cfg):
        cfg.resume = str(tmp_path / "out" / "checkpoints")
        cfg.batch_size = 16
    from fedexp.errors import ConfigError

    with pytest.raises(ConfigError, match="different batch_size"):
        run(cfg)


@pytest.mark.slow
def test_two_job_sweep_loses_no_run_and_no_metric(tmp_path):
    db = mlflow_db(tmp_path / "mlflow.db")
    proc = run_cli(
        "run",
        "-m",
        "algorithm=fedavg,local",
        "rounds=3",
        "progress=log",
        "device=cpu",
        "hydra/launcher=parallel",
        f"tracker.uri={db}",
        f"hydra.sweep.dir={tmp_path}/multirun",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(db)
    exps = [e for e in client.search_experiments() if e.name.startswith("fedexp/")]
    assert len(exps) == 1
    runs = client.search_runs([exps[0].experiment_id])
    runs = [r for r in runs if "mlflow.parentRunId" in r.data.tags]  # the jobs, not the parent
    assert sorted(r.data.tags["sweep.algorithm"] for r in runs) == ["fedavg", "local"]
    for r in runs:
        assert r.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "acc/weighted")]
        assert steps == [0, 1, 2, 3]
        assert len(client.get_metric_history(r.info.run_id, "bytes/up_cum")) == 3
