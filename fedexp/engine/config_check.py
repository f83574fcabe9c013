"""A run's config checked across its groups, before any data is loaded or anything is tracked.

The run settings are checked by :func:`fedexp.config.schema.validate`; the group nodes
(:data:`fedexp.config.groups.PLAIN_GROUPS`, the model, the compressor's channels) are checked
here against their targets' signatures: unknown keys, value types, non-finite floats and the
ranges the signature declares (:mod:`fedexp.config.ranges`); then what ties groups together:
an adaptive server optimiser against the algorithm (:func:`check_server_optimizer`), the
privacy settings (:func:`fedexp.privacy.checks.check_privacy`) and the simulated system
(:func:`fedexp.system.checks.check_system`). The CLI calls :func:`check_groups` right after
compose, before the tracker is created and before the data are read, so a bad value costs
nothing and leaves nothing behind (no MLflow run, no output files). The runner builds each node
through the same checks (:func:`fedexp.config.instantiate.instantiate_checked`), so the API is
covered as well.

It sits with the engine, above the groups it reads (the config package below them imports
none of them).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from omegaconf import OmegaConf

from fedexp.config.groups import MODEL_EXTRA
from fedexp.config.groups import PLAIN_GROUPS
from fedexp.config.groups import check_channel
from fedexp.config.groups import split_model_node
from fedexp.config.instantiate import check_node
from fedexp.config.instantiate import locate_target
from fedexp.engine.solver.server_optim import steps_global_model
from fedexp.errors import ConfigError
from fedexp.privacy.checks import check_privacy
from fedexp.system.checks import check_system


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
