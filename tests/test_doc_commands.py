"""Every ``fedexp run`` command of README.md and docs/*.md runs as written (issue 43 item 1).

The commands are read from the documents' code blocks (fenced, or indented by four spaces),
with their continuation lines joined and the shell variables the block sets (``X="..."``)
put in, and each is run in-process through :func:`fedexp.cli.main` from an empty folder for
one round: ``rounds=1 checkpoint_every=0 progress=none tracker=none threads=1`` are appended
(and the command's own ``tracker.*`` settings, which only say where to log, are left out). A sweep
(``-m``) runs one job: each swept key at its first value, the experiment file's own sweep
too, Optuna for one trial, the parallel launcher with one job at a time; every value of the
whole sweep still goes through the checks ``fedexp run`` makes before Hydra starts.

The data the imaging commands read are made as the documents make them: every ``python -m
data_prep.*`` line of their code blocks that needs no download (``data_prep.synthetic`` and
``data_prep.synthetic_images`` write look-alikes of the official releases in their formats,
``data_prep.luna16`` and ``data_prep.brats`` prepare what those wrote) runs once per test
session, in order, in one folder (:func:`documented_data`); a command's data folder is taken
from there, else from the checkout. A preparation line that fails fails
:func:`test_the_documented_data_preparation_runs`.

A command is skipped, with the reason, when what it needs is not here, as found out from
the command itself: a data set folder that neither the documents' preparation nor the
checkout has, a checkpoint to resume from, a tracking server, SLURM, a ``...`` left for the
reader to fill in, or a population too large for a test (the scale examples).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from filelock import FileLock
from hydra import compose
from hydra import initialize_config_dir

from helpers import CONF
from helpers import ROOT
from helpers import without_hydra_logging

pytestmark = pytest.mark.slow

#: The documents whose commands must run.
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: What a test run may build at most: the scale examples (10^6 clients) are benchmarks.
MAX_CLIENTS = 10_000
MAX_SAMPLES = 1_000_000

#: Appended to every command: one round, nothing kept that a test does not need, one torch
#: thread (a run takes every core by default, and two test workers that each did so ran an
#: imaging command 15x slower: 350 s against 23 s).
ONE_ROUND = ["rounds=1", "checkpoint_every=0", "progress=none", "tracker=none", "threads=1"]


@dataclass(frozen=True)
class Command:
    """One ``fedexp run`` command of a document: where it is and its arguments."""

    where: str
    args: tuple[str, ...]

    @property
    def sweep(self) -> bool:
        return "-m" in self.args or "--multirun" in self.args


def _blocks(text: str) -> list[list[tuple[int, str]]]:
    """The document's code blocks, fenced or indented by 4 spaces: (line number, line) lists."""
    blocks: list[list[tuple[int, str]]] = []
    fenced: list[tuple[int, str]] | None = None
    indented: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if fenced is None:
                fenced = []
            else:
                blocks.append(fenced)
                fenced = None
        elif fenced is not None:
            fenced.append((number, line))
        elif line.startswith("    ") and line.strip():
            indented.append((number, line[4:]))
        elif indented and line.strip():
            blocks.append(indented)
            indented = []
    if indented:
        blocks.append(indented)
    return blocks


