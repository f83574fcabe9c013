"""Resuming a run: the settings that must not change, and those that did (recorded as tags).

:func:`flatten_config` is the resolved config as ``{"algorithm.lam": "0.1", ...}``: the run's
MLflow params, and the form in which a resume compares its settings with the checkpoint's.

:func:`resume_target` is the checkpoint a ``resume=`` on the command line names, checked
before Hydra makes a folder: a path that does not exist, or a folder without a checkpoint, is
refused in one line (exit 2, nothing created); a run's folder (``outputs/<date>/<time>``,
which holds ``checkpoints/``) stands for its ``checkpoints/``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from omegaconf import OmegaConf

from fedexp.errors import ConfigError

#: Settings that must not change when a run is resumed (they define the experiment and the
#: shape of its state). Everything else may: rounds, eval/checkpoint frequency, device,
#: progress, tracker, divergence_factor, and what rescuing a diverged run needs: lr,
#: local_steps / local_epochs. A change is recorded (:func:`_resume_changes`).
_RESUME_KEYS = (
    "dataset",
    "model",
    "partition",
    "algorithm",
    "compressor",
    "optimizer",
    "server_optimizer",
    "augment",
    "seed",
    "num_clients",
    "participation",
    "batch_size",
    "sampling",
    "test_fraction",
    "val_fraction",
    "holdout_clients",
)

#: Defaults of resume keys added after checkpoints were first written (older ones lack them).
_RESUME_DEFAULTS = {
    "val_fraction": 0.0,
    "holdout_clients": 0.0,
    "sampling": "replacement",
    "augment": {"_target_": "fedexp.data.augment.NoAugmentation"},
    "server_optimizer": {"_target_": "fedexp.engine.solver.server_optim.ServerSGD"},
}

#: The checkpoint a folder is resumed from (``checkpoint.FILENAME``; that module imports torch).
LAST_CHECKPOINT = "last.safetensors"
#: The folder of a run's checkpoints, in its run folder.
CHECKPOINTS = "checkpoints"

#: Keys whose change on resume is not recorded (they name where this attempt writes).
_UNRECORDED = ("resume", "resume_unsealed", "output_dir")


def flatten_config(cfg: DictConfig) -> dict[str, str]:
    """The resolved config as ``{"algorithm.lam": "0.1", ...}`` (MLflow params)."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(node, list) and any(isinstance(v, dict) for v in node):
            for i, v in enumerate(node):
                walk(v, f"{prefix}{i}.")
        else:
            out[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def _privacy_settings(config: dict[str, Any]) -> dict[str, Any]:
    """A config's ``privacy.*`` settings; ``{"privacy.mode": "none"}`` without DP."""
    node = config.get("privacy") or {}
    if node.get("mode", "none") == "none":
        return {"privacy.mode": "none"}
    return {f"privacy.{k}": v for k, v in node.items() if k != "_target_"}


def _check_privacy_resume(cfg: DictConfig, now: dict[str, Any], before: dict[str, Any]) -> None:
    """Refuse a resume whose DP settings differ from the checkpoint's: one line, the first key.

    A run's DP mechanism is fixed for its life: a resume that added noise would report an ε
    for uploads released without it, one that dropped it would release unnoised uploads under
    a spent budget. With ``privacy.target_epsilon`` the noise is calibrated to ``rounds``,
    which then may not change either. Both values are named, the checkpoint's too.
    """
    a, b = _privacy_settings(before), _privacy_settings(now)
    if a.get("privacy.target_epsilon") is not None:
        a["rounds"], b["rounds"] = before.get("rounds"), now.get("rounds")
    for key in dict.fromkeys([*a, *b]):
        old, new = a.get(key, "(unset)"), b.get(key, "(unset)")
        if old != new:
            what = "its calibrated noise" if key == "rounds" else "its DP settings"
            raise ConfigError(
                f"resume={cfg.resume}: {key}={new} but the checkpoint's run has {key}={old}; "
                f"a run keeps {what} for its life: resume with {key}={old}"
            )


def _check_resume(cfg: DictConfig, saved_yaml: str) -> None:
    saved = OmegaConf.create(saved_yaml)
    now = OmegaConf.to_container(cfg, resolve=True)
    before = OmegaConf.to_container(saved, resolve=True)
    _check_privacy_resume(cfg, now, before)
    diff = [
        k
        for k in _RESUME_KEYS
        if now.get(k, _RESUME_DEFAULTS.get(k)) != before.get(k, _RESUME_DEFAULTS.get(k))
    ]
    if diff:
        raise ConfigError(
            f"resume={cfg.resume}: the checkpoint was made with different {', '.join(diff)}; "
            "resume with the same settings (only rounds, eval/checkpoint frequency, device, "
            "progress, tracker, divergence_factor, lr and local_steps/local_epochs may change)"
        )


def _resume_changes(cfg: DictConfig, saved_yaml: str, round_: int) -> list[dict[str, Any]]:
    """The settings that differ from the checkpoint's config (a rescue's smaller lr, ...).

    Returns ``[{"round": r, "key": "lr", "from": "0.1", "to": "0.01"}, ...]``: ``r`` is the
    checkpoint's round, the new value holds from round r + 1 on.
    """
    before = flatten_config(OmegaConf.create(saved_yaml))
    now = flatten_config(cfg)
    keys = [k for k in dict.fromkeys([*before, *now]) if k.split(".")[0] not in _UNRECORDED]
    return [
        {"round": round_, "key": k, "from": before.get(k, "(unset)"), "to": now.get(k, "(unset)")}
        for k in keys
        if before.get(k) != now.get(k)
    ]


def _change_tags(changes: list[dict[str, Any]]) -> dict[str, str]:
    """MLflow tags of resume changes: ``fedexp.resume.<round>.<key>`` = ``"old -> new"``.

    Tags, not params: MLflow params cannot change once logged (``lr`` keeps the first value).
    """
    return {f"fedexp.resume.{c['round']}.{c['key']}": f"{c['from']} -> {c['to']}" for c in changes}


def resume_target(resume: str) -> str:
    """The checkpoint ``resume=<resume>`` names, before Hydra makes a run folder.

    A checkpoint file, or a folder holding ``last.safetensors``, is taken as it is (the
    checkpoint's contents are checked when it is loaded); a run's folder whose
    ``checkpoints/`` holds one stands for that folder (``resume=outputs/<date>/<time>`` is
    ``resume=outputs/<date>/<time>/checkpoints``, and the run continues in its folder).

    Args:
        resume: the value of ``resume=`` on the command line.

    Returns:
        ``resume``, or ``<resume>/checkpoints`` for a run's folder.

    Raises:
        ConfigError: the path does not exist, or names a folder without a checkpoint (one
            line naming it and what was expected).
    """
    path = Path(resume).expanduser()
    if path.is_file() or (path / LAST_CHECKPOINT).is_file():
        return resume
    if not path.exists():
        raise ConfigError(
            f"resume={resume}: no such file or folder; expected a run's folder "
            f"(outputs/<date>/<time>), its {CHECKPOINTS}/ or a checkpoint file"
        )
    folder = path / CHECKPOINTS
    if (folder / LAST_CHECKPOINT).is_file():
        return os.path.join(resume, CHECKPOINTS)
    if folder.is_dir():
        raise ConfigError(
            f"resume={resume}: {folder} holds no checkpoint ({LAST_CHECKPOINT}): the run "
            "stopped before its first one (checkpoint_every=N writes one every N rounds)"
        )
    raise ConfigError(
        f"resume={resume}: no checkpoint found (expected {path / LAST_CHECKPOINT}, or a run's "
        f"folder holding {CHECKPOINTS}/{LAST_CHECKPOINT})"
    )


def check_resume_early(cfg: DictConfig) -> None:
    """Refuse a resume whose settings differ from the checkpoint's, before anything is logged.

    The checkpoint's settings are read from its header alone (no tensor is read); the runner
    checks them again as it loads it. Refused here, a resume leaves its run's ``cli.log`` as
    it was (issue 70, item 11: the refused command's ``threads:`` line was appended to it).

    Raises:
        ConfigError: a setting that must not change did (:func:`_check_resume`).
    """
    from fedexp.engine.files.checkpoint import peek

    path = Path(cfg.resume)
    meta = peek(path / LAST_CHECKPOINT if path.is_dir() else path)
    if meta is not None and isinstance(meta.get("config"), str):
        _check_resume(cfg, meta["config"])
