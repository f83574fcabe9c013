"""A run's health: when its losses blew up (stop it), and when a round is a sound point.

The stop rule (:func:`_check_blowup`) ends a run whose mean training loss in a round exceeds
``divergence_factor`` times the reference loss (:func:`_reference_loss`); the much stricter
health rule (:func:`_healthy`) says which checkpointed round a rescue after a divergence may
resume from (``good.safetensors``, :mod:`fedexp.engine.files.checkpoint`).
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from fedexp.errors import DivergenceError


def _reference_loss(history: list[dict[str, float]]) -> float | None:
    """The loss a blow-up is measured against.

    The initial model's mean test loss (round 0's evaluation), else the first round's mean
    training loss; None when neither is a positive number.
    """
    rows = history[:2]
    values = [r.get("loss/mean") for r in rows if r.get("round") == 0]
    values += [r.get("train/train_loss") for r in rows]
    for value in values:
        if value is not None and math.isfinite(value) and value > 0:
            return float(value)
    return None


def _check_blowup(cfg: DictConfig, history: list[dict[str, float]], metrics: dict, t: int) -> None:
    """Stop a finite blow-up: round ``t``'s mean training loss above ``divergence_factor``.

    Raises:
        DivergenceError: the loss exceeds ``divergence_factor`` times the reference loss
            (:func:`_reference_loss`); 0 disables the check.
    """
    factor = float(cfg.get("divergence_factor", 1e4) or 0)
    loss = metrics.get("train/train_loss")
    if factor <= 0 or loss is None or not math.isfinite(loss):
        return
    ref = _reference_loss(history)
    if ref is not None and loss > factor * ref:
        raise DivergenceError(
            f"training loss grew from {ref:.4g} to {loss:.4g} (×{loss / ref:.3g}) by round {t}: "
            f"the run diverged (lower lr={cfg.lr:g}, or divergence_factor=0 to allow it)"
        )


#: A checkpointed round is healthy, and its checkpoint kept as ``good.safetensors`` (what a
#: rescue after a divergence resumes from), when its losses are at most this many times the
#: reference loss (:func:`_healthy`).
GOOD_LOSS_FACTOR = 10.0


def _healthy(
    cfg: DictConfig, history: list[dict[str, float]], client_history: list[dict[str, float]]
) -> bool:
    """Whether the last round of ``history`` is a sound point for a rescue to resume from.

    Much stricter than the stop rule (:func:`_check_blowup`, ×``divergence_factor``): the
    round's mean training loss and, when it was evaluated, its mean test loss are finite and
    at most :data:`GOOD_LOSS_FACTOR` times the reference loss (:func:`_reference_loss`: the
    initial model's test loss; ``divergence_factor`` when that is smaller), and no client's
    test loss is infinite (the mean leaves such clients out; it is absent when none is
    finite). The test loss is what catches a model blowing up while the training loss looks
    fine (Ditto's global model under its personal ones). A round with neither loss is healthy.
    """
    row = history[-1]
    factor = float(cfg.get("divergence_factor", 1e4) or 0)
    bound = min(GOOD_LOSS_FACTOR, factor) if factor > 0 else GOOD_LOSS_FACTOR
    ref = _reference_loss(history)
    losses = [row.get("train/train_loss")]
    if "time/eval_s" in row:  # evaluated this round
        losses.append(row.get("loss/mean", math.nan))
        for client in reversed(client_history):  # the round's own rows are the last ones
            if client["round"] != row["round"]:
                break
            if client.get("loss") == math.inf:
                return False
    for loss in losses:
        if loss is not None and not (math.isfinite(loss) and (ref is None or loss <= bound * ref)):
            return False
    return True