def _logical_lines(block: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The block's lines with ``\\``-continuations joined, each with its first line's number."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, line in block:
        start = start or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending, start = "", 0
    return out


def doc_commands(prefix: str = "fedexp run") -> list[Command]:
    """Every ``prefix`` command of :data:`DOCUMENTS` (its words after ``prefix``), shell
    variables put in."""
    commands = []
    for doc in DOCUMENTS:
        for block in _blocks(doc.read_text()):
            names: dict[str, str] = {}
            for number, line in _logical_lines(block):
                assignment = re.fullmatch(r"\s*([A-Z_][A-Z0-9_]*)=(.*)", line)
                if assignment:
                    names[assignment[1]] = shlex.split(assignment[2])[0]
                    continue
                if not line.strip().startswith(prefix):
                    continue
                tokens = shlex.split(line, comments=True)
                words = []
                for token in tokens[len(prefix.split()) :]:
                    word = re.fullmatch(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", token)
                    words += shlex.split(names[word[1]]) if word else [token]
                commands.append(Command(f"{doc.relative_to(ROOT)}:{number}", tuple(words)))
    return commands


#: The modules whose documented lines make data from nothing (look-alikes of the releases in
#: their official formats) or from what such a line made.
PREPARATION = ("data_prep.synthetic", "data_prep.synthetic_images", "data_prep.luna16",
               "data_prep.brats")  # fmt: skip


def preparation_commands() -> list[Command]:
    """The documents' ``python -m data_prep.*`` lines that need no download, in their order,
    each once: a line with a placeholder (``[--delta 7]``, ``RAW``) is the reader's to fill in.

    A line that reads a release (``--root``) is kept; :func:`prepare` runs it only where an
    earlier line wrote that folder.
    """
    kept, seen = [], set()
    for command in doc_commands("python -m"):
        module, *args = command.args
        placeholder = any(a.startswith("[") or re.fullmatch(r"[A-Z]+", a) for a in args)
        if module in PREPARATION and not placeholder and command.args not in seen:
            seen.add(command.args)
            kept.append(command)
    return kept


def prepare(folder: Path) -> list[str]:
    """Run :func:`preparation_commands` in ``folder``: what failed (empty: nothing)."""
    failed = []
    for command in preparation_commands():
        root = _option(command.args, "--root")
        if root is not None and not (folder / root).is_dir():
            continue  # a real release's folder (/data/LUNA16): not made here
        done = subprocess.run(
            [sys.executable, "-m", *command.args], cwd=folder, capture_output=True, text=True
        )
        if done.returncode:
            failed.append(f"{command.where}: python -m {' '.join(command.args)}\n{done.stderr}")
    return failed


def _option(args: tuple[str, ...], name: str) -> str | None:
    """The value after ``name`` in a command line's ``args``, or None."""
    return args[args.index(name) + 1] if name in args[:-1] else None


def _setting(args: tuple[str, ...], key: str) -> str | None:
    """The value the command gives ``key`` (the last one), or None."""
    values = [a.split("=", 1)[1] for a in args if a.split("=", 1)[0].lstrip("+") == key]
    return values[-1] if values else None


def _dataset_folder(args: tuple[str, ...]) -> Path | None:
    """The data set folder the command reads: ``dataset.path``, else its option's default."""
    path = _setting(args, "dataset.path")
    if path is None:
        option = _setting(args, "dataset")
        experiment = _setting(args, "experiment")
        if option is None and experiment is not None:  # the experiment file's data set
            node = yaml.safe_load((CONF / "experiment" / f"{experiment}.yaml").read_text())
            for entry in node.get("defaults", []):
                if isinstance(entry, dict) and "override /dataset" in entry:
                    option = entry["override /dataset"]
        if option is None:
            return None
        path = (yaml.safe_load((CONF / "dataset" / f"{option}.yaml").read_text()) or {}).get("path")
    return None if path is None or "/" not in str(path) else Path(str(path))


def data_folder(folder: Path, prepared: Path | None) -> Path | None:
    """Where the data set ``folder`` of a command is: made by the documents' preparation in
    ``prepared`` (None: not asked for), else in the checkout, else None."""
    for root in ([prepared] if prepared else []) + [ROOT]:
        if (root / folder).exists():
            return root / folder
    return None


def skip_reason(command: Command, prepared: Path | None = None) -> str | None:
    """Why ``command`` cannot run here (what it needs that is absent), or None.

    ``prepared``: the folder of the documents' data preparation (:func:`documented_data`).
    """
    args = command.args
    if any("..." in a for a in args):
        return "it has a '...' for the reader to fill in"
    if any("$" in a for a in args):  # a shell variable the document leaves to the reader
        return "it has a $VARIABLE for the reader to fill in"
    folder = _dataset_folder(args)
    if folder is not None and data_folder(folder, prepared) is None:
        return f"it reads the prepared data set {folder}, which is not here"
    resume = _setting(args, "resume")
    if resume is not None and not (ROOT / resume).exists():
        return f"it resumes from {resume}, a run's checkpoints that are not here"
    uri = _setting(args, "tracker.uri") or ""
    if uri.startswith(("http://", "https://")):
        return f"it logs to an MLflow tracking server at {uri}"
    if _setting(args, "hydra/launcher") == "slurm" and shutil.which("sbatch") is None:
        return "it submits to SLURM (no sbatch here)"
    clients = _setting(args, "num_clients")
    samples = _setting(args, "dataset.num_samples")
    if (clients and int(clients) > MAX_CLIENTS) or (samples and int(samples) > MAX_SAMPLES):
        return f"a scale example ({clients} clients, {samples} samples): a benchmark"
    return None


COMMANDS = doc_commands()


@pytest.fixture(scope="session")
def documented_data(tmp_path_factory) -> tuple[Path, str]:
    """The documents' data preparation (:func:`prepare`), once for the session's workers:
    (its folder, what failed: empty when nothing did)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' folders share a parent
        base = base.parent
    folder = base / "documented-data"
    with FileLock(str(folder) + ".lock"):
        record = folder.with_suffix(".failed")
        if not record.exists():
            folder.mkdir(exist_ok=True)
            record.write_text("\n\n".join(prepare(folder)))
    return folder, record.read_text()


def _first(override: str) -> str:
    """``key=a,b,c`` as ``key=a`` (Hydra's own parser says what a sweep is)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([override])[0]
    if not parsed.is_sweep_override():
        return override
    return f"{parsed.get_key_element()}={next(iter(parsed.sweep_string_iterator()))}"


def one_job(args: tuple[str, ...]) -> list[str]:
    """A sweep's arguments for one job of it (its first), as a sweep still (``-m``)."""
    given = [a for a in args if a not in ("-m", "--multirun")]
    reduced = [_first(a) if "=" in a and not a.startswith("hydra.") else a for a in given]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        hydra_cfg = compose("config", overrides=reduced, return_hydra_config=True).hydra
    keys = {a.split("=", 1)[0].lstrip("+~") for a in reduced}
    extra = []
    params = hydra_cfg.sweeper.get("params") or {}
    optuna = "optuna" in str(hydra_cfg.sweeper.get("_target_", "")).lower()
    for key, value in params.items():
        if key not in keys and not optuna:
            extra.append(_first(f"{key}={value}"))
    if optuna:
        extra += ["hydra.sweeper.n_trials=1", "hydra.sweeper.n_jobs=1"]
    if "joblib" in str(hydra_cfg.launcher.get("_target_", "")).lower():
        extra.append("hydra.launcher.n_jobs=1")  # joblib runs a single job in this process
    return ["-m", *reduced, *extra]


def _handlers() -> dict[str, list[logging.Handler]]:
    loggers = [logging.getLogger(), *map(logging.getLogger, logging.root.manager.loggerDict)]
    return {lg.name: list(lg.handlers) for lg in loggers}


@pytest.fixture
def fedexp_main(tmp_path, monkeypatch, capsys):
    """``fedexp run ARGS`` in this process from an empty folder: (exit code, stderr).

    Hydra's logging set-up is left out (it would close pytest's own log handlers); the
    handlers a run adds (Optuna's, bound to this test's captured stderr) and the signal
    state are put back afterwards. The run's plots are not drawn (tests/test_engine.py draws
    them): they were half of a one-round run's time.
    """
    from fedexp import cli
    from fedexp.figures import plots

    for name in ("plot_rounds", "plot_clients", "plot_client_models"):
        monkeypatch.setattr(plots, name, lambda *a, **k: None)
    without_hydra_logging(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    term = signal.getsignal(signal.SIGTERM)
    level = logging.getLogger().level
    before = _handlers()

    def run(*args: str) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["fedexp", "run", *args])
        code = 0
        try:
            cli.main()
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
        return code, capsys.readouterr().err

    yield run
    signal.signal(signal.SIGTERM, term)
    logging.getLogger().setLevel(level)
    for name, handlers in _handlers().items():
        logger = logging.getLogger(name) if name != "root" else logging.getLogger()
        for handler in handlers:
            if handler not in before.get(name, []):
                logger.removeHandler(handler)


def test_the_documents_have_commands_and_every_skip_says_why():
    """The extraction finds the commands (README's privacy one among them), and a skipped
    command is one whose needs are absent, not a command that fails."""
    where = {c.where for c in COMMANDS}
    assert len(COMMANDS) >= 40 and any(w.startswith("README.md") for w in where)
    privacy = [c for c in COMMANDS if "privacy=central" in c.args and c.where[0] == "R"]
    assert privacy and skip_reason(privacy[0]) is None
    skipped = {c.where: skip_reason(c) for c in COMMANDS if skip_reason(c)}
    assert all("prepared data set" in r or "SLURM" in r or "server" in r or "..." in r
               or "$VARIABLE" in r or "checkpoints" in r or "scale" in r
               for r in skipped.values())  # fmt: skip


def test_the_documented_data_preparation_runs(documented_data):
    """Every documented ``python -m data_prep.*`` line that needs no download runs, and they
    make every data folder the documents' commands read (the imaging commands run in CI)."""
    folder, failed = documented_data
    assert not failed, failed
    assert len(preparation_commands()) >= 10
    missing = {c.where: _dataset_folder(c.args) for c in COMMANDS
               if "prepared data set" in (skip_reason(c, folder) or "")}  # fmt: skip
    assert not missing, f"documented commands whose data no documented line prepares: {missing}"


def test_a_run_after_a_failed_sweep_in_the_same_process_exits_0(fedexp_main):
    """The exit code is the command's own: a failed sweep's summary does not outlive it (it
    made the next command of the process exit 1 after its results, with no line saying why)."""
    code, err = fedexp_main("-m", "batch_size=500", *ONE_ROUND)  # the job is refused
    assert code == 1 and "batch_size=500: larger than every client's training data" in err
    code, err = fedexp_main(*ONE_ROUND)
    assert code == 0, err


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_a_documented_command_runs_for_one_round(command, fedexp_main, tmp_path, request):
    folder = _dataset_folder(command.args)
    prepared = request.getfixturevalue("documented_data")[0] if folder else None
    reason = skip_reason(command, prepared)
    if reason:
        pytest.skip(f"{command.where}: {reason}")
    from fedexp.cli.overrides import group_option_errors
    from fedexp.config.keys import unknown_key_errors
    from fedexp.config.schema import override_errors

    args = [a for a in command.args if not a.startswith("tracker.")]
    # the run starts in an empty folder: the data it reads are the documents' preparation's
    # or the checkout's, the checkpoints it resumes from the checkout's
    reads = {"dataset.path": folder and data_folder(folder, prepared),
             "resume": _setting(args, "resume")}  # fmt: skip
    for key, found in reads.items():
        if found is not None and not Path(found).is_absolute():
            found = ROOT / found
        if found is not None:
            args = [a for a in args if a.split("=", 1)[0].lstrip("+") != key]
            args.append(f"{key}={found}")
    # the whole sweep passes the checks made before Hydra starts
    assert not group_option_errors(args) + unknown_key_errors(args, CONF) + override_errors(args)
    if "dataset.path=bc.csv" in args:  # README's own table, written as the README says
        from sklearn.datasets import load_breast_cancer

        load_breast_cancer(as_frame=True).frame.to_csv(tmp_path / "bc.csv", index=False)
    if command.sweep:
        args = one_job(tuple(args))
    code, err = fedexp_main(*args, *ONE_ROUND)
    assert code == 0, f"{command.where}: fedexp run {' '.join(command.args)}\n{err}"
    assert "fedexp: error" not in err and "Traceback" not in err, err
