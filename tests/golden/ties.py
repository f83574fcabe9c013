"""How far a classification metric may move when near-tied scores swap (issue 37).

Accuracy, balanced accuracy and AUC are step functions of the logits: two scores within a few
ulps of each other can swap order when the same model runs on another CPU kind (AVX-512 or
AVX2, Intel or AMD: the kernels add in another order), and the metric jumps by one sample or one
pair although every parameter agrees to 1e-7. :func:`slack` bounds that jump per client from
the logits of the run under test: the metric's change if every score that is within ``rel``
(relative to the sample's largest logit) of a decision boundary moved across it. A client
without near ties gets slack 0, so its metric must equal the recording.

:func:`recording_ties` collects those bounds while an engine evaluates, by wrapping
``fedexp.metrics.classification_table`` where the engine calls it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: A score within this fraction of (1 + the sample's largest |logit|) of a boundary may cross it
#: on another machine; parameters agree to ~1e-7 across CPU kinds, logits to ~1e-6.
REL = 1e-5

#: The metrics bounded here, in ``classification_table``'s column order.
DISCRETE = ("acc", "bal_acc", "auc")


def _near_pairs(score: torch.Tensor, scale: torch.Tensor, pos: torch.Tensor) -> float:
    """Fraction of (positive, negative) pairs whose scores are within the tie band."""
    sp, sn = score[pos], score[~pos]
    if not len(sp) or not len(sn):
        return 0.0
    band = REL * (scale[pos][:, None] + scale[~pos][None, :])
    return float(((sp[:, None] - sn[None, :]).abs() <= band).sum()) / (len(sp) * len(sn))


def slack(
    logits: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor, num_classes: int
) -> torch.Tensor:
    """``(m, 3)``: per client, the largest change of acc, bal_acc and AUC a swap of near ties
    can make (arguments as ``fedexp.metrics.classification_table``'s)."""
    out = torch.zeros(logits.shape[0], len(DISCRETE), dtype=torch.float64)
    for i, n in enumerate(lengths.tolist()):
        z = logits[i, :n].detach().to(torch.float64).cpu()
        labels = y[i, :n].long().cpu()
        if not n:
            continue
        scale = 1 + z.abs().amax(-1)
        if z.shape[-1] == 1:  # a sigmoid model predicts class 1 when its logit is > 0
            margin = z[:, 0].abs()
        else:
            top = z.topk(2, dim=-1).values
            margin = top[:, 0] - top[:, 1]
        near = margin <= REL * scale
        out[i, 0] = float(near.sum()) / n
        present = [k for k in range(num_classes) if (labels == k).any()]
        out[i, 1] = sum(
            float((near & (labels == k)).sum()) / float((labels == k).sum()) for k in present
        ) / len(present)
        if len(present) < 2:
            continue
        if num_classes == 2:
            score = z[:, 0] if z.shape[-1] == 1 else z[:, 1] - z[:, 0]
            out[i, 2] = _near_pairs(score, scale, labels == 1)
        else:  # one-vs-rest on the probabilities renormalised over the present classes,
            # the macro mean over them (two present classes: the larger label's AUC alone)
            sub = z - torch.logsumexp(z[:, present], dim=-1, keepdim=True)
            used = present[-1:] if len(present) == 2 else present
            out[i, 2] = sum(_near_pairs(sub[:, k], scale, labels == k) for k in used) / len(used)
    return out


@contextlib.contextmanager
def recording_ties() -> Iterator[list[torch.Tensor]]:
    """Within the block, every call of ``classification_table`` appends its :func:`slack`
    rows to the yielded list (clients in the order the engine scored them)."""
    import fedexp.metrics
    import fedexp.models.task

    calls: list[torch.Tensor] = []
    original = fedexp.metrics.classification_table

    def wrapped(logits, y, lengths, num_classes):
        calls.append(slack(logits, y, lengths, num_classes))
        return original(logits, y, lengths, num_classes)

    modules = (fedexp.metrics, fedexp.models.task)
    for module in modules:
        module.classification_table = wrapped
    try:
        yield calls
    finally:
        for module in modules:
            module.classification_table = original


class Allowance:
    """What each discrete figure of a run may differ by, from the slack of every evaluation.

    Args:
        rounds: per evaluated round, (slack ``(N, 3)`` from :func:`slack`, the clients' values
            ``(N, 3)`` of :data:`DISCRETE`, their test sizes ``(N,)``), clients in order.
    """

    def __init__(self, rounds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        self.rounds = rounds

    def _best(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per client, the slack of its best value over rounds 0..t, and whether it has one."""
        slacks = torch.stack([torch.where(v.isfinite(), s, 0) for s, v, _ in self.rounds[: t + 1]])
        seen = torch.stack([v.isfinite() for _, v, _ in self.rounds[: t + 1]]).any(0)
        return slacks.amax(0), seen

    def metric(self, t: int, key: str) -> float:
        """Round ``t``'s allowance for aggregate ``key`` (``acc/mean``, ``auc/best_mean``...;
        0 for a continuous figure)."""
        name, _, agg = key.rpartition("/")
        if name not in DISCRETE:
            return 0.0
        j = DISCRETE.index(name)
        if agg == "best_mean":  # the mean of each client's best so far (seen clients)
            best, seen = self._best(t)
            return float(best[:, j][seen[:, j]].mean())
        s, v, w = (x[:, j] if x.dim() == 2 else x for x in self.rounds[t])
        ok = v.isfinite()
        s, w = s[ok], w[ok]
        if agg == "mean":
            return float(s.mean())
        if agg == "weighted":
            return float((s * w).sum() / w.sum())
        if agg == "worst":  # the minimum moves by at most the largest move
            return float(s.max())
        if agg == "std":  # |std(a) - std(b)| <= std-norm of a - b <= RMS of the moves
            return float(s.square().mean().sqrt())
        raise KeyError(key)

    def state(self, key: str) -> torch.Tensor | None:
        """Per client, the allowance of state entry ``key`` (``best/acc``...) after the last
        round; None for a continuous entry."""
        prefix, _, name = key.partition("/")
        if prefix != "best" or name not in DISCRETE:
            return None
        best, _ = self._best(len(self.rounds) - 1)
        return best[:, DISCRETE.index(name)]
