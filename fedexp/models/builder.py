"""Build a model from its config node: seeded initialisation, shared/personal patterns."""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig
from torch import nn

from fedexp import streams
from fedexp.config.groups import split_model_node
from fedexp.config.instantiate import instantiate_checked


def build_model(
    node: DictConfig, input_shape: Sequence[int], num_classes: int, seed: int
) -> tuple[nn.Module, list[str]]:
    """Instantiate ``node`` with the data's shape, initialised from ``seed`` alone.

    The node's optional ``personal`` key (glob patterns on parameter names) is not a
    builder argument: it is returned for the shared/personal split.
    """
    node, personal = split_model_node(node)
    with streams.seeded_global(seed):
        module = instantiate_checked(
            node, "model", input_shape=list(input_shape), num_classes=num_classes
        )
    return module, personal
