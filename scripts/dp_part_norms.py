"""How an algorithm's upload parts compare in norm, to choose ``privacy.part_clip``'s shares.

Runs the algorithm with central DP that neither clips nor noises (``privacy.clip=inf
privacy.noise_multiplier=0``), records each part's L2 norm per upload as
``PrivateUplink.client_side`` sees it, and prints per round the median norm of each part and
the median share of each part in an upload's squared norm (docs/privacy.md, "Per-part
clipping"). With ``--compare``, also runs the algorithm under central DP at ``--epsilon`` with
joint clipping and with each given split, and prints the final accuracy and share clipped::

    python scripts/dp_part_norms.py                                  # SCAFFOLD, 10 rounds
    python scripts/dp_part_norms.py --compare dy:0.5,dc:0.5 dy:0.8,dc:0.2 --rounds 30 --clip 0.1
    python scripts/dp_part_norms.py --algorithm feddwa --rounds 5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fedexp.engine.runner import build_engine  # noqa: E402
from fedexp.engine.runner import run  # noqa: E402
from fedexp.privacy import uplink  # noqa: E402
from fedexp.privacy.mechanisms import joint_norms  # noqa: E402
from fedexp.tracking.base import NullTracker  # noqa: E402
from helpers import compose_config  # noqa: E402

RUN = ["num_clients=100", "participation=0.2", "batch_size=4", "progress=none", "tracker=none"]


def norms(algorithm: str, rounds: int, extra: list[str]) -> None:
    """Print each round's median part norms and median shares of the squared norm."""
    seen: list[dict[str, torch.Tensor]] = []
    real = uplink.PrivateUplink.client_side

    def spy(self, round_, clients, uploads, refs):  # noqa: ANN001, ANN202
        parts = self._changes(uplink._parts(uploads), refs)
        seen.append({k: joint_norms([v]) for k, v in parts.items()})
        return real(self, round_, clients, uploads, refs)

    uplink.PrivateUplink.client_side = spy  # type: ignore[method-assign]
    try:
        cfg = compose_config(
            f"algorithm={algorithm}",
            "privacy=central",
            "privacy.noise_multiplier=0",
            "privacy.clip=inf",
            f"rounds={rounds}",
            "checkpoint_every=0",
            *RUN,
            *extra,
        )
        engine = build_engine(cfg)
        engine.setup()
        for _ in range(rounds):
            engine.run_round()
    finally:
        uplink.PrivateUplink.client_side = real  # type: ignore[method-assign]
    for t, parts in enumerate(seen):
        total = sum(v.square() for v in parts.values())
        cells = [
            f"{k}: norm {float(v.median()):.3g}, share {float((v.square() / total).median()):.2f}"
            for k, v in parts.items()
        ]
        print(f"round {t + 1}: " + "; ".join(cells))


def compare(
    algorithm: str, rounds: int, epsilon: float, clip: float, splits: list[str], extra: list[str]
) -> None:
    """Final accuracy and share clipped under joint clipping and each split, at C = ``clip``."""
    for split in [None, *splits]:
        part = [f"+privacy.part_clip={{{split}}}"] if split else []
        cfg = compose_config(
            f"algorithm={algorithm}",
            "privacy=central",
            f"privacy.target_epsilon={epsilon}",
            f"privacy.clip={clip}",
            f"rounds={rounds}",
            "checkpoint_every=0",
            *RUN,
            *part,
            *extra,
        )
        tracker = NullTracker()
        result = run(cfg, tracker=tracker)
        clipped = tracker.metrics.get("privacy/clipped", {})
        mean = sum(clipped.values()) / max(1, len(clipped))
        print(
            f"{split or 'joint':>16}: acc/mean {result.metrics['acc/mean']:.4f}, "
            f"loss/mean {result.metrics.get('loss/mean', float('nan')):.4f}, "
            f"uploads clipped {mean:.2f} (mean over rounds)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="scaffold")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--compare", nargs="*", default=[], help="splits, e.g. dy:0.5,dc:0.5")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--clip", type=float, default=1.0, help="C of --compare's runs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    extra = [f"seed={args.seed}"]
    norms(args.algorithm, args.rounds, extra)
    if args.compare:
        compare(args.algorithm, args.rounds, args.epsilon, args.clip, args.compare, extra)


if __name__ == "__main__":
    main()
