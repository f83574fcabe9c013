"""``fedexp report`` end to end on a real MLflow store holding runs logged by hand.

Each test writes its own experiment into one SQLite store (created once per module): runs
with the params a fedexp run logs (the keys that matter here, plus ones the report ignores),
the tags the CLI sets (``choice.algorithm``, ``sweep``), metric histories with chosen values,
so every number in the report can be checked against numpy.
"""

from __future__ import annotations

import csv
import io
import itertools
from pathlib import Path

import numpy as np
import pytest
from mlflow.entities import Metric
from mlflow.entities import Param
from mlflow.tracking import MlflowClient

from fedexp.report import main
from helpers import mlflow_db

_clock = itertools.count(1_700_000_000_000, 1000)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A fresh SQLite MLflow store: ``(uri, client)``."""
    uri = mlflow_db(tmp_path_factory.mktemp("report") / "m.db")
    return uri, MlflowClient(uri)


def log_run(
    client: MlflowClient,
    experiment: str,
    algorithm: str = "fedavg",
    seed: int = 0,
    metrics: dict[str, float | list[float]] | None = None,
    sweep: str | None = None,
    status: str = "FINISHED",
    **params: object,
) -> str:
    """Log one run as fedexp's runner and CLI would; a list value is a per-round history."""
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    tags = {"choice.algorithm": algorithm} | ({"sweep": sweep} if sweep else {})
    start = next(_clock)
    run = client.create_run(exp_id, start_time=start, tags=tags)
    rid = run.info.run_id
    base = {
        "algorithm._target_": f"fedexp.algorithms.{algorithm}.X",
        "lr": 0.1,
        "rounds": 3,
        "seed": seed,
        "partition.delta": 2.0,
        "output_dir": f"outputs/{rid}",  # differs in every run: ignored
        "tracker.uri": "sqlite:///elsewhere.db",  # ignored
        "device": "cpu",  # ignored
    }
    items = [Param(k, str(v)) for k, v in (base | params).items()]
    points = []
    for name, value in (metrics or {}).items():
        history = value if isinstance(value, list) else [value]
        points += [Metric(name, float(v), start + s, s) for s, v in enumerate(history)]
    client.log_batch(rid, metrics=points, params=items)
    client.set_terminated(rid, status)
    return rid


def report(capsys, *args: str) -> tuple[int, str, str]:
    """``fedexp report ARGS``: (exit code, stdout, stderr)."""
    code = 0
    try:
        main(list(args))
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def md_rows(text: str) -> dict[str, list[str]]:
    """First Markdown table of ``text`` -> {first cell: other cells}."""
    block = text.split("\n\n")[1] if text.startswith(("acc", "loss")) else text
    lines = [ln.strip().strip("|").split("|") for ln in block.splitlines() if ln.startswith("|")]
    return {c[0].strip(): [x.strip() for x in c[1:]] for c in lines if "---" not in c[0]}


def cell(values, scale=100.0) -> str:
    """The text of a cell, computed independently with numpy (ddof = 1)."""
    arr = np.asarray(values) * scale
    return f"{arr.mean():.2f} ± {np.std(arr, ddof=1):.2f} (n={len(arr)})"


ACC = {  # final acc/mean per (algorithm, δ): three seeds each
    ("fedavg", 1.0): [0.71, 0.74, 0.80],
    ("fedavg", 2.0): [0.61, 0.66, 0.62],
    ("ditto", 1.0): [0.90, 0.85, 0.88],
    ("ditto", 2.0): [0.79, 0.81, 0.86],
}


@pytest.fixture(scope="module")
def grid(store):
    """Experiment ``grid``: ACC, a run per (algorithm, δ, seed), plus a FAILED and a RUNNING run."""
    uri, client = store
    for (alg, delta), values in ACC.items():
        for seed, v in enumerate(values):
            log_run(client, "grid", alg, seed, {"acc/mean": v}, **{"partition.delta": delta})
    log_run(client, "grid", "fedavg", 0, {"acc/mean": 0.0}, status="FAILED")
    log_run(client, "grid", "fedavg", 0, {"acc/mean": 0.0}, status="KILLED")
    return uri


def test_cells_are_mean_and_sample_std_with_the_statistics_stated(grid, capsys):
    code, out, err = report(capsys, "--uri", grid, "-e", "grid", "--cols", "partition.delta")
    assert code == 0, err
    head = out.splitlines()[0]
    assert "mean ± sample std (ddof = 1) over n runs" in head
    assert "final value" in head and "× 100" in head
    rows = md_rows(out)
    assert rows["algorithm"] == ["δ=1", "δ=2"]  # readable header: partition.delta -> δ
    assert rows["FedAvg"] == [cell(ACC["fedavg", 1.0]), cell(ACC["fedavg", 2.0])]
    assert rows["Ditto"] == [cell(ACC["ditto", 1.0]), cell(ACC["ditto", 2.0])]
    assert err == ""  # nothing dropped: the FAILED and KILLED runs are not read at all


