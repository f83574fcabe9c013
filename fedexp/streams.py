"""Random streams keyed by (seed, purpose, round, client).

A bottom module, like :mod:`fedexp.contract`: it imports nothing of fedexp's engine, so the
engine, the algorithms, the data, the models, compression, privacy and the simulated system
all draw from it without importing the engine (``tests/test_imports.py``). The solver's
pass permutations, which turn a client's stream into its epochs of minibatches, live with
the solver (:mod:`fedexp.engine.solver.passes`).

Each stream is derived from its key alone (NumPy's SeedSequence hashing), so a client's batches
do not depend on which other clients ran before it, nor on the order the clients run in or
how the engine groups them into cohorts, and a resumed run draws exactly what an
uninterrupted one would: the streams need no state in the checkpoint beyond the seed and the
round.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch

# Purposes: separate streams for the same (round, client).
SAMPLING, CLIENT, INIT, SERVER = 1, 2, 3, 4
#: the streams of work done to evaluate a client (fine-tuning before the test: FedAvg-FT)
EVAL = 5
#: Poisson sampling's coin of each (round, client); the DP noise of clients and of the server
POISSON, PRIVACY_CLIENT, PRIVACY_SERVER = 6, 7, 8
#: a client's device and links, drawn once (``system=lognormal``: (seed, SYSTEM, quantity,
#: client)); whether it is on in a round (``system.availability``: (seed, AVAILABLE, round,
#: client)); ``fedexp.system``
SYSTEM, AVAILABLE = 61, 62


def derive_seed(*key: int) -> int:
    """A 63-bit seed hashed from integer ``key`` parts."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0] >> 1)


def generator(*key: int) -> torch.Generator:
    """A CPU torch generator seeded from ``key``."""
    return torch.Generator().manual_seed(derive_seed(*key))


#: Held while torch's global generator is seeded and drawn from: the stacked runs of a sweep
#: are threads of one process (``fedexp.engine.round.stacking``), and one run's model
#: initialisation must not draw from a generator another run has just seeded.
_GLOBAL = threading.RLock()


@contextlib.contextmanager
def seeded_global(seed: int) -> Iterator[None]:
    """Torch's global CPU generator seeded with ``seed`` inside the block, as it was after.

    For code that draws from the global generator only (layers' ``reset_parameters``); one
    thread at a time.
    """
    with _GLOBAL, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def sample_clients(seed: int, round_: int, num_clients: int, fraction: float) -> list[int]:
    """Clients taking part in ``round_``: ``max(1, round(fraction * N))`` without replacement."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"participation={fraction}: expected a fraction in (0, 1]")
    m = max(1, int(round(fraction * num_clients)))
    if m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(seed, SAMPLING, round_))
    return np.sort(rng.choice(num_clients, size=m, replace=False)).tolist()


# ------------------------------------------------------------ counter-based client streams
def _s64(value: int) -> int:
    """``value`` modulo 2⁶⁴ as a signed 64-bit integer (torch's int64 wraps the same way)."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function of ``x + φ`` on int64 tensors, element-wise.

    SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom number generators",
    OOPSLA 2014) outputs ``mix(state + k·φ)`` for its k-th value; evaluated at any counter it
    is a counter-based generator, so all clients' draws of a step are one tensor expression.
    The multiplications wrap modulo 2⁶⁴ as in the C original.
    """
    z = x + _GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def _mix64_int(x: int) -> int:
    """:func:`mix64` of one signed 64-bit Python integer (the same bits, no tensor)."""
    z = (x + 0x9E3779B97F4A7C15) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return _s64(z ^ (z >> 31))


def stream_keys(
    seed: int, purpose: int, round_: int, clients: torch.Tensor | list[int]
) -> torch.Tensor:
    """63-bit keys of the (seed, purpose, round, client) streams of ``clients`` (int64).

    The (seed, purpose, round) part is hashed on the host and joins the clients' ids as a
    scalar operand: nothing is copied to their device, which a GPU's host would wait for.
    """
    n = torch.as_tensor(clients, dtype=torch.int64)
    head = _mix64_int(_mix64_int(_mix64_int(_s64(seed)) ^ _s64(purpose)) ^ _s64(round_))
    return _srl(mix64(n ^ head), 1)


def poisson_sample(seed: int, round_: int, num_clients: int, rate: float) -> list[int]:
    """Clients taking part in ``round_`` under Poisson sampling (the cohort may be empty).

    Each client takes part independently with probability ``rate``.
    Each client's coin is its own (seed, :data:`POISSON`, round, client) stream's first draw, so
    who takes part does not depend on how the population is split or ordered.
    """
    keys = stream_keys(seed, POISSON, round_, torch.arange(num_clients))
    uniform = _srl(mix64(keys), 11).to(torch.float64) * 2.0**-53
    return torch.nonzero(uniform < rate).flatten().tolist()


def batch_indices(
    keys: torch.Tensor, draws: torch.Tensor, size: int, num: torch.Tensor
) -> torch.Tensor:
    """Minibatch indices of many clients at once, uniform with replacement.

    Row i is the ``draws[i]``-th minibatch of the stream with key ``keys[i]``: ``size``
    indices in ``[0, num[i])``. Each index is a SplitMix64 value of (key, draw, position)
    reduced modulo ``num[i]`` (the bias, below ``num / 2⁶³``, is negligible), so a client's
    batch is the same whether it is drawn alone or with a cohort, on any device.

    Args:
        keys: int64 [m] stream keys (:func:`stream_keys`).
        draws: int64 [m] how many minibatches each stream has drawn before.
        size: indices per row.
        num: int64 [m] the clients' training-set sizes (≥ 1).

    Returns:
        int64 [m, size] on ``keys``' device.
    """
    base = mix64(keys ^ mix64(draws.to(keys.device)))
    pos = torch.arange(size, dtype=torch.int64, device=keys.device) * _GOLDEN
    return _srl(mix64(base[:, None] + pos[None, :]), 1) % num.to(keys.device)[:, None]
