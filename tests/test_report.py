"""``fedexp report``: tables across seeds and bytes-to-accuracy from MLflow records."""

from __future__ import annotations

import math

import numpy as np
from omegaconf import open_dict

from fedexp.engine.runner import run
from fedexp.report import collect, reach, reach_plot, reach_table, table


def test_report_tables_from_mlflow(small_cfg, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    finals = {}
    for algorithm in ("fedavg", "local"):
        for seed in (0, 1):
            cfg = small_cfg(f"algorithm={algorithm}", f"seed={seed}", "rounds=3")
            with open_dict(cfg):
                cfg.tracker.uri = uri
                cfg.tracker.experiment = "grid"
                cfg.output_dir = str(tmp_path / f"{algorithm}{seed}")
            res = run(cfg, tags={"choice.algorithm": algorithm})
            finals.setdefault(algorithm, []).append(res.metrics["acc/weighted"])
    groups = collect(uri, ["grid"], "acc/weighted", ["choice.algorithm", "seed"])
    assert set(groups) == {("fedavg", "0"), ("fedavg", "1"), ("local", "0"), ("local", "1")}
    by_alg = collect(uri, ["grid"], "acc/weighted", ["choice.algorithm"])
    assert sorted(by_alg[("fedavg",)]) == sorted(finals["fedavg"])
    text = table(by_alg, 1, "algorithm", "")
    mean, std = 100 * np.mean(finals["local"]), 100 * np.std(finals["local"], ddof=1)
    assert f"{mean:.2f} ± {std:.2f} (n=2)" in text

    reached = reach(uri, ["grid"], "acc/weighted", 0.0, ["choice.algorithm"])
    rows = reached[("fedavg",)]
    assert all(r["up"] == 0.0 for r in rows)  # reached at round 0, before any byte
    never = reach(uri, ["grid"], "acc/weighted", 1.01, ["choice.algorithm"])
    assert all(math.isnan(r["up"]) for r in never[("local",)])
    assert "0/2" in reach_table(never, "algorithm", 1.01, "acc/weighted")
    reach_plot(reached, str(tmp_path / "p.png"), "acc/weighted")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_report_command_scales_values(small_cfg, tmp_path, capsys):
    from fedexp.report import main

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = small_cfg("rounds=2")
    with open_dict(cfg):
        cfg.tracker.uri = uri
        cfg.tracker.experiment = "one"
    res = run(cfg, tags={"choice.algorithm": "fedavg"})
    main(["--uri", uri, "-e", "one", "--scale", "1"])
    out = capsys.readouterr().out
    assert f"{res.metrics['acc/mean']:.4g} ± 0 (n=1)" in out and "acc/mean" in out


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


def test_report_command_paper_flags(monkeypatch, capsys):
    from fedexp import report

    seen = {}

    def fake_collect(uri, experiments, metric, keys):
        seen["keys"] = keys
        return GROUPS

    monkeypatch.setattr(report, "collect", fake_collect)
    report.main(
        ["-e", "x", "--cols", "partition.delta", "--best", "--rank-of", "pfednet"]
        + ["--order", "pfednet,fedavg", "--labels", "pfednet=pFedNet,fedavg=FedAvg"]
    )
    out = capsys.readouterr().out
    assert seen["keys"] == ["choice.algorithm", "partition.delta"]
    assert "| algorithm | δ=1 | δ=2 |" in out
    rows = _rows(out)
    assert list(rows) == ["algorithm", "pFedNet", "FedAvg", "ditto", "rank"]
    assert rows["rank"] == ["top 1", "top 2"] and rows["pFedNet"][0].startswith("**")
    report.main(
        ["-e", "x", "--cols", "partition.delta", "--lower-is-better", "--rank-of", "pFedNet"]
    )
    assert _rows(capsys.readouterr().out)["rank"] == ["top 2", "top 2"]


def test_default_scale_is_percent_for_fractions_only():
    from fedexp.report import default_scale

    assert default_scale("acc/mean") == 100 and default_scale("auc/best_mean") == 100
    assert default_scale("iou/mean") == 100 and default_scale("bal_acc/weighted") == 100
    for metric in ("bytes/up_cum", "time/round_mean_s", "loss/mean", "train/train_loss"):
        assert default_scale(metric) == 1
