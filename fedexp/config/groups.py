"""The config groups' nodes as the checks and the builders read them.

The group nodes (``dataset``, ``partition``, ``model``, ``algorithm``, ``optimizer``,
``server_optimizer``, ``augment``, ``compressor``, ``privacy``, ``tracker``, ``system``) name a
fedexp class or builder in ``_target_``: :data:`PLAIN_GROUPS` are checked against its signature
as they are; the model node less its ``personal`` key (:func:`split_model_node`), with the
arguments the builder passes from the data (:data:`MODEL_EXTRA`); a compressor's channels key by
key (:func:`check_channel`). The run's whole config is checked across its groups by
:func:`fedexp.engine.config_check.check_groups`, which sits above the groups' own checks
(privacy, system, the server optimiser against the algorithm).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig
from omegaconf import ListConfig
from omegaconf import open_dict

from fedexp.config.instantiate import check_node
from fedexp.errors import ConfigError

#: Arguments the model builder passes from the data (not config keys).
MODEL_EXTRA = frozenset({"input_shape", "num_classes"})
#: The keys of a ``compressor.uplink``/``downlink`` node.
CHANNEL_KEYS = ("codec", "transforms", "error_feedback")
#: The group nodes checked against their target's signature (the compressor's channels apart).
PLAIN_GROUPS = (
    "dataset", "partition", "algorithm", "optimizer", "server_optimizer", "augment", "privacy",
    "tracker", "system",
)  # fmt: skip


def split_model_node(node: DictConfig) -> tuple[DictConfig, list[str]]:
    """The model node without its ``personal`` key, and that key's glob patterns.

    ``personal`` (the entries pFL methods keep per client) is not a builder argument.

    Raises:
        ConfigError: ``model.personal`` is not a list of strings.
    """
    node = node.copy()
    with open_dict(node):
        personal = node.pop("personal", None)
    if personal is None:
        return node, []
    if isinstance(personal, str):
        personal = [personal]
    if not isinstance(personal, ListConfig | list | tuple) or not all(
        isinstance(p, str) and p for p in personal
    ):
        raise ConfigError(
            f"model.personal={personal!r}: expected a list of glob patterns over the model's "
            "entry names, e.g. [head.*]"
        )
    return node, [str(p) for p in personal]


def check_channel_keys(node: Any, path: str) -> None:
    """Refuse a channel node that is not a mapping of :data:`CHANNEL_KEYS`."""
    if not isinstance(node, Mapping | DictConfig):
        raise ConfigError(f"{path}: expected a node with keys {', '.join(CHANNEL_KEYS)}")
    for key in node:
        if key not in CHANNEL_KEYS:
            raise ConfigError(
                f"unknown key '{path}.{key}' (expected: {', '.join(sorted(CHANNEL_KEYS))})"
            )
    if "codec" not in node:
        raise ConfigError(f"{path}.codec is missing (expected a codec node with a _target_)")
    ef = node.get("error_feedback", False)
    if not isinstance(ef, bool):
        raise ConfigError(f"{path}.error_feedback={ef!r}: expected true or false")


def check_channel(node: Any, path: str) -> None:
    """A channel node: its keys, its codec's and every transform's arguments."""
    check_channel_keys(node, path)
    check_node(node.codec, f"{path}.codec")
    transforms = node.get("transforms") or []
    if not isinstance(transforms, ListConfig | list):
        raise ConfigError(f"{path}.transforms={transforms!r}: expected a list of transform nodes")
    for i, transform in enumerate(transforms):
        check_node(transform, f"{path}.transforms[{i}]")
