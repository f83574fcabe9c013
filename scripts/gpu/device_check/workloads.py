"""The benchmark workloads: each model's engine, plain-loop module, example batch and FLOPs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    #: a loss of (logits, targets)
    Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


#: Overrides of the 3-D workloads' models (see :data:`WORKLOADS`).
MODEL_3D = {"densenet3d": ("model.block_config=[4,4,4]",), "unet3d": ()}


def imaging_folder(
    kind: str,
    clients: int,
    per_client: int,
    root: Path,
    dims: int = 2,
    side: int | None = None,
    regions: bool = False,
) -> Path:
    """A prepared LUNA16 or BraTS folder (``data_prep``'s layout) of random patches.

    Cubes with ``dims=3``; ``side`` voxels a side (default the converters': 32 and 64);
    BraTS masks of the three regions with ``regions`` (``--labels regions``), else whole
    tumour. Only their shapes matter (benchmarks, memory estimates).
    """
    import numpy as np

    rng = np.random.default_rng(0)
    n = clients * per_client
    side = side or (32 if kind == "luna16" else 64)
    folder = root / f"{kind}-{dims}d-{side}-{'r' if regions else 'w'}-{clients}"
    folder.mkdir(parents=True, exist_ok=True)
    block = min(n, 509)  # random patches, repeated: only their shapes matter (and it is quick)
    spatial = (side,) * dims
    if kind == "luna16":
        x = np.resize(rng.random((block, 1, *spatial), dtype=np.float32), (n, 1, *spatial))
        np.save(folder / "labels.npy", rng.integers(0, 2, n).astype(np.int64))
        column, groups = "seriesuid", [f"s{i % 997}" for i in range(n)]
    else:
        x = np.resize(rng.random((block, 4, *spatial), dtype=np.float32), (n, 4, *spatial))
        channels = (3,) if regions else ()
        shape = (*channels, *spatial)
        masks = np.resize(rng.random((block, *shape)) < 0.2, (n, *shape))
        np.save(folder / "masks.npy", masks.astype(np.uint8))
        column, groups = "patient", [f"p{i % 997}" for i in range(n)]
    np.save(folder / "images.npy", x)
    (folder / "manifest.csv").write_text(column + "\n" + "\n".join(groups) + "\n")
    return folder


def _workload(
    model: str, n: int, dev: torch.device, tmp: Path, spec: tuple[int, int, int]
) -> tuple[Any, nn.Module | None, Loss | None, float, tuple[int, ...]]:
    """(engine, plain-loop module, loss, lr, input shape) of one benchmark cell; ``spec``:
    (samples a client, local steps, batch)."""
    import bench_engine
    import common
    import gpu_cnn_rate

    from fedexp.engine.runner import build_engine
    from fedexp.models.builder import build_model
    from helpers import compose_config

    samples, steps, batch = spec
    if model == "cnn":
        engine = gpu_cnn_rate.engine(n, dev)
        return engine, common.make_model("cnn", 0), common.loss_fn, 0.1, (1, 32, 32)
    if model == "lr":
        engine = bench_engine.build(n, steps, batch, dev.type)
        return engine, None, None, 0.1, tuple(engine.clients[0].x_train.shape[1:])
    kind = "luna16" if model.startswith("densenet") else "brats"
    dims = 3 if model.endswith("3d") else 2
    folder = imaging_folder(kind, n, samples, tmp, dims)
    cfg = compose_config(
        f"dataset={kind}",
        f"dataset.path={folder}",
        f"dataset.dims={dims}",
        f"model={model.removesuffix('3d')}",
        *MODEL_3D.get(model, ()),
        "partition=iid",
        f"num_clients={n}",
        f"local_steps={steps}",
        f"batch_size={batch}",
        "lr=0.05",
        f"device={dev.type}",
        "tracker=none",
    )
    engine = build_engine(cfg)
    shape = tuple(engine.clients[0].x_train.shape[1:])
    module, _ = build_model(cfg.model, shape, 2, 0)
    return engine, module, common.loss_fn, 0.05, shape


def _example_batch(
    model: str, shape: tuple[int, ...], size: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    x = torch.randn(size, *shape, device=dev)
    if model == "lr":
        return x, torch.randint(0, 2, (size,), device=dev).float()
    if model.startswith("unet"):
        return x, torch.randint(0, 2, (size, *shape[1:]), device=dev)
    return x, torch.randint(0, 2, (size,), device=dev)


def _train_flops(module: nn.Module, loss_fn: Loss, x: torch.Tensor, y: torch.Tensor) -> float:
    """Forward + backward FLOPs of ``module`` on ``x`` (matrix products and convolutions)."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    m = copy.deepcopy(module)
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(m(x), y).backward()
    return float(counter.get_total_flops())


def _lr_module_and_loss(shape: tuple[int, ...]) -> tuple[nn.Module, Loss]:
    from torch import nn

    bce = nn.BCEWithLogitsLoss()
    return nn.Linear(shape[0], 1), lambda z, y: bce(z[:, 0], y.float())
