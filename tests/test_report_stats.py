"""The report's statistics and building blocks on hand-made runs (no MLflow, no training)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedexp.report.collect import Agg
from fedexp.report.collect import Run
from fedexp.report.collect import latest_per_config
from fedexp.report.collect import same_value
from fedexp.report.render import default_scale
from fedexp.report.render import table
from fedexp.report.render import tex
from fedexp.report.stats import free_params
from fedexp.report.stats import paired_differences
from fedexp.report.stats import pooling_conflicts
from fedexp.report.stats import sample_std
from fedexp.report.stats import select
from fedexp.report.stats import summary


def run(rid: str, start: int = 0, tags: dict | None = None, **params: object) -> Run:
    """A finished run with ``params`` (as strings, as MLflow keeps them)."""
    base = {"lr": "0.1", "seed": "0", "output_dir": f"out/{rid}"}
    return Run(rid, start, base | {k: str(v) for k, v in params.items()}, tags or {}, {})


@pytest.mark.parametrize("values", [[0.7, 0.8, 0.95], [1.0, 2.0], [3.0, 3.0, 3.0, 4.5]])
def test_sample_std_is_ddof_1(values):
    assert sample_std(values) == pytest.approx(np.std(values, ddof=1))
    assert sample_std(values) > np.std(values)  # not the population std
    mean, std, n = summary(values)
    assert (mean, n) == (pytest.approx(np.mean(values)), len(values))
    assert std == pytest.approx(np.std(values, ddof=1))


def test_one_run_has_std_zero_and_no_run_nan():
    assert sample_std([0.5]) == 0.0
    assert math.isnan(summary([])[0]) and summary([])[2] == 0


def test_latest_per_config_ignores_where_and_how_a_run_ran():
    runs = [
        run("a", 1, seed=0),
        run("b", 5, seed=0, device="cuda", threads=4, **{"tracker.uri": "x"}),  # same config
        run("c", 3, seed=1),
        run("d", 9, seed=0, lr=0.01),  # another config
        run("e", 2, seed=0, eval_every=5),  # eval_every changes what best/last:K see
    ]
    kept, dropped = latest_per_config(runs)
    assert {r.run_id for r in kept} == {"b", "c", "d", "e"} and dropped == 1


def test_pooling_conflicts_name_the_params_beyond_rows_cols_and_seed():
    cells = {
        ("fedavg",): [run("a", seed=0), run("b", seed=1)],  # seeds only: fine
        ("fedprox",): [
            run("c", **{"algorithm.mu": 0.1}),
            run("d", seed=1, **{"algorithm.mu": 0.01}),
            run("e", lr=0.01, **{"algorithm.mu": 0.1}),
        ],
    }
    differing, bad = pooling_conflicts(cells, {"choice.algorithm", "seed"})
    assert bad == [("fedprox",)]
    assert differing == {"algorithm.mu": ["0.01", "0.1"], "lr": ["0.01", "0.1"]}
    assert pooling_conflicts(cells, {"choice.algorithm", "seed", "lr", "algorithm.mu"})[0] == {}


def test_a_choice_tag_stands_for_the_params_it_explains():
    none = {"choice.compressor": "none"}
    topk = {"choice.compressor": "topk"}
    runs = [
        run("a", tags=none, **{"compressor.codec": "dense"}),
        run("b", tags=topk, **{"compressor.codec": "topk", "compressor.keep": 0.1}),
        run("c", tags=topk, **{"compressor.codec": "topk", "compressor.keep": 0.2}),
    ]
    free = free_params(runs, {"seed"})
    # compressor.codec follows the choice; compressor.keep varies within topk: kept
    assert free == {"choice.compressor": ["none", "topk"], "compressor.keep": ["0.1", "0.2", "-"]}


def test_paired_differences_by_hand():
    cells = {
        ("fedavg", "1"): [("0", 0.70), ("1", 0.60), ("2", 0.75)],
        ("ditto", "1"): [("0", 0.80), ("1", 0.75), ("2", 0.78), ("3", 0.99)],
        ("local", "1"): [("0", 0.50), ("0", 0.60), ("2", 0.55)],  # seed 0 twice: averaged
        ("ditto", "2"): [("0", 0.5)],  # no FedAvg at δ=2
    }
    diffs = paired_differences(cells, 1, ("fedavg",))
    assert diffs[("ditto", "1")] == pytest.approx([0.10, 0.15, 0.03])
    assert diffs[("local", "1")] == pytest.approx([0.55 - 0.70, 0.55 - 0.75])
    assert diffs[("ditto", "2")] == [] and ("fedavg", "1") not in diffs


def test_select_picks_the_best_mean_and_names_the_setting():
    runs = [
        run("a", seed=0, **{"algorithm.mu": 0.1}),
        run("b", seed=1, **{"algorithm.mu": 0.1}),
        run("c", seed=0, **{"algorithm.mu": 0.01}),
        run("d", seed=1, **{"algorithm.mu": 0.01}),
    ]
    scores = {"a": 0.9, "b": 0.7, "c": 0.85, "d": 0.8}  # means: μ=0.1 0.80, μ=0.01 0.825
    best = select(runs, scores, {"seed"})
    assert [r.run_id for r in best.runs] == ["c", "d"] and best.setting == {"algorithm.mu": "0.01"}
    assert best.score == pytest.approx((0.825, np.std([0.85, 0.8], ddof=1), 2))
    assert best.candidates == 2
    worst = select(runs, scores, {"seed"}, maximize=False)
    assert worst.setting == {"algorithm.mu": "0.1"}


def test_agg_parse_and_values():
    assert Agg.parse("final") == Agg("final") and Agg.parse("last:4") == Agg("last", 4)
    for bad in ("last", "last:0", "last:x", "mean", "best:2"):
        with pytest.raises(ValueError, match="final, best or last:K"):
            Agg.parse(bad)
    with pytest.raises(ValueError, match="the clients' p10 is a metric: --metric acc/p10"):
        Agg.parse("p10")  # issue 68's "--agg p10": the tail over clients is --metric acc/p10
    hist = [(0, 0.2), (1, 0.9), (2, math.nan), (3, 0.5)]
    assert Agg("final").of(hist, False) == 0.5
    assert Agg("best").of(hist, False) == 0.9 and Agg("best").of(hist, True) == 0.2
    assert Agg("last", 2).of(hist, False) == pytest.approx(0.7)
    assert Agg("last", 9).of(hist, False) == pytest.approx(1.6 / 3)


def test_one_scale_per_table_val_metrics_like_their_test_twins():
    assert default_scale("val/acc/mean") == default_scale("acc/mean") == 100
    assert default_scale("val/loss/mean") == default_scale("loss/mean") == 1
    assert default_scale("val/iou/mean") == 100 and default_scale("bytes/up_cum") == 1


def test_same_value_compares_numbers_as_numbers():
    assert same_value("1", "1.0") and same_value("0.10", "0.1") and same_value("a", "a")
    assert not same_value("0.1", "0.01") and not same_value("fedavg", "FedAvg")


def test_latex_escapes_labels_and_writes_greek_in_math():
    assert tex("fedavg_ft & 5% #1") == r"fedavg\_ft \& 5\% \#1"
    assert tex("δ=1, λ ± μ") == r"$\delta$=1, $\lambda$ $\pm$ $\mu$"
    groups = {("fedavg_ft", "1.0"): [0.5, 0.7], ("x", "1.0"): [0.9, 0.9]}
    text = table(groups, 1, "algorithm", "δ", best=True, rank_of="x", fmt="latex")
    lines = text.splitlines()
    assert lines[0] == r"\begin{tabular}{lc}" and lines[2] == r"algorithm & $\delta$=1 \\"
    assert r"fedavg\_ft & 60.00 $\pm$ 14.14 (n=2) \\" in lines
    assert r"x & \textbf{90.00 $\pm$ 0.00 (n=2)} \\" in lines
    assert lines[-4:] == [r"\midrule", r"rank & top 1 \\", r"\bottomrule", r"\end{tabular}"]
