"""The ``system`` node checked against the run before anything is built or tracked."""

from __future__ import annotations

from omegaconf import DictConfig

from fedexp.config.instantiate import instantiate_checked
from fedexp.errors import ConfigError


def check_system(cfg: DictConfig) -> None:
    """Refuse a ``system`` node the run cannot take, in one line, before any output.

    Reads the trace files (a bad row is named with its file, row and column), and refuses a
    clock that drops or skips clients together with client-level DP: the accountant counts
    every round's sampling as Poisson (or fixed-size) over every client, which a deadline,
    over-selection or unavailable clients would break.

    Raises:
        ConfigError: naming the key (or file, row and column) and what is expected.
    """
    node = cfg.get("system")
    if node is None or node.get("profile", "none") == "none":
        return
    system = instantiate_checked(node, "system")
    system.check_files(int(cfg.get("batch_size", 32)))
    privacy = cfg.get("privacy") or {}
    if privacy.get("mode", "none") == "none":
        return
    for key, off in (
        ("deadline", system.deadline is None),
        ("over_select", not system.over_select),
        ("availability", system.availability >= 1.0),
        ("availability_file", not system.availability_file),
    ):
        if not off:
            value = getattr(system, key)
            raise ConfigError(
                f"system.{key}={value}: with privacy={privacy.get('mode')} every sampled "
                "client's upload is accounted for, so the clock may not drop or skip clients; "
                f"remove system.{key} (the clock still times a DP run) or use privacy=none"
            )
