"""Parameters as flat vectors with a layout (MATH §1).

One model instance is reused for every client: its parameters are supplied as views into a
flat vector through :func:`torch.func.functional_call`, so client state is just a vector
(and N clients' state can be one ``[N, d]`` tensor).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call


@dataclass(frozen=True)
class Layout:
    """Names, shapes and offsets of a model's parameters in ``parameters_to_vector`` order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, module: nn.Module) -> Layout:
        """The layout of ``module``'s trainable parameters."""
        names, shapes, offsets, total = [], [], [], 0
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(total)
            total += p.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), total)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped like each parameter."""
        out = {}
        for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True):
            size = 1
            for s in shape:
                size *= s
            out[name] = flat[off : off + size].view(shape)
        return out

    def indices(self, patterns: Sequence[str], device: torch.device | str = "cpu") -> torch.Tensor:
        """Flat coordinates of the parameters whose name matches any glob pattern."""
        idx = []
        for name, shape, off in zip(self.names, self.shapes, self.offsets, strict=True):
            if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                size = int(torch.Size(shape).numel())
                idx.append(torch.arange(off, off + size))
        if not idx:
            return torch.zeros(0, dtype=torch.long, device=device)
        return torch.cat(idx).to(device)


class FlatModel:
    """A module evaluated at a flat parameter vector.

    Args:
        module: the network (its own parameters are only the initial point).
        device: where the module and every parameter vector live.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module.to(device)
        self.layout = Layout.of(self.module)
        self.buffers = dict(self.module.named_buffers())
        self.device = device

    def initial(self) -> torch.Tensor:
        """The module's own parameters as one flat vector (a copy)."""
        return (
            torch.nn.utils.parameters_to_vector(
                [p for p in self.module.parameters() if p.requires_grad]
            )
            .detach()
            .clone()
        )

    def __call__(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Forward pass of the module with parameters ``flat``."""
        params = self.layout.unflatten(flat)
        return functional_call(self.module, {**params, **self.buffers}, (x,))
