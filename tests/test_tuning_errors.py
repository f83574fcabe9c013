"""Optuna search-space mistakes: one line naming the key, exit 2, nothing made (issue "Hardening,
round two", item 3).

Before, each of these reached hydra-optuna-sweeper and stopped the sweep with a traceback
(Optuna's ValueError, an AssertionError, a ZeroDivisionError), after the sweep's folder and the
MLflow store had been made; some ran to the end doing what was not asked (an unknown tag, two
directions). :func:`fedexp.tuning.search_space.search_space_errors` refuses them before Hydra
composes.

Most cases run ``fedexp.cli.main`` in-process with Hydra replaced by a stub that fails the test
if reached; three run the real command in a child process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from fedexp import cli
from fedexp.cli import overrides
from fedexp.tuning import search_space
from fedexp.tuning.search_space import search_space_errors
from helpers import CONF
from helpers import ROOT
from helpers import run_cli

#: A tiny Optuna sweep on the command line (nothing runs: the checks come first).
TINY = ["rounds=1", "hydra.sweeper.n_trials=1"]


def _assert_one_line(code, err, cwd, *needles):
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedexp: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    made = sorted(p.name for p in cwd.iterdir())
    assert made == [], f"the refused command made {made}"  # no mlflow.db, mlruns, multirun


@pytest.fixture
def fedexp_run(tmp_path, monkeypatch, capsys):
    """``fedexp run ARGS`` in-process, from an empty folder: (exit code, stderr)."""
    monkeypatch.chdir(tmp_path)

    def hydra_reached():
        raise AssertionError("Hydra was reached: the search space was not refused")

    monkeypatch.setattr(cli, "_hydra_main", lambda: hydra_reached)

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["fedexp", "run", *args])
        with pytest.raises(SystemExit) as stop:
            cli.main()
        return stop.value.code, capsys.readouterr().err

    return run


@pytest.fixture(scope="module")
def conf_copy(tmp_path_factory):
    """fedexp's conf/ plus a bad hparams_search file and an experiment that tunes."""
    conf = tmp_path_factory.mktemp("cfg") / "conf"
    shutil.copytree(CONF, conf)
    (conf / "hparams_search" / "bad.yaml").write_text(
        textwrap.dedent(
            """\
            # @package _global_
            defaults:
              - override /hydra/sweeper: optuna
            hydra:
              sweeper:
                direction: [maximize, sideways]
                n_jobs: 0
                params:
                  lr: tag(log, interval(0, 1))
            """
        )
    )
    (conf / "experiment" / "tuned.yaml").write_text(
        textwrap.dedent(
            """\
            # @package _global_
            defaults:
              - override /hparams_search: lr
            hydra:
              sweeper:
                params:
                  algorithm.mu: interval(1, 0.1)
            """
        )
    )
    return conf


@pytest.fixture
def with_conf(conf_copy, monkeypatch):
    """The CLI and the checks read ``conf_copy`` instead of conf/."""
    monkeypatch.setattr(overrides, "CONFIG_DIR", str(conf_copy))
    monkeypatch.setattr(search_space, "CONF_DIR", conf_copy)
    return conf_copy


