"""Every config group's node checked whole, before any data is loaded or anything is tracked.

The run settings are checked by :func:`fedexp.config.schema.validate`; the group nodes
(``dataset``, ``partition``, ``model``, ``algorithm``, ``optimizer``, ``server_optimizer``,
``augment``, ``compressor``, ``privacy``, ``tracker``, ``system``) name a fedexp class or builder in
``_target_`` and are checked here against its signature: unknown keys, value types, non-finite
floats and the ranges the signature declares (:mod:`fedexp.config.ranges`); an adaptive server
optimiser against the algorithm (:func:`check_server_optimizer`). The CLI calls
:func:`check_groups` right after compose, before the tracker is created and before the data
are read, so a bad value costs nothing and leaves nothing behind (no MLflow run, no output
files). The runner builds each node through the same checks
(:func:`fedexp.config.instantiate.instantiate_checked`), so the API is covered as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from fedexp.config.instantiate import check_node, locate_target
from fedexp.engine.solver.server_optim import steps_global_model
from fedexp.errors import ConfigError
from fedexp.privacy.checks import check_privacy
from fedexp.system.checks import check_system

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


def _missing_keys(cfg: DictConfig) -> list[str]:
    """The mandatory values (``???``) left unset, as full keys (``dataset.label``)."""
    found = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, DictConfig):
            for key in node:
                full = f"{path}.{key}" if path else str(key)
                if OmegaConf.is_missing(node, key):
                    found.append(full)
                else:
                    walk(node._get_node(key), full)

    walk(cfg, "")
    return found


def check_server_optimizer(cfg: DictConfig) -> None:
    """Refuse an adaptive ``server_optimizer`` for a method without a global model.

    FedAdagrad, FedAdam and FedYogi step a global model on the mean upload; a method whose
    server keeps no such model (local-only, FedAMP, pFedNet, L2GD, ...) would silently ignore
    them. ``sgd`` (the default) is every method's own server and always accepted.

    Raises:
        ConfigError: one line naming ``server_optimizer`` and the algorithm.
    """
    node, algo = cfg.get("server_optimizer"), cfg.get("algorithm")
    if node is None or algo is None or "_target_" not in node or "_target_" not in algo:
        return
    optimizer = locate_target(node._target_, "server_optimizer._target_")
    if not getattr(optimizer, "adaptive", False):
        return
    algorithm = locate_target(algo._target_, "algorithm._target_")
    if not steps_global_model(algorithm):
        name = getattr(optimizer, "name", optimizer.__name__)
        raise ConfigError(
            f"server_optimizer={name}: {algorithm.__name__} (algorithm) has no global model "
            "that its server moves by the mean upload, so a server optimiser has nothing to "
            "step; use server_optimizer=sgd (the default)"
        )


def check_groups(cfg: DictConfig) -> None:
    """Check every group node of the run config before anything is built.

    Raises:
        ConfigError: one line naming the first bad key, its value and what was expected
            (``algorithm.mu=nan: expected ≥ 0``, ``dataset.label: no value given``).
    """
    missing = _missing_keys(cfg)
    if missing:
        said = ", ".join(missing)
        raise ConfigError(
            f"{said}: no value given (the config marks {'it' if len(missing) == 1 else 'them'} "
            f"??? = mandatory); set {'it' if len(missing) == 1 else 'each'} on the command "
            f"line, e.g. {missing[0]}=..."
        )
    for group in PLAIN_GROUPS:
        if group in cfg and cfg[group] is not None:
            check_node(cfg[group], group)
    if cfg.get("model") is not None:
        node, _ = split_model_node(cfg.model)
        check_node(node, "model", extra=set(MODEL_EXTRA))
    compressor = cfg.get("compressor")
    if compressor is not None:
        for direction in ("uplink", "downlink"):
            check_channel(compressor.get(direction), f"compressor.{direction}")
    check_server_optimizer(cfg)
    check_privacy(cfg)
    check_system(cfg)
