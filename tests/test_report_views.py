"""``fedexp report --views``: personal, global, gain and new clients as columns (issue 68).

Runs logged by hand into a fresh MLflow store, as in ``test_report_cli.py``, so every cell is
checked against numpy.
"""

from __future__ import annotations

import csv
import io

import pytest
from mlflow.tracking import MlflowClient
from test_report_cli import cell
from test_report_cli import log_run
from test_report_cli import md_rows
from test_report_cli import report

from fedexp.report.render import default_scale
from helpers import mlflow_db

#: final values per algorithm and view, three seeds each; FedAMP has no global model and no
#: held-out clients, local-only no held-out clients
LOGGED = {
    "fedavg": {
        "acc/mean": [0.80, 0.82, 0.84],
        "global/acc/mean": [0.80, 0.82, 0.84],
        "gain/acc/mean": [0.0, 0.0, 0.0],
        "new/acc/mean": [0.70, 0.75, 0.72],
    },
    "ditto": {
        "acc/mean": [0.90, 0.88, 0.91],
        "global/acc/mean": [0.80, 0.82, 0.84],
        "gain/acc/mean": [0.10, 0.06, 0.07],
        "new/acc/mean": [0.71, 0.74, 0.70],
    },
    "fedamp": {"acc/mean": [0.86, 0.87, 0.85]},
}


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    uri = mlflow_db(tmp_path_factory.mktemp("views") / "m.db")
    client = MlflowClient(uri)
    for alg, metrics in LOGGED.items():
        for seed in range(3):
            log_run(client, "views", alg, seed, {k: v[seed] for k, v in metrics.items()})
    return uri


def test_a_column_per_view_in_the_order_asked(views, capsys):
    args = ["--uri", views, "-e", "views", "--views", "personal", "global", "gain", "new"]
    code, out, err = report(capsys, *args)
    assert code == 0, err
    assert "a column per view (personal: acc/mean, global: global/acc/mean" in out.splitlines()[0]
    rows = md_rows(out)
    assert rows["algorithm"] == ["personal", "global", "gain", "new"]
    for alg, label in (("fedavg", "FedAvg"), ("ditto", "Ditto")):
        logged = LOGGED[alg]
        assert rows[label] == [
            cell(logged[k])
            for k in ("acc/mean", "global/acc/mean", "gain/acc/mean", "new/acc/mean")
        ]
    assert rows["FedAMP"] == [cell(LOGGED["fedamp"]["acc/mean"]), "", "", ""]  # none logged


def test_a_view_no_run_logs_is_left_out_with_a_warning(views, capsys):
    where = ["--where", "choice.algorithm=fedamp"]
    args = ["--uri", views, "-e", "views", "--views", "personal", "new", *where]
    code, out, err = report(capsys, *args)
    assert code == 0, err
    assert "warning: --views new: left out" in err
    assert md_rows(out)["algorithm"] == ["personal"]
    args = ["--uri", views, "-e", "views", "--views", "personal", "--metric", "loss/mean"]
    code, out, err = report(capsys, *args)
    assert code == 1 and "--views: no run logs any view of loss/mean" in err


def test_csv_has_a_row_per_cell_and_view(views, capsys):
    args = ["--uri", views, "-e", "views", "--views", "personal", "gain", "--format", "csv"]
    code, out, err = report(capsys, *args)
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    got = {(r["row"], r["metric"]): float(r["mean"]) for r in rows}
    assert got["Ditto", "gain/acc/mean"] == pytest.approx(100 * sum([0.10, 0.06, 0.07]) / 3)
    assert ("FedAMP", "gain/acc/mean") not in got and ("FedAMP", "acc/mean") in got


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--paired", "fedavg"], "--paired: not with --views"),
        (["--epsilon"], "--epsilon: not with --views"),
        (["--reach", "0.8"], "--reach: not with --views"),
    ],
)
def test_views_refuse_what_they_would_ignore(views, capsys, extra, said):
    code, _, err = report(capsys, "--uri", views, "-e", "views", "--views", "personal", *extra)
    assert code == 2 and said in err


def test_the_views_of_a_fraction_are_shown_in_percent():
    for metric in ("global/acc/mean", "gain/acc/p10", "new/auc/mean", "val/acc/p90"):
        assert default_scale(metric) == 100.0
    assert default_scale("gain/loss/mean") == 1.0
