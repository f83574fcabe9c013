"""CP (CANDECOMP/PARAFAC) factors of a model's weight tensors (TDPFed §III-IV, §VII-B).

A weight tensor W ∈ R^{I_1×…×I_N} of rank R is ``[[A^(1), …, A^(N)]] = Σ_r a_r^(1) ∘ … ∘ a_r^(N)``
with factor matrices A^(n) ∈ R^{I_n×R} (TDPFed eq. 4 for a fully connected layer, eq. 6 for a
convolution). The rank follows from the compression rate: CR = ΠI_n / (R·ΣI_n) (eqs. 21-22),
so R = round(ΠI_n / (CR·ΣI_n)) (this rounding reproduces TDPFed's Table I for every layer).

:class:`CPLayout` maps a model's flat vector (``fedexp.models.flat.Layout``) to a flat vector
of factors: every trainable parameter with two or more dimensions (linear and convolution
weights) is replaced by its factor matrices; one-dimensional parameters (biases) and running
statistics are carried as they are (they are not tensors to factorise; TDPFed's compression
rate counts weights only). :meth:`CPLayout.compose` maps factors back to a flat model vector:
differentiable and batched over leading dimensions. :func:`als` fits factors to a tensor by
alternating least squares (Kolda & Bader 2009, §3.4), used to initialise the factors from a
model and, for TDPFed's ACT aggregation, to re-derive factors of an averaged tensor.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedexp.models.flat import Layout


def cp_rank(shape: Sequence[int], rate: float) -> int:
    """The CP rank that compresses a tensor of ``shape`` by ``rate`` (TDPFed eqs. 21-22).

    Args:
        shape: the tensor's dimensions (I_out, I_in) or (I_T, I_S, I_d, I_d); order is free.
        rate: the compression rate CR > 0 (×1.5, ×2, …).

    Returns:
        R = round(ΠI_n / (CR·ΣI_n)), at least 1.
    """
    if rate <= 0:
        raise ValueError(f"compression rate {rate}: expected > 0")
    return max(1, round(math.prod(shape) / (rate * sum(shape))))


def compose(factors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[[A^(1), …, A^(N)]]``: the tensor Σ_r a_r^(1) ∘ … ∘ a_r^(N) (TDPFed eq. 6).

    Args:
        factors: N factor matrices of shape ``(..., I_n, R)`` (common leading batch
            dimensions allowed).

    Returns:
        The tensor of shape ``(..., I_1, …, I_N)``.
    """
    letters = string.ascii_lowercase
    modes = letters[: len(factors)]
    spec = ",".join(f"...{m}z" for m in modes) + f"->...{modes}"
    return torch.einsum(spec, *factors)


def _mttkrp(tensor: torch.Tensor, factors: Sequence[torch.Tensor], n: int) -> torch.Tensor:
    """X_(n) (⊙_{m≠n} A^(m)): the matricised tensor times the Khatri-Rao product."""
    letters = string.ascii_lowercase
    modes = letters[: tensor.dim()]
    ins = [modes] + [f"{modes[m]}z" for m in range(tensor.dim()) if m != n]
    others = [factors[m] for m in range(tensor.dim()) if m != n]
    return torch.einsum(",".join(ins) + f"->{modes[n]}z", tensor, *others)


def als(
    tensor: torch.Tensor, factors: Sequence[torch.Tensor], sweeps: int = 10
) -> list[torch.Tensor]:
    """Alternating least squares sweeps from ``factors`` towards ``tensor`` (Kolda & Bader).

    Each sweep solves, for n = 1..N in turn, A^(n) ← X_(n)(⊙_{m≠n} A^(m)) V_n⁺ with
    V_n = ∗_{m≠n} A^(m)ᵀA^(m) (TDPFed eq. 16: the Hadamard product of the other Gram
    matrices). The pseudo-inverse keeps it defined when R exceeds a dimension.

    Args:
        tensor: the target X (no batch dimension).
        factors: the starting factor matrices (I_n × R); not modified.
        sweeps: the number of sweeps.

    Returns:
        The fitted factor matrices.
    """
    out = [f.detach().clone() for f in factors]
    if tensor.dim() == 1:
        return out
    for _ in range(sweeps):
        for n in range(tensor.dim()):
            rank = out[n].shape[-1]
            gram = torch.ones(rank, rank, dtype=tensor.dtype, device=tensor.device)
            for m in range(tensor.dim()):
                if m != n:
                    gram = gram * (out[m].T @ out[m])
            out[n] = _mttkrp(tensor, out, n) @ torch.linalg.pinv(gram, hermitian=True)
    return out


@dataclass(frozen=True)
class _Entry:
    """One model entry in the factor vector: its factor shapes or a dense block."""

    name: str
    shape: tuple[int, ...]
    model_offset: int
    offset: int
    rank: int  # 0: carried dense

    @property
    def factor_shapes(self) -> list[tuple[int, int]]:
        return [(i, self.rank) for i in self.shape]

    @property
    def size(self) -> int:
        if self.rank == 0:
            return math.prod(self.shape)
        return self.rank * sum(self.shape)


