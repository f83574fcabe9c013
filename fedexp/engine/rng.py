"""Random streams keyed by (seed, purpose, round, client).

Each stream is derived from its key alone (NumPy's SeedSequence hashing), so a client's batches
do not depend on which other clients ran before it, nor on the order the clients run in or
how the engine groups them into cohorts, and a resumed run draws exactly what an
uninterrupted one would: the streams need no state in the checkpoint beyond the seed and the
round.
"""

from __future__ import annotations

import numpy as np
import torch

# Purposes: separate streams for the same (round, client).
SAMPLING, CLIENT, INIT, SERVER = 1, 2, 3, 4


def derive_seed(*key: int) -> int:
    """A 63-bit seed hashed from integer ``key`` parts."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)[0] >> 1)


def generator(*key: int) -> torch.Generator:
    """A CPU torch generator seeded from ``key``."""
    return torch.Generator().manual_seed(derive_seed(*key))


def sample_clients(seed: int, round_: int, num_clients: int, fraction: float) -> list[int]:
    """Clients taking part in ``round_``: ``max(1, round(fraction * N))`` without replacement."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"participation={fraction}: expected a fraction in (0, 1]")
    m = max(1, int(round(fraction * num_clients)))
    if m >= num_clients:
        return list(range(num_clients))
    rng = np.random.default_rng(derive_seed(seed, SAMPLING, round_))
    return sorted(rng.choice(num_clients, size=m, replace=False).tolist())


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


def stream_keys(
    seed: int, purpose: int, round_: int, clients: torch.Tensor | list[int]
) -> torch.Tensor:
    """63-bit keys of the (seed, purpose, round, client) streams of ``clients`` (int64)."""
    n = torch.as_tensor(clients, dtype=torch.int64)
    head = mix64(mix64(mix64(torch.tensor(_s64(seed), dtype=torch.int64)) ^ purpose) ^ round_)
    return _srl(mix64(head.to(n.device) ^ n), 1)


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


class Stream(torch.Generator):
    """One client's random stream of one round (purpose :data:`CLIENT`).

    A CPU ``torch.Generator`` seeded by the stream's key (every draw an algorithm makes with
    it: noise, permutations), which also numbers the client's minibatch draws:
    :meth:`fedexp.data.federated.ClientData.batch` takes its indices from
    :func:`batch_indices` at the stream's draw counter, so the local solver draws a whole
    cohort's minibatches of a step at once (:func:`fedexp.engine.solver.draw_batch`) and each
    client gets what its stream gives it alone.

    Args:
        key: the stream's 63-bit key (:func:`stream_keys`).
    """

    def __new__(cls, key: int) -> Stream:  # noqa: D102 - torch.Generator takes a device here
        return super().__new__(cls)

    def __init__(self, key: int) -> None:
        super().__init__()
        self.manual_seed(key)
        self.key = key
        #: minibatches drawn so far
        self.draws = 0

    def indices(self, size: int, num: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The next minibatch's ``size`` indices into ``num`` samples (advances the counter)."""
        keys = torch.tensor([self.key], dtype=torch.int64, device=device)
        draws = torch.tensor([self.draws], dtype=torch.int64)
        self.draws += 1
        return batch_indices(keys, draws, size, torch.tensor([num], dtype=torch.int64))[0]


def client_streams(seed: int, round_: int, clients: list[int]) -> dict[int, Stream]:
    """The :class:`Stream` of each of ``clients`` in ``round_`` (keys computed at once)."""
    keys = stream_keys(seed, CLIENT, round_, clients).tolist()
    return {n: Stream(k) for n, k in zip(clients, keys, strict=True)}


def client_stream(seed: int, round_: int, client: int) -> Stream:
    """The :class:`Stream` of one client in ``round_`` (its row of a cohort draws the same)."""
    return client_streams(seed, round_, [client])[client]
