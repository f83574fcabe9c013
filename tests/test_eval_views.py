"""Personalisation judged as the field judges it (issue 68): the tail, global against
personal, new clients.

- the per-client quantiles are numpy's, the share of clients a gain hurts is counted;
- FedAvg evaluates every client with the global model: its gain is exactly 0, and the global
  view is the global model scored client by client (another computation than the stacked one);
- on IID clients (one task shared) the gain is ~0, on label-skewed clients (two classes each)
  local-only's and Ditto's own models beat the global one;
- held-out clients never enter a training cohort (the cohorts that read the pool are
  observed), never count in the training metrics, and are scored as new clients from the
  global model.
"""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from fedexp import streams
from fedexp.config.schema import validate
from fedexp.engine.round.views import NEWCOMER
from fedexp.engine.round.views import held_out
from fedexp.engine.round.views import with_gains
from fedexp.engine.runner import build_engine
from fedexp.errors import ConfigError
from fedexp.metrics import QUANTILES
from fedexp.metrics import aggregate
from helpers import SMALL
from helpers import compose_config


def _engine(*overrides: str):
    engine = build_engine(compose_config(*SMALL, *overrides))
    engine.setup()
    return engine


# ---------------------------------------------------------------------------- the tail
def test_quantiles_are_numpys_over_the_finite_values():
    gen = np.random.default_rng(0)
    values = gen.random(37)
    values[[3, 11]] = math.nan  # left out, as for the mean
    rows = [{"acc": float(v), "loss": float(1 - v)} for v in values]
    weights = gen.integers(1, 50, size=37).astype(float).tolist()
    out = aggregate(rows, weights)
    finite = values[np.isfinite(values)]
    for name, q in QUANTILES.items():
        assert out[f"acc/{name}"] == pytest.approx(np.quantile(finite, q), abs=1e-15)
        assert out[f"loss/{name}"] == pytest.approx(np.quantile(1 - finite, q), abs=1e-15)
    assert out["acc/p10"] <= out["acc/p50"] <= out["acc/p90"]
    assert out["acc/worst"] == finite.min() and out["loss/worst"] == (1 - finite).max()


def test_a_gain_is_oriented_and_its_hurt_share_counted():
    rows = [
        {"acc": 0.9, "loss": 0.2, "global/acc": 0.8, "global/loss": 0.3},  # helped
        {"acc": 0.5, "loss": 0.9, "global/acc": 0.7, "global/loss": 0.4},  # hurt
        {"acc": 0.6, "loss": 0.5, "global/acc": 0.6, "global/loss": 0.5},  # neither
        {"acc": 0.4, "loss": 0.6, "global/acc": 0.3, "global/loss": 0.7},  # helped
    ]
    gained = with_gains(rows)
    assert [r["gain/acc"] for r in gained] == pytest.approx([0.1, -0.2, 0.0, 0.1])
    assert [r["gain/loss"] for r in gained] == pytest.approx([0.1, -0.5, 0.0, 0.1])
    out = aggregate(gained, [1.0] * 4)
    assert out["gain/acc/hurt"] == 0.25 and out["gain/loss/hurt"] == 0.25
    assert out["gain/acc/worst"] == pytest.approx(-0.2)  # a gain's worst is its smallest
    assert out["global/loss/worst"] == 0.7  # a loss's worst is its largest, under any view


# ---------------------------------------------------------------- global and personal
def test_fedavgs_personal_model_is_the_global_one_so_its_gain_is_exactly_zero():
    engine = _engine("algorithm=fedavg", "partition=iid")
    engine.run_round()
    agg, rows = engine.evaluate()
    for row in rows:
        for key in ("acc", "bal_acc", "loss"):
            assert row[f"global/{key}"] == row[key]
            assert row[f"gain/{key}"] == 0.0
    assert agg["gain/acc/mean"] == 0.0 and agg["gain/acc/hurt"] == 0.0
    assert agg["global/acc/mean"] == agg["acc/mean"]


def test_the_global_view_is_the_global_model_scored_client_by_client():
    """Ditto's stacked pass (personal v_n and the global x in one batch) against x on each
    client alone (``Context.evaluate``)."""
    engine = _engine("algorithm=ditto", "num_clients=6")
    for _ in range(2):
        engine.run_round()
    _, rows = engine.evaluate()
    x = engine.server["x"]
    assert any(r["gain/acc"] != 0 for r in rows)  # the personal models differ from x
    for n, row in enumerate(rows):
        alone = engine.ctx.evaluate(x, engine.clients[n])
        assert row["global/acc"] == alone["acc"]
        assert row["global/loss"] == pytest.approx(alone["loss"], rel=1e-6)
        assert row["gain/acc"] == pytest.approx(row["acc"] - alone["acc"], abs=1e-12)


