"""A misspelt or foreign key gets one line with the closest valid keys, before Hydra composes.

Issue "The researcher's loop, round two", item 4 (and the hardening corpus's last unclear
cases): ``algorithm.lamda=0.1`` or ``algorithm.mu=0.1`` on FedAvg got Hydra's multi-line struct
error and a HYDRA_FULL_ERROR hint. :func:`fedexp.config.keys.unknown_key_errors` checks every
plain override against the chosen options' files.
"""

from __future__ import annotations

import pytest

from fedexp.cli import CONFIG_DIR
from fedexp.config.keys import unknown_key_errors
from helpers import run_cli


def errors(*args: str) -> list[str]:
    return unknown_key_errors(list(args), CONFIG_DIR)


def test_a_misspelt_group_key_names_the_closest():
    (line,) = errors("algorithm=ditto", "algorithm.lamda=0.1")
    assert line.startswith("algorithm.lamda: ditto (algorithm=ditto) has no such key")
    assert "did you mean algorithm.lam?" in line and "personal_steps" in line


def test_a_key_of_another_option_names_the_options_that_have_it():
    (line,) = errors("algorithm.mu=0.1")  # the default algorithm is FedAvg
    assert line.startswith("algorithm.mu: fedavg (algorithm=fedavg) has no such key")
    assert "algorithm=fedprox|fedprox_ft|superfed have it" in line


def test_every_option_of_a_swept_group_is_checked():
    (line,) = errors("-m", "algorithm=fedavg,ditto", "algorithm.lam=0.1")
    assert line.startswith("algorithm.lam: fedavg (algorithm=fedavg)")
    assert errors("-m", "algorithm=ditto,pfedme", "algorithm.lam=0.1") == []


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["roundz=3"], "roundz: no such setting; did you mean rounds?"),
        (
            ["compressor=topk_zlib", "compressor.uplink.codec.level=3"],
            "compressor.uplink.codec.level:",
        ),
        (["dataset=mnist", "dataset.root=x"], "dataset.root: mnist (dataset=mnist)"),
        (["lr.x=1"], "lr.x: lr is a plain setting"),
        (["compressor=cer_stc", "compressor.uplink.transforms.1.gamma=0"], "compressor.uplink"),
    ],
)
def test_unknown_keys(args, start):
    (line,) = errors(*args)
    assert line.startswith(start), line


@pytest.mark.parametrize(
    "args",
    [
        ["algorithm=pfednet", "algorithm.lam=0.1", "rounds=3"],
        ["compressor=cer_stc", "compressor.uplink.transforms.0.gamma=0.1"],
        ["+algorithm.new_key=1", "~tracker.uri", "hydra.run.dir=x", "hydra/launcher=parallel"],
        ["+experiment=pfednet_tables", "algorithm.anything=1"],  # left to Hydra
        ["dataset=csv", "dataset.label=y", "model.personal=[head.*]", "hparams_search=lr"],
    ],
)
def test_valid_or_unchecked_command_lines_pass(args):
    assert errors(*args) == []


def test_the_cli_prints_one_line_and_exits_2(tmp_path):
    proc = run_cli("run", "algorithm=ditto", "algorithm.lamda=0.1", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedexp: error: algorithm.lamda:"), lines
    assert "HYDRA_FULL_ERROR" not in proc.stderr and not (tmp_path / "outputs").exists()
