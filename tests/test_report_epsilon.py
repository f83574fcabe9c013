"""``fedexp report --epsilon``: the ε the runs of each cell spent, beside the cell.

Runs are logged by hand into a SQLite MLflow store, as a private run logs them (the
``privacy.*`` params, a ``privacy/epsilon`` history) and as a run without DP does (``privacy.mode
= none``, no ``privacy/epsilon``), with the helpers of ``test_report_cli``.
"""

from __future__ import annotations

import csv
import io
import math
import sys

import pytest
from mlflow.tracking import MlflowClient
from test_report_cli import cell
from test_report_cli import log_run
from test_report_cli import md_rows
from test_report_cli import report

from fedexp.report.collect import Run
from fedexp.report.collect import epsilon_of
from fedexp.report.render import epsilon_text
from fedexp.report.render import key_value
from helpers import mlflow_db

#: final acc/mean per (algorithm, target ε) over seeds 0 and 1; None: privacy=none (ε = ∞)
ACC = {
    ("fedavg", 1): [0.52, 0.56],
    ("fedavg", 3): [0.71, 0.69],
    ("fedavg", None): [0.90, 0.91],
    ("ditto", 1): [0.80, 0.84],
    ("ditto", 3): [0.93, 0.95],
    ("ditto", None): [0.97, 0.98],
}
#: the ε history a run of target ε logs (its last value is what it spent)
SPENT = {1: [0.41, 0.77, 0.9999996], 3: [1.2, 2.4, 2.9999996]}


