"""The ``system`` node checked against the run before anything is built or tracked."""

from __future__ import annotations

from omegaconf import DictConfig

from fedexp.config.instantiate import instantiate_checked
from fedexp.config.instantiate import locate_target
from fedexp.errors import ConfigError


def check_system(cfg: DictConfig) -> None:
    """Refuse a ``system`` node the run cannot take, in one line, before any output.

    Reads the trace files (a bad row is named with its file, row and column), and refuses a
    clock that drops or skips clients together with client-level DP: the accountant counts
    every round's sampling as Poisson (or fixed-size) over every client, which a deadline,
    over-selection or unavailable clients would break. FedBuff's buffer is checked by
    :func:`check_buffer`.

    Raises:
        ConfigError: naming the key (or file, row and column) and what is expected.
    """
    node = cfg.get("system")
    if node is None or node.get("profile", "none") == "none":
        return
    system = instantiate_checked(node, "system")
    system.check_files(int(cfg.get("batch_size", 32)))
    privacy = cfg.get("privacy") or {}
    if system.buffer is not None:
        n, held = int(cfg.num_clients), float(cfg.get("holdout_clients") or 0.0)
        # the clients ``holdout_clients`` keeps out (``views.held_out``'s count)
        members = n - (min(max(1, int(round(held * n))), n - 1) if held > 0 and n >= 2 else 0)
        node = cfg.get("algorithm") or {}
        target = node.get("_target_")
        algorithm = locate_target(target, "algorithm._target_") if target else None
        check_buffer(
            system.buffer,
            max(1, int(round(float(cfg.participation) * members))),
            getattr(algorithm, "server_reads", "each") == "mean"
            and bool(getattr(algorithm, "server_optimized", False)),
            getattr(algorithm, "__name__", "the algorithm"),
            privacy.get("mode", "none"),
            bool(node.get("all_train", getattr(algorithm, "all_train", False))),
        )
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


def check_buffer(
    buffer: int, cohort: int, steps_on_mean: bool, algorithm: str, privacy: str, all_train: bool
) -> None:
    """Refuse a FedBuff buffer (``system.buffer``) the run cannot take, in one line.

    Args:
        buffer: K, the uploads a server step takes.
        cohort: C, the clients in flight (the run's cohort: ``participation`` of the members).
        steps_on_mean: whether the algorithm's server moves a global model by the weighted
            mean of the uploads, model differences (``server_reads == "mean"`` and
            ``server_optimized``: FedAvg, FedProx, FedNova, SCAFFOLD, ...). FedBuff's
            staleness weights scale that step; a server that averages models (L2GD) or
            personal quantities (pFedSOP) would be shrunk by them instead.
        algorithm: its name, for the message.
        privacy: the ``privacy`` mode ("none": none).
        all_train: whether every client trains each round (``Algorithm.all_train``): the
            clients in flight would train again.

    Raises:
        ConfigError: naming the key and what is expected.
    """
    if buffer > cohort:
        raise ConfigError(
            f"system.buffer={buffer}: more than the {cohort} clients in flight (the round's "
            "cohort: participation · num_clients); set system.buffer ≤ "
            f"{cohort} or raise participation"
        )
    if not steps_on_mean:
        raise ConfigError(
            f"system.buffer={buffer}: {algorithm}'s server does not step a global model on "
            "the weighted mean of model differences, which FedBuff weighs by staleness "
            "(algorithm=fedavg, fedprox, fednova, scaffold and the like); set system.buffer=null"
        )
    if all_train:
        raise ConfigError(
            f"system.buffer={buffer}: {algorithm} trains every client each round "
            "(all_train), also the clients in flight; set algorithm.all_train=false or "
            "system.buffer=null"
        )
    if privacy != "none":
        raise ConfigError(
            f"system.buffer={buffer} with privacy={privacy}: the accountant counts each "
            "round's cohort as the uploads of that round; set system.buffer=null or "
            "privacy=none"
        )
