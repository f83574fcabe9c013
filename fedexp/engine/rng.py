"""Random streams keyed by (seed, purpose, round, client).

Each stream is derived from its key alone (NumPy's SeedSequence hashing), so a client's batches
do not depend on which other clients ran before it, nor on the execution order or backend,
and a resumed run draws exactly what an uninterrupted one would: the streams need no state in
the checkpoint beyond the seed and the round.
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