@pytest.mark.parametrize(
    "args,needles",
    [
        (
            ["hparams_search=lr", "lr=tag(log, interval(0, 1))"],
            ["lr=tag(log, interval(0, 1)): a log-scale interval needs a lower bound > 0"],
        ),
        (["hparams_search=lr", "lr=interval(1, 0.1)"], ["lr=interval(1, 0.1):", "low ≤ high"]),
        (
            ["hparams_search=lr", "hydra.sweeper.direction=sideways"],
            ["hydra.sweeper.direction=sideways: expected minimize or maximize"],
        ),
        (
            ["hydra/sweeper=optuna", "lr=tag(log, interval(0, 1))"],
            ["lr=tag(log, interval(0, 1)):", "lower bound > 0"],
        ),
        (
            ["hparams_search=lr", "hydra.sweeper.params.lr='interval(1, 0.1)'"],
            ["hydra.sweeper.params.lr=interval(1, 0.1):", "low ≤ high"],
        ),
        (
            ["hparams_search=fedprox", "algorithm=fedprox", "algorithm.mu=tag(log,interval(0,1))"],
            ["algorithm.mu=tag(log,interval(0,1)):", "lower bound > 0"],
        ),
        (["hparams_search=lr", "local_steps=int(interval(5, 1))"], ["local_steps=", "low ≤ high"]),
        (["hparams_search=lr", "lr=choice()"], ["lr=choice(): choice() is empty"]),
        (["hparams_search=lr", "local_steps=range(5, 1)"], ["local_steps=range(5, 1):", "≤ stop"]),
        (["hparams_search=lr", "local_steps=range(1, 5, 0)"], ["local_steps=", "step > 0"]),
        (
            ["hparams_search=lr", "local_steps=tag(log, int(interval(0, 8)))"],
            ["local_steps=tag(log, int(interval(0, 8))):", "lower bound ≥ 1"],
        ),
        (
            ["hparams_search=lr", "lr=tag(logarithmic, interval(0.1, 1))"],
            ["lr=tag(logarithmic, interval(0.1, 1)):", "unknown tag logarithmic"],
        ),
        (
            ["hparams_search=lr", "lr=tag(log, choice(0.1, 1))"],
            ["lr=tag(log, choice(0.1, 1)):", "interval() only"],
        ),
        (["hparams_search=lr", "lr=interval(a, 1)"], ["lr=interval(a, 1):", "must be a number"]),
        (["hparams_search=lr", "lr=interval(nan, 1)"], ["lr=interval(nan, 1):", "finite"]),
        (["hparams_search=lr", "lr=interval(0.1, inf)"], ["lr=interval(0.1, inf):", "finite"]),
        (["hparams_search=lr", "hydra.sweeper.n_trials=0"], ["hydra.sweeper.n_trials=0:", "≥ 1"]),
        (["hparams_search=lr", "hydra.sweeper.n_trials=abc"], ["hydra.sweeper.n_trials=abc:"]),
        (["hparams_search=lr", "hydra.sweeper.n_jobs=0"], ["hydra.sweeper.n_jobs=0:", "≥ 1"]),
        (["hparams_search=lr", "hydra.sweeper.n_jobs=-1"], ["hydra.sweeper.n_jobs=-1:", "≥ 1"]),
        (
            ["hparams_search=lr", "hydra.sweeper.direction=[maximize,sideways]"],
            ["hydra.sweeper.direction=[maximize,sideways]:", "sideways is not a direction"],
        ),
        (
            ["hparams_search=lr", "hydra.sweeper.direction=[maximize,minimize]"],
            ["hydra.sweeper.direction=[maximize,minimize]:", "objective is one number"],
        ),
        (["hparams_search=lr", "hydra.sweeper.direction=[]"], ["hydra.sweeper.direction=[]:"]),
        (
            ["hparams_search=lr", "hydra.sweeper.sampler.seed=abc"],
            ["hydra.sweeper.sampler.seed=abc: expected an integer"],
        ),
        (["hparams_search=lr", "hydra.sweeper.sampler.seed=-1"], ["sampler.seed=-1:"]),
        (["hparams_search=lr", "hydra.sweeper.sampler.seed=1.5"], ["sampler.seed=1.5:"]),
        (
            ["hparams_search=lr", "hydra.sweeper.max_failure_rate=2"],
            ["hydra.sweeper.max_failure_rate=2:", "[0, 1]"],
        ),
        (["hparams_search=lr", "algorithm=glob(fed*)"], ["algorithm=glob(fed*):", "glob()"]),
        (["hparams_search=lr", "lr=shuffle(range(5, 1))"], ["lr=shuffle(range(5, 1)):", "empty"]),
        (
            ["hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "lr=interval(0.1, 1)"],
            ["lr=interval(0.1, 1):", "grid sampler"],
        ),
    ],
    ids=[
        "log-from-0",
        "low-above-high",
        "direction",
        "sweeper-on-command-line",
        "params-on-command-line",
        "fedprox-mu-log-from-0",
        "int-interval-reversed",
        "choice-empty",
        "range-reversed",
        "range-step-0",
        "int-log-from-0",
        "unknown-tag",
        "log-tag-on-choice",
        "non-numeric-bound",
        "nan-bound",
        "inf-bound",
        "n-trials-0",
        "n-trials-not-int",
        "n-jobs-0",
        "n-jobs-negative",
        "direction-list-bad-entry",
        "two-directions",
        "direction-empty-list",
        "seed-not-int",
        "seed-negative",
        "seed-float",
        "max-failure-rate",
        "glob",
        "shuffle-empty",
        "grid-sampler-interval",
    ],
)
def test_bad_search_space_is_one_line(fedexp_run, tmp_path, args, needles):
    code, err = fedexp_run("-m", *TINY, *args)
    _assert_one_line(code, err, tmp_path, *needles)


def test_bad_hparams_search_file_names_file_and_keys(fedexp_run, with_conf, tmp_path):
    code, err = fedexp_run("-m", *TINY, "hparams_search=bad")
    where = "(in conf/hparams_search/bad.yaml)"
    _assert_one_line(
        code,
        err,
        tmp_path,
        f"hydra.sweeper.params.lr=tag(log, interval(0, 1)) {where}: a log-scale interval",
        f"hydra.sweeper.direction=[maximize, sideways] {where}: sideways is not a direction",
        f"hydra.sweeper.n_jobs=0 {where}: expected an integer ≥ 1",
    )


def test_command_line_wins_over_the_file(with_conf):
    args = ["-m", "hparams_search=bad", "hydra.sweeper.params.lr='tag(log, interval(0.01, 1))'"]
    fixed = ["hydra.sweeper.direction=maximize", "hydra.sweeper.n_jobs=1"]
    assert len(search_space_errors(args)) == 2
    assert search_space_errors([*args, *fixed]) == []
    # a search key deleted on the command line is not searched, nor checked
    assert (
        search_space_errors(["-m", "hparams_search=bad", "~hydra.sweeper.params.lr", *fixed]) == []
    )
    assert (
        search_space_errors(["-m", "hparams_search=bad", "hydra.sweeper.params=null", *fixed]) == []
    )


def test_experiment_that_tunes_is_checked(fedexp_run, with_conf, tmp_path):
    code, err = fedexp_run("-m", *TINY, "+experiment=tuned", "algorithm=fedprox")
    _assert_one_line(
        code,
        err,
        tmp_path,
        "hydra.sweeper.params.algorithm.mu=interval(1, 0.1) (in conf/experiment/tuned.yaml):",
        "low ≤ high",
    )


@pytest.mark.parametrize(
    "args",
    [
        ["hparams_search=lr", "lr=tag(log, interval(0, 1))"],
        ["hparams_search=lr", "lr=interval(1, 0.1)"],
        ["hparams_search=lr", "hydra.sweeper.direction=sideways"],
    ],
    ids=["log-from-0", "low-above-high", "direction"],
)
def test_the_real_command_refuses_before_making_anything(tmp_path, args):
    """The issue's three commands, MLflow tracker on: before, a traceback after mlflow.db."""
    proc = run_cli("run", "-m", *TINY, *args, cwd=tmp_path, timeout=120)
    key = args[-1].split(":")[0]
    _assert_one_line(proc.returncode, proc.stderr, tmp_path, f"fedexp: error: {key}:")


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "hparams_search=lr"],
        ["-m", "hparams_search=fedprox", "algorithm=fedprox"],
        ["-m", "hparams_search=ditto", "algorithm=ditto"],
        ["-m", "hparams_search=pfednet", "algorithm=pfednet"],
        [
            "-m",
            "hparams_search=fedprox",
            "algorithm=fedprox",
            "lr=tag(log, interval(0.01, 1))",
            "hydra.sweeper.params.algorithm.mu='tag(log, interval(0.001, 1))'",
            "hydra.sweeper.n_trials=30",
            "hydra.sweeper.n_jobs=2",
            "hydra/launcher=parallel",
        ],
        [
            "--multirun",
            "hydra/sweeper=optuna",
            "hydra.sweeper.direction=[maximize]",
            "hydra.sweeper.sampler.seed=null",
            "hydra.sweeper.max_failure_rate=0.5",
            "algorithm=fedavg,ditto",
            "lr=choice(0.1, 1)",
            "local_steps=range(1, 5)",
            "seed=int(interval(0, 3))",
            "batch_size=tag(log, int(interval(8, 64)))",
            "participation=interval(0.5, 1)",
        ],
        ["-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "lr=choice(0.1, 1)"],
        ["-m", "hparams_search=lr", "lr=0.1", "rounds=2"],
    ],
    ids=[
        "lr",
        "fedprox",
        "ditto",
        "pfednet",
        "fedprox-narrowed",
        "optuna-on-command-line",
        "grid-of-choices",
        "fixed-value",
    ],
)
def test_good_search_spaces_pass(args):
    assert search_space_errors(args) == []


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "lr=interval(1, 0.1)"],  # the basic sweeper: Hydra's own message
        ["hparams_search=lr", "lr=interval(1, 0.1)"],  # no -m: nothing is swept
        ["-m", "hparams_search=lr_grid", "hydra.sweeper.direction=sideways"],  # basic sweeper
        ["-m", "hparams_search=lr", "hydra/sweeper=basic", "lr=interval(1, 0.1)"],
        ["-m", "hparams_search=lr", "lr=interval(1, 0.1)", "--cfg", "job"],
    ],
    ids=["basic-sweeper", "single-run", "lr-grid", "command-line-wins", "cfg"],
)
def test_nothing_checked_where_optuna_does_not_run(args):
    assert search_space_errors(args) == []


