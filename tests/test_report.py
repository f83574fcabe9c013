"""``fedexp report``: tables across seeds and bytes-to-accuracy from MLflow records."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

from fedexp.engine.runner import run
from fedexp.report import collect
from fedexp.report import reach
from fedexp.report import reach_plot
from fedexp.report import reach_table
from fedexp.report import table
from helpers import mlflow_db


@pytest.mark.slow
def test_report_tables_from_mlflow(small_cfg, tmp_path, capsys):
    from fedexp.report import main

    uri = mlflow_db(tmp_path / "mlflow.db")

    def grid_run(algorithm: str, seed: int, *extra: str):
        cfg = small_cfg(
            f"algorithm={algorithm}", f"seed={seed}", "rounds=2", "num_clients=3", *extra
        )
        with open_dict(cfg):
            cfg.tracker.uri = uri
            cfg.tracker.experiment = "grid"
            cfg.output_dir = str(tmp_path / f"{algorithm}{seed}{len(extra)}")
        return run(cfg, tags={"choice.algorithm": algorithm})

    finals = {}
    for algorithm in ("fedavg", "local"):
        for seed in (0, 1):
            res = grid_run(algorithm, seed)
            finals.setdefault(algorithm, []).append(res.metrics["acc/weighted"])
    groups = collect(uri, ["grid"], "acc/weighted", ["choice.algorithm", "seed"])
    assert set(groups) == {("fedavg", "0"), ("fedavg", "1"), ("local", "0"), ("local", "1")}
    by_alg = collect(uri, ["grid"], "acc/weighted", ["choice.algorithm"])
    assert sorted(by_alg[("fedavg",)]) == sorted(finals["fedavg"])
    text = table(by_alg, 1, "algorithm", "")
    mean, std = 100 * np.mean(finals["local"]), 100 * np.std(finals["local"], ddof=1)
    assert f"{mean:.2f} ± {std:.2f} (n=2)" in text

    # best over rounds, from the runs' MLflow histories
    client = MlflowClient(uri)
    ids = [
        r.info.run_id
        for r in client.search_runs([client.get_experiment_by_name("grid").experiment_id])
    ]
    best = {i: max(m.value for m in client.get_metric_history(i, "acc/weighted")) for i in ids}
    assert len(best) == 4
    main(["--uri", uri, "-e", "grid", "--metric", "acc/weighted", "--agg", "best"])
    out = capsys.readouterr().out
    local = [best[i] for i in ids if client.get_run(i).data.tags["choice.algorithm"] == "local"]
    mean, std = 100 * np.mean(local), 100 * np.std(local, ddof=1)
    assert f"| Local | {mean:.2f} ± {std:.2f} (n=2) |" in out and "best over" in out

    # the same configuration run again: n stays 2, the later run counts
    again = grid_run("fedavg", 0, "threads=1")  # threads do not change the configuration
    assert again.metrics["acc/weighted"] == finals["fedavg"][0]  # deterministic
    main(["--uri", uri, "-e", "grid", "--metric", "acc/weighted"])
    out, err = capsys.readouterr()
    mean, std = 100 * np.mean(finals["fedavg"]), 100 * np.std(finals["fedavg"], ddof=1)
    assert f"| FedAvg | {mean:.2f} ± {std:.2f} (n=2) |" in out
    assert "1 older run(s) dropped" in err

    # another lr in the same cell: refused, naming lr and its values
    grid_run("fedavg", 0, "lr=0.05")
    with pytest.raises(SystemExit) as exc:
        main(["--uri", uri, "-e", "grid", "--metric", "acc/weighted"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "cells pool runs that differ in lr (0.05, 0.1)" in err and "--allow-pooling" in err

    # --where keeps one lr; --scale 1 shows fractions with 4 significant digits
    main(["--uri", uri, "-e", "grid", "--where", "lr=0.1", "--scale", "1"])
    out, err = capsys.readouterr()
    local = collect(uri, ["grid"], "acc/mean", ["choice.algorithm"])[("local",)]
    assert "× 1;" in out and "1 older run(s) dropped" in err
    mean, std = np.mean(local), np.std(local, ddof=1)
    assert f"| Local | {mean:.4g} ± {std:.4g} (n=2) |" in out
    # rows by seed would pool the two algorithms: refused, naming choice.algorithm
    with pytest.raises(SystemExit):
        main(["--uri", uri, "-e", "grid", "--where", "lr=0.1", "--rows", "seed"])
    assert "differ in choice.algorithm (fedavg, local)" in capsys.readouterr().err

    reached = reach(uri, ["grid"], "acc/weighted", 0.0, ["choice.algorithm"])
    rows = reached[("local",)]
    assert all(r["up"] == 0.0 for r in rows)  # reached at round 0, before any byte
    never = reach(uri, ["grid"], "acc/weighted", 1.01, ["choice.algorithm"])
    assert all(math.isnan(r["up"]) for r in never[("local",)])
    assert "0/2" in reach_table(never, "algorithm", 1.01, "acc/weighted")
    reach_plot(reached, str(tmp_path / "p.png"), "acc/weighted")
    assert (tmp_path / "p.png").stat().st_size > 0


# Hand-made final accuracies (fractions) per (algorithm, δ): the paper's layout, no MLflow.
GROUPS = {
    ("fedavg", "1.0"): [0.80, 0.82],  # 81.00: ties pfednet at δ=1
    ("fedavg", "2.0"): [0.70],
    ("ditto", "1.0"): [0.75, 0.77],  # 76.00
    ("ditto", "2.0"): [0.90, 0.92],  # 91.00: best at δ=2
    ("pfednet", "1.0"): [0.81, 0.81],  # 81.00
    ("pfednet", "2.0"): [0.85, 0.87],  # 86.00: second at δ=2
}


def _rows(text: str) -> dict[str, list[str]]:
    """Markdown table -> {first cell: other cells}."""
    lines = [ln.strip("|").split("|") for ln in text.splitlines() if ln.startswith("|")]
    return {c[0].strip(): [x.strip() for x in c[1:]] for c in lines if "---" not in c[0]}


def test_paper_table_best_rank_and_header():
    text = table(GROUPS, 1, "algorithm", "δ", best=True, rank_of="pfednet")
    rows = _rows(text)
    assert text.splitlines()[0] == "| algorithm | δ=1 | δ=2 |"
    assert rows["fedavg"][0] == "**81.00 ± 1.41 (n=2)**"  # the tie: both bold
    assert rows["pfednet"][0] == "**81.00 ± 0.00 (n=2)**"
    assert rows["ditto"][0] == "76.00 ± 1.41 (n=2)"
    assert rows["ditto"][1] == "**91.00 ± 1.41 (n=2)**"
    assert not rows["pfednet"][1].startswith("**") and not rows["fedavg"][1].startswith("**")
    assert rows["rank"] == ["top 1", "top 2"]
    assert list(rows)[-1] == "rank"  # the last row, as in Tables II-VII
    assert list(rows)[1:4] == ["ditto", "fedavg", "pfednet"]  # default: sorted


def test_paper_table_lower_is_better_flips_best_and_rank():
    rows = _rows(
        table(GROUPS, 1, "algorithm", "δ", best=True, lower_is_better=True, rank_of="pfednet")
    )
    assert rows["ditto"][0].startswith("**") and rows["fedavg"][1].startswith("**")
    assert not rows["pfednet"][0].startswith("**") and not rows["ditto"][1].startswith("**")
    assert rows["rank"] == ["top 2", "top 2"]  # at δ=1 only ditto is lower; at δ=2 fedavg


def test_paper_table_order_labels_and_missing_rank_row():
    text = table(
        GROUPS,
        1,
        "algorithm",
        "δ",
        order=["pfednet", "FedAvg"],
        labels={"fedavg": "FedAvg", "pfednet": "pFedNet"},
        rank_of="nosuch",
    )
    rows = _rows(text)
    assert list(rows) == ["algorithm", "pFedNet", "FedAvg", "ditto"]  # listed first, rest sorted
    assert "rank" not in rows and "**" not in text  # no --rank-of row, no --best
    # --rank-of matches the displayed label too; a row missing a cell ranks nothing there
    partial = {**GROUPS, ("new", "1.0"): [0.99]}
    rows = _rows(table(partial, 1, "algorithm", "δ", rank_of="new", labels={"new": "New"}))
    assert rows["rank"] == ["top 1", ""] and rows["New"][1] == ""


def _fake_store(monkeypatch, groups):
    """``fedexp report`` reads these groups as runs (row = algorithm, column = δ, by seed)."""
    from fedexp.report import cli
    from fedexp.report import pipeline
    from fedexp.report.collect import Run

    runs = [
        Run(
            f"{alg}-{delta}-{seed}",
            seed,
            {"seed": str(seed), "partition.delta": delta, "algorithm._target_": alg},
            {"choice.algorithm": alg},
            {"acc/mean": value},
        )
        for (alg, delta), values in groups.items()
        for seed, value in enumerate(values)
    ]
    monkeypatch.setattr(cli, "client_for", lambda uri: None)
    monkeypatch.setattr(pipeline, "fetch", lambda client, experiments: runs)


def test_report_command_paper_flags(monkeypatch, capsys):
    from fedexp import report

    _fake_store(monkeypatch, GROUPS)
    report.main(
        ["-e", "x", "--cols", "partition.delta", "--best", "--rank-of", "pfednet"]
        + ["--order", "pfednet,fedavg", "--labels", "pfednet=pFedNet (λ = 0.1)"]
    )
    out = capsys.readouterr().out
    assert "| algorithm | δ=1 | δ=2 |" in out
    rows = _rows(out)
    assert list(rows) == ["algorithm", "pFedNet (λ = 0.1)", "FedAvg", "Ditto", "rank"]
    assert rows["rank"] == ["top 1", "top 2"] and rows["pFedNet (λ = 0.1)"][0].startswith("**")
    report.main(
        ["-e", "x", "--cols", "partition.delta", "--lower-is-better", "--rank-of", "pFedNet"]
    )
    assert _rows(capsys.readouterr().out)["rank"] == ["top 2", "top 2"]


def test_default_scale_is_percent_for_fractions_only():
    from fedexp.report import default_scale

    assert (
        default_scale("acc/mean") == 100
        and default_scale("val/acc/mean") == 100
        and default_scale("auc/best_mean") == 100
    )
    assert default_scale("iou/mean") == 100 and default_scale("bal_acc/weighted") == 100
    for metric in ("bytes/up_cum", "time/round_mean_s", "loss/mean", "train/train_loss"):
        assert default_scale(metric) == 1
