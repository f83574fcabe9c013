"""The ``privacy`` node checked against the run before anything is built or tracked."""

from __future__ import annotations

import copy

from omegaconf import DictConfig

from fedexp.config.instantiate import instantiate_checked
from fedexp.config.instantiate import locate_target
from fedexp.errors import ConfigError
from fedexp.privacy.uplink import PrivateUplink


def check_privacy(cfg: DictConfig) -> None:
    """Refuse DP settings that the run's algorithm or sizes cannot meet, in one line.

    Builds the mechanism as the run will (without ``target_epsilon``'s calibration, which
    only fails for targets no noise reaches, and is checked when the run is built): adaptive
    clipping on a server that reads each upload, an adaptive count noise too small for the
    total multiplier, noise that drowns every update (:data:`~fedexp.privacy.uplink.DROWNING`),
    a ``privacy.part_clip`` that does not name the algorithm's upload parts.
    ``privacy.clip=inf`` with noise is refused by the settings themselves.

    Raises:
        ConfigError: naming the key and what is expected.
    """
    node = cfg.get("privacy")
    if node is None or node.get("mode", "none") == "none":
        return
    settings = copy.copy(instantiate_checked(node, "privacy"))
    if settings.target_epsilon is not None:  # z is calibrated later: the ignored z is not checked
        settings.target_epsilon, settings.noise_multiplier = None, 0.0
    target = cfg.get("algorithm", {}).get("_target_")
    algorithm = locate_target(target, "algorithm._target_") if target else None
    try:
        PrivateUplink(
            settings,
            getattr(algorithm, "server_reads", "each"),
            getattr(algorithm, "uplink_parts", {}),
            int(cfg.num_clients),
            float(cfg.participation),
            int(cfg.rounds),
            int(cfg.seed),
            algorithm=_name(cfg, algorithm),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _name(cfg: DictConfig, algorithm: object) -> str | None:
    """The algorithm as the run names it: its config option (``scaffold``), else its class."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.choices["algorithm"])
    except Exception:  # noqa: BLE001 - no Hydra run (the API, tests): the class's name
        return getattr(algorithm, "__name__", None)