def test_checks_import_no_optuna_torch_or_mlflow():
    code = textwrap.dedent(
        """
        import sys
        from fedexp.tuning.search_space import search_space_errors
        assert search_space_errors(["-m", "hparams_search=fedprox", "lr=interval(1, 0)"])
        assert search_space_errors(["-m", "hparams_search=fedprox"]) == []
        print(sorted({m.split(".")[0] for m in sys.modules} & {"optuna", "torch", "mlflow"}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


#: Search values the sweeper's conversion (hydra-optuna-sweeper 1.3, Optuna 2.10) refuses.
PLUGIN_REFUSES = [
    "interval(1, 0.1)",
    "tag(log, interval(0, 1))",
    "tag(log, interval(-1, 1))",
    "int(interval(5, 1))",
    "tag(log, int(interval(0, 8)))",
    "range(5, 1)",
    "range(1, 5, 0)",
    "range(5, 1, -1)",
    "range(1.0, 2.0, 0.0)",
    "shuffle(range(5, 1))",
    "glob(*)",
]
#: Values it takes but should not: a non-finite bound fails each trial's draw, a tag is ignored.
PLUGIN_TAKES_WRONGLY = [
    "interval(nan, 1)",
    "interval(0, inf)",
    "tag(logarithmic, interval(0.1, 1))",
    "tag(log, choice(0.1, 1))",
    "tag(log, range(1, 5))",
]
#: Values it takes, rightly.
PLUGIN_TAKES = [
    "0.1",
    "choice(0.1, 1)",
    "0.1,1",
    "range(1, 5)",
    "range(3, 3)",
    "range(0.5, 2.0, 0.5)",
    "shuffle(range(1, 5))",
    "interval(0.1, 1)",
    "interval(1, 1)",
    "interval(-1, 1)",
    "int(interval(1, 8))",
    "tag(log, interval(0.0001, 1))",
    "tag(log, int(interval(1, 8)))",
    "sort(choice(1, 0.1))",
]


def test_refuses_what_the_sweeper_refuses():
    """The checks against the sweeper's own conversion (imports Optuna: about 2 s)."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.hydra_optuna_sweeper._impl import create_optuna_distribution_from_override

    parser = OverridesParser.create()

    def plugin_takes(value: str) -> bool:
        try:
            create_optuna_distribution_from_override(parser.parse_override(f"lr={value}"))
        except Exception:  # noqa: BLE001 - ValueError, AssertionError, ArithmeticError, ...
            return False
        return True

    def refused(value: str) -> bool:
        return bool(search_space_errors(["-m", "hydra/sweeper=optuna", f"lr={value}"]))

    for value in PLUGIN_REFUSES:
        assert not plugin_takes(value) and refused(value), value
    for value in PLUGIN_TAKES_WRONGLY:
        assert plugin_takes(value) and refused(value), value
    for value in PLUGIN_TAKES:
        assert plugin_takes(value) and not refused(value), value
