"""The solver's pass permutations: a client's stream as a shuffling ``DataLoader``'s epochs.

A client's round stream (:func:`fedexp.streams.stream_keys`) numbers its minibatch draws;
here draw t becomes the sample indices a shuffling ``DataLoader`` would give at that point
(:func:`pass_indices`: a keyed Feistel permutation of each epoch, with cycle walking), or
uniform draws with replacement (:func:`fedexp.streams.batch_indices`), whichever the run's
``sampling`` says (:func:`minibatch_indices`). :class:`Stream` is one client's stream of a
round as a ``torch.Generator`` that counts its draws. On the CPU a process switches from
the tensor arithmetic to the compiled kernel (:mod:`fedexp.engine.solver.passes_cpu`, bit for
bit the same) once the tensor path has cost what loading the kernel does (rent or buy).
"""

from __future__ import annotations

import torch

from fedexp.streams import _GOLDEN
from fedexp.streams import _MIX1
from fedexp.streams import _MIX2
from fedexp.streams import CLIENT
from fedexp.streams import _s64
from fedexp.streams import _srl
from fedexp.streams import batch_indices
from fedexp.streams import mix64
from fedexp.streams import stream_keys
from fedexp.transfer import to_device

#: rounds of the Feistel network of :func:`pass_indices` (four: Luby and Rackoff's bound for a
#: pseudorandom permutation from pseudorandom round functions)
_FEISTEL_ROUNDS = 4
_ROUND = [_s64((r + 1) * 0x9E3779B97F4A7C15) for r in range(_FEISTEL_ROUNDS)]


def _bit_length(num: torch.Tensor) -> torch.Tensor:
    """Bits of ``num − 1`` (int64, element-wise; 0 for num = 1)."""
    span = (num - 1).clamp(min=0)
    bits = torch.zeros_like(num)
    for shift in (32, 16, 8, 4, 2, 1):  # binary search of the highest set bit
        high = _srl(span, shift) > 0
        bits += high.long() * shift
        span = torch.where(high, _srl(span, shift), span)
    return bits + (span > 0).long()


