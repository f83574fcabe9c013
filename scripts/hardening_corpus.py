"""Run a corpus of bad (and a few good) inputs through the CLI and classify what comes back.

Each case is a ``fedexp`` command line and whether it must be refused or accepted. An outcome
is one of:

- ``clear``: refused with exit ≠ 0, no traceback, and exactly one ``fedexp...: error`` line
  (log lines of libraries aside);
- ``accepted``: exit 0 where the input is legitimate;
- ``traceback``: a Python traceback reached the user;
- ``wrong success``: exit 0 for an input that must be refused;
- ``unclear``: refused, but not in one ``error`` line (e.g. Hydra's multi-line messages);
- ``wrong refusal``: a legitimate input refused.

Besides, every refused case is checked to have left no MLflow run behind (each case gets its
own working folder and the default MLflow store in it), nor the path its ``absent`` names
(``run left behind``); a case's ``unsaid`` words in its line make it ``unclear``. A case runs
``fedexp`` or, with ``program``, a module (``python -m data_prep.brats``: its refusals are
one ``error:`` line).

Usage::

    .venv/bin/python scripts/hardening_corpus.py --jobs 2 [--only WORD] [--show]

Prints one line per case that is not ``clear``/``accepted`` (all with ``--show``) and a table
of outcomes. Not a test: a measurement of the whole surface, quoted in docs/design.md.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = ["rounds=1", "progress=none", "checkpoint_every=0", "device=cpu"]


@dataclass
class Case:
    """One command line, and whether it must be refused (``bad``) or accepted."""

    args: list[str]
    bad: bool = True
    #: a file to create first: "csv", "csv_nolabel", "file", "mnist_empty", "run_no_checkpoint",
    #: "brats_raw", "luna_raw" (synthetic releases), "dp_run" (a DP run's folder, ``run``)
    setup: str = ""
    #: the program: ``fedexp``, or a module run with ``python -m`` (``data_prep.brats``)
    program: str = "fedexp"
    #: a path (in the case's folder) a refusal must not leave behind
    absent: str = ""
    #: words the refusal's line must not hold (e.g. a resume command for a refused resume)
    unsaid: str = ""


def _run_cases() -> list[Case]:
    run = [
        "lr=nan",
        "lr=inf",
        "lr=-1",
        "lr=abc",
        "rounds=0",
        "rounds=1.5",
        "num_clients=0",
        "participation=0",
        "participation=nan",
        "local_steps=0",
        "local_epochs=0",
        "local_epochs=nan",
        "batch_size=-3",
        "seed=-1",
        "seed=abc",
        "eval_every=0",
        "checkpoint_every=-1",
        "divergence_factor=nan",
        "divergence_factor=-1",
        "test_fraction=1",
        "val_fraction=1",
        "threads=-1",
        "progress=fancy",
        "sampling=bogus",
        "device=tpu",
        "device=cuda",
        "resume=/nonexistent/ckpt",
        "backend=lockstep",
        "algorithm=fedavgg",
        "roundz=3",
        "algorithm.lamda=0.1",
        "+algorithm.mu=0.1",
    ]
    algorithm = [
        "algorithm=fedprox algorithm.mu=nan",
        "algorithm=fedprox algorithm.mu=-1",
        "algorithm=ditto algorithm.lam=nan",
        "algorithm=pfedme algorithm.lam=nan",
        "algorithm=fedamp algorithm.alpha_k=nan",
        "algorithm=pfedsop algorithm.rho=nan",
        "algorithm.server_lr=nan",
        "algorithm.server_lr=-1",
        "algorithm=ifca algorithm.init_scale=nan",
        "algorithm=tdpfed algorithm.rate=nan",
        "algorithm=tdpfed algorithm.rate=-1",
        "algorithm=apfl algorithm.alpha=2",
        "algorithm=l2gd algorithm.p=1.5",
        "algorithm=fedala algorithm.rand_percent=0",
        "algorithm=fedala algorithm.threshold=nan",
        "algorithm=feddwa algorithm.topk=0",
        "algorithm=fedrep algorithm.head_ratio=inf",
        "algorithm=fpfc algorithm.a=nan",
        "algorithm=superfed algorithm.nu=nan",
        "algorithm=pfednet algorithm.lam=-1",
        "algorithm=pfednet algorithm.k=0",
        "algorithm=pfednet algorithm.k=5",
        "algorithm=pfednet algorithm.p=3",
        "algorithm=fedper algorithm.head=[nomatch.*]",
        "algorithm=fedrod algorithm.head=[x.*]",
        "algorithm=ifca algorithm.k=0",
        "algorithm=fedamp algorithm.sigma=0",
        "algorithm=ditto algorithm.personal_steps=0",
        "algorithm=fedrod algorithm.count_floor=nan",
    ]
    model = [
        "model=mlp model.hidden=0",
        "model=mlp model.layers=-1",
        "model=mlp model.dropout=1.5",
        "model=dnn model.hidden=-5 dataset=digits partition=dirichlet",
        "model=resnet9 model.width=0 dataset=digits partition=dirichlet",
        "model=unet dataset=digits partition=dirichlet",
        "model=resnet9",
        "model=vgg8",
        "model.personal=[nomatch.*]",
        "model=mlp model.norm=group",
    ]
    other = [
        "optimizer.weight_decay=nan",
        "optimizer=adam optimizer.eps=nan",
        "optimizer=adam optimizer.beta1=1",
        "optimizer.momentum=-0.5",
        "compressor=stc compressor.uplink.codec.q=0",
        "compressor=stc compressor.uplink.codec.q=2",
        "compressor=topk compressor.uplink.codec.q=nan",
        "compressor=cer_stc compressor.uplink.transforms.0.gamma=nan",
        "compressor=cer compressor.uplink.transforms.0.eta=-1",
        "compressor=topk_zlib +compressor.uplink.codec.level=12",
        "partition=dirichlet partition.alpha=0",
        "partition=dirichlet partition.alpha=nan",
        "partition=dirichlet partition.max_tries=0",
        "partition=label_imbalance partition.delta=nan",
        "partition=shards partition.classes_per_client=0 dataset=digits",
        "partition=shards partition.classes_per_client=11 dataset=digits",
        "dataset=synthetic dataset.num_samples=0",
        "dataset=synthetic dataset.heterogeneity=nan",
        "tracker.system_metrics_interval=0",
        "+tracker.retries=0",
        "tracker.uri=http://127.0.0.1:9",
        "dataset=csv dataset.path=missing.csv dataset.label=y",
        "seed=0,1",
        "algorithm=fedavg,ditto",
        "~rounds",
        "~algorithm",
        "+rounds=3",
        "+rouns=3",
        "++algorithm=ditto",
    ]
    good = [
        [],
        ["algorithm=fedprox", "algorithm.mu=0"],
        ["model=mlp", "model.hidden=8"],
        ["compressor=stc", "compressor.uplink.codec.q=1"],
        ["algorithm=ditto"],
        ["partition=dirichlet", "partition.alpha=0.1"],
        ["optimizer=adam"],
    ]
    cases = [Case(["run", *FAST, *a.split()]) for a in run + algorithm + model + other]
    cases += [
        Case(["run", *FAST, "dataset=csv", "dataset.path=good.csv"], setup="csv"),
        Case(["run", *FAST, "dataset=csv", "dataset.path=good.csv", "dataset.label=nope"],
             setup="csv"),
        Case(["run", *FAST, "tracker.uri=sqlite:///afile/x.db"], setup="file"),
        Case(["run", *FAST, "dataset=mnist", "dataset.path=mnist", "partition=dirichlet"],
             setup="mnist_empty"),
        # paths checked before Hydra makes a run folder (issue 70): a data set's, a resume's
        Case(["run", *FAST, "dataset=brats", "dataset.path=/nonexistent/brats"]),
        Case(["run", *FAST, "dataset=luna16"]),  # its default path, prepared/luna16
        Case(["run", *FAST, "dataset=tiny_imagenet", "dataset.path=nowhere"]),
        Case(["run", *FAST, "resume=."]),  # a folder without a checkpoint
        Case(["run", *FAST, "resume=outputs/run"], setup="run_no_checkpoint"),
    ]  # fmt: skip
    tuning = [
        "'lr=tag(log, interval(0, 1))'",
        "'lr=interval(1, 0.1)'",
        "hydra.sweeper.direction=sideways",
        "hydra.sweeper.n_trials=0",
        "'lr=range(5, 1)'",
        "'lr=tag(logarithmic, interval(0.01, 1))'",
    ]
    for t in tuning:
        cases.append(Case(["run", "-m", "hparams_search=lr", *FAST, t.strip("'")]))
    report = [
        ["report", "--scale", "nan"],
        ["report", "--uri", "sqlite:///nowhere/mlflow.db"],
        ["report", "--experiment", "nope"],
        ["report", "--out", "afile/x.md"],
        ["report", "--experiment", "nope", "--plot", "x.png"],
        ["report", "--experiment", "nope", "--reach", "0.9", "--best"],
    ]
    cases += [Case(r, setup="file" if "afile" in r[-1] else "") for r in report]
    # issue 70, item 11: one line, nothing left, no resume command for a refused resume
    cases += [
        Case(["report", "--reach", "acc/mean=2"]),
        Case(["report"]),
        Case(["run", *FAST, "algorithm=pfednet", "algorithm.k=50", "num_clients=10",
              "hydra.run.dir=given/run"], absent="given"),
        Case(["run", *FAST, "privacy=none", "resume=run"], setup="dp_run",
             unsaid="checkpoint kept"),
    ]  # fmt: skip
    # issue 70, item 7: sizes no volume can hold, a --sites file that is not there
    brats, luna = ["--root", "raw", "--out", "out"], ["--root", "raw", "--out", "out"]
    cases += [
        Case([*brats, "--patch", "998"], setup="brats_raw", program="data_prep.brats"),
        Case([*brats, "--patch", "998", "--dims", "3"], setup="brats_raw",
             program="data_prep.brats", absent="out"),
        Case([*brats, "--sites", "nosuch.csv"], setup="brats_raw", program="data_prep.brats"),
        Case([*luna, "--patch", "998"], setup="luna_raw", program="data_prep.luna16"),
        Case([*brats, "--dims", "3", "--patch", "16"], bad=False, setup="brats_raw",
             program="data_prep.brats"),
    ]  # fmt: skip
    cases += [Case(["run", *FAST, *g], bad=False) for g in good]
    return cases


def _setup(kind: str, cwd: Path) -> None:
    if kind == "csv":
        (cwd / "good.csv").write_text("a,b,y\n" + "1,2,0\n3,4,1\n" * 20)
    elif kind == "file":
        (cwd / "afile").write_text("in the way\n")
    elif kind == "mnist_empty":
        (cwd / "mnist").mkdir()
    elif kind == "run_no_checkpoint":  # a run stopped before its first checkpoint
        (cwd / "outputs" / "run" / "checkpoints").mkdir(parents=True)
    elif kind in ("brats_raw", "luna_raw"):  # synthetic releases (80x80x24, 48x48x40 volumes)
        from data_prep import synthetic

        if kind == "brats_raw":
            synthetic.write_brats(cwd / "raw", "brats2021", n_studies=2, seed=5)
        else:
            synthetic.write_luna16(cwd / "raw", n_studies=2, seed=3)
    elif kind == "dp_run":  # a DP run's folder with its checkpoint
        subprocess.run(
            [sys.executable, "-c", "from fedexp.cli import entry; entry()", "run", *FAST,
             "privacy=central", "checkpoint_every=1", "tracker=none", "hydra.run.dir=run"],
            cwd=cwd, capture_output=True, timeout=600, check=True,
        )  # fmt: skip


def _mlflow_runs(cwd: Path) -> int:
    db = cwd / "mlflow.db"
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(db) as con:
            return con.execute("select count(*) from runs").fetchone()[0]
    except sqlite3.Error:
        return 0


def classify(case: Case) -> tuple[str, str]:
    """Run one case in a fresh folder; its outcome and the first line of what it said."""
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        _setup(case.setup, cwd)
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        env.pop("MLFLOW_TRACKING_URI", None)
        command = [sys.executable, "-c", "from fedexp.cli import entry; entry()"]
        if case.program != "fedexp":
            command = [sys.executable, "-m", case.program]
        proc = subprocess.run(
            [*command, *case.args],
            cwd=cwd, capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        text = proc.stdout + proc.stderr
        errors = [
            line for line in proc.stderr.splitlines()
            if (line.startswith("fedexp") and "error" in line.split(":", 2)[1])
            or (case.program != "fedexp" and line.startswith("error: "))
        ]  # fmt: skip
        said = (errors or [x for x in proc.stderr.splitlines() if x.strip()] or [""])[-1]
        leftover = case.bad and proc.returncode != 0 and _mlflow_runs(cwd) > 0
        leftover = leftover or bool(case.absent and (cwd / case.absent).exists())
        if case.unsaid and case.unsaid in said:
            errors = errors * 2  # (said what it must not: unclear)
    if "Traceback (most recent call last)" in text:
        return "traceback", said
    if not case.bad:
        return ("accepted" if proc.returncode == 0 else "wrong refusal"), said
    if proc.returncode == 0:
        return "wrong success", said
    if leftover:
        return "run left behind", said
    return ("clear" if len(errors) == 1 else "unclear"), said


def main() -> None:
    """Run the corpus and print the table of outcomes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="run the cases whose command has this")
    parser.add_argument("--show", action="store_true", help="print every case")
    args = parser.parse_args()
    cases = [c for c in _run_cases() if args.only in " ".join(c.args)]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(classify, cases))
    counts = Counter(outcome for outcome, _ in results)
    for case, (outcome, said) in zip(cases, results, strict=True):
        if args.show or outcome not in ("clear", "accepted"):
            program = "fedexp" if case.program == "fedexp" else f"python -m {case.program}"
            print(f"{outcome:15s} {program} {' '.join(case.args)}\n{'':15s} -> {said[:200]}")
    print(f"\n{len(cases)} cases ({sum(c.bad for c in cases)} bad, "
          f"{sum(not c.bad for c in cases)} good):")  # fmt: skip
    for outcome, n in counts.most_common():
        print(f"  {outcome:15s} {n}")


if __name__ == "__main__":
    main()