def test_latex_and_csv_outputs(grid, capsys, tmp_path):
    args = ["--uri", grid, "-e", "grid", "--cols", "partition.delta", "--best"]
    code, out, _ = report(capsys, *args, "--format", "latex")
    assert code == 0
    assert "\\begin{tabular}{lcc}" in out and "\\toprule" in out and "\\bottomrule" in out
    assert "algorithm & $\\delta$=1 & $\\delta$=2 \\\\" in out
    ditto = np.asarray(ACC["ditto", 1.0]) * 100
    mean, std = f"{ditto.mean():.2f}", f"{np.std(ditto, ddof=1):.2f}"
    assert f"\\textbf{{{mean} $\\pm$ {std} (n=3)}}" in out  # ditto is best at δ=1
    assert "±" not in out.split("\\begin{tabular}")[1]  # the table itself: $\pm$ only
    assert out.startswith("% acc/mean")  # the statement as a LaTeX comment

    target = tmp_path / "sub" / "t.csv"
    code, out, err = report(capsys, *args, "--format", "csv", "--out", str(target))
    assert code == 0 and out == "" and str(target) in err
    rows = list(csv.DictReader(io.StringIO(target.read_text())))
    assert len(rows) == 4
    for row in rows:
        raw = ACC[row["choice.algorithm"], float(row["partition.delta"])]
        values = [float(v) for v in row["values"].split()]
        assert sorted(values) == pytest.approx(sorted(100 * np.asarray(raw)))
        assert float(row["mean"]) == pytest.approx(100 * np.mean(raw))
        assert float(row["std"]) == pytest.approx(100 * np.std(raw, ddof=1))
        assert row["n"] == "3" and row["scale"] == "100" and row["agg"] == "final"
        assert sorted(row["seeds"].split()) == ["0", "1", "2"]
        assert len(row["run_ids"].split()) == 3
    assert {r["row"] for r in rows} == {"FedAvg", "Ditto"}


def test_rerun_sweep_keeps_the_latest_run_per_configuration(store, capsys):
    uri, client = store
    first, second = [0.50, 0.60, 0.70], [0.52, 0.61, 0.75]
    for sweep, values in (("s1", first), ("s2", second)):  # the same sweep run twice
        for seed, v in enumerate(values):
            log_run(client, "rerun", "fedavg", seed, {"acc/mean": v}, sweep=sweep)
    code, out, err = report(capsys, "--uri", uri, "-e", "rerun")
    assert code == 0
    assert md_rows(out)["FedAvg"] == [cell(second)]  # n stays 3, the later runs' values
    assert len(err.strip().splitlines()) == 1 and "3 older run(s) dropped" in err
    code, out, err = report(capsys, "--uri", uri, "-e", "rerun", "--sweep", "s1")
    assert code == 0 and md_rows(out)["FedAvg"] == [cell(first)] and err == ""
    code, _, err = report(capsys, "--uri", uri, "-e", "rerun", "--sweep", "s3")
    assert code == 1 and "--sweep 's3'" in err and "s1, s2" in err
    assert len(err.strip().splitlines()) == 1


def test_a_cell_pooling_two_lrs_is_refused(store, capsys):
    uri, client = store
    values = {0.1: [0.8, 0.82], 0.01: [0.6, 0.65]}
    for lr, accs in values.items():
        for seed, v in enumerate(accs):
            log_run(client, "lrs", "fedavg", seed, {"acc/mean": v}, lr=lr)
    code, out, err = report(capsys, "--uri", uri, "-e", "lrs")
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("fedexp: error: 1 of 1 cells pool runs that differ in lr (0.01, 0.1)")
    assert "--rows/--cols" in err and "--where lr=0.01" in err and "--allow-pooling" in err

    code, out, _ = report(capsys, "--uri", uri, "-e", "lrs", "--cols", "lr")
    assert code == 0 and md_rows(out)["FedAvg"] == [cell(values[0.01]), cell(values[0.1])]
    code, out, _ = report(capsys, "--uri", uri, "-e", "lrs", "--where", "lr=0.10")
    assert code == 0 and md_rows(out)["FedAvg"] == [cell(values[0.1])]
    code, out, err = report(capsys, "--uri", uri, "-e", "lrs", "--allow-pooling")
    assert code == 0 and md_rows(out)["FedAvg"] == [cell(values[0.1] + values[0.01])]
    assert err.startswith("fedexp report: warning:") and "lr (0.01, 0.1)" in err