def _feistel(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """One pass of :func:`_permute`'s network over [0, 2^(a+b)) (L: a bits, R: b bits).

    The round function is the top bits of a multiply-xorshift hash of R and the key (the
    high bits of a product are its best mixed).
    """
    one = torch.ones_like(a)
    keys = [key ^ k for k in _ROUND]
    halves = [(a, b), (b, a)]
    masks = [((one << a) - 1, (one << b) - 1, (64 - a).clamp(max=63))]
    masks.append((masks[0][1], masks[0][0], (64 - b).clamp(max=63)))
    for r in range(_FEISTEL_ROUNDS):  # (L: a bits, R: b bits) -> (R: b bits, L ⊕ F(R): a bits)
        (ka, kb), (mask_a, mask_b, top_a) = halves[r % 2], masks[r % 2]
        right = x & mask_b
        z = (right ^ keys[r]) * _MIX1
        z = (z ^ _srl(z, 32)) * _MIX2
        x = (right << ka) | ((x >> kb) ^ ((z >> top_a) & mask_a))
    return x


def _permute(
    value: torch.Tensor, key: torch.Tensor, bits: torch.Tensor, num: torch.Tensor
) -> torch.Tensor:
    """``value`` (in [0, num)) through a pseudorandom permutation of [0, num), element-wise.

    An unbalanced Feistel network on the k = bitlength(num − 1) bits of the value (halves of
    a = ⌈k/2⌉ and b = ⌊k/2⌋ bits; each of its four rounds maps (L, R) to (R, L ⊕ F(R)), a
    bijection of [0, 2ᵏ) whatever F is: four rounds of pseudorandom F give a pseudorandom
    permutation, Luby and Rackoff 1988), with F a hash of R and the permutation's key;
    values the network sends past ``num`` are walked through it again until they land inside
    (cycle walking, Black and Rogaway, "Ciphers with arbitrary finite domains", CT-RSA 2002),
    which restricts the permutation of [0, 2ᵏ) to one of [0, num). 2ᵏ < 2·num, so fewer than
    two walks are expected per value. On small domains (a few bits a half) a Feistel network
    reaches only part of the permutations, unevenly; a rotation by a key-derived offset
    β ∈ [0, num) after it, v ↦ (v + β) mod num, makes every position's sample exactly
    uniform and evens out the rest (tested on 5 to 100 samples).

    Args:
        value: int64 [m, B], entries in [0, num).
        key: int64 [m, B] the key of each entry's permutation.
        bits: int64 [m, 1] bitlength(num − 1) of each row.
        num: int64 [m, 1] each row's domain size (≥ 1).
    """
    a = (bits + 1) // 2
    b = bits - a
    out = _feistel(value, a, b, key)
    todo = (out >= num).nonzero()
    while todo.numel():  # the few that left [0, num): walk them on
        rows, cols = todo[:, 0], todo[:, 1]
        walked = _feistel(out[rows, cols], a[rows, 0], b[rows, 0], key[rows, cols])
        out[rows, cols] = walked
        todo = todo[walked >= num[rows, 0]]
    out += _srl(mix64(key), 1) % num  # the rotation
    return torch.where(out >= num, out - num, out)


def pass_indices(
    keys: torch.Tensor,
    draws: torch.Tensor,
    size: int,
    num: torch.Tensor,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Minibatch indices of many clients at once, a shuffling ``DataLoader``'s epochs.

    Each client's stream visits its ``num[i]`` samples in epochs, each a fresh pseudorandom
    permutation (keyed by the stream's key and the epoch number) cut into ⌈num/size⌉
    minibatches of ``size``, the last one short (num mod size samples), as a shuffling
    ``DataLoader`` without ``drop_last`` gives them: draw t is batch j = t mod ⌈num/size⌉ of
    epoch e = ⌊t / ⌈num/size⌉⌋, its position c the entry j·size + c of epoch e's
    permutation (:func:`_permute`). Positions past the epoch's end (a short batch's
    padding, :func:`pass_valid`) repeat the epoch's last entry; the solver gives them no
    weight. Counter-based like :func:`fedexp.streams.batch_indices`: a client's batch is the
    same drawn alone or with a cohort, in any grouping, on any device.

    Args:
        keys: int64 [m] stream keys (:func:`fedexp.streams.stream_keys`).
        draws: int64 [m] how many minibatches each stream has drawn before.
        size: indices per row.
        num: int64 [m] the clients' training-set sizes (≥ 1).
        device: where the indices go (default: ``keys``' device). A cohort keeps its keys
            and counters on the host (:class:`fedexp.contract.Cohort`), so that a GPU's
            indices are drawn there without reading the device (:func:`pass_indices_host`).

    Returns:
        int64 [m, size] on ``device``.
    """
    dev = keys.device if device is None else torch.device(device)
    if size > 0 and (dev.type != "cpu" or _compiled(keys.shape[0] * size)):
        return pass_indices_host(keys, draws, size, num, dev)
    return pass_indices_tensor(keys, draws, size, num).to(dev)


def pass_indices_host(
    keys: torch.Tensor,
    draws: torch.Tensor,
    size: int,
    num: torch.Tensor,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`pass_indices` by the compiled kernel on the host, for a cohort on any device.

    On a GPU the tensor path (:func:`pass_indices_tensor`) launches some seventy kernels for
    the Feistel network and as many again for each cycle walk, and reads the count of walked
    entries on the host after each walk: the device check measured a logistic regression's
    round of 100 clients at 1,381 dispatched operations and 16 host synchronisations, 6-7 of
    them the walks (docs/benchmarks.md). Here the kernel
    (:mod:`fedexp.engine.solver.passes_cpu`, bit for bit the tensor arithmetic) draws on
    the host, and the indices go to ``device`` (default: ``keys``') from page-locked memory
    in a copy the host does not wait for. Keys, counters and sizes on the host (a cohort's,
    :class:`fedexp.contract.Cohort`) are read as they are: no synchronisation at all; those
    on a device come over in one read.
    """
    from fedexp.engine.solver.passes_cpu import pass_indices_cpu

    dev = keys.device if device is None else torch.device(device)
    on = {t.device for t in (keys, draws, num)}
    if on == {torch.device("cpu")}:
        host = (keys, draws.to(torch.int64), num.to(torch.int64))
    else:
        at = keys.device
        both = torch.stack((keys, draws.to(at, torch.int64), num.to(at, torch.int64)))
        host = tuple(both.cpu())
    out = pass_indices_cpu(host[0], host[1], size, host[2], _PASS, _ROUND, dev.type == "cuda")
    return out if dev.type == "cpu" else out.to(dev, non_blocking=True)


#: What the CPU's compiled pass kernel (numba, :mod:`fedexp.engine.solver.passes_cpu`) costs a
#: process before its first draw: importing numba and loading the cached kernel, 0.55-0.65 s
#: (docs/benchmarks.md, "Start-up"); and what the tensor path costs a call on the CPU: about
#: 1 ms plus 0.1 µs an index, where the kernel takes 0.02 ms plus 0.015 µs an index.
_KERNEL_START_MS = 600.0
_TENSOR_CALL_MS = 1.0
_TENSOR_INDEX_MS = 1e-4
#: the tensor path's estimated cost so far in this process (at the kernel's start: loaded)
_tensor_spent_ms = 0.0


def _compiled(entries: int) -> bool:
    """Whether this CPU call of ``entries`` indices goes to the compiled kernel.

    Rent or buy: a process draws with the tensor path until what it has spent there reaches
    what loading the kernel costs, then loads it and keeps it. A short run (the default run
    draws 1.1 ms a round) never pays the kernel's 0.6 s start, and a long one pays at most
    that much more than if it had loaded the kernel at once. Both give the same indices bit
    for bit (``tests/test_passes.py``), so which one draws changes no figure. The estimate is
    counted, not timed, so the switch falls at the same call on any machine.
    """
    global _tensor_spent_ms
    if _tensor_spent_ms >= _KERNEL_START_MS:
        return True
    _tensor_spent_ms += _TENSOR_CALL_MS + _TENSOR_INDEX_MS * entries
    return False


def use_compiled_passes() -> None:
    """Draw this process's CPU passes with the compiled kernel from now on.

    For measurements of a run's steady state (benchmarks, the round census), which
    :func:`pass_indices` otherwise reaches after the kernel's start cost's worth of draws.
    """
    global _tensor_spent_ms
    _tensor_spent_ms = _KERNEL_START_MS


def _epoch_positions(
    draws: torch.Tensor, size: int, num: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Epoch ``[m, 1]`` and position in it ``[m, size]`` of each entry of draw ``draws``."""
    per = (num + size - 1) // size  # minibatches an epoch
    d = draws.to(num.device)[:, None]
    offset = (d % per) * size + torch.arange(size, dtype=torch.int64, device=num.device)
    return d // per, offset


def pass_valid(draws: torch.Tensor, size: int, num: torch.Tensor) -> torch.Tensor:
    """Which entries of :func:`pass_indices` are samples, bool [m, size] on ``num``'s device.

    False for the padding of an epoch's short last minibatch (positions ≥ num).
    """
    num = num[:, None]
    return _epoch_positions(draws, size, num)[1] < num


def pass_width(draw: int, size: int, num: int) -> int:
    """How many of draw ``draw``'s ``size`` entries are samples (one client, on the host)."""
    per = -(-num // size)
    return min(size, num - (draw % per) * size)


def pass_indices_tensor(
    keys: torch.Tensor, draws: torch.Tensor, size: int, num: torch.Tensor
) -> torch.Tensor:
    """:func:`pass_indices` as tensor operations (any device; the CPU runs a compiled loop)."""
    dev = keys.device
    num = num.to(dev)[:, None]
    epoch, offset = _epoch_positions(draws, size, num)
    offset = torch.minimum(offset, num - 1)  # a short batch's padding: the epoch's last entry
    key = mix64(keys[:, None] ^ (epoch * _GOLDEN) ^ _PASS).expand(-1, size).contiguous()
    return _permute(offset, key, _bit_length(num), num)


#: tweak of the pass permutations' keys (apart from :func:`fedexp.streams.batch_indices`' draws)
_PASS = _s64(0x5851F42D4C957F2D)

#: how a client's minibatches are drawn: shuffled passes (the papers' epochs) or uniformly
#: with replacement
SAMPLINGS = ("shuffle", "replacement")


def minibatch_indices(
    keys: torch.Tensor,
    draws: torch.Tensor,
    size: int,
    num: torch.Tensor,
    sampling: str,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`pass_indices` ("shuffle") or :func:`fedexp.streams.batch_indices` ("replacement").

    On ``device`` (default: ``keys``'); draws with replacement are made there, the inputs
    copied over without a host wait (:func:`fedexp.transfer.to_device`).
    """
    if sampling == "shuffle":
        return pass_indices(keys, draws, size, num, device)
    if sampling == "replacement":
        if device is None:
            return batch_indices(keys, draws, size, num)
        keys, draws, num = (to_device(t, device) for t in (keys, draws, num))
        return batch_indices(keys, draws, size, num)
    raise ValueError(f"sampling={sampling!r}: expected one of {', '.join(SAMPLINGS)}")


class Stream(torch.Generator):
    """One client's random stream of one round (purpose :data:`fedexp.streams.CLIENT`).

    A CPU ``torch.Generator`` seeded by the stream's key (every draw an algorithm makes with
    it: noise, permutations), which also numbers the client's minibatch draws:
    :meth:`fedexp.data.federated.ClientData.batch` takes its indices from
    :func:`minibatch_indices` at the stream's draw counter, so the local solver draws a whole
    cohort's minibatches of a step at once (:func:`fedexp.engine.solver.steps.draw_batch`) and
    each client gets what its stream gives it alone.

    Args:
        key: the stream's 63-bit key (:func:`fedexp.streams.stream_keys`).
        sampling: how its minibatches are drawn (:data:`SAMPLINGS`, :func:`minibatch_indices`).
    """

    def __new__(cls, key: int, sampling: str = "shuffle") -> Stream:  # noqa: D102
        return super().__new__(cls)

    def __init__(self, key: int, sampling: str = "shuffle") -> None:
        super().__init__()
        self.manual_seed(key)
        self.key = key
        self.sampling = sampling
        #: minibatches drawn so far
        self.draws = 0

    def indices(self, size: int, num: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The next minibatch's indices into ``num`` samples (advances the counter).

        ``size`` of them, or fewer for the short batch that ends an epoch of shuffled passes
        (:func:`pass_width`).
        """
        keys = torch.tensor([self.key], dtype=torch.int64)
        draw = self.draws
        self.draws += 1
        draws = torch.tensor([draw], dtype=torch.int64)
        nums = torch.tensor([num], dtype=torch.int64)
        idx = minibatch_indices(keys, draws, size, nums, self.sampling, device)[0]
        return idx[: pass_width(draw, size, num)] if self.sampling == "shuffle" else idx


def client_streams(
    seed: int, round_: int, clients: list[int], sampling: str = "shuffle"
) -> dict[int, Stream]:
    """The :class:`Stream` of each of ``clients`` in ``round_`` (keys computed at once)."""
    keys = stream_keys(seed, CLIENT, round_, clients).tolist()
    return {n: Stream(k, sampling) for n, k in zip(clients, keys, strict=True)}


def client_stream(seed: int, round_: int, client: int, sampling: str = "shuffle") -> Stream:
    """The :class:`Stream` of one client in ``round_`` (its row of a cohort draws the same)."""
    return client_streams(seed, round_, [client], sampling)[client]
