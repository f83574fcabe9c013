"""Every experiment config (conf/experiment/*.yaml) composes and runs end to end, shrunk.

For each experiment file: every value of every ``hydra.sweeper.params`` key names an existing
config option (group keys such as ``algorithm``) and composes into a config whose ``_target_``
nodes fit their targets; then each ``fedexp run`` command of the file's header runs one job,
shrunk (1 round, 3 clients, 1 local step, tiny models), with the first value of every sweep and
the prepared synthetic imaging data.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from fedexp.config.instantiate import check_node
from helpers import CONF
from helpers import compose_config

pytestmark = pytest.mark.usefixtures("one_thread")

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))

#: Overrides that make any experiment tiny.
SHRINK = [
    "rounds=1",
    "num_clients=3",
    "local_steps=1",
    "batch_size=4",  # the synthetic LUNA16 clients hold 4 training samples
    "eval_every=1",
    "progress=none",
    "checkpoint_every=0",
    "device=cpu",
]

#: Tiny versions of the image models, by the model's builder.
TINY_MODEL = {
    "fedexp.models.imaging.densenet": ["model.growth_rate=4", "model.block_config=[2,2]"],
    "fedexp.models.imaging.unet": ["model.channels=[8,16]", "model.strides=[2]"],
    "fedexp.models.vision.vgg8": ["model.channels=[4,4,8,8,8]", "model.hidden=8"],
    "fedexp.models.vision.resnet9": ["model.width=4"],
}

#: The prepared synthetic folder for each imaging data set, by the data set's builder.
IMAGING = {
    "fedexp.data.imaging.luna16": "luna",
    "fedexp.data.imaging.brats": "brats",
    "fedexp.data.images.mnist": "mnist",
    "fedexp.data.images.cifar10": "cifar10",
    "fedexp.data.images.cifar100": "cifar100",
    "fedexp.data.images.tiny_imagenet": "tiny_imagenet",
}

_PARSER = OverridesParser.create()


def sweep_values(name: str) -> dict[str, list[str]]:
    """The file's ``hydra.sweeper.params`` as ``{key: [value, ...]}`` (override strings)."""
    node = OmegaConf.load(CONF / "experiment" / f"{name}.yaml")
    params = OmegaConf.select(node, "hydra.sweeper.params") or {}
    out = {}
    for key, value in params.items():
        (override,) = _PARSER.parse_overrides([f"{key}={value}"])
        out[key] = list(override.sweep_string_iterator())
    return out


def header_runs(name: str) -> list[list[str]]:
    """The overrides of each ``fedexp run`` command in the file's header comments."""
    runs = []
    for line in (CONF / "experiment" / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("# ")
        if text.startswith("fedexp run "):
            words = shlex.split(text)
            runs.append([w for w in words[2:] if not w.startswith(("-", "hydra/launcher="))])
    return runs


def first_value(override: str) -> str:
    """``key=a,b,c`` -> ``key=a`` (any other override unchanged)."""
    (parsed,) = _PARSER.parse_overrides([override])
    if not parsed.is_sweep_override():
        return override
    return f"{parsed.get_key_element()}={next(iter(parsed.sweep_string_iterator()))}"


def test_experiments_are_found():
    assert {"pfednet_luna16", "pfednet_brats", "pfednet_lambda"} <= set(EXPERIMENTS)
    for name in EXPERIMENTS:
        assert sweep_values(name), f"{name}: no hydra.sweeper.params"
        assert header_runs(name), f"{name}: the first lines name no `fedexp run` command"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_sweep_value_composes(name):
    sweeps = sweep_values(name)
    first = [f"{k}={v[0]}" for k, v in sweeps.items()]
    for key, values in sweeps.items():
        if (CONF / key).is_dir():  # a config group: every option must exist
            missing = [v for v in values if not (CONF / key / f"{v}.yaml").is_file()]
            assert not missing, f"{name}: {key} options {missing} have no conf/{key}/<name>.yaml"
    # the first values together, then each other value of each key (seeds: any int composes)
    variants = [[]] + [
        [f"{key}={value}"]
        for key, values in sweeps.items()
        if key != "seed"
        for value in values[1:]
    ]
    for variant in variants:
        keys = {o.split("=", 1)[0] for o in variant}
        others = [o for o in first if o.split("=", 1)[0] not in keys]
        cfg = compose_config(f"+experiment={name}", *others, *variant)
        for group in ("dataset", "partition", "algorithm"):  # model: `personal` is fedexp's
            check_node(cfg[group], group)
        assert cfg.tracker.experiment == f"fedexp/{name}"


def test_pfednet_lam_defaults_the_configs_rely_on():
    """pfednet_luna16 keeps pfednet.yaml's λ (0.01, Table II); pfednet_brats's header sets 1.0."""
    cfg = compose_config("+experiment=pfednet_luna16", "algorithm=pfednet")
    assert cfg.algorithm.lam == 0.01
    assert ["algorithm=pfednet", "algorithm.lam=1.0"] in [
        [o for o in run if o.startswith("algorithm")] for run in header_runs("pfednet_brats")
    ]
    assert "pfednet" not in sweep_values("pfednet_brats")["algorithm"]
    assert ["algorithm=pfednet", "algorithm.lam=0.1"] in [  # the paper's tabular λ (§VI-B1)
        [o for o in run if o.startswith("algorithm")] for run in header_runs("pfednet_tables")
    ]
    assert "pfednet" not in sweep_values("pfednet_tables")["algorithm"]


def _shrunk(name: str, command: list[str], prepared, tmp_path: Path):
    """The command's config, first value of each sweep, shrunk to one tiny job."""
    command = [first_value(o) for o in command if o != f"+experiment={name}"]
    given = {o.split("=", 1)[0] for o in command}
    sweeps = [f"{k}={v[0]}" for k, v in sweep_values(name).items() if k not in given]
    overrides = [f"+experiment={name}", *sweeps, *command, *SHRINK]
    cfg = compose_config(*overrides)
    extra = list(TINY_MODEL.get(cfg.model._target_, []))
    if cfg.algorithm._target_ == "fedexp.algorithms.pfednet.PFedNet":  # k < num_clients
        extra.append(f"algorithm.k={min(cfg.algorithm.k, cfg.num_clients - 1)}")
    if "classes_per_client" in cfg.partition:  # the prepared data sets have few classes
        extra.append(f"partition.classes_per_client={min(cfg.partition.classes_per_client, 2)}")
    if cfg.dataset._target_ in IMAGING:
        extra.append(f"dataset.path={getattr(prepared, IMAGING[cfg.dataset._target_])}")
    return compose_config(*overrides, *extra, output_dir=tmp_path / "out")


@pytest.mark.parametrize(
    ("name", "index"),
    [(n, i) for n in EXPERIMENTS for i in range(len(header_runs(n)))],
)
@pytest.mark.slow
def test_header_command_runs_shrunk(name, index, prepared, tmp_path):
    from fedexp.engine.runner import run
    from fedexp.tracking.base import NullTracker

    cfg = _shrunk(name, header_runs(name)[index], prepared, tmp_path)
    tracker = NullTracker()
    run(cfg, tracker=tracker)
    headline = "iou/mean" if cfg.dataset._target_.endswith("brats") else "acc/mean"
    assert headline in tracker.metrics, sorted(tracker.metrics)