@pytest.mark.parametrize(
    ("args", "start", "closest"),
    [
        (["--rows", "choice.algoritm"], "--rows 'choice.algoritm'", "choice.algorithm"),
        (["--cols", "partition.delt"], "--cols 'partition.delt'", "partition.delta"),
        (["--metric", "acc/maen"], "--metric 'acc/maen'", "acc/mean"),
        (["--select-by", "val/acc/mean"], "--select-by 'val/acc/mean'", "acc/mean"),
        (["--where", "seeed=1"], "--where 'seeed'", "seed"),
        (["-e", "gird"], "--experiment 'gird'", "grid"),
    ],
    ids=["rows", "cols", "metric", "select-by", "where", "experiment"],
)
def test_misspelt_names_list_the_valid_ones_closest_first(grid, capsys, args, start, closest):
    base = ["--uri", grid] + ([] if "-e" in args else ["-e", "grid"])
    code, out, err = report(capsys, *base, *args)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"fedexp: error: {start}")
    valid = err.strip().split("(closest first): ")[1].split(", ")
    assert valid[0] == closest


def test_aggregation_over_rounds(store, capsys):
    uri, client = store
    curves = [[0.5, 0.9, 0.7, 0.6], [0.4, 0.8, 0.85, 0.8], [0.3, 0.7, 0.75, 0.9]]
    for seed, curve in enumerate(curves):
        log_run(client, "curves", "fedavg", seed, {"acc/mean": curve, "loss/mean": curve})
    expect = {
        "final": [c[-1] for c in curves],
        "best": [max(c) for c in curves],
        "last:3": [np.mean(c[-3:]) for c in curves],
    }
    for agg, values in expect.items():
        code, out, _ = report(capsys, "--uri", uri, "-e", "curves", "--agg", agg)
        assert code == 0 and md_rows(out)["FedAvg"] == [cell(values)], agg
    head = out.splitlines()[0]
    assert "mean of the last 3 logged values" in head
    code, out, _ = report(
        capsys, "--uri", uri, "-e", "curves", "--agg", "best", "--metric", "loss/mean",
        "--lower-is-better",
    )  # fmt: skip
    assert code == 0 and "best over the logged rounds (min)" in out and "× 1;" in out
    arr = np.asarray([min(c) for c in curves])
    assert md_rows(out)["FedAvg"] == [f"{arr.mean():.4g} ± {np.std(arr, ddof=1):.4g} (n=3)"]
    code, out, err = report(capsys, "--uri", uri, "-e", "curves", "--agg", "last:4")
    assert code == 0 and md_rows(out)["FedAvg"] == [cell([np.mean(c) for c in curves])]
    assert "--agg last:4: 3 of 3 runs have fewer than 4 values of acc/mean after round 0" in err
    code, _, err = report(capsys, "--uri", uri, "-e", "curves", "--agg", "last:0")
    assert code == 2 and "last:K with K ≥ 1" in err


def test_paired_differences_match_a_hand_computation(store, capsys):
    uri, client = store
    fedavg = {0: 0.70, 1: 0.60, 2: 0.75}
    ditto = {0: 0.80, 1: 0.75, 2: 0.78, 3: 0.99}  # seed 3 has no FedAvg partner
    for alg, values in (("fedavg", fedavg), ("ditto", ditto)):
        for seed, v in values.items():
            log_run(client, "paired", alg, seed, {"acc/mean": v})
    code, out, _ = report(capsys, "--uri", uri, "-e", "paired", "--paired", "FedAvg")
    assert code == 0
    main_table, statement, diffs = out.split("\n\n")[1:4]
    assert "matched by seed" in statement and "share the data partition" in statement
    assert "ddof = 1" in statement and "row − FedAvg" in statement
    d = [100 * (ditto[s] - fedavg[s]) for s in (0, 1, 2)]  # by hand: 10, 15, 3
    assert d == pytest.approx([10.0, 15.0, 3.0])
    expect = f"{np.mean(d):.2f} ± {np.std(d, ddof=1):.2f} (n=3)"
    assert md_rows(diffs) == {"algorithm": ["value"], "Ditto": [expect]}
    assert md_rows(main_table)["Ditto"] == [cell(list(ditto.values()))]  # n=4 there
    code, _, err = report(capsys, "--uri", uri, "-e", "paired", "--paired", "fedsgd")
    assert code == 1 and "--paired 'fedsgd': no such row; rows: Ditto, FedAvg" in err


