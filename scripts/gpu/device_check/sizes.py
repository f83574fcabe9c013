"""The steps, in order, and how big each is in each mode (``gpu``, ``cpu``, ``smallest``)."""

from __future__ import annotations

import dataclasses

STEPS = (
    "env",
    "cuda_tests",
    "golden",
    "syncs",
    "bench_cnn",
    "bench_lr",
    "bench_densenet",
    "bench_unet",
    "bench_densenet3d",
    "bench_unet3d",
    "profile",
    "conv_gemm",
    "sweep",
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How big each step is in one mode of the check.

    Attributes:
        total_s: wall-clock budget of all steps together.
        budgets: each step's own budget, seconds (never beyond what ``total_s`` leaves).
        inline: every step in one child process (the smallest form, quick to start).
        threads: torch CPU threads (0: torch's default).
        clients: client counts of the benchmark.
        clients_3d: client counts of the 3-D workloads (a cube is 32-64 slices).
        warmup: rounds before the timed ones.
        rounds: timed rounds at most (fewer when the cell's time runs out).
        plain_s: seconds of the plain loop's timing a cell.
        bound_reps: timed steps of the measured bound.
        bound_cap: samples in the measured bound's batch at most (the rate is per sample).
        golden: golden cases, in order.
        test_files: CUDA test files to run at most (0: all).
        sync_clients: the two client counts of ``syncs``.
        profile_clients: clients of the profiled CNN round.
        sweep_algorithms: the sweep's algorithms (one delta, one seed).
        sweep_rounds: rounds of each sweep job.
        sweep_cpu: algorithms of the CPU baseline sweep (the first ones), 0: none.
        sweep_seeds: seeds of the stacked sweep (each algorithm a group of that many runs).
        gemm_cells: (workload, clients) of ``conv_gemm``, in order.
        workloads: (samples a client, steps, batch) of the imaging models, where smaller than
            :data:`WORKLOADS` (a CPU takes seconds a DenseNet step).
    """

    total_s: float
    budgets: dict[str, float]
    inline: bool
    threads: int
    clients: tuple[int, ...]
    clients_3d: tuple[int, ...]
    warmup: int
    rounds: int
    plain_s: float
    bound_reps: int
    bound_cap: int
    golden: tuple[str, ...]
    test_files: int
    sync_clients: tuple[int, int]
    profile_clients: int
    sweep_algorithms: tuple[str, ...]
    sweep_rounds: int
    sweep_cpu: int
    sweep_seeds: int = 2
    gemm_cells: tuple[tuple[str, int], ...] = (("cnn", 2),)
    workloads: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)

    def workload(self, model: str) -> tuple[int, int, int]:
        """(samples a client, local steps, batch) of ``model`` in this mode."""
        return self.workloads.get(model, WORKLOADS[model])


def _budgets(*seconds: float) -> dict[str, float]:
    """Each step's budget, in the order of :data:`STEPS`."""
    return dict(zip(STEPS, seconds, strict=True))


SIZES: dict[str, Sizes] = {
    "gpu": Sizes(
        total_s=520,
        budgets=_budgets(15, 25, 35, 45, 40, 30, 65, 45, 45, 45, 15, 40, 75),
        inline=False,
        threads=0,
        clients=(100, 1000),
        clients_3d=(10, 100),
        warmup=2,
        rounds=10,
        plain_s=6.0,
        bound_reps=20,
        bound_cap=4096,
        golden=(
            "fedavg",
            "fedprox-cnn",
            "fedavg-stc-partial",
            "fedbn-batchnorm",
            "pfednet",
            "ditto",
        ),
        test_files=0,
        sync_clients=(10, 100),
        profile_clients=100,
        sweep_algorithms=("fedavg", "ditto", "fedper", "fedrep", "apfl", "local"),
        sweep_rounds=10,
        sweep_cpu=2,
        sweep_seeds=4,
        gemm_cells=(("cnn", 100), ("cnn", 1000), ("unet", 100), ("densenet", 100)),
    ),
    "cpu": Sizes(
        total_s=310,
        budgets=_budgets(15, 35, 25, 20, 20, 20, 40, 25, 25, 20, 15, 20, 30),
        inline=False,
        threads=1,
        clients=(4, 8),
        clients_3d=(2, 4),
        warmup=1,
        rounds=2,
        plain_s=1.0,
        bound_reps=2,
        bound_cap=64,
        golden=("fedavg", "fedprox-cnn"),
        test_files=0,
        sync_clients=(2, 4),
        profile_clients=4,
        sweep_algorithms=("fedavg", "local"),
        sweep_rounds=2,
        sweep_cpu=1,
        gemm_cells=(("cnn", 4), ("unet", 4)),
        workloads={
            "densenet": (10, 1, 2),
            "unet": (10, 1, 4),
            "densenet3d": (5, 1, 2),
            "unet3d": (10, 1, 2),
        },
    ),
    "smallest": Sizes(
        total_s=100,
        budgets=_budgets(10, 30, 15, 10, 10, 10, 10, 10, 10, 10, 10, 10, 30),
        inline=True,
        threads=1,
        clients=(2,),
        clients_3d=(2,),
        warmup=1,
        rounds=1,
        plain_s=0.2,
        bound_reps=1,
        bound_cap=16,
        golden=("fedavg",),
        test_files=1,
        sync_clients=(2, 3),
        profile_clients=2,
        sweep_algorithms=("fedavg",),
        sweep_rounds=1,
        sweep_cpu=0,
        sweep_seeds=1,
        workloads={
            "densenet": (5, 1, 2),
            "unet": (5, 1, 2),
            "densenet3d": (5, 1, 2),
            "unet3d": (5, 1, 2),
        },
    ),
}

#: Benchmark workloads: samples a client (80/20 train/test split for the config ones), local
#: steps, batch. ``cnn`` is issue 14's (scripts/peers/common.py), built by gpu_cnn_rate.py.
WORKLOADS: dict[str, tuple[int, int, int]] = {
    "lr": (50, 5, 16),  # scripts/bench_engine.py's
    "cnn": (64, 2, 16),
    "densenet": (40, 2, 16),  # LUNA16-shaped 1x32x32 patches, conf/model/densenet.yaml
    "unet": (20, 2, 8),  # BraTS-shaped 4x64x64 patches and masks, conf/model/unet.yaml
    # the 3-D ones (dataset.dims=3): LUNA16-shaped 1x32x32x32 cubes with a thinner DenseNet
    # (block_config [4,4,4]: 1 GiB a client's step against 7 GiB for the 2-D one's 16-16-16),
    # BraTS-shaped 4x64x64x64 crops with the U-Net (about 120 MiB a client's step at batch 2)
    "densenet3d": (20, 2, 8),
    "unet3d": (10, 2, 2),
}
