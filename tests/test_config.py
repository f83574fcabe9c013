"""Every config of every group composes and instantiates; bad keys/types fail naming the key."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError
from omegaconf.errors import ValidationError

from fedexp.config.instantiate import instantiate_checked
from fedexp.engine.runner import build_channel
from fedexp.engine.runner import build_engine
from fedexp.errors import ConfigError
from fedexp.errors import FedexpError
from fedexp.models.builder import build_model
from fedexp.models.flat import FlatModel
from helpers import CONF
from helpers import compose_config
from helpers import mlflow_db

GROUPS = ["dataset", "model", "partition", "algorithm", "compressor", "tracker"]
# options that need user input to compose into a runnable config
NEEDS = {
    ("dataset", "csv"): ["dataset.path=x.csv", "dataset.label=y"],
    ("dataset", "luna16"): ["dataset.path=no/such/folder"],
    ("dataset", "brats"): ["dataset.path=no/such/folder"],
}
# datasets whose files are absent here: the error must name this (the file or the command)
MISSING = {
    "csv": "x.csv",
    "luna16": "python -m data_prep.luna16",
    "brats": "python -m data_prep.brats",
    "mnist": "train-images-idx3-ubyte",
    "cifar10": "cifar-10-binary.tar.gz",
    "cifar100": "cifar-100-binary.tar.gz",
    "tiny_imagenet": "wnids.txt",
}
# input shape of one sample per model option (tabular models: 30 features)
INPUT_SHAPES = {
    "densenet": [1, 32, 32],
    "unet": [4, 64, 64],
    "vgg8": [3, 32, 32],
    "resnet18": [3, 32, 32],
    "resnet9": [3, 32, 32],
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_instantiates(group, option, tmp_path):
    cfg = compose_config(f"{group}={option}", *NEEDS.get((group, option), []))
    node = cfg[group]
    if group == "compressor":
        for direction in ("uplink", "downlink"):
            build_channel(node[direction], f"compressor.{direction}")
    elif group == "model":
        module, personal = build_model(node, INPUT_SHAPES.get(option, [30]), 2, seed=0)
        layout = FlatModel(module, "cpu").layout
        assert personal and 0 < layout.indices(personal).numel() <= layout.numel
    elif group == "tracker":
        if option == "mlflow":
            node.uri = mlflow_db(tmp_path / "m.db")
        assert instantiate_checked(node, "tracker") is not None
    elif group == "dataset" and option in MISSING:
        with pytest.raises(FedexpError, match=MISSING[option]):  # the files do not exist here
            instantiate_checked(node, "dataset")
    else:
        assert instantiate_checked(node, group) is not None


def test_default_config_builds_an_engine():
    engine = build_engine(compose_config("device=cpu"))
    assert len(engine.clients) == 5
    assert engine.x0.numel() == 31  # 30 features + bias, one logit


def test_unknown_top_level_key_fails_at_compose_naming_it():
    with pytest.raises(ConfigCompositionException) as info:
        compose_config("roundz=3")
    assert "roundz" in str(info.value) or "roundz" in str(info.value.__cause__)


def test_wrong_type_fails_at_compose_naming_the_key():
    with pytest.raises((ConfigCompositionException, ValidationError)) as info:
        compose_config("rounds=many")
    text = str(info.value) + str(info.value.__cause__)
    assert "rounds" in text


def test_unknown_group_key_names_the_full_key():
    cfg = compose_config("+algorithm.server_lrr=0.5")
    with pytest.raises(ConfigError, match=r"algorithm\.server_lrr"):
        instantiate_checked(cfg.algorithm, "algorithm")


def test_wrong_type_in_group_names_the_key():
    cfg = compose_config("algorithm.server_lr=fast")
    with pytest.raises(ConfigError, match=r"algorithm\.server_lr='fast'.*float"):
        instantiate_checked(cfg.algorithm, "algorithm")


def test_struct_mode_rejects_unknown_group_key_without_plus():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as info:
        compose_config("partition.deltaa=2")
    assert "deltaa" in str(info.value) + str(info.value.__cause__)


@pytest.mark.parametrize("launcher", ["parallel", "slurm"])
def test_launcher_configs_compose(launcher):
    from hydra import compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    node = cfg.hydra.launcher
    if launcher == "parallel":
        assert node._target_.endswith("JoblibLauncher") and node.n_jobs == 2
    else:
        assert node._target_.endswith("SlurmLauncher") and node.timeout_min == 120


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_experiment_configs_compose_and_build(experiment, prepared):
    cfg = compose_config(f"+experiment={experiment}", "device=cpu")
    imaging = {  # placeholders in the files: the look-alike releases instead
        "luna16": prepared.luna,
        "brats": prepared.brats,
        "mnist": prepared.mnist,
        "cifar10": prepared.cifar10,
        "cifar100": prepared.cifar100,
        "tiny_imagenet": prepared.tiny_imagenet,
    }
    kind = cfg.dataset._target_.rsplit(".", 1)[-1]
    if kind in imaging:
        cfg.dataset.path = str(imaging[kind])
        cfg.batch_size = 2  # the synthetic releases give each client a few samples
        cfg.num_clients = min(cfg.num_clients, 4)
        if "k" in cfg.algorithm:
            cfg.algorithm.k = min(cfg.algorithm.k, 3)
    engine = build_engine(cfg)
    assert engine.clients and cfg.tracker.experiment.startswith("fedexp/")


def test_codec_without_arguments_refuses_a_key():
    cfg = compose_config("compressor=cer_runs", "+compressor.uplink.codec.q=0.01")
    with pytest.raises(ConfigError, match=r"compressor\.uplink\.codec\.q"):
        build_channel(cfg.compressor.uplink, "compressor.uplink")
