"""Two parts of issue 14's cohort engine, each against what it replaced, in one process.

* ``cnn``: one local step (forward and backward, batch 16) of bench_peers' small CNN (64,642
  parameters): a plain ``nn.Module`` in PyTorch's default NCHW layout (what the peers run), the
  same module converted to channels-last, and fedexp's ``FlatModel`` (a flat parameter
  vector through ``functional_call``) with and without its channels-last weights, its
  gradient by plain autograd (a loop written here, as ``fedexp.engine.solver.steps._rowwise`` takes
  it through ``Context.loss_grad_post``: the row-by-row path channels-last CNNs run on the CPU)
  and by ``torch.func.grad`` (what the solver's vmapped path uses).
* ``codecs``: a cohort's messages through a lossy channel with error feedback: message by
  message (``Channel.send`` + ``receive``, the engine's fallback path) against one pass
  (``Channel.send_many`` + ``receive_many``), for STC (q = 0.01) and top-k (q = 0.1).

The variants are interleaved, ``--repeats`` times; the table gives each one's median and its
ratio to the first row of its group.

    python scripts/bench_cohort_parts.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "peers"))

import common  # noqa: E402
from torch.func import grad_and_value  # noqa: E402

from fedexp.comm.channel import Channel  # noqa: E402
from fedexp.comm.stc import STCCodec  # noqa: E402
from fedexp.comm.topk import TopKCodec  # noqa: E402
from fedexp.models.flat import FlatModel  # noqa: E402


def _time(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def cnn_variants() -> dict[str, Callable[[], object]]:
    """One training step of each CNN variant (the same batch and starting point)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1, 32, 32, generator=gen)
    y = torch.randint(0, 2, (16,), generator=gen)
    nchw = common.make_model("cnn", 0)
    nhwc = common.make_model("cnn", 0).to(memory_format=torch.channels_last)

    def plain(module: torch.nn.Module) -> Callable[[], object]:
        params = list(module.parameters())
        return lambda: torch.autograd.grad(common.loss_fn(module(x), y), params)

    def flat(model: FlatModel, functorch: bool) -> Callable[[], object]:
        p0 = model.initial()

        def loss(p: torch.Tensor) -> torch.Tensor:
            return common.loss_fn(model(p, x), y)

        if functorch:
            step = grad_and_value(loss)
            return lambda: step(p0)

        def autograd() -> object:
            p = p0.detach().requires_grad_(True)
            return torch.autograd.grad(loss(p), p)

        return autograd

    cpu = torch.device("cpu")
    return {
        "plain module, NCHW (the peers)": plain(nchw),
        "plain module, channels-last": plain(nhwc),
        "FlatModel NCHW, autograd": flat(FlatModel(common.make_model("cnn", 0), cpu, False), False),
        "FlatModel channels-last, autograd (fedexp)": flat(
            FlatModel(common.make_model("cnn", 0), cpu), False
        ),
        "FlatModel channels-last, torch.func.grad": flat(
            FlatModel(common.make_model("cnn", 0), cpu), True
        ),
    }


def codec_variants() -> dict[str, dict[str, Callable[[], object]]]:
    """Per cohort shape and codec: message by message against one pass."""
    groups = {}
    for name, codec in (("STC q=0.01", STCCodec(0.01)), ("top-k q=0.1", TopKCodec(0.1))):
        for m, d in ((1000, 31), (10, 64642)):
            channel = Channel(codec, error_feedback=True)
            gen = torch.Generator().manual_seed(m)
            x = torch.randn(m, d, generator=gen)
            res = 0.01 * torch.randn(m, d, generator=gen)

            def one_by_one(channel=channel, x=x, res=res, d=d) -> object:  # noqa: ANN001
                out = []
                for row, r in zip(x, res, strict=True):
                    payload, _, _ = channel.send(row, r)
                    out.append(channel.receive(payload, d, "cpu"))
                return out

            def one_pass(channel=channel, x=x, res=res, d=d) -> object:  # noqa: ANN001
                payloads, _ = channel.send_many(x, res)
                return channel.receive_many(payloads, d, "cpu")

            groups[f"{name}, m = {m}, d = {d}"] = {
                "message by message (Channel.send)": one_by_one,
                "one pass (Channel.send_many)": one_pass,
            }
    return groups


def run_group(title: str, variants: dict[str, Callable[[], object]], repeats: int, unit: str):
    """Interleave the variants ``repeats`` times; print medians and ratios."""
    for fn in variants.values():  # warm-up: numba compilation, oneDNN primitives
        fn()
        fn()
    budget = 0.25  # seconds of calls per variant and repeat
    calls = {k: max(1, int(budget / max(_time(fn, 1), 1e-6))) for k, fn in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            times[k].append(_time(fn, calls[k]))
    medians = {k: statistics.median(v) for k, v in times.items()}
    base = next(iter(medians.values()))
    print(f"\n{title}\n\n| variant | {unit} (median) | speed vs the first row |\n|---|---:|---:|")
    for k, t in medians.items():
        print(f"| {k} | {t * 1e3:.3f} | {base / t:.2f}x |")


def main() -> None:
    """Run the groups and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--parts", nargs="+", choices=["cnn", "codecs"], default=["cnn", "codecs"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"python scripts/bench_cohort_parts.py --threads {args.threads} --repeats {args.repeats}")
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    if "cnn" in args.parts:
        run_group("CNN: one local step, batch 16", cnn_variants(), args.repeats, "ms a step")
    if "codecs" in args.parts:
        for title, variants in codec_variants().items():
            run_group(f"Codec, error feedback: {title}", variants, args.repeats, "ms a cohort")


if __name__ == "__main__":
    main()
