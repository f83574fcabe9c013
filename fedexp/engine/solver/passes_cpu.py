"""The CPU kernel of :func:`fedexp.engine.rng.pass_indices`: the same arithmetic, compiled.

:func:`fedexp.engine.rng.pass_indices` evaluates each index of a cohort's minibatch as a
chain of tensor operations (a Feistel network with cycle walking, then a rotation); on the CPU
those dozens of element-wise passes over an ``[m, B]`` tensor, and the few cycle-walking
rounds on small subsets, cost more than the training step they feed. This numba kernel runs
the identical 64-bit arithmetic (wrapping multiplications, logical shifts) one index at a time
in a loop, so it returns the same indices bit for bit (tested against the tensor version).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, uint64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@njit(cache=True, inline="always")
def _mix64(x: uint64) -> uint64:
    z = x + _GOLDEN
    z = (z ^ (z >> uint64(30))) * _MIX1
    z = (z ^ (z >> uint64(27))) * _MIX2
    return z ^ (z >> uint64(31))


@njit(cache=True, inline="always")
def _feistel(x: uint64, a: uint64, b: uint64, key: uint64, rounds: np.ndarray) -> uint64:
    for r in range(rounds.shape[0]):  # (L: a bits, R: b bits) -> (R: b bits, L ⊕ F(R): a bits)
        right = x & ((uint64(1) << b) - uint64(1))
        z = (right ^ key ^ rounds[r]) * _MIX1
        z = (z ^ (z >> uint64(32))) * _MIX2
        top = uint64(64) - a if a > 0 else uint64(63)
        f = (z >> top) & ((uint64(1) << a) - uint64(1))
        x = (right << a) | ((x >> b) ^ f)
        a, b = b, a
    return x


@njit(cache=True)
def _kernel(
    keys: np.ndarray,
    draws: np.ndarray,
    size: int,
    num: np.ndarray,
    tweak: uint64,
    rounds: np.ndarray,
    out: np.ndarray,
) -> None:
    for i in range(keys.shape[0]):
        n = uint64(num[i])
        span, bits = n - uint64(1), uint64(0)
        while span > 0:
            bits += uint64(1)
            span >>= uint64(1)
        a = (bits + uint64(1)) // uint64(2)
        b = bits - a
        per = (n + uint64(size) - uint64(1)) // uint64(size)  # minibatches an epoch
        epoch = uint64(draws[i]) // per
        start = (uint64(draws[i]) % per) * uint64(size)
        key = _mix64(uint64(keys[i]) ^ (epoch * _GOLDEN) ^ tweak)
        shift = (_mix64(key) >> uint64(1)) % n
        for j in range(size):
            offset = start + uint64(j)
            if offset >= n:  # a short batch's padding: the epoch's last entry
                offset = n - uint64(1)
            v = _feistel(offset, a, b, key, rounds)
            while v >= n:  # cycle walking
                v = _feistel(v, a, b, key, rounds)
            v += shift  # the rotation
            out[i, j] = v - n if v >= n else v


def pass_indices_cpu(
    keys: torch.Tensor, draws: torch.Tensor, size: int, num: torch.Tensor, tweak: int,
    rounds: list[int],
) -> torch.Tensor:  # fmt: skip
    """:func:`fedexp.engine.rng.pass_indices` of CPU tensors (``tweak``, ``rounds``: its keys)."""
    m = keys.shape[0]
    out = np.empty((m, size), dtype=np.int64)
    _kernel(
        keys.contiguous().numpy().view(np.uint64),
        draws.numpy().astype(np.int64),
        size,
        num.numpy().astype(np.int64),
        np.uint64(tweak % (1 << 64)),
        np.array([r % (1 << 64) for r in rounds], dtype=np.uint64),
        out,
    )
    return torch.from_numpy(out)