def test_select_by_validation_reports_the_chosen_configurations_test_metric(store, capsys):
    uri, client = store
    # FedProx: μ = 0.1 is better on validation, μ = 0.01 on test (what test-tuning would pick)
    runs = {
        ("fedprox", 0.1): ([0.90, 0.92], [0.70, 0.72]),
        ("fedprox", 0.01): ([0.80, 0.81], [0.80, 0.85]),
        ("fedavg", None): ([0.75, 0.77], [0.74, 0.73]),
    }
    for (alg, mu), (val, test) in runs.items():
        for seed, (v, t) in enumerate(zip(val, test, strict=True)):
            extra = {"algorithm.mu": mu} if mu is not None else {}
            log_run(client, "tune", alg, seed, {"val/acc/mean": v, "acc/mean": t}, **extra)
    args = ["--uri", uri, "-e", "tune", "--select-by", "val/acc/mean"]
    code, out, err = report(capsys, *args)
    assert code == 0, err  # no pooling refusal: the μ values are the candidates
    parts = out.split("\n\n")
    assert "chosen on val/acc/mean" in parts[0]
    assert md_rows(parts[1])["FedProx"] == [cell(runs["fedprox", 0.1][1])]
    assert md_rows(parts[1])["FedAvg"] == [cell(runs["fedavg", None][1])]
    chosen = md_rows(parts[3])
    assert chosen["algorithm"] == ["chosen", "val/acc/mean (× 100)", "candidates"]
    assert chosen["FedProx"] == ["algorithm.mu=0.1", cell(runs["fedprox", 0.1][0]), "2"]
    assert chosen["FedAvg"] == ["(only one)", cell(runs["fedavg", None][0]), "1"]
    # selecting on a loss minimises it
    for (alg, mu), (val, _) in runs.items():
        for seed, v in enumerate(val):
            extra = {"algorithm.mu": mu} if mu is not None else {}
            log_run(client, "tune_loss", alg, seed, {"val/loss/mean": v, "acc/mean": v}, **extra)
    code, out, _ = report(capsys, "--uri", uri, "-e", "tune_loss", "--select-by", "val/loss/mean")
    assert code == 0 and md_rows(out.split("\n\n")[3])["FedProx"][0] == "algorithm.mu=0.01"
    # selecting on the test metric itself is allowed, with a warning: it leaks the test set
    code, out, err = report(capsys, "--uri", uri, "-e", "tune", "--select-by", "acc/mean")
    assert code == 0 and md_rows(out.split("\n\n")[3])["FedProx"][0] == "algorithm.mu=0.01"
    assert "warning: --select-by acc/mean is not a validation metric" in err


def test_help_explains_every_option_with_its_default():
    from fedexp.report.options import _Formatter
    from fedexp.report.options import parser

    p = parser()
    fmt = _Formatter("fedexp report")
    options = [a for a in p._actions if a.dest != "help"]
    assert len(options) >= 20
    for action in options:
        text = fmt._get_help_string(action) or ""
        assert len(text) > 20 and "default" in text, action.option_strings
    assert "(default: None)" not in p.format_help()
    assert p.epilog.count("fedexp report -e") == 3


def test_every_algorithm_has_a_display_name():
    from fedexp.report import ALGORITHM_LABELS

    names = {p.stem for p in (Path(__file__).parents[1] / "conf" / "algorithm").glob("*.yaml")}
    assert names and names <= set(ALGORITHM_LABELS), names - set(ALGORITHM_LABELS)
    assert ALGORITHM_LABELS["fedavg_ft"] == "FedAvg-FT" and ALGORITHM_LABELS["pfedme"] == "pFedMe"


def test_reach_reads_the_bytes_at_the_first_round_at_target(store, capsys, tmp_path):
    uri, client = store
    kib = 1024.0
    for seed, acc in enumerate(([0.5, 0.8, 0.95, 0.97], [0.6, 0.92, 0.9, 0.93])):
        up = [0.0, 10 * kib, 20 * kib, 30 * kib]
        down = [0.0, 40 * kib, 80 * kib, 120 * kib]
        log_run(
            client, "bytes", "fedavg", seed,
            {"acc/mean": acc, "bytes/up_cum": up, "bytes/down_cum": down},
        )  # fmt: skip
    log_run(client, "bytes", "local", 0, {"acc/mean": [0.5, 0.6], "bytes/up_cum": [0.0, 0.0]})
    png = tmp_path / "reach.png"
    code, out, _ = report(capsys, "--uri", uri, "-e", "bytes", "--reach", "0.9", "--plot", str(png))
    assert code == 0 and png.stat().st_size > 0
    rows = md_rows(out)
    # FedAvg reaches 0.9 at rounds 2 and 1: 20 and 10 KiB up, 80 and 40 KiB down
    assert rows["FedAvg"][:3] == ["2/2", "15.0", "60.0"]
    assert rows["Local"][:3] == ["0/1", "nan", "nan"]