def test_local_only_gains_on_label_skewed_clients():
    """Two digits per client: each local model beats the clients' averaged model there."""
    engine = _engine(
        "algorithm=local",
        "dataset=digits",
        "partition=shards",
        "partition.classes_per_client=2",
        "num_clients=10",
    )
    for _ in range(3):
        engine.run_round()
    agg, rows = engine.evaluate()
    assert agg["gain/acc/mean"] > 0.2 and agg["gain/acc/hurt"] == 0.0
    # the global model of local-only: the clients' models averaged by training samples
    theta = torch.stack([s["theta"] for s in engine.client_states])
    sizes = torch.tensor([c.num_train for c in engine.clients], dtype=theta.dtype)
    average = (sizes[:, None] * theta).sum(0) / sizes.sum()
    glob = engine.global_model()
    assert glob is not None and torch.allclose(glob, average, rtol=1e-6, atol=1e-7)
    assert rows[0]["global/acc"] == engine.ctx.evaluate(average, engine.clients[0])["acc"]


@pytest.mark.parametrize("algorithm", ["local", "ditto"])
def test_on_clients_sharing_one_task_personalisation_gains_about_nothing(algorithm):
    """The same digits, the same method: split IID (one task shared) the gain is ~0 and some
    clients lose, split two digits a client it is large and hurts none (the metric tells the
    two partitions apart, not the method)."""
    gains = {}
    for partition in (["partition=iid"], ["partition=shards", "partition.classes_per_client=2"]):
        engine = _engine(f"algorithm={algorithm}", "dataset=digits", "num_clients=10", *partition)
        for _ in range(3):
            engine.run_round()
        agg, _ = engine.evaluate()
        gains[partition[0]] = (agg["gain/acc/mean"], agg["gain/acc/hurt"])
    (iid, iid_hurt), (skewed, skewed_hurt) = gains["partition=iid"], gains["partition=shards"]
    assert abs(iid) < 0.1 and iid_hurt > 0
    assert skewed > 0.4 and skewed_hurt == 0.0


def test_eval_global_false_scores_the_clients_own_models_alone():
    engine = _engine("algorithm=ditto", "eval_global=false")
    engine.run_round()
    agg, rows = engine.evaluate()
    assert not [k for k in agg if k.startswith(("global/", "gain/"))]
    assert not [k for k in rows[0] if k.startswith(("global/", "gain/"))]
    assert "acc/p10" in agg


def test_a_method_without_a_global_model_has_no_global_view():
    engine = _engine("algorithm=fedamp")
    engine.run_round()
    agg, _ = engine.evaluate()
    assert engine.global_model() is None
    assert not [k for k in agg if k.startswith(("global/", "gain/"))]


# ------------------------------------------------------------------------- new clients
def test_the_held_out_clients_are_drawn_from_the_runs_own_stream():
    chosen = held_out(3, 20, 0.25)
    assert chosen == held_out(3, 20, 0.25) and len(chosen) == 5
    assert list(chosen) == sorted(set(chosen)) and all(0 <= n < 20 for n in chosen)
    assert held_out(4, 20, 0.25) != chosen  # another seed, other clients
    assert held_out(3, 20, 0.0) == () and len(held_out(3, 2, 0.9)) == 1  # someone trains


def _observed(engine) -> list[tuple[int, list[int], list[int]]]:
    """(purpose, clients, pool rows) of every cohort the engine makes from now on."""
    seen = []
    cohorts = engine._cohorts

    def spy(clients, purpose):
        groups = cohorts(clients, purpose)
        for _, cohort, _ in groups:
            seen.append((purpose, list(cohort.clients), cohort.rows.tolist()))
        return groups

    engine._cohorts = spy
    return seen


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm=fedavg", "participation=0.5"),
        # every client trains each round (pFedMe's Algorithm 1): every client not held out
        ("algorithm=pfedme", "participation=0.5", "algorithm.all_train=true"),
    ],
)
def test_held_out_clients_never_train_nor_count_and_are_tested_as_new(overrides):
    engine = _engine(*overrides, "num_clients=10", "holdout_clients=0.3")
    out = set(engine.holdout)
    assert len(out) == 3
    seen = _observed(engine)
    for _ in range(3):
        metrics = engine.run_round()
        assert not out & set(engine.last_sampled)
        trained = metrics.get("clients/trained", metrics["clients/sampled"])
        assert trained <= 7
    agg, rows = engine.evaluate()
    training = [(c, r) for p, c, r in seen if p == streams.CLIENT]
    assert training and not out & {n for c, _ in training for n in c}
    assert not out & {n for _, r in training for n in r}  # no pool row of theirs is read
    newcomers = [c for p, c, _ in seen if p == NEWCOMER]
    assert sorted(n for c in newcomers for n in c) == sorted(out)
    assert len(rows) == 10
    for n, row in enumerate(rows):
        if n in out:  # scored as new clients only
            assert "acc" not in row and "new/acc" in row
        else:
            assert "acc" in row and "new/acc" not in row
    own = [rows[n]["acc"] for n in range(10) if n not in out]
    new = [rows[n]["new/acc"] for n in sorted(out)]
    assert agg["acc/mean"] == pytest.approx(np.mean(own), abs=1e-12)
    assert agg["new/acc/mean"] == pytest.approx(np.mean(new), abs=1e-12)


