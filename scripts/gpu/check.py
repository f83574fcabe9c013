"""The device check (issue 40): one command on the GPU machine, every figure into ``$OUT``.

    bash scripts/gpu/check.sh                  # on the device (installs .whl/ first)
    bash scripts/gpu/check.sh --cpu            # the rehearsal here: every step, small sizes
    bash scripts/gpu/check.sh --cpu --smallest # its smallest form (tests/test_gpu_check.py)
    bash scripts/gpu/check.sh --only bench_cnn,profile --budget 200   # a rerun of some steps

Steps, in order, each in a child process of its own (a CUDA error or an out-of-memory stays
in its step) with its own time budget; ``--smallest`` runs them all in one child:

* ``env``: versions, the device, a float32 matrix product's TFLOP/s;
* ``cuda_tests``: every test that needs CUDA (``cuda_select.py``), JUnit outcomes;
* ``golden``: golden cases (``tests/golden``) on the device against their CPU recording;
* ``syncs``: host synchronisations in one round (``torch.cuda.set_sync_debug_mode``), at two
  client counts: their difference over the clients' is the syncs per client; and the next
  round's dispatched ops and host reads (``fedexp.engine.round.census``), equal at both;
  then LR rounds with the pass draws on the host against the tensor path GPU runs took
  before (``compare_draws``: syncs and round time of each); then the round census's cases
  (every algorithm, codec and privacy mode of ``tests/test_round_census.py``, 10 clients)
  on the device, each one's syncs a training round and an evaluation (``census_syncs``);
* ``bench_cnn``, ``bench_lr``, ``bench_densenet``, ``bench_unet`` and the 3-D
  ``bench_densenet3d`` (LUNA16-shaped 32³ cubes) and ``bench_unet3d`` (BraTS-shaped 4×64³
  crops), at fewer clients (``clients_3d``): client updates/s of
  fedexp's round and of the plain per-client loop (``scripts/bench_engine.py``'s) on the same
  tensors, the measured step bound (``scripts/gpu_cnn_rate.py``'s: one SGD step of one model
  on every client's minibatch at once), the FLOP bound (train FLOPs per sample × samples per
  update ÷ the chip's stated float32 peak) and peak GPU memory; fedexp's rate both eager and
  with captured rounds (CUDA graphs, ``capture=auto``: ``captured_over_eager``);
* ``profile``: one CNN round under ``torch.profiler``: the top kernels;
* ``conv_gemm``: rounds of the CNN, the U-Net and the DenseNet with their convolutions as
  vmap's grouped ones and as matrix products (the run setting ``conv_gemm``), in turn on one
  engine: client updates/s and peak memory of each; and the CNN's server state after two
  rounds of 10 clients both ways (float32, TF32 off);
* ``sweep``: a ``pfednet_tables``-style sweep (``fedexp run -m``) on the device, one job a
  run, then the same algorithms over ``sweep_seeds`` seeds with ``hydra/launcher=stacked``
  (a group of runs a cohort), and as the baseline the first ones on the CPU.

Written to ``$OUT`` (at most 5 files): ``check.json`` (every figure), ``summary.md``,
``kernels.txt``, ``cuda_tests.txt``, ``log.txt``. Both JSON and summary are rewritten after
every step, so a check stopped from outside still leaves what it had.

The parts live in ``device_check/`` beside this file (one module a step or family of steps;
the sizes and budgets in ``device_check/sizes.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # (loaded by its path: its parts, device_check/, beside it)
    sys.path.insert(0, str(HERE))

from device_check.child import run_child  # noqa: E402
from device_check.environment import PEAKS  # noqa: E402
from device_check.environment import _fp32_peak  # noqa: E402
from device_check.kernel_profile import _kernels  # noqa: E402
from device_check.orchestrator import Check  # noqa: E402
from device_check.paths import ROOT  # noqa: E402
from device_check.paths import _import_paths  # noqa: E402
from device_check.sizes import SIZES  # noqa: E402
from device_check.sizes import STEPS  # noqa: E402
from device_check.sizes import WORKLOADS  # noqa: E402
from device_check.sizes import Sizes  # noqa: E402
from device_check.summary import summary  # noqa: E402
from device_check.syncs import count_syncs  # noqa: E402
from device_check.workloads import _example_batch  # noqa: E402
from device_check.workloads import _lr_module_and_loss  # noqa: E402
from device_check.workloads import _train_flops  # noqa: E402
from device_check.workloads import _workload  # noqa: E402

#: what other scripts and the tests use (scripts/bench_device.py, tests/test_gpu_check.py)
__all__ = [
    "PEAKS",
    "ROOT",
    "SIZES",
    "STEPS",
    "WORKLOADS",
    "Check",
    "Sizes",
    "_example_batch",
    "_fp32_peak",
    "_kernels",
    "_lr_module_and_loss",
    "_train_flops",
    "_workload",
    "count_syncs",
    "main",
    "run_child",
    "summary",
]


def main() -> int:
    """Parse the arguments; the orchestrator, or (``--child``) the steps' process."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="the rehearsal on this machine")
    p.add_argument("--smallest", action="store_true", help="the rehearsal's smallest form")
    p.add_argument("--only", default="", help="comma-separated steps (default: all)")
    p.add_argument("--budget", type=float, default=0, help="total seconds (default: the mode's)")
    p.add_argument(
        "--stretch",
        type=float,
        default=1.0,
        help="every step's budget and the total times this (a rehearsal on a busy machine)",
    )
    p.add_argument("--out", default="", help="output folder (default: $OUT, else a temp one)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadlines", default="", help=argparse.SUPPRESS)
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    _import_paths()
    if args.child:
        deadlines = [float(d) for d in args.deadlines.split(",")]
        run_child(args.child.split(","), args.mode, deadlines, Path(args.out), Path(args.work))
        return 0
    mode = "smallest" if args.smallest else "cpu" if args.cpu else "gpu"
    steps = [s.strip() for s in args.only.split(",") if s.strip()] or list(STEPS)
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        p.error(f"unknown steps {unknown}; the steps are {', '.join(STEPS)}")
    steps = [s for s in STEPS if s in steps]
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="fedexp-check-"))
    out.mkdir(parents=True, exist_ok=True)
    if not args.stretch > 0:
        p.error(f"--stretch {args.stretch}: expected a positive factor")
    total = (args.budget or SIZES[mode].total_s) * args.stretch
    check = Check(mode, steps, total, out, stretch=args.stretch)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the summary still gets written
    return check.run()


if __name__ == "__main__":
    sys.exit(main())