def test_reach_with_lower_is_better_reads_the_first_round_at_or_below_target(store, capsys):
    """A loss reaches its target from above: the first round with the metric ≤ VALUE."""
    uri, client = store
    kib = 1024.0
    for seed, loss in enumerate(([0.9, 0.5, 0.3, 0.25], [0.8, 0.35, 0.28, 0.2])):
        log_run(
            client, "loss-reach", "fedavg", seed,
            {"train/train_loss": loss, "bytes/up_cum": [0.0, kib, 2 * kib, 3 * kib],
             "bytes/down_cum": [0.0, 4 * kib, 8 * kib, 12 * kib]},
        )  # fmt: skip
    args = ["--uri", uri, "-e", "loss-reach", "--metric", "train/train_loss", "--reach", "0.3"]
    code, out, _ = report(capsys, *args, "--lower-is-better")
    assert code == 0 and "train/train_loss ≤ 0.3" in out
    # rounds 2 and 2 (0.3 ≤ 0.3; 0.28): 2 KiB up, 8 KiB down
    assert md_rows(out)["FedAvg"][:3] == ["2/2", "2.0", "8.0"]
    code, out, _ = report(capsys, *args)  # ≥ 0.3: round 0 of both, before any byte
    assert code == 0 and "train/train_loss ≥ 0.3" in out
    assert md_rows(out)["FedAvg"][:3] == ["2/2", "0.0", "0.0"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--paired", "fedavg"],
        ["--select-by", "val/acc/mean"],
        ["--best"],
        ["--rank-of", "fedavg"],
        ["--order", "fedavg"],
        ["--scale", "1"],
        ["--allow-pooling"],
        ["--epsilon"],
        ["--agg", "best"],
        ["--format", "csv"],
    ],
)
def test_reach_refuses_an_option_of_the_table_it_would_ignore(store, capsys, extra):
    uri, _ = store
    code, out, err = report(capsys, "--uri", uri, "-e", "bytes", "--reach", "0.9", *extra)
    assert code == 2 and not out
    assert f"{extra[0]}" in err.splitlines()[-1] and "not with --reach" in err


def test_plot_without_reach_is_refused(store, capsys, tmp_path):
    uri, _ = store
    png = tmp_path / "never.png"
    code, out, err = report(capsys, "--uri", uri, "-e", "bytes", "--plot", str(png))
    assert code == 2 and not out and "--plot: only with --reach" in err
    assert not png.exists()


# --- bad options create nothing (issue 24, item 4) ---------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "x"])
def test_a_scale_that_is_not_a_finite_number_is_refused(grid, capsys, value):
    code, out, err = report(capsys, "--uri", grid, "-e", "grid", f"--scale={value}")
    assert code == 2 and not out
    assert "--scale" in err and repr(value) in err


def test_a_store_that_does_not_exist_is_refused_and_not_created(capsys, tmp_path):
    missing = tmp_path / "nowhere" / "mlflow.db"
    code, out, err = report(capsys, "--uri", f"sqlite:///{missing}", "-e", "grid")
    assert code == 1 and not out
    assert err.count("\n") == 1 and f"--uri=sqlite:///{missing}: no MLflow store there" in err
    assert not missing.exists() and not missing.parent.exists()
    folder = tmp_path / "mlruns"
    code, _, err = report(capsys, "--uri", str(folder), "-e", "grid")
    assert code == 1 and "is not a folder" in err and not folder.exists()


def test_out_under_a_file_is_refused_before_any_work(grid, capsys, tmp_path):
    blocker = tmp_path / "table.md"
    blocker.write_text("kept")
    code, out, err = report(capsys, "--uri", grid, "-e", "grid", "--out", str(blocker / "x.md"))
    assert code == 2 and not out
    assert f"--out {blocker / 'x.md'}: {blocker} is a file, not a folder" in err
    assert blocker.read_text() == "kept"
    code, _, err = report(capsys, "--uri", grid, "-e", "grid", "--out", str(tmp_path))
    assert code == 2 and "is a folder" in err
