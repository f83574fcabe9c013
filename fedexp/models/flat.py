"""Parameters (and BatchNorm statistics) as flat vectors with a layout.

One model instance is reused for every client: its parameters are supplied as views into a
flat vector through :func:`torch.func.functional_call`, so client state is just a vector
(and N clients' state can be one ``[N, d]`` tensor).

The vector holds the trainable parameters first, then the module's floating-point buffers
(BatchNorm running means and variances). A client's statistics therefore travel, are
averaged, personalised (FedBN) and checkpointed exactly like its parameters; they receive no
gradient, and a training forward pass returns the vector with the statistics it updated
(:meth:`FlatModel.forward_train`). Integer buffers (BatchNorm's ``num_batches_tracked``, read
only when its momentum is None) are not part of the vector: each call gets a fresh copy.
"""

from __future__ import annotations

import bisect
import fnmatch
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from fedexp.errors import ConfigError
from fedexp.models.conv_gemm import install as install_conv_gemm
from fedexp.models.norms import functional_norms
from fedexp.models.norms import momentum
from fedexp.models.norms import tracked_norms
from fedexp.models.norms import updated
from fedexp.models.pool_first import pool_first
from fedexp.transfer import to_device


@dataclass(frozen=True)
class Layout:
    """Names, shapes and offsets of a model's flat vector: parameters, then float buffers.

    Attributes:
        names: entry names (``parameters_to_vector`` order, then the float buffers).
        shapes: their shapes.
        offsets: where each starts in the flat vector.
        numel: d, the length of the flat vector.
        num_params: the trainable prefix ``[0, num_params)``; the rest are buffers.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    num_params: int = -1

    def __post_init__(self) -> None:
        if self.num_params < 0:
            object.__setattr__(self, "num_params", self.numel)
        sizes = tuple(int(torch.Size(shape).numel()) for shape in self.shapes)
        ends = tuple(off + size for off, size in zip(self.offsets, sizes, strict=True))
        object.__setattr__(self, "_sizes", sizes)  # computed once: unflatten runs every step
        object.__setattr__(self, "_ends", ends)
        object.__setattr__(self, "_whole_params", bisect.bisect_right(ends, self.num_params))

    @classmethod
    def of(cls, module: nn.Module) -> Layout:
        """The layout of ``module``'s trainable parameters and floating-point buffers."""
        names, shapes, offsets, total = [], [], [], 0
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(total)
            total += p.numel()
        num_params = total
        for name, b in module.named_buffers():
            if not b.is_floating_point():
                continue
            names.append(name)
            shapes.append(tuple(b.shape))
            offsets.append(total)
            total += b.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), total, num_params)

    @property
    def num_buffers(self) -> int:
        """Entries of the flat vector that are buffers (running statistics)."""
        return self.numel - self.num_params

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped like each entry (parameters, and buffers if present).

        The entries that ``flat`` holds whole, as one :func:`torch.split` (its backward is
        one concatenation; a slice per entry would add a zero-filled d-vector per entry).
        """
        end = flat.shape[-1]
        k = bisect.bisect_right(self._ends, end)  # entries held whole (consecutive from 0)
        if k == 0:
            return {}
        used = self._ends[k - 1]
        parts = torch.split(flat if used == end else flat[:used], self._sizes[:k])
        return {
            n: t.view(shape) for n, shape, t in zip(self.names, self.shapes, parts, strict=False)
        }

    def unflatten_rows(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the rows of a stacked ``[m, d]`` (d ≥ the parameters): ``[m, *shape]`` each.

        The parameters only (:meth:`unflatten` of each row, without :func:`torch.func.vmap`).
        """
        m = flat.shape[0]
        if flat.shape[1] != self.num_params:  # buffers after the parameters
            flat = flat[:, : self.num_params]
        parts = torch.split(flat, self._sizes[: self._whole_params], dim=1)
        named = zip(self.names, self.shapes, parts, strict=False)
        return {n: t.view(m, *shape) for n, shape, t in named}

    def indices(self, patterns: Sequence[str], device: torch.device | str = "cpu") -> torch.Tensor:
        """Flat coordinates of the entries whose name matches any glob pattern."""
        return self.select(lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns), device)

    def matched(
        self, patterns: Sequence[str], key: str, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """:meth:`indices` of patterns a config gave under ``key``, which must match something.

        Patterns that match no entry would silently make every coordinate shared (FedPer
        with a head that matches nothing is FedAvg).

        Raises:
            ConfigError: ``patterns`` is not empty and no entry's name matches any of them.
        """
        idx = self.indices(patterns, device)
        if len(patterns) and idx.numel() == 0:
            shown = ", ".join(self.names[:12]) + (", ..." if len(self.names) > 12 else "")
            raise ConfigError(
                f"{key}={list(patterns)}: no entry of the model matches (glob patterns over "
                f"its entry names: {shown})"
            )
        return idx

    def select(self, keep, device: torch.device | str = "cpu") -> torch.Tensor:  # noqa: ANN001
        """Flat coordinates of the entries ``n`` with ``keep(n)`` true."""
        idx = []
        for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True):
            if keep(name):
                size = int(torch.Size(shape).numel())
                idx.append(torch.arange(off, off + size))
        if not idx:
            return torch.zeros(0, dtype=torch.long, device=device)
        return to_device(torch.cat(idx), device)