def private(target: float | None, **extra: object) -> dict[str, object]:
    """The ``privacy.*`` params of a ``privacy=central`` run (``privacy=none``: mode only)."""
    if target is None:
        return {"privacy.mode": "none"}
    return {
        "privacy.mode": "central",
        "privacy.clip": 0.5,
        "privacy.noise_multiplier": 1.0,
        "privacy.target_epsilon": target,
        "privacy.delta": 1e-05,
    } | extra


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A fresh SQLite MLflow store (made once: a store's set-up takes seconds): (uri, client)."""
    uri = mlflow_db(tmp_path_factory.mktemp("report_eps") / "m.db")
    return uri, MlflowClient(uri)


@pytest.fixture(scope="module")
def grid(store):
    """Experiment ``dp``: ACC, a run per (algorithm, target ε, seed): the store's URI."""
    uri, client = store
    for (alg, target), values in ACC.items():
        for seed, v in enumerate(values):
            metrics: dict[str, float | list[float]] = {"acc/mean": v}
            if target is not None:
                metrics["privacy/epsilon"] = SPENT[target]
            log_run(client, "dp", alg, seed, metrics, **private(target))
    return uri


def test_epsilon_beside_each_cell_and_infinity_without_privacy(grid, capsys):
    args = ["--uri", grid, "-e", "dp", "--cols", "privacy.target_epsilon"]
    code, out, err = report(capsys, *args, "--epsilon")
    assert code == 0, err
    rows = md_rows(out)
    assert rows["algorithm"] == ["target ε=1", "target ε=3", "target ε=∞"]  # ∞ last
    for alg, label in (("fedavg", "FedAvg"), ("ditto", "Ditto")):
        expect = [
            cell(ACC[alg, 1]).replace(")", ", ε=1)"),
            cell(ACC[alg, 3]).replace(")", ", ε=3)"),
            cell(ACC[alg, None]).replace(")", ", ε=∞)"),
        ]
        assert rows[label] == expect
    head = out.splitlines()[0]
    assert "ε: the privacy the runs of a cell spent" in head and "at δ=1e-05" in head


def test_without_the_option_the_table_is_unchanged(grid, capsys):
    code, out, _ = report(capsys, "--uri", grid, "-e", "dp", "--cols", "privacy.target_epsilon")
    assert code == 0 and "ε=" not in out.replace("target ε=", "")
    assert "privacy the runs" not in out
    assert md_rows(out)["FedAvg"] == [cell(ACC["fedavg", t]) for t in (1, 3, None)]


def test_latex_and_csv(grid, capsys):
    args = ["--uri", grid, "-e", "dp", "--cols", "privacy.target_epsilon", "--epsilon"]
    code, out, _ = report(capsys, *args, "--format", "latex")
    assert code == 0
    table = out.split("\\begin{tabular}")[1]
    assert "algorithm & target $\\varepsilon$=1 & target $\\varepsilon$=3" in table
    assert "(n=2, $\\varepsilon$=3)" in table and "(n=2, $\\varepsilon$=$\\infty$)" in table
    assert "ε" not in table and "∞" not in table

    code, out, _ = report(capsys, *args, "--format", "csv")
    assert code == 0
    rows = {
        (r["choice.algorithm"], r["privacy.target_epsilon"]): r
        for r in csv.DictReader(io.StringIO(out))
    }
    assert set(rows) == {(a, t) for a in ("fedavg", "ditto") for t in ("1", "3", "∞")}
    assert float(rows["fedavg", "3"]["epsilon"]) == pytest.approx(SPENT[3][-1])
    assert rows["ditto", "∞"]["epsilon"] == "inf" and rows["ditto", "∞"]["epsilons"] == "inf inf"
    assert len(rows["fedavg", "1"]["epsilons"].split()) == 2


def test_where_reads_the_raw_value_and_rows_can_be_the_target(grid, capsys):
    code, out, _ = report(
        capsys, "--uri", grid, "-e", "dp", "--where", "privacy.target_epsilon=3.0", "--epsilon"
    )
    assert code == 0 and md_rows(out)["Ditto"] == [cell(ACC["ditto", 3]).replace(")", ", ε=3)")]
    code, out, _ = report(
        capsys, "--uri", grid, "-e", "dp", "--where", "choice.algorithm=fedavg", "--epsilon",
        "--rows", "privacy.target_epsilon",
    )  # fmt: skip
    assert code == 0
    assert list(md_rows(out)) == ["target ε", "1", "3", "∞"]


def test_null_target_runs_without_privacy_metric_and_infinite_epsilon(store, capsys):
    uri, client = store
    # a central run with no target (z given): ε from its metric, the column "none"
    for seed, eps in enumerate((4.0, 5.0)):
        metrics = {"acc/mean": 0.7, "privacy/epsilon": [1.0, eps]}
        log_run(client, "z", "fedavg", seed, metrics, **_null())
    # central runs that logged no ε, or ε = ∞ (MLflow's SQL store keeps the largest float)
    log_run(client, "z", "ditto", 0, {"acc/mean": 0.8}, **_null())
    log_run(client, "z", "ditto", 1, {"acc/mean": 0.8, "privacy/epsilon": math.inf}, **_null())
    code, out, err = report(
        capsys, "--uri", uri, "-e", "z", "--cols", "privacy.target_epsilon", "--epsilon"
    )
    assert code == 0, err
    rows = md_rows(out)
    assert rows["algorithm"] == ["target ε=none"]
    assert rows["FedAvg"] == ["70.00 ± 0.00 (n=2, ε=4.5)"]
    assert rows["Ditto"] == ["80.00 ± 0.00 (n=2, ε=∞)"]


def _null() -> dict[str, object]:
    """A ``privacy=central`` run's params with ``privacy.target_epsilon=null``."""
    return private(1) | {"privacy.target_epsilon": None}


def test_epsilon_with_reach_is_refused(grid, capsys):
    code, out, err = report(capsys, "--uri", grid, "-e", "dp", "--reach", "0.5", "--epsilon")
    assert code == 2 and not out and "--epsilon: not with --reach" in err


def test_epsilon_of_a_run_and_its_text():
    def run(mode: str | None, eps: float | None) -> Run:
        params = {} if mode is None else {"privacy.mode": mode}
        metrics = {} if eps is None else {"privacy/epsilon": eps}
        return Run("r", 0, params, {}, metrics)

    assert epsilon_of(run("central", 2.5)) == 2.5
    assert epsilon_of(run("local", 0.0)) == 0.0
    for r in (run("none", None), run(None, None), run("central", None)):
        assert epsilon_of(r) == math.inf
    assert epsilon_of(run("central", sys.float_info.max)) == math.inf
    assert epsilon_of(run("none", 3.0)) == math.inf  # mode none: no DP, whatever was logged
    texts = [epsilon_text(x) for x in (2.9999996, 2.877, 0.6201, 12.34, 1234.5, math.inf)]
    assert texts == ["3", "2.88", "0.62", "12.3", "1234", "∞"]
    assert key_value("privacy.target_epsilon", "-") == "∞"
    assert key_value("privacy.target_epsilon", "None") == "none"
    assert key_value("algorithm.mu", "-") == "-"  # other keys keep their values