def test_a_new_client_without_local_steps_is_the_global_model_on_its_test_split():
    engine = _engine("algorithm=fedavg", "num_clients=8", "holdout_clients=0.25", "holdout_steps=0")
    engine.run_round()
    _, rows = engine.evaluate()
    x = engine.server["x"]
    for n in engine.holdout:
        assert rows[n]["new/acc"] == engine.ctx.evaluate(x, engine.clients[n])["acc"]


def test_new_clients_local_steps_draw_from_their_own_streams():
    """Evaluating twice scores the same; the run's training is not moved by it."""
    engine = _engine("algorithm=fedavg", "num_clients=8", "holdout_clients=0.25")
    twin = _engine("algorithm=fedavg", "num_clients=8", "holdout_clients=0.25")
    engine.run_round()
    twin.run_round()
    first, _ = engine.evaluate()
    again, _ = engine.evaluate()
    assert first["new/acc/mean"] == again["new/acc/mean"]
    assert first["new/loss/mean"] == again["new/loss/mean"]
    engine.run_round()
    twin.run_round()  # never evaluated
    assert torch.equal(engine.server["x"], twin.server["x"])


def test_holdout_settings_are_checked():
    with pytest.raises(ConfigError, match="holdout_clients=1.0"):
        validate({"holdout_clients": 1.0})
    with pytest.raises(ConfigError, match="holdout_steps=-1"):
        validate({"holdout_steps": -1})
    with pytest.raises(ConfigError, match="holdout_clients=0.2: not with privacy"):
        build_engine(compose_config(*SMALL, "holdout_clients=0.2", "privacy=central"))


def test_fedrods_global_model_is_its_generic_predictor():
    """[x ; 0] through FedRoD's predict (g + p with p = 0) is the model at x."""
    engine = _engine("algorithm=fedrod", "model=mlp", "model.hidden=8", "holdout_clients=0.4")
    engine.run_round()
    glob = engine.global_model()
    x = engine.server["x"]
    inputs = engine.clients[0].x_test
    got = engine.algorithm.predict(engine.ctx, glob, inputs)
    assert torch.allclose(got, engine.ctx.model(x, inputs), rtol=1e-6, atol=1e-6)
    agg, _ = engine.evaluate()
    assert "gain/acc/mean" in agg
    assert math.isfinite(agg["new/loss/mean"])  # a newcomer trains θ of [θ ; 0]


def test_a_head_method_has_no_global_model_but_a_rule_for_newcomers():
    """FedPer: the heads are never aggregated; a new client gets the body and a new head."""
    engine = _engine(
        "algorithm=fedper", "model=mlp", "model.hidden=8", "holdout_clients=0.4", "holdout_steps=0"
    )
    engine.run_round()
    agg, rows = engine.evaluate()
    assert engine.global_model() is None and "global/acc/mean" not in agg
    x = engine.server["x"]
    for n in engine.holdout:
        assert rows[n]["new/acc"] == engine.ctx.evaluate(x, engine.clients[n])["acc"]


def test_a_run_writes_every_view_in_its_files(tmp_path):
    """rounds.csv holds the tail, the global view and the new clients; clients.csv a row per
    client, the held-out ones with their new-client figures."""
    from fedexp.engine.runner import run
    from fedexp.tracking.base import NullTracker

    cfg = compose_config(
        *SMALL, "algorithm=ditto", "num_clients=6", "holdout_clients=0.3", "figures=false",
        output_dir=tmp_path / "out",
    )  # fmt: skip
    res = run(cfg, tracker=NullTracker())
    with open(res.output_dir / "rounds.csv") as fh:
        rounds = list(csv.DictReader(fh))
    for key in ("acc/p10", "acc/p90", "global/acc/mean", "gain/acc/hurt", "new/acc/mean"):
        assert all(r[key] for r in rounds), key
    assert set(res.tracker.metrics["new/acc/mean"]) == {0, 1, 2, 3}
    with open(res.output_dir / "clients.csv") as fh:
        clients = list(csv.DictReader(fh))
    assert len(clients) == 6
    held = {int(c["client"]) for c in clients if c["new/acc"]}
    assert len(held) == 2 and all(not clients[n]["acc"] for n in held)


def test_a_resume_keeps_the_held_out_clients():
    """Who trains is the run's: a resume may not change ``holdout_clients`` (an older
    checkpoint, without the key, held none out)."""
    from omegaconf import OmegaConf

    from fedexp.engine.files.resume import _check_resume

    before = compose_config(*SMALL)
    saved = OmegaConf.to_yaml(before)
    older = OmegaConf.to_yaml({k: v for k, v in before.items() if k != "holdout_clients"})
    now = compose_config(*SMALL, "holdout_clients=0.2", "resume=somewhere")
    for yaml in (saved, older):
        with pytest.raises(ConfigError, match="holdout_clients"):
            _check_resume(now, yaml)
    _check_resume(compose_config(*SMALL, "holdout_steps=3", "eval_global=false"), saved)
