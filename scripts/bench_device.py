"""A round on the run's device: ops, host reads, client updates/s and the compute bound.

Issue 39 ("The round on the device"), item 6. For each model (logistic regression, the 2-conv
CNN, MONAI's DenseNet on LUNA16-shaped patches, MONAI's U-Net on BraTS-shaped ones) and each
client count, FedAvg (or ``--algorithm``) every client every round:

* **ops / round** and **host reads / round**: the second round counted by
  ``fedexp.engine.round.census.Census`` (each op is a kernel launch on a GPU, each host read
  waits for the queue); they must not grow with the clients (``tests/test_round_census.py``);
* **updates/s**: client updates a second, over the timed rounds after a warm-up
  (``torch.cuda.synchronize`` around them on CUDA);
* **peak memory**: ``torch.cuda.max_memory_allocated`` on CUDA, the process's peak RSS on
  the CPU;
* on CUDA, the **fraction of the compute bound**: updates/s ÷ (the chip's stated float32
  peak ÷ (training FLOPs a sample × samples an update)), with the FLOPs counted by
  ``torch.utils.flop_counter`` and the peaks of ``scripts/gpu/check.py``.

The workloads are the device check's (``scripts/gpu/check.py``: ``_workload``, its sizes).

    .venv/bin/python scripts/bench_device.py                          # CPU, LR and CNN
    .venv/bin/python scripts/bench_device.py --models lr,cnn,densenet,unet --clients 10,100,1000
    python3 scripts/bench_device.py --device cuda --json out.json     # on the device machine
    .venv/bin/python scripts/bench_device.py --models lr --tensor-draws  # short runs' draw path

Figures and commands: docs/benchmarks.md ("A round on the device").
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = (
    ROOT,
    ROOT / "tests",
    ROOT / "scripts",
    ROOT / "scripts" / "peers",
    ROOT / "scripts" / "gpu",
)
for path in PATHS:
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import check  # noqa: E402  (scripts/gpu/check.py: the device check's workloads and peaks)
import torch  # noqa: E402

from fedexp.engine.round.census import Census  # noqa: E402

#: (samples a client, local steps, batch) of each model on the CPU (the device uses the
#: device check's ``WORKLOADS``): a CPU takes seconds a DenseNet step of the GPU's sizes
CPU_WORKLOADS = {"lr": (50, 5, 16), "cnn": (64, 2, 16), "densenet": (8, 1, 4), "unet": (4, 1, 2)}


def _peak_memory_mib(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (KiB on Linux)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def cell(model: str, clients: int, args: argparse.Namespace, tmp: Path) -> dict:
    """One model at one client count: ops, reads, updates/s, memory (and the bound on CUDA)."""
    dev = torch.device(args.device)
    spec = (check.WORKLOADS if dev.type == "cuda" else CPU_WORKLOADS)[model]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    engine, module, loss_fn, _, shape = check._workload(model, clients, dev, tmp, spec)
    if args.algorithm != "fedavg":
        raise SystemExit("--algorithm: only fedavg's workloads are built here for now")
    engine.run_round()  # warm-up: the first round writes the states
    with Census() as counted:
        engine.run_round()
    gc.collect()
    _sync(dev)
    start, done = time.perf_counter(), 0
    while done < args.rounds and (done == 0 or time.perf_counter() - start < args.seconds):
        engine.run_round()
        done += 1
    _sync(dev)
    elapsed = time.perf_counter() - start
    out = {
        "model": model,
        "clients": clients,
        "ops_per_round": counted.total_ops,
        "host_reads_per_round": counted.total_reads,
        "updates_per_s": clients * done / elapsed,
        "round_s": elapsed / done,
        "peak_memory_mib": _peak_memory_mib(dev),
    }
    if dev.type == "cuda":
        samples, steps, batch = spec
        if module is None:
            module, loss_fn = check._lr_module_and_loss(shape)
        x, y = check._example_batch(model, shape, batch, dev)
        flops = check._train_flops(module.to(dev), loss_fn, x, y) / batch
        fp32, _, source = check._fp32_peak(dev)
        bound = fp32 * 1e12 / (flops * steps * batch)
        out.update(flop_bound_updates_per_s=bound, fraction_of_bound=out["updates_per_s"] / bound)
        out["peak_source"] = source
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="lr,cnn")
    parser.add_argument("--clients", default="10,100,1000")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds at most")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds at most")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--algorithm", default="fedavg")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--tensor-draws",
        action="store_true",
        help="draw the passes with tensor ops (passes.pass_indices_tensor: a short CPU run's "
        "path; GPU runs took it before 2026-11-30, they take the host's kernel now), not the "
        "compiled kernel: that path's ops and host reads, counted here",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fedexp.engine.solver import passes

    if args.tensor_draws:
        passes.pass_indices = passes.pass_indices_tensor
    else:  # the steady state: the CPU's compiled pass kernel from the first round
        passes.use_compiled_passes()
    rows = []
    header = "| model | clients | ops/round | host reads/round | updates/s | round s | peak MiB |"
    bound = args.device.startswith("cuda")
    print(header + (" fraction of bound |" if bound else ""))
    print("|" + "---|" * (7 + bound))
    with tempfile.TemporaryDirectory(prefix="bench-device-") as tmp:
        for model in args.models.split(","):
            for n in (int(c) for c in args.clients.split(",")):
                try:
                    r = cell(model, n, args, Path(tmp))
                except Exception as exc:  # an out-of-memory at 1,000 U-Nets: the next cell
                    print(f"| {model} | {n} | {type(exc).__name__}: {str(exc)[:80]} |")
                    continue
                rows.append(r)
                line = (
                    f"| {model} | {n} | {r['ops_per_round']} | {r['host_reads_per_round']} | "
                    f"{r['updates_per_s']:.0f} | {r['round_s']:.3f} | {r['peak_memory_mib']:.0f} |"
                )
                if bound:
                    line += f" {r['fraction_of_bound']:.3%} |"
                print(line, flush=True)
                gc.collect()
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
