"""pFedNet's personalised models as λ grows, in one shared PCA basis (the paper's Figure 2).

    python scripts/lambda_pca.py --out docs/figures/lambda_pca.png

Trains pFedNet on the default config (breast cancer, 5 clients, label imbalance δ = 2) for
each λ, then projects every client's personalised model on the first two principal components
of the λ = 0 models, so that the collapse of the personal parts is seen on a common scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fedexp.engine.runner import build_engine  # noqa: E402
from helpers import compose_config  # noqa: E402


def train(lam: float, rounds: int) -> tuple[torch.Tensor, float]:
    cfg = compose_config(
        "algorithm=pfednet",
        f"algorithm.lam={lam}",
        "device=cpu",
        "tracker=none",
        f"rounds={rounds}",
    )
    engine = build_engine(cfg)
    engine.setup()
    for _ in range(rounds):
        metrics = engine.run_round()
    agg, _ = engine.evaluate()
    return engine.server["Z"].T.clone(), metrics["pfednet/spread"], agg["acc/weighted"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lams", type=float, nargs="+", default=[0, 0.001, 0.01, 0.1, 1, 10])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--out", default="lambda_pca.png")
    args = parser.parse_args()
    runs = {lam: train(lam, args.rounds) for lam in args.lams}
    base = runs[args.lams[0]][0].double()
    mean = base.mean(dim=0, keepdim=True)
    _, _, vh = torch.linalg.svd(base - mean, full_matrices=False)
    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.subplots()
    print("| λ | spread (mean ‖z_n − z̄‖) | accuracy (weighted) |\n|---:|---:|---:|")
    for lam, (z, spread, acc) in runs.items():
        xy = (z.double() - mean) @ vh[:2].T
        ax.scatter(xy[:, 0], xy[:, 1], label=f"λ={lam:g} (spread {spread:.3g})", alpha=0.8)
        print(f"| {lam:g} | {spread:.4g} | {acc:.4f} |")
    ax.set(xlabel="PC1 of the λ=0 models", ylabel="PC2", title="clients' personalised models")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"\nfigure: {args.out}")


if __name__ == "__main__":
    main()
