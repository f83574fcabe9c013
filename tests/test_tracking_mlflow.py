"""MLflow records you can tell apart (issue 13): provenance tags, the dataset input, system
metrics, no constant per-round series, the per-client table and plot; read back with
MLflow's own client."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import threading
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from fedexp.data.tabular import breast_cancer
from fedexp.engine.runner import run
from helpers import ROOT
from helpers import SMALL
from helpers import compose_config

#: 3 clients of logistic regression on breast cancer: 31 float32 parameters each way
DENSE_BYTES = 3 * 4 * 31


def _cfg(tmp, *overrides):
    cfg = compose_config(*SMALL, "num_clients=3", *overrides, output_dir=tmp / "out")
    with open_dict(cfg):
        cfg.tracker.uri = f"sqlite:///{tmp}/m.db"
    return cfg


def _steps(client, run_id, key):
    return [m.step for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def _monitors_alive():
    return [t for t in threading.enumerate() if t.name == "SystemMetricsMonitor" and t.is_alive()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One FedAvg run of 2 rounds, slowed down so that system metrics are sampled in it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("finished")
    cfg = _cfg(tmp, "rounds=2")
    with open_dict(cfg):
        cfg.tracker.system_metrics_interval = 0.05

    def slow(engine, metrics):
        time.sleep(0.3)

    try:
        res = run(cfg, callbacks=[slow])
    finally:
        torch.set_num_threads(threads)
    client = MlflowClient(cfg.tracker.uri)
    return SimpleNamespace(
        res=res, client=client, run=client.get_run(res.run_id), tmp=tmp, uri=cfg.tracker.uri
    )


def test_run_is_tagged_with_commit_versions_device_and_host(finished):
    tags = finished.run.data.tags
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        assert "mlflow.source.git.commit" not in tags  # not a checkout: skipped quietly
    else:
        assert tags["mlflow.source.git.commit"] == head.stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        assert tags["fedexp.git.dirty"] == ("true" if status else "false")
    assert tags["fedexp.version.torch"] == torch.__version__
    assert tags["fedexp.version.numpy"] == np.__version__
    for package in ("python", "fedexp", "mlflow", "hydra-core", "monai"):
        assert tags[f"fedexp.version.{package}"] not in ("", "absent"), package
    assert tags["fedexp.device"] == "cpu" and tags["fedexp.device.name"]
    assert tags["fedexp.host"] == socket.gethostname()


def test_dataset_is_an_mlflow_input_with_the_content_hash(finished):
    (inp,) = finished.run.inputs.dataset_inputs
    ds = inp.dataset
    data = breast_cancer()  # loaded again, hashed independently
    sha = hashlib.sha256(data.x.tobytes() + data.y.tobytes()).hexdigest()
    assert ds.name == "breast_cancer" and ds.digest == sha[:32]
    assert ds.source_type == "code"
    assert json.loads(ds.source) == {"tags": {"loader": "sklearn.datasets.load_breast_cancer"}}
    profile = json.loads(ds.profile)
    assert profile["sha256"] == sha and profile["num_classes"] == 2
    assert profile["features_shape"] == [569, 30] and profile["targets_shape"] == [569]
    schema = json.loads(ds.schema)["mlflow_tensorspec"]
    assert json.loads(schema["features"])[0]["tensor-spec"] == {
        "dtype": "float32",
        "shape": [-1, 30],
    }
    assert {t.key: t.value for t in inp.tags} == {"mlflow.data.context": "federated"}


def test_system_metrics_are_sampled_while_the_run_is_open(finished):
    keys = set(finished.run.data.metrics)
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= keys
    steps = _steps(finished.client, finished.res.run_id, "system/cpu_utilization_percentage")
    assert len(steps) >= 2 and len(set(steps)) == len(steps)  # sampled during the run
    assert not _monitors_alive()  # and stopped when it ended


def test_round_is_the_step_and_constant_byte_counts_are_logged_every_round(finished):
    c, rid = finished.client, finished.res.run_id
    assert "round" not in finished.run.data.metrics
    up = c.get_metric_history(rid, "bytes/up")
    # dense: the same each round, logged each round (a line in MLflow's charts, not a dot)
    assert sorted((m.step, m.value) for m in up) == [(1, DENSE_BYTES), (2, DENSE_BYTES)]
    assert _steps(c, rid, "bytes/down") == [1, 2]
    assert _steps(c, rid, "bytes/up_dense") == [1, 2]
    cum = sorted(c.get_metric_history(rid, "bytes/up_cum"), key=lambda m: m.step)
    assert [(m.step, m.value) for m in cum] == [(1, DENSE_BYTES), (2, 2 * DENSE_BYTES)]
    assert _steps(c, rid, "acc/mean") == [0, 1, 2]
    assert _steps(c, rid, "compression/up") == [1, 2]  # every other metric as before
    # rounds.csv keeps every round's value, round included
    rounds = pd.read_csv(finished.res.output_dir / "rounds.csv")
    assert rounds["round"].tolist() == [0, 1, 2]
    assert rounds["bytes/up"].dropna().tolist() == [DENSE_BYTES, DENSE_BYTES]


def test_per_client_table_and_plot_are_artifacts(finished):
    c, rid = finished.client, finished.res.run_id
    arts = {a.path for a in c.list_artifacts(rid)}
    assert {"clients_rounds.csv", "clients_rounds.json", "clients.png"} <= arts
    logged = json.loads(finished.run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "clients_rounds.json", "type": "table"} in logged  # the UI's table view
    local = c.download_artifacts(rid, "clients_rounds.json", str(finished.tmp / "dl"))
    table = pd.read_json(local, orient="split")
    csv = pd.read_csv(finished.res.output_dir / "clients_rounds.csv")
    assert table["round"].tolist() == [0] * 3 + [1] * 3 + [2] * 3
    assert table["client"].tolist() == [0, 1, 2] * 3
    pd.testing.assert_frame_equal(
        table.drop(columns=["round", "client"]),
        csv.drop(columns=["round", "client"]),
        check_dtype=False,  # JSON does not say 19.0 is a float
    )
    png = (finished.res.output_dir / "clients.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_reads_the_runs(finished, capsys):
    from fedexp.report.cli import main

    common = ["-e", "fedexp", "--uri", finished.uri, "--rows", "seed", "--scale", "1"]
    main([*common, "--metric", "bytes/up_cum"])
    assert re.search(rf"\b{2 * DENSE_BYTES}\b", capsys.readouterr().out)
    main([*common, "--metric", "bytes/up"])  # logged once: its final value is still right
    assert re.search(rf"\b{DENSE_BYTES}\b", capsys.readouterr().out)


def test_compressed_bytes_are_logged_every_round_and_system_metrics_can_be_off(finished, tmp_path):
    cfg = _cfg(tmp_path, "rounds=3", "compressor=topk", "model=mlp")
    with open_dict(cfg):
        cfg.tracker.uri = finished.uri  # the store is set up once
        cfg.tracker.experiment = "compressed"
        cfg.tracker.system_metrics = False
    res = run(cfg)
    client = MlflowClient(cfg.tracker.uri)
    up = sorted(client.get_metric_history(res.run_id, "bytes/up"), key=lambda m: m.step)
    assert [m.step for m in up] == [1, 2, 3]
    assert len({m.value for m in up}) == 3  # top-k positions are coded: sizes vary
    assert _steps(client, res.run_id, "bytes/up_cum") == [1, 2, 3]
    assert _steps(client, res.run_id, "bytes/up_dense") == [1, 2, 3]  # constant: every round too
    metrics = client.get_run(res.run_id).data.metrics
    assert not [k for k in metrics if k.startswith("system/")] and "round" not in metrics


#: what MLflow reads as a CI or test environment (``mlflow.telemetry.utils``), where its
#: telemetry is off anyway: taken out of the environment of the first process below
_CI_VARS = ("PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "CI", "CIRCLECI", "GITLAB_CI", "JENKINS_URL",
            "TRAVIS", "TF_BUILD", "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN", "BUILDKITE",
            "TEAMCITY_VERSION", "CLOUD_RUN_EXECUTION", "RUNBOT_HOST_URL")  # fmt: skip


def test_mlflow_usage_telemetry_is_off_unless_the_environment_says_otherwise():
    """Importing fedexp turns MLflow's usage telemetry off (README, "What is logged"): no
    telemetry client, so no thread of MLflow's unsets an environment variable while a run
    reads the environment (a run's start failed so in CI); a user's own setting is kept."""
    import os
    import sys

    code = (
        "import os, fedexp, mlflow\n"
        "from mlflow.telemetry.client import get_telemetry_client\n"
        "print(os.environ.get('MLFLOW_DISABLE_TELEMETRY'), get_telemetry_client() is None)"
    )
    env = {k: v for k, v in os.environ.items() if k not in _CI_VARS}
    env.pop("MLFLOW_DISABLE_TELEMETRY", None)
    env.pop("DO_NOT_TRACK", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT)  # fmt: skip
    assert out.stdout.split() == ["true", "True"], out.stderr[-2000:]
    # the user's choice stands (in a test environment: MLflow sends nothing from here)
    env.update(MLFLOW_DISABLE_TELEMETRY="false", PYTEST_CURRENT_TEST="a test")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT)  # fmt: skip
    assert out.stdout.split()[0] == "false", out.stderr[-2000:]
