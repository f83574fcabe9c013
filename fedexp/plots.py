"""Figures saved next to a run's results and logged to MLflow as artifacts."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_rounds(history: list[dict[str, float]], path: Path) -> Path | None:
    """Accuracy (weighted, mean, worst client), training loss and cumulative bytes per round."""
    if not history:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    evals = [h for h in history if "acc/weighted" in h]
    for key, style in (("acc/weighted", "-"), ("acc/mean", "--"), ("acc/worst", ":")):
        axes[0].plot([h["round"] for h in evals], [h[key] for h in evals], style, label=key)
    axes[0].set(xlabel="round", ylabel="test accuracy", title="accuracy across clients")
    axes[0].legend()
    train = [h for h in history if "train/train_loss" in h]
    axes[1].plot([h["round"] for h in train], [h["train/train_loss"] for h in train])
    axes[1].set(xlabel="round", ylabel="loss", title="mean local training loss")
    for d in ("up", "down"):
        rows = [h for h in history if f"bytes/{d}_cum" in h]
        axes[2].plot(
            [h["round"] for h in rows], [h[f"bytes/{d}_cum"] for h in rows], label=f"{d}link"
        )
    axes[2].set(xlabel="round", ylabel="bytes", title="cumulative bytes on the wire")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
