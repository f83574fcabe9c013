"""Evaluation on the validation split (``val/...`` metrics), the tuning objective and the
callback that makes a NaN job a failed Optuna trial."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from hydra.core.utils import JobReturn
from hydra.core.utils import JobStatus

from fedexp.engine.files import checkpoint
from fedexp.engine.runner import build_engine
from fedexp.errors import FedexpError
from fedexp.metrics import classification_metrics
from fedexp.tuning import objective as tuning

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(make, val_fraction: float, *overrides: str):
    """The engine of ``make(*overrides)`` whose clients have a ``val_fraction`` split."""
    return build_engine(
        make("num_clients=3", "batch_size=16", f"val_fraction={val_fraction}", *overrides)
    )


def _independent(engine, split: str) -> list[dict[str, float]]:
    """Every client's metrics on ``split`` ("val" or "test"), computed without Engine.evaluate."""
    out = []
    for n, data in enumerate(engine.clients):
        params = engine.algorithm.eval_params(engine.ctx, engine.server, engine.client_states[n], n)
        x, y = (data.x_val, data.y_val) if split == "val" else (data.x_test, data.y_test)
        with torch.no_grad():
            logits = engine.algorithm.predict(engine.ctx, params, x)
        m = classification_metrics(logits, y, 2)
        m["loss"] = float(engine.ctx.task.loss(logits, y))
        m["n"] = float(len(y))
        out.append(m)
    return out


@pytest.mark.parametrize("algorithm", ["fedavg", "ditto"])
def test_val_metrics_equal_an_independent_evaluation_on_the_val_examples(small_cfg, algorithm):
    engine = _engine(small_cfg, 0.25, f"algorithm={algorithm}")
    assert all(c.num_val > 0 for c in engine.clients)
    for _ in range(2):
        engine.run_round()
    agg, rows = engine.evaluate()
    ref = _independent(engine, "val")
    n = np.array([r["n"] for r in ref])
    for key in ("acc", "bal_acc", "loss"):
        v = np.array([r[key] for r in ref])
        assert agg[f"val/{key}/mean"] == pytest.approx(v.mean(), rel=1e-6, abs=1e-9)
        assert agg[f"val/{key}/weighted"] == pytest.approx(
            (v * n).sum() / n.sum(), rel=1e-6, abs=1e-9
        )
        assert agg[f"val/{key}/std"] == pytest.approx(v.std(), rel=1e-6, abs=1e-9)
    assert agg["val/acc/worst"] == pytest.approx(min(r["acc"] for r in ref), rel=1e-6, abs=1e-9)
    assert agg["val/loss/worst"] == pytest.approx(max(r["loss"] for r in ref), rel=1e-6, abs=1e-9)
    # the same aggregates as the test metrics, under val/
    # (the views beside the clients' own models, global/ and gain/, score test splits only)
    test_keys = {k for k in agg if not k.startswith(("val/", "global/", "gain/"))}
    assert {k for k in agg if k.startswith("val/")} == {f"val/{k}" for k in test_keys}
    # the per-client rows are the test split's
    test = _independent(engine, "test")
    assert [r["num_test"] for r in rows] == [t["n"] for t in test]
    assert [r["acc"] for r in rows] == pytest.approx([t["acc"] for t in test], rel=1e-6, abs=1e-9)
    assert agg["acc/mean"] == pytest.approx(np.mean([t["acc"] for t in test]), rel=1e-6, abs=1e-9)


def test_test_metrics_are_on_the_same_examples_with_and_without_validation(small_cfg):
    plain = _engine(small_cfg, 0.0, "algorithm=fedavg")
    split = _engine(small_cfg, 0.2, "algorithm=fedavg")
    a, rows_a = plain.evaluate()  # the initial model x0 is the same: identical test metrics
    b, rows_b = split.evaluate()
    assert not any(k.startswith("val/") for k in a)
    assert {k: v for k, v in b.items() if not k.startswith("val/")} == a
    assert rows_a == rows_b
    for c0, c1 in zip(plain.clients, split.clients, strict=True):
        assert torch.equal(c0.x_test, c1.x_test) and c1.num_train < c0.num_train
    # after training, the smaller training set is the only difference: the test metrics are
    # those of the trained model on the very same test examples
    split.run_round()
    _, rows = split.evaluate()
    test = _independent(split, "test")
    assert [r["loss"] for r in rows] == pytest.approx([t["loss"] for t in test], rel=1e-6, abs=1e-9)


