"""The CPU kernel of :func:`fedexp.engine.solver.passes.pass_indices`: the same sums, compiled.

:func:`fedexp.engine.solver.passes.pass_indices` evaluates each index of a cohort's minibatch as a
chain of tensor operations (a Feistel network with cycle walking, then a rotation); on the CPU
those dozens of element-wise passes over an ``[m, B]`` tensor, and the few cycle-walking
rounds on small subsets, cost more than the training step they feed. This numba kernel runs
the identical 64-bit arithmetic (wrapping multiplications, logical shifts), so it returns the
same indices bit for bit (tested against the tensor version).

A row's entries share its key and its Feistel rounds' widths, so the kernel takes each
round over the whole row in a branch-free loop, which the compiler turns into vector
instructions; the entries that cycle walking sends round again (those still ≥ n, about a
fifth of the first pass for n = 100 in a domain of 128) are gathered into a short list and
walked the same way until none is left. One index at a time, with a scalar loop, took twice
as long: 16 ns against 8 ns an index for rows of 32 of 100 samples (`scripts/bench_peers.py`'s
logistic regression), 11.5 against 5.3 ns for rows of 32 of 60,000 (one thread, an Intel
Xeon with AVX-512).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit
from numba import uint64

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
def _feistel(x: np.ndarray, count: int, plan: np.ndarray) -> None:
    """The Feistel network on ``x[:count]`` in place, round by round over the entries.

    ``plan[r]``: round r's (key, a, b, mask of b bits, mask of a bits, shift of F's top
    bits), as :func:`_plan` writes them. Round r maps (L: a bits, R: b bits) to
    (R: b bits, L ⊕ F(R): a bits).
    """
    for r in range(plan.shape[0]):
        key, a, b, low_b, low_a, top = (
            plan[r, 0], plan[r, 1], plan[r, 2], plan[r, 3], plan[r, 4], plan[r, 5]
        )  # fmt: skip
        for j in range(count):
            v = x[j]
            right = v & low_b
            z = (right ^ key) * _MIX1
            z = (z ^ (z >> uint64(32))) * _MIX2
            x[j] = (right << a) | ((v >> b) ^ ((z >> top) & low_a))


@njit(cache=True, inline="always")
def _plan(key: uint64, a: uint64, b: uint64, rounds: np.ndarray, plan: np.ndarray) -> None:
    """Each Feistel round's constants of one key and halves of a and b bits, into ``plan``."""
    for r in range(rounds.shape[0]):
        plan[r, 0] = key ^ rounds[r]
        plan[r, 1] = a
        plan[r, 2] = b
        plan[r, 3] = (uint64(1) << b) - uint64(1)
        plan[r, 4] = (uint64(1) << a) - uint64(1)
        plan[r, 5] = uint64(64) - a if a > 0 else uint64(63)
        a, b = b, a


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
    plan = np.empty((rounds.shape[0], 6), dtype=np.uint64)
    x = np.empty(size, dtype=np.uint64)
    walk = np.empty(size, dtype=np.uint64)  # the entries still out of range, and where
    at = np.empty(size, dtype=np.int64)
    for i in range(keys.shape[0]):
        n = uint64(num[i])
        span, bits = n - uint64(1), uint64(0)
        while span > 0:
            bits += uint64(1)
            span >>= uint64(1)
        a = (bits + uint64(1)) // uint64(2)
        per = (n + uint64(size) - uint64(1)) // uint64(size)  # minibatches an epoch
        epoch = uint64(draws[i]) // per
        start = (uint64(draws[i]) % per) * uint64(size)
        key = _mix64(uint64(keys[i]) ^ (epoch * _GOLDEN) ^ tweak)
        shift = (_mix64(key) >> uint64(1)) % n
        _plan(key, a, bits - a, rounds, plan)
        last = n - uint64(1)
        for j in range(size):  # a short batch's padding: the epoch's last entry
            offset = start + uint64(j)
            x[j] = offset if offset < n else last
        _feistel(x, size, plan)
        count = 0
        for j in range(size):
            if x[j] >= n:
                walk[count] = x[j]
                at[count] = j
                count += 1
        while count > 0:  # cycle walking
            _feistel(walk, count, plan)
            left = 0
            for t in range(count):
                if walk[t] >= n:
                    walk[left] = walk[t]
                    at[left] = at[t]
                    left += 1
                else:
                    x[at[t]] = walk[t]
            count = left
        for j in range(size):  # the rotation
            v = x[j] + shift
            out[i, j] = v - n if v >= n else v


def pass_indices_cpu(
    keys: torch.Tensor, draws: torch.Tensor, size: int, num: torch.Tensor, tweak: int,
    rounds: list[int], pin: bool = False,
) -> torch.Tensor:  # fmt: skip
    """:func:`fedexp.engine.solver.passes.pass_indices` of CPU tensors; keys ``tweak``, ``rounds``.

    ``pin``: written into page-locked memory, whose copy to a GPU need not wait.
    """
    m = keys.shape[0]
    if pin:
        result = torch.empty((m, size), dtype=torch.int64, pin_memory=True)
        out = result.numpy()
    else:
        out = np.empty((m, size), dtype=np.int64)
        result = torch.from_numpy(out)
    _kernel(
        keys.contiguous().numpy().view(np.uint64),
        draws.numpy().astype(np.int64),
        size,
        num.numpy().astype(np.int64),
        np.uint64(tweak % (1 << 64)),
        np.array([r % (1 << 64) for r in rounds], dtype=np.uint64),
        out,
    )
    return result
