"""Every numeric setting of every config group declares its type and range, and is checked.

Issue "Hardening, round two", item 1: settings were checked one by one in constructors, so
new ones slipped through (``algorithm.mu=nan`` ran and blamed ``lr``; ``model.hidden=0``
succeeded). Each argument now declares its range once, in its target's signature
(:mod:`fedexp.config.ranges`), and :func:`fedexp.engine.config_check.check_groups` refuses NaN,
infinity and an out-of-range value on every one of them before anything is built. This file
enumerates every option of every group (conf/<group>/*.yaml), every numeric argument of its
target, and tries the three values on each.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf import open_dict

from fedexp.config.groups import MODEL_EXTRA
from fedexp.config.instantiate import locate_target
from fedexp.config.ranges import Range
from fedexp.config.ranges import range_of
from fedexp.engine.config_check import check_groups
from fedexp.errors import ConfigError
from helpers import ROOT
from helpers import compose_config
from helpers import run_cli

CONF = ROOT / "conf"
#: Arguments fedexp passes itself (from the data or the run settings), not config keys.
SET_BY_FEDEXP = {"partition": {"labels", "num_clients", "seed", "groups"}, "model": MODEL_EXTRA}
#: Options that need files this test does not have; their nodes are checked all the same.
NEEDS = {("dataset", "csv"): ["dataset.path=x.csv", "dataset.label=y"]}


def _numeric(annotation: typing.Any) -> type | None:
    """``int`` or ``float`` if the annotation (Annotated / Optional stripped) is one of them."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _numeric(annotation.__origin__)
    if annotation in (int, float):
        return annotation
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None  # a sequence of numbers is not one number
    for arg in typing.get_args(annotation):
        found = _numeric(arg)
        if found is not None:
            return found
    return None


def _nodes(group: str, node: typing.Any) -> list[tuple[str, typing.Any]]:
    """The ``_target_`` nodes of a group's node with their paths (a compressor has several)."""
    if group != "compressor":
        return [(group, node)]
    out = []
    for direction in ("uplink", "downlink"):
        channel = node[direction]
        out.append((f"compressor.{direction}.codec", channel.codec))
        for i, t in enumerate(channel.get("transforms") or []):
            out.append((f"compressor.{direction}.transforms[{i}]", t))
    return out


def _cases() -> list[tuple[str, str, str, str, type, Range | None]]:
    """(group, option, node path, argument, its type, its declared range) for every one."""
    cases = []
    for folder in sorted(p for p in CONF.iterdir() if p.is_dir()):
        group = folder.name
        if group.startswith(("experiment", "hparams_search", "hydra")):
            continue
        for yaml in sorted(folder.glob("*.yaml")):
            for path, node in _nodes(group, OmegaConf.load(yaml)):
                target = locate_target(node["_target_"], f"{path}._target_")
                fn = target.__init__ if inspect.isclass(target) else target
                hints = typing.get_type_hints(fn, include_extras=True)
                for name in inspect.signature(target).parameters:
                    if name in SET_BY_FEDEXP.get(group, set()) or name not in hints:
                        continue
                    kind = _numeric(hints[name])
                    if kind is not None:
                        cases.append((group, yaml.stem, path, name, kind, range_of(hints[name])))
    return cases


CASES = _cases()
IDS = [
    f"{g}={o}:{p.split('.', 1)[-1] if '.' in p else ''}{'.' if '.' in p else ''}{n}"
    for g, o, p, n, *_ in CASES
]


def test_the_enumeration_finds_every_group():
    groups = {c[0] for c in CASES}
    assert groups >= {"algorithm", "model", "optimizer", "compressor", "partition", "dataset"}
    assert len(CASES) > 100


@pytest.mark.parametrize(("group", "option", "path", "name", "kind", "declared"), CASES, ids=IDS)
def test_every_numeric_argument_declares_a_range(group, option, path, name, kind, declared):
    """The range is declared where the argument is (so a new setting cannot slip through)."""
    assert declared is not None, (
        f"{path}.{name} ({option}): declare its range in the signature, e.g. "
        f"{name}: Annotated[{kind.__name__}, Range(...)] (fedexp.config.ranges)"
    )


@pytest.fixture(scope="module")
def composed():
    """One composed run config per (group, option), cached."""
    cache: dict[tuple[str, str], typing.Any] = {}

    def get(group: str, option: str):
        if (group, option) not in cache:
            extra = NEEDS.get((group, option), [])
            cache[group, option] = compose_config(f"{group}={option}", *extra)
        return cache[group, option].copy()

    return get


def _set(cfg, path: str, name: str, value) -> None:
    node = cfg
    for part in path.replace("[", ".").replace("]", "").split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    with open_dict(node):
        node[name] = value


@pytest.mark.parametrize(("group", "option", "path", "name", "kind", "declared"), CASES, ids=IDS)
def test_nan_inf_and_out_of_range_are_refused_in_one_line(
    composed, group, option, path, name, kind, declared
):
    cfg = composed(group, option)
    check_groups(cfg)  # the option as shipped passes
    bad = [math.nan, math.inf, -math.inf]
    if declared is not None and declared.inf:
        bad.remove(math.inf)
    for outside in declared.outside() if declared is not None else ():
        bad.append(int(outside) if kind is int else outside)
    for value in bad:
        case = composed(group, option)
        _set(case, path, name, value)
        with pytest.raises(ConfigError) as err:
            check_groups(case)
        message = str(err.value)
        assert message.startswith(f"{path}.{name}="), message
        assert "\n" not in message and "expected" in message, message


def test_a_range_reads_as_words():
    assert Range(gt=0).describe() == "> 0"
    assert Range(ge=0, le=1).describe() == "in [0, 1]"
    assert Range(gt=0, le=1, note="1 keeps all").describe() == "in (0, 1]; 1 keeps all"
    assert Range(ge=1, inf=True).describe() == "≥ 1 (or inf)"
    assert Range(ge=0, lt=1).outside() == (-1.0, 1.0) and Range(ge=2).outside() == (1.0,)
    assert Range(gt=0, le=1).outside() == (0.0, 2.0) and Range().outside() == ()
    assert not Range(ge=0).contains(math.nan) and Range(ge=0, inf=True).contains(math.inf)


@pytest.mark.slow
def test_the_cli_refuses_before_anything_is_created(tmp_path: Path):
    """exit 2, one line naming key, value and range; no MLflow store, no run folder."""
    proc = run_cli(
        "run", "algorithm=fedprox", "algorithm.mu=nan", "rounds=1",
        f"tracker.uri=sqlite:///{tmp_path / 'store' / 'mlflow.db'}",
        f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "alembic" not in line]
    assert lines == ["fedexp: error: algorithm.mu=nan: expected ≥ 0"], proc.stderr[-2000:]
    assert not (tmp_path / "store").exists() and not (tmp_path / "mlflow.db").exists()
    assert not list((tmp_path / "out").glob("*.csv"))


@pytest.mark.slow
def test_a_mandatory_value_left_unset_is_named(tmp_path: Path):
    """``dataset=csv`` without ``dataset.label`` (was omegaconf's MissingMandatoryValue)."""
    csv = tmp_path / "good.csv"
    csv.write_text("a,b,y\n1,2,0\n3,4,1\n")
    proc = run_cli(
        "run", "dataset=csv", f"dataset.path={csv}", "tracker=none", "rounds=1",
        f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.strip() and "alembic" not in x]
    assert line.startswith("fedexp: error: dataset.label: no value given"), line