class CPLayout:
    """The factor vector of a model: CP factors of its weights, its other entries as they are.

    Args:
        layout: the model's flat layout.
        rate: the compression rate of every factorised weight (TDPFed's ×1.5, ×2).
        min_dims: entries with fewer dimensions are carried dense (2: biases and statistics).
    """

    def __init__(self, layout: Layout, rate: float, min_dims: int = 2) -> None:
        entries, offset = [], 0
        for name, shape, model_off in zip(layout.names, layout.shapes, layout.offsets, strict=True):
            trainable = model_off < layout.num_params
            rank = cp_rank(shape, rate) if trainable and len(shape) >= min_dims else 0
            entry = _Entry(name, tuple(shape), model_off, offset, rank)
            entries.append(entry)
            offset += entry.size
        self.entries: tuple[_Entry, ...] = tuple(entries)
        self.numel = offset
        self.model_numel = layout.numel
        self.rate = rate

    @property
    def ranks(self) -> dict[str, int]:
        """The CP rank of every factorised entry, by name."""
        return {e.name: e.rank for e in self.entries if e.rank > 0}

    @property
    def num_factor_entries(self) -> int:
        """Σ sizes of the factor matrices (the factorised part of the vector)."""
        return sum(e.size for e in self.entries if e.rank > 0)

    def factors(self, vec: torch.Tensor, entry: _Entry) -> list[torch.Tensor]:
        """Views of ``entry``'s factor matrices in the factor vector ``vec`` (batched ok)."""
        out, off = [], entry.offset
        for rows, rank in entry.factor_shapes:
            block = vec[..., off : off + rows * rank]
            out.append(block.reshape(*vec.shape[:-1], rows, rank))
            off += rows * rank
        return out

    def dense_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """True at the coordinates of the factor vector that are carried dense."""
        mask = torch.zeros(self.numel, dtype=torch.bool, device=device)
        for e in self.entries:
            if e.rank == 0:
                mask[e.offset : e.offset + e.size] = True
        return mask

    def model_mask(self, model_mask: torch.Tensor) -> torch.Tensor:
        """A boolean mask over the model vector moved to the factor vector's dense blocks.

        Used for running statistics: ``model_mask`` is True at buffer coordinates, which are
        always dense; factorised coordinates get False.
        """
        mask = torch.zeros(self.numel, dtype=torch.bool, device=model_mask.device)
        for e in self.entries:
            if e.rank == 0:
                size = e.size
                mask[e.offset : e.offset + size] = model_mask[
                    e.model_offset : e.model_offset + size
                ]
        return mask

    def dense_source(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 [numel]: each dense coordinate's model coordinate (0 at factor coordinates).

        ``model_vec[..., dense_source()]`` puts a model vector's dense entries (biases,
        running statistics) where the factor vector carries them, rows of vectors at once.
        """
        index = torch.zeros(self.numel, dtype=torch.long)
        for e in self.entries:
            if e.rank == 0:
                index[e.offset : e.offset + e.size] = torch.arange(
                    e.model_offset, e.model_offset + e.size
                )
        return index.to(device)

    def compose(self, vec: torch.Tensor) -> torch.Tensor:
        """The model vector ``[[A]]``: every weight composed, the rest copied (batched ok)."""
        parts = []
        for e in self.entries:
            if e.rank == 0:
                parts.append(vec[..., e.offset : e.offset + e.size])
            else:
                full = compose(self.factors(vec, e))
                parts.append(full.reshape(*vec.shape[:-1], -1))
        return torch.cat(parts, dim=-1)

    def decompose(
        self,
        model_vec: torch.Tensor,
        start: torch.Tensor | None = None,
        sweeps: int = 10,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Factors fitted to ``model_vec`` by ALS; dense entries copied.

        Args:
            model_vec: a model vector (no batch dimension).
            start: factors to start the sweeps from (None: a seeded random start, each
                factor N(0, 1) scaled so the composed tensor has the target's norm).
            sweeps: ALS sweeps per weight.
            generator: the random start's stream.
        """
        out = torch.empty(self.numel, dtype=model_vec.dtype, device=model_vec.device)
        for e in self.entries:
            target = model_vec[e.model_offset : e.model_offset + math.prod(e.shape)]
            if e.rank == 0:
                out[e.offset : e.offset + e.size] = target
                continue
            tensor = target.reshape(e.shape)
            if start is not None:
                init = self.factors(start, e)
            else:
                init = [
                    torch.randn(s, generator=generator, dtype=torch.float64).to(tensor)
                    for s in e.factor_shapes
                ]
                norm = compose(init).norm()
                scale = (tensor.norm() / norm).clamp_min(1e-12) ** (1.0 / len(init))
                init = [f * scale for f in init]
            fitted = als(tensor, init, sweeps)
            out[e.offset : e.offset + e.size] = torch.cat([f.reshape(-1) for f in fitted])
        return out
