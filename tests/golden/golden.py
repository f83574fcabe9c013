"""Running a golden case: the figures ``record.py`` keeps and ``test_golden.py`` compares."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from golden.cases import CASES
from golden.cases import pins
from golden.ties import DISCRETE
from golden.ties import Allowance
from golden.ties import recording_ties

HERE = Path(__file__).resolve().parent
ROUNDS = 3
#: what a round's figures are compared on: not wall times
_SKIP = ("time/", "system/", "memory/")
#: aggregates added after the recording (issue 68): the clients' quantiles, derived from the
#: same per-client figures as the recorded mean, worst and std
_SKIP_SUFFIX = ("/p10", "/p50", "/p90")


def state_path(name: str) -> Path:
    """Where case ``name``'s state tree is kept."""
    return HERE / "states" / f"{name}.safetensors"


def metrics_path() -> Path:
    """The per-round metrics of every case."""
    return HERE / "metrics.json"


def _flatten(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/"))
        else:
            out[name] = value.detach().cpu()
    return out


def run_case(
    name: str, out_dir: Path, *extra: str
) -> tuple[dict[str, torch.Tensor], list[dict[str, float]], Allowance]:
    """Case ``name`` (and ``extra`` overrides), ``ROUNDS`` rounds: its flat state tree, each
    round's metrics and what near ties allow its discrete figures to differ by
    (``golden.ties``)."""
    from fedexp.engine.round.checkpointing import _state_key
    from fedexp.engine.runner import build_engine
    from helpers import SMALL
    from helpers import compose_config

    cfg = compose_config(*SMALL, *CASES[name], *pins(CASES[name]), *extra, output_dir=out_dir)
    engine = build_engine(cfg)
    engine.setup()
    history, evaluated = [], []
    for _ in range(ROUNDS):
        metrics = engine.run_round()
        with recording_ties() as calls:
            aggregates, per_client = engine.evaluate()
        metrics.update(aggregates)
        history.append(
            {
                k: float(v)
                for k, v in sorted(metrics.items())
                if not k.startswith(_SKIP) and not k.endswith(_SKIP_SUFFIX)
            }
        )
        values = torch.tensor([[m.get(k, math.nan) for k in DISCRETE] for m in per_client])
        slack = torch.cat(calls) if calls else torch.zeros(len(per_client), len(DISCRETE))
        assert len(slack) == len(per_client), "an evaluation scored clients out of turn"
        sizes = torch.tensor([m["num_test"] for m in per_client], dtype=torch.float64)
        evaluated.append((slack, values.to(torch.float64), sizes))
    tree = engine.state_tree()
    # every client's state as the recording holds it (one entry a client, initial ones too);
    # the tree saves them stacked by key since issue 25
    del tree["clients"]
    tree["client"] = {str(n): s for n, s in enumerate(engine.client_states)}
    # and the channels' memories one entry a (client, part), as the tree saved them before
    tree["channel"] = {
        d: {
            kind: {_state_key(k): v for k, v in getattr(engine.transport, kind)[d].items()}
            for kind in ("residual", "replica", "reference")
        }
        for d in ("up", "down")
    }
    return _flatten(tree), history, Allowance(evaluated)
