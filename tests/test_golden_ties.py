"""The golden check's allowance for near ties (``golden/ties.py``, issue 37): a swap of near-tied
scores moves accuracy, balanced accuracy and AUC by no more than the slack it reports, and a
run without near ties gets none."""

from __future__ import annotations

import pytest
import torch
from golden.ties import REL
from golden.ties import slack

from fedexp.metrics import classification_table


def _jitter(z: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``z`` with every score moved within the tie band (as another CPU kind might)."""
    scale = 1 + z.abs().amax(-1, keepdim=True)
    return z + (torch.rand(z.shape, generator=gen, dtype=z.dtype) - 0.5) * REL * scale


@pytest.mark.parametrize("classes,logits", [(2, 1), (2, 2), (4, 4)])
def test_swapping_near_ties_stays_within_the_slack(classes, logits):
    gen = torch.Generator().manual_seed(classes + logits)
    m, n = 6, 40
    z = torch.randn(m, n, logits, generator=gen, dtype=torch.float64)
    z[:, ::3] = z[:, :1]  # a third of each client's samples share one score vector: ties
    if logits > 1:
        z[:, 1::5, 1] = z[:, 1::5, 0]  # and some samples sit on a decision boundary
    else:
        z[:, 1::5] = 0.0
    y = torch.randint(0, classes, (m, n), generator=gen)
    lengths = torch.tensor([40, 33, 20, 40, 7, 12])
    allowed = slack(z, y, lengths, classes)
    assert (allowed > 0).any(), "the planted ties were not seen"
    base = classification_table(z, y, lengths, classes)
    for _ in range(20):
        moved = classification_table(_jitter(z, gen), y, lengths, classes)
        gap = (moved - base).abs().nan_to_num(0.0)
        assert (gap <= allowed + 1e-12).all()


def test_well_separated_scores_get_no_slack():
    gen = torch.Generator().manual_seed(0)
    z = torch.arange(60, dtype=torch.float64).reshape(2, 30, 1) / 7 - 2.1
    y = torch.randint(0, 2, (2, 30), generator=gen)
    assert slack(z, y, torch.tensor([30, 25]), 2).eq(0).all()
