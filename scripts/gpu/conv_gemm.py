"""A cohort's 2-D convolutions by cuDNN's grouped kernels or as im2col products, side by side.

    python3 scripts/gpu/conv_gemm.py --models cnn,unet --variants grouped,gemm   # on the device
    python scripts/gpu/conv_gemm.py --cpu --smallest                              # rehearsal

On the device, after the wheels of ``scripts/gpu/check.sh`` are installed and on PYTHONPATH
with this tree (docs/benchmarks.md gives the whole command). For each workload of the device
check (the 2-conv CNN, MONAI's 2-D U-Net and DenseNet on random BraTS- and LUNA16-shaped
patches), at each cohort size: one engine, its rounds timed in each variant in turn:
``grouped`` (vmap's grouped convolutions, cuDNN's), ``gemm`` (the run setting ``conv_gemm``,
:mod:`fedexp.models.conv_gemm`), and each with ``cudnn.benchmark`` on (``*_benchmark``); the
client updates/s and the peak memory. First, for each workload, whether two engines built
alike end two rounds of 10 clients with the same server state both ways (the largest gap
relative to the state's largest entry; convolutions in float32, TF32 off, as the products
are). Figures to ``$OUT/conv_gemm.json``. On the CPU the convolutions go client by client
(channels-last) and the two variants are the same computation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import check  # noqa: E402

check._import_paths()

import torch  # noqa: E402

from fedexp.models import conv_gemm  # noqa: E402


def rate(engine, rounds: int, dev: torch.device) -> float:  # noqa: ANN001 - an Engine
    """Client updates/s of ``rounds`` rounds after one warm-up round."""
    engine.run_round()
    check._sync(dev)
    start = time.perf_counter()
    for _ in range(rounds):
        engine.run_round()
    check._sync(dev)
    return rounds * len(engine.clients) / (time.perf_counter() - start)


def server_gap(model: str, n: int, dev: torch.device, tmp: Path, spec) -> float:  # noqa: ANN001
    """Largest relative gap of the server state after two rounds, grouped vs im2col."""
    states = []
    torch.backends.cudnn.allow_tf32 = False  # both in float32 (the products are: matmul's default)
    for gemm in (False, True):
        torch.manual_seed(0)
        engine = check._workload(model, n, dev, tmp, spec)[0]
        if gemm:
            conv_gemm.install(engine.ctx.model.module)
        engine.run_round()
        engine.run_round()
        states.append({k: v.detach().double().cpu() for k, v in engine.server.items()})
    torch.backends.cudnn.allow_tf32 = True
    gap = 0.0
    for key, a in states[0].items():
        b = states[1][key]
        scale = a.abs().max().item() or 1.0
        gap = max(gap, (a - b).abs().max().item() / scale)
    return gap


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--smallest", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--models", default="cnn,unet,densenet")
    p.add_argument("--variants", default="grouped,gemm,gemm_benchmark,grouped_benchmark")
    args = p.parse_args()
    dev = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True  # (PyTorch's default for convolutions)
    cells = {
        "cnn": (100, 1000),
        "unet": (100, 1000),
        "densenet": (100,),
    }
    if args.smallest:
        cells = {k: (4,) for k in cells}
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp())
    tmp = Path(tempfile.mkdtemp())
    doc: dict = {"device": str(torch.cuda.get_device_name() if dev.type == "cuda" else dev)}
    models = args.models.split(",")
    # equality first (small cohorts), then speed
    for model in models:
        spec = check.WORKLOADS[model]
        if args.smallest:
            spec = (4, 1, 2)
        try:
            doc[f"{model}_gap"] = server_gap(model, 10 if not args.smallest else 3, dev, tmp, spec)
        except Exception as exc:  # noqa: BLE001 - reported, the rest goes on
            doc[f"{model}_gap"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"[gemm] {model}: server gap {doc[f'{model}_gap']}", flush=True)
    for model in models:
        spec = check.WORKLOADS[model] if not args.smallest else (4, 1, 2)
        for n in cells[model]:
            cell: dict = {}
            doc[f"{model}_{n}"] = cell
            try:
                engine = check._workload(model, n, dev, tmp, spec)[0]
                for name in args.variants.split(","):
                    torch.backends.cudnn.benchmark = name.endswith("benchmark")
                    if name.startswith("gemm"):
                        conv_gemm.install(engine.ctx.model.module)
                    else:
                        conv_gemm.uninstall(engine.ctx.model.module)
                    check._reset_peak(dev)
                    try:
                        cell[name] = rate(engine, args.rounds, dev)
                        cell[name + "_peak_mib"] = check._peak_mib(dev)
                    except Exception as exc:  # noqa: BLE001
                        cell[name] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"[gemm] {model} {n} {name}: {cell[name]}", flush=True)
                    (out / "conv_gemm.json").write_text(json.dumps(doc, indent=1))
            except Exception as exc:  # noqa: BLE001
                cell["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"[gemm] {model} {n}: {cell['error']}", flush=True)
            engine = None
            check._free(dev)
    torch.backends.cudnn.benchmark = False
    (out / "conv_gemm.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