def test_val_best_means_follow_each_metrics_direction_and_survive_a_checkpoint(small_cfg):
    engine = _engine(small_cfg, 0.3, "algorithm=local", "lr=0.5")
    first, _ = engine.evaluate()
    loss0 = np.array([r["loss"] for r in _independent(engine, "val")])
    acc0 = np.array([r["acc"] for r in _independent(engine, "val")])
    engine.run_round()
    second, _ = engine.evaluate()
    loss1 = np.array([r["loss"] for r in _independent(engine, "val")])
    acc1 = np.array([r["acc"] for r in _independent(engine, "val")])
    assert not np.allclose(loss0, loss1)
    assert second["val/loss/best_mean"] == pytest.approx(np.minimum(loss0, loss1).mean())
    assert second["val/acc/best_mean"] == pytest.approx(np.maximum(acc0, acc1).mean())
    # the checkpoint's tree nests "val/acc" under best/val/acc: it loads back flat
    tree = checkpoint.unflatten_state(checkpoint.flatten_state(engine.state_tree()))
    fresh = _engine(small_cfg, 0.3, "algorithm=local", "lr=0.5")
    fresh.load_state_tree(tree, engine.round, engine.ledger)
    assert fresh.best.keys() == engine.best.keys() and "val/loss" in fresh.best
    for key in engine.best:
        assert torch.equal(fresh.best[key], engine.best[key].cpu())
    assert fresh.evaluate()[0] == engine.evaluate()[0]


# ----------------------------------------------------------------------- the objective
@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(tuning, "_warned", False)


def test_objective_is_the_validation_headline_when_there_is_a_validation_split(
    fresh_warning, caplog
):
    metrics = {"acc/mean": 0.9, "val/acc/mean": 0.7, "val/acc/weighted": 0.8, "auc/mean": 0.5}
    with caplog.at_level(logging.WARNING, logger="fedexp"):
        assert tuning.objective_value({"val_fraction": 0.2}, metrics) == 0.7
    assert not caplog.records
    seg = {"iou/mean": 0.5, "acc/mean": 0.95, "val/iou/mean": 0.4, "val/acc/mean": 0.9}
    assert tuning.objective_value({"val_fraction": 0.1}, seg) == 0.4
    assert tuning.objective_key({"val_fraction": 0.1}, seg) == "val/iou/mean"


def test_objective_without_validation_is_the_test_headline_with_one_leak_warning(
    fresh_warning, caplog
):
    with caplog.at_level(logging.WARNING, logger="fedexp"):
        assert tuning.objective_value({"val_fraction": 0.0}, {"acc/mean": 0.9}) == 0.9
        assert tuning.objective_value({}, {"iou/mean": 0.6, "acc/mean": 0.9}) == 0.6
    leaks = [r for r in caplog.records if "leaks" in r.getMessage()]
    assert len(leaks) == 1 and "acc/mean" in leaks[0].getMessage()


def test_no_leak_warning_for_a_single_hydra_run(fresh_warning, caplog):
    from hydra import compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from helpers import CONF

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="fedexp"):
            assert tuning.objective_value(cfg, {"acc/mean": 0.9}) == 0.9
    finally:
        HydraConfig.instance().cfg = None
    assert not caplog.records  # a single run: nothing is tuned on its value


@pytest.mark.parametrize(
    "metrics", [{"acc/mean": 0.9}, {"val/acc/mean": math.nan}, {"val/acc/mean": math.inf}]
)
def test_objective_is_nan_when_the_validation_metric_is_missing_or_not_finite(metrics):
    assert math.isnan(tuning.objective_value({"val_fraction": 0.2}, metrics))


def _job(value, status=JobStatus.COMPLETED) -> JobReturn:
    ret = JobReturn(overrides=["lr=1"])
    ret.return_value, ret.status = value, status
    return ret


def test_a_nan_job_becomes_a_failed_job_and_others_are_left_alone():
    hook = tuning.NaNTrialsFail()
    ret = _job(math.nan)
    hook.on_job_end(config=None, job_return=ret)
    assert ret.status == JobStatus.FAILED
    with pytest.raises(FedexpError, match="returned NaN: a failed trial"):
        ret.return_value  # noqa: B018 - the getter raises, as the Optuna sweeper sees it
    ok = _job(0.75)
    hook.on_job_end(config=None, job_return=ok)
    assert ok.status == JobStatus.COMPLETED and ok.return_value == 0.75
    failed = _job(ValueError("boom"), JobStatus.FAILED)
    hook.on_job_end(config=None, job_return=failed)
    assert failed.status == JobStatus.FAILED and isinstance(failed._return_value, ValueError)