def _nhwc(weight: torch.Tensor) -> torch.Tensor:
    """A channels-last copy of a convolution weight (2-D, or 3-D: channels-last-3d).

    [O, I, kh, kw] gets strides (I·kh·kw, 1, kw·I, I); [O, I, kd, kh, kw] the same with depth.
    Written with views and ``contiguous`` so that it also runs under vmap; with I = 1 the data
    order is the same and only the strides change (``contiguous`` alone would keep them).
    """
    o, i, *k = weight.shape
    last = weight.permute(0, *range(2, weight.dim()), 1).contiguous().view(-1).view(o, *k, i)
    return last.permute(0, weight.dim() - 1, *range(1, weight.dim() - 1))


class FlatModel:
    """A module evaluated at a flat vector of parameters and running statistics.

    On the CPU, 2-D convolution weights are handed to the module in channels-last strides
    (``channels_last``): oneDNN's convolutions and PyTorch's max-pooling then run in NHWC,
    and every activation after the first convolution stays NHWC. Measured on issue 14's
    2-conv CNN (one thread, batch 16, forward and backward): 1.3-1.9x a step, the gradient
    equal to the NCHW one up to rounding. 3-D convolution weights go over in channels-last-3d
    strides alike (cubes, ``dataset.dims=3``; a round of a thin 3-D DenseNet on 4 clients'
    16³ cubes: 0.46 s against 0.57 s row by row in NCDHW and 0.80 s vmapped). The copy per
    call is the size of the weights; its backward puts the gradient back in the vector's
    order. Under :func:`torch.func.vmap` the convolutions of stacked weights become grouped
    ones that do not gain from it, so the local solver computes such a model's gradients row
    by row, client by client (:func:`fedexp.engine.solver.steps.rowwise`).

    Args:
        module: the network (its own parameters and buffers are only the initial point).
        device: where the module and every flat vector live.
        channels_last: hand 2-D (3-D) convolution weights over in channels-last(-3d)
            strides; None: on the CPU when the module has a ``Conv2d`` or ``Conv3d``.
        conv_gemm: a cohort's 2-D convolutions as matrix products
            (:mod:`fedexp.models.conv_gemm`), not vmap's grouped ones: for the GPU (with
            ``channels_last`` it does nothing).
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device,
        channels_last: bool | None = None,
        conv_gemm: bool = False,
    ) -> None:
        # ReLUs moved after their max-pooling (the same values and gradients, a quarter of
        # the entries: fedexp.models.pool_first); the module as it is where none is
        self.module = pool_first(module).to(device)
        self.layout = Layout.of(self.module)
        convs = [
            name + ".weight"
            for name, sub in self.module.named_modules()
            if isinstance(sub, nn.Conv2d | nn.Conv3d) and sub.weight.requires_grad
        ]
        if channels_last is None:
            channels_last = torch.device(device).type == "cpu" and bool(convs)
        #: whether 2-D convolution weights are handed over in channels-last strides
        self.channels_last = bool(channels_last and convs)
        self._nhwc = frozenset(convs) if self.channels_last else frozenset()
        #: whether a cohort's 2-D convolutions go as matrix products (:meth:`use_conv_gemm`)
        self.conv_gemm = bool(conv_gemm) and self.use_conv_gemm()
        float_names = set(self.layout.names[len(self._param_names()) :])
        #: integer buffers (e.g. ``num_batches_tracked``), copied fresh into every call
        self.int_buffers = {k: v for k, v in self.module.named_buffers() if k not in float_names}
        self.device = device
        mask = torch.zeros(self.layout.numel, dtype=torch.bool, device=device)
        mask[self.layout.num_params :] = True
        #: True at the buffer coordinates (no gradient; set by the training forward pass)
        self.buffer_mask = mask
        self._norms = tracked_norms(self.module)
        buffer_names = self.layout.names[len(self._param_names()) :]
        #: every float buffer is a BatchNorm's running statistic, updated by a pure function
        #: of the valid rows (:mod:`fedexp.models.norms`): such a model's cohort gradients and
        #: statistics can be vmapped, padded rows left out
        self.functional_stats = bool(buffer_names) and all(
            name.rpartition(".")[0] in self._norms
            and name.rpartition(".")[2] in ("running_mean", "running_var")
            for name in buffer_names
        )
        #: index sets made once (:meth:`indices_once`): key -> coordinates
        self._indices: dict[Hashable, torch.Tensor] = {}

    def use_conv_gemm(self) -> bool:
        """Send a cohort's 2-D convolutions through matrix products (:mod:`.conv_gemm`).

        Never with channels-last weights, whose cohorts train row by row, one model at a
        time, so that no layer would take the path.

        Returns:
            :attr:`conv_gemm`: whether some layer now takes it.
        """
        self.conv_gemm = not self.channels_last and install_conv_gemm(self.module) > 0
        return self.conv_gemm

    def _param_names(self) -> list[str]:
        return [n for n, p in self.module.named_parameters() if p.requires_grad]

    @property
    def has_buffers(self) -> bool:
        """Whether the flat vector holds running statistics."""
        return self.layout.num_buffers > 0

    def indices_once(self, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, made the first time ``key`` is asked for, then kept with the model.

        For coordinate sets that depend only on this model and a choice fixed for the run (an
        algorithm's personal part and its complement): made once, not in every round, where
        each making copies from the host and, for a complement, reads a mask's ``nonzero``
        back, which on a GPU waits for the device's queue.
        """
        found = self._indices.get(key)
        if found is None:
            found = self._indices[key] = make()
        return found

    def module_indices(self, types: tuple[type, ...], device: torch.device | str = "cpu"):
        """Flat coordinates of the entries of every submodule that is one of ``types``."""
        prefixes = [
            name + "." for name, m in self.module.named_modules() if isinstance(m, types) and name
        ]
        return self.layout.select(lambda n: any(n.startswith(p) for p in prefixes), device)

    def initial(self) -> torch.Tensor:
        """The module's own parameters and float buffers as one flat vector (a copy)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        floats = [b for b in self.module.buffers() if b.is_floating_point()]
        return torch.cat([t.detach().reshape(-1) for t in (*params, *floats)]).clone()

    def _tensors(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Views for ``functional_call``: parameters of ``flat``, buffers of a detached copy."""
        n = self.layout.num_params
        views = self.layout.unflatten(flat if flat.shape[-1] == n else flat[:n])
        for name in self._nhwc:
            views[name] = _nhwc(views[name])
        if not self.layout.num_buffers and not self.int_buffers:
            return views, flat[n:]  # no running statistics: nothing to copy
        buffers = flat[n:].detach().clone()
        for name, shape, off in zip(
            self.layout.names, self.layout.shapes, self.layout.offsets, strict=True
        ):
            if off >= n:
                size = int(torch.Size(shape).numel())
                views[name] = buffers[off - n : off - n + size].view(shape)
        views.update({k: v.clone() for k, v in self.int_buffers.items()})
        return views, buffers

    def forward_train(
        self, flat: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and the running statistics the forward pass produced (None: no buffers).

        In training mode BatchNorm updates its running statistics in place; here, with
        :attr:`functional_stats`, they are computed as a function of the batch statistics
        of the valid ``rows`` (a [B] bool mask; None: every row) and returned as the buffer
        part of the flat vector, which also holds under :func:`torch.func.vmap`. Other
        buffers are updated in a copy.
        """
        views, buffers = self._tensors(flat)
        if not self.has_buffers:
            return functional_call(self.module, views, (x,)), None
        if not self.functional_stats:
            return functional_call(self.module, views, (x,)), buffers
        with functional_norms(self._norms, rows) as stats:
            out = functional_call(self.module, views, (x,))
        if not stats:  # evaluation mode: the running statistics as they were
            return out, buffers
        n, pieces = self.layout.num_params, []
        for name, shape, off in zip(
            self.layout.names, self.layout.shapes, self.layout.offsets, strict=True
        ):
            if off < n:
                continue
            old = buffers[off - n : off - n + int(torch.Size(shape).numel())]
            norm, _, attr = name.rpartition(".")
            mean, var = stats[norm]
            stat = (mean if attr == "running_mean" else var).detach().reshape(-1)
            pieces.append(updated(old, stat.to(old.dtype), momentum(self._norms[norm])))
        return out, torch.cat(pieces)

    def forward_with_input(
        self, flat: torch.Tensor, x: torch.Tensor, name: str, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """:meth:`forward_train`, plus the input of the submodule ``name``, as ``[B, -1]``.

        The input a head sees is the body's representation of the batch (MOON's z). A hook
        on the submodule records it for this call only; as a function of ``flat`` it runs
        under :func:`torch.func.vmap` too (one row per client).

        Raises:
            ValueError: the submodule ran other than once in the forward pass.
        """
        seen: list[torch.Tensor] = []

        def record(_module: nn.Module, args: tuple) -> None:
            seen.append(args[0])

        handle = self.module.get_submodule(name).register_forward_pre_hook(record)
        try:
            logits, buffers = self.forward_train(flat, x, rows)
        finally:
            handle.remove()
        if len(seen) != 1:
            raise ValueError(f"submodule {name!r} ran {len(seen)} times in one forward pass")
        return logits, buffers, seen[0].flatten(1)

    @property
    def stacks(self) -> bool:
        """Whether :meth:`forward_stacked` holds.

        The module computes a cohort's logits from stacked parameters itself (its
        ``stacked_forward``, where its ``stacks`` says so) and has no running statistics;
        and its cohorts are vmapped as they are: not channels-last (trained row by row) nor
        with :attr:`conv_gemm` (a VGG8's grouped forward, :mod:`fedexp.models.grouped`).
        """
        return (
            bool(getattr(self.module, "stacks", False))
            and not self.has_buffers
            and not self.channels_last
            and not self.conv_gemm
        )

    def forward_stacked(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The logits of m clients' models ``flat`` ``[m, d]`` on their inputs ``[m, B, ...]``.

        What ``vmap(self)(flat, x)`` gives, by the module's own batched operations (its
        ``stacked_forward``, where :attr:`stacks`; on its ``stacked_params``' views of
        ``flat`` where it has them, else :meth:`Layout.unflatten_rows`'): :func:`torch.func.vmap`
        wraps every call of a small model in work of its own (a FedAvg round of 100
        logistic-regression clients, 5 steps: 7.7 ms vmapped, 5.2 ms stacked;
        docs/bench_peers.md), and a convolution's in permutes and copies of every layer's
        input and output (a VGG8's grouped forward, :mod:`fedexp.models.grouped`: vmap's
        values to rounding).
        """
        own = getattr(self.module, "stacked_params", None)  # its own layout (VGG8's grouped)
        params = self.layout.unflatten_rows(flat) if own is None else own(self.layout, flat)
        return self.module.stacked_forward(params, x)

    def with_buffers(self, flat: torch.Tensor, buffers: torch.Tensor | None) -> torch.Tensor:
        """``flat`` with its buffer part replaced by ``buffers`` (unchanged if None)."""
        if buffers is None:
            return flat
        return torch.cat([flat[: self.layout.num_params], buffers])

    def __call__(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Forward pass of the module at ``flat`` (buffer updates, if any, are discarded)."""
        return self.forward_train(flat, x)[0]
