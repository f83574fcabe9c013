"""What a model is trained for: its loss and its per-client evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedexp.metrics import classification_metrics


class ClassificationTask:
    """Cross-entropy classification; a one-logit model is binary logistic regression."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy (binary cross-entropy with logits for one output)."""
        if logits.shape[-1] == 1:
            return F.binary_cross_entropy_with_logits(logits[:, 0], y.to(logits.dtype))
        return F.cross_entropy(logits, y)

    def evaluate(self, logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Accuracy, balanced accuracy and AUC on one client's test split."""
        return classification_metrics(logits, y, self.num_classes)
