"""A model that does not fit the data set is refused before round 0, in one line.

Issue "Hardening, round two", item 2: ``model=unet`` on a classification set and
``model=resnet9`` or ``model=logreg`` on BraTS segmentation ended in shape tracebacks inside
the first round; item 1: ``algorithm.head=[nomatch.*]`` (FedPer) ran as FedAvg. The model's
output is now checked against the data's task (:func:`fedexp.models.task.check_model_fits`)
and personal patterns must match an entry of the model.
"""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from fedexp.data.dataset import ArrayDataset
from fedexp.engine.runner import build_engine
from fedexp.errors import ConfigError
from fedexp.models.builder import build_model
from fedexp.models.task import check_model_fits
from helpers import compose_config

FAST = ["progress=none", "tracker=none", "device=cpu", "checkpoint_every=0", "rounds=1"]


def _segmentation(n: int = 6, size: int = 16) -> ArrayDataset:
    """A BraTS-like set: four channels, binary masks of the image's size."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4, size, size)).astype(np.float32)
    y = (rng.random((n, size, size)) > 0.5).astype(np.int64)
    return ArrayDataset("brats-like", x, y, 2, task="segmentation")


def _model(name: str, data: ArrayDataset):
    node = OmegaConf.load(f"conf/model/{name}.yaml")
    module, _ = build_model(node, data.x.shape[1:], data.num_classes, seed=0)
    return module


@pytest.mark.parametrize("name", ["resnet9", "logreg", "densenet", "vgg8"])
def test_a_classifier_on_segmentation_is_refused(name):
    data = _segmentation()
    with pytest.raises(ConfigError) as err:
        check_model_fits(_model(name, data), data, name, "brats")
    message = str(err.value)
    assert message.startswith(f"model={name} on dataset=brats (segmentation"), message
    assert "[2, 16, 16]" in message and "\n" not in message


def test_the_segmentation_model_fits_segmentation():
    data = _segmentation()
    module = _model("unet", data)
    check_model_fits(module, data, "unet", "brats")
    assert module.training  # the check leaves the model's mode as it was


def test_unet_on_a_classification_set_is_refused_before_the_engine_is_built():
    cfg = compose_config(*FAST, "dataset=digits", "partition=dirichlet", "model=unet")
    with pytest.raises(ConfigError, match=r"^model=unet on dataset=digits \(classification"):
        build_engine(cfg)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.personal=[nomatch.*]", "model.personal"),
        ("algorithm=fedper", "algorithm.head"),
        ("algorithm=fedrod", "algorithm.head"),
    ],
)
def test_personal_patterns_that_match_nothing_are_refused(override, key):
    extra = [] if override.startswith("model") else [f"{key}=[nomatch.*]"]
    cfg = compose_config(*FAST, "model=mlp", override, *extra)
    with pytest.raises(ConfigError) as err:
        build_engine(cfg).setup()
    message = str(err.value)
    assert message.startswith(f"{key}=['nomatch.*']: no entry of the model matches"), message
    assert "head.weight" in message  # the entries it could have named


def test_patterns_that_match_keep_working():
    cfg = compose_config(*FAST, "model=mlp", "algorithm=fedper", "algorithm.head=[head.*]")
    engine = build_engine(cfg)
    engine.setup()
    assert len(engine.algorithm.personal_idx(engine.ctx)) > 0
