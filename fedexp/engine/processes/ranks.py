"""One run over several processes (torch.distributed): who owns which client, and the exchanges.

Every rank holds the whole server state and runs the same server step on the same inputs, so
the server needs no broadcast; the clients are split among the ranks (client n belongs to rank
n mod P), each rank runs its own share of the round's cohort, and what the server needs from
them, the decoded uploads, is gathered to every rank in client order. Sampling, minibatches
and DP noise come from each client's own (seed, round, client) stream, so no figure depends on
P but for floating-point summation order.

Tensors cross as safetensors bytes and small records as JSON: nothing is unpickled. The
backend is gloo (CPU); NCCL on GPUs goes through the same calls with CUDA byte buffers.
"""

from __future__ import annotations

import base64
import json
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from fedexp.contract import MeanUpload
from fedexp.contract import Message
from fedexp.contract import parts_updates
from fedexp.contract import update_parts
from fedexp.data.client import client_ids
from fedexp.engine.processes.share import Share

#: How long a collective may wait for a rank before the run fails (a rank that died).
TIMEOUT = timedelta(minutes=10)
#: Bytes a rank sends in :meth:`Ranks.gather_bytes`'s first exchange (a round's records fit).
SHORT = 1 << 14
#: A rank's weighted upload sums up to this many bytes travel with the round's records.
INLINE = 1 << 12


def _encode(named: dict[str, torch.Tensor]) -> bytes:
    """Named tensors as safetensors bytes (CPU copies)."""
    return save_tensors({k: v.detach().cpu().clone() for k, v in named.items()})


class Ranks:
    """This process's place in the run, its rank among ``size`` (:attr:`share`), and the exchanges.

    Args:
        rank: this process's rank.
        size: P, the number of processes.
        device: where the byte buffers of the collectives live (CPU for gloo).
    """

    def __init__(self, rank: int, size: int, device: torch.device | str = "cpu") -> None:
        self.rank, self.size, self.device = rank, size, torch.device(device)

    @classmethod
    def current(cls) -> Ranks | None:
        """The initialised process group as :class:`Ranks`, or None for a single process."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return cls(dist.get_rank(), dist.get_world_size(), device)

    @property
    def share(self) -> Share:
        """This rank's :class:`Share`: the clients whose table rows and states it holds."""
        return Share(self.rank, self.size)

    @property
    def leader(self) -> bool:
        """Rank 0: the one that talks to the tracker and writes the run's files."""
        return self.rank == 0

    def owner(self, client: int) -> int:
        """The rank that runs ``client``."""
        return self.share.owner(client)

    def mine(self, clients: Sequence[int]) -> list[int]:
        """This rank's clients among ``clients``, in their order."""
        return self.share.mine(clients)

    # ------------------------------------------------------------------ exchanges
    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (sizes may differ).

        One ``all_gather`` of a fixed :data:`SHORT`-byte buffer (a length, then the first
        bytes) when every rank's data fit in it, as a round's records do; a second one for
        the rest when one does not. Each collective wakes every rank's communication thread,
        so a round's fixed cost is counted in collectives.
        """
        room = SHORT - 8  # after the length
        head = torch.zeros(SHORT, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = data[:room]
        if first:
            head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        heads = [torch.zeros_like(head, device=self.device) for _ in range(self.size)]
        dist.all_gather(heads, head.to(self.device))
        heads = [h.cpu() for h in heads]
        sizes = [int(h[:8].view(torch.int64)) for h in heads]
        out = [bytes(h[8 : 8 + min(n, room)].numpy()) for h, n in zip(heads, sizes, strict=True)]
        rest = max(sizes) - room
        if rest <= 0:
            return out
        buf = torch.zeros(rest, dtype=torch.uint8)
        tail = data[room:]
        if tail:
            buf[: len(tail)] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
        bufs = [torch.zeros_like(buf, device=self.device) for _ in range(self.size)]
        dist.all_gather(bufs, buf.to(self.device))
        return [
            o + bytes(b[: max(0, n - room)].cpu().numpy())
            for o, b, n in zip(out, bufs, sizes, strict=True)
        ]

    def gather_json(self, record: Any) -> list[Any]:
        """Every rank's JSON-serialisable ``record``, in rank order."""
        return [json.loads(b) for b in self.gather_bytes(json.dumps(record).encode())]

    def gather_tensors(self, named: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every rank's named tensors (CPU copies), in rank order."""
        blob = _encode(named)
        return [load_tensors(b) for b in self.gather_bytes(blob)]

    def leader_gathers(
        self, named: dict[str, torch.Tensor]
    ) -> list[dict[str, torch.Tensor]] | None:
        """Every rank's named tensors (CPU copies), in rank order, to rank 0 alone.

        The others get None: a checkpoint's client states go to rank 0, which writes them,
        and to no other rank. The lengths first (one ``all_gather`` of an int64), then one
        ``gather`` of the bytes, each padded to the longest.
        """
        blob = _encode(named)
        mine = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        lengths = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(lengths, mine)
        sizes = [int(n) for n in lengths]
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        buf = buf.to(self.device)
        bufs = [torch.zeros_like(buf) for _ in range(self.size)] if self.leader else None
        dist.gather(buf, bufs, dst=0)
        if bufs is None:
            return None
        return [load_tensors(bytes(b[:n].cpu().numpy())) for b, n in zip(bufs, sizes, strict=True)]

    def gather_rows(
        self, clients: Sequence[int], mine: Sequence[int], parts: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Each part's rows of every rank, in ``clients`` order.

        ``parts``: this rank's rows ``[len(mine), ...]`` of each part (the same names on every
        rank that has rows); returns ``[len(clients), ...]`` per part, on the parts' device.
        """
        device = next(iter(parts.values())).device if parts else torch.device("cpu")
        got = self.gather_tensors({**parts, "__clients__": client_ids(list(mine))})
        ids = client_ids(list(clients))
        where = torch.full((int(ids.max()) + 1 if len(ids) else 0,), -1, dtype=torch.int64)
        where[ids] = torch.arange(len(ids))  # a client's row in ``clients`` order
        names = sorted({k for g in got for k in g if k != "__clients__"})
        out = {}
        for name in names:
            have = [g for g in got if name in g]  # a rank without rows sends no parts
            rows = torch.cat([g[name] for g in have])
            order = torch.cat([g["__clients__"] for g in have])
            index = where[order]
            full = torch.empty((len(clients), *rows.shape[1:]), dtype=rows.dtype)
            full[index] = rows
            out[name] = full.to(device)
        return out


#: Words of gloo's errors when the other end of a connection went away (gloo raises a plain
#: RuntimeError: ``[.../gloo/transport/tcp/pair.cc:537] Read error [...]: Connection reset
#: by peer``, ``Connection closed by peer``, ``Broken pipe``).
_PEER_GONE = ("closed by peer", "reset by peer", "Broken pipe", "gloo/transport/")


def peer_left(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank left (gloo, NCCL).

    Or the group's start: the rank that left says why in its own error.
    """
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return any(w in text for w in _PEER_GONE)


def add_floats(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each key's sum over the ranks' records (a key missing from one counts 0)."""
    total: dict[str, float] = {}
    for record in records:
        for k, v in record.items():
            total[k] = total.get(k, 0.0) + v
    return total


#: ``IFF_LOOPBACK`` of ``/sys/class/net/<interface>/flags`` (Linux's ``<net/if.h>``).
_IFF_LOOPBACK = 0x8


def loopback_interface() -> str | None:
    """This machine's loopback interface (``lo``; ``lo0`` on macOS), or None if none is found."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        try:
            if int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & _IFF_LOOPBACK:
                return name
        except (OSError, ValueError):
            continue
    return next((n for n in names if n in ("lo", "lo0")), None)


def keep_on_loopback() -> None:
    """The collectives' own sockets on the loopback interface, unless the user named one.

    gloo listens on the address this machine's host name resolves to (often a network
    interface's) and NCCL's bootstrap on the first network interface it finds; on one machine
    the ranks reach each other through loopback alone. ``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` the user set are kept (a run over several machines names the
    interface its nodes share).
    """
    name = loopback_interface()
    if name is None:
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, name)


def listen(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host``'s address alone (its first), on ``port`` (0: any)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(address[:2], family=family)


def make_store(
    rank: int, size: int, host: str, port: int, listener: socket.socket | None = None
) -> dist.TCPStore:
    """The group's key-value store (no authentication): rank 0 serves it on ``host`` alone.

    torch's ``TCPStore`` server listens on every interface (its libuv daemon binds ``::``)
    whatever host it is given, so that anyone who reaches the machine could read and write
    the group's keys while the run lasts. Rank 0 therefore binds ``host:port`` itself
    (``listener``, else :func:`listen`) and hands the socket to the store
    (``master_listen_fd``); the others connect to ``host:port``.
    """
    if rank != 0:
        return dist.TCPStore(host, port, size, is_master=False, timeout=TIMEOUT)
    fd = (listener or listen(host, port)).detach()  # (the store owns the socket from now)
    try:
        return dist.TCPStore(
            host,
            port,
            size,
            is_master=True,
            timeout=TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def init_from_env(backend: str = "auto") -> Ranks | None:
    """Join the process group the environment describes; None when this process runs alone.

    ``torchrun`` (or :mod:`fedexp.engine.processes.launch`) sets ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    if not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=TIMEOUT)
    return Ranks.current()


def gather_uploads(
    ranks: Ranks,
    sampled: list[int],
    senders: list[int],
    updates: Mapping[int, Message],
    refs: dict[str, torch.Tensor],
) -> tuple[Mapping[int, Message], dict[str, torch.Tensor], bool]:
    """Every rank's decoded uploads (and DP references), in ``sampled`` order on every rank.

    Returns (the round's uploads, their references, whether anyone uploaded).
    """
    parts = {f"u/{k}": v for k, v in update_parts(updates, senders).items()} if updates else {}
    parts.update({f"r/{k}": v for k, v in refs.items()})
    got = ranks.gather_rows(sampled, senders, parts)
    ups = {k[2:]: v for k, v in got.items() if k.startswith("u/")}
    refs = {k[2:]: v for k, v in got.items() if k.startswith("r/")}
    if not ups:
        return {}, refs, False
    return parts_updates(ups, sampled), refs, True


def weighted_sums(
    parts: Mapping[str, torch.Tensor], weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Σ_n ω_n u_n over this rank's senders, per part (a row's shape).

    Args:
        parts: this rank's senders' decoded uploads, stacked by part (``update_parts``).
        weights: float64 ``[senders]``: their weights ω_n, in their order.
    """
    out = {}
    for name, v in parts.items():
        w = weights.to(device=v.device, dtype=v.dtype)
        out[name] = (w @ v.reshape(len(w), -1)).reshape(v.shape[1:])
    return out


def sums_record(sums: Mapping[str, torch.Tensor], limit: int = INLINE) -> list:
    """What a rank tells the others of its :func:`weighted_sums`, in the round's records.

    [each part's shape and dtype, the sums themselves (safetensors, base64) when they come to
    at most ``limit`` bytes, else None]. Small sums (a logistic regression's) then cost no
    collective of their own.
    """
    layout = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in sums.items()}
    size = sum(v.numel() * v.element_size() for v in sums.values())
    inline = None
    if sums and size <= limit:
        blob = save_tensors({k: v.detach().cpu().contiguous() for k, v in sums.items()})
        inline = base64.b64encode(blob).decode("ascii")
    return [layout, inline]


def reduce_uploads(
    ranks: Ranks,
    sampled: list[int],
    sums: Mapping[str, torch.Tensor],
    records: Sequence[list],
) -> tuple[Mapping[int, Message], bool]:
    """The round's weighted mean upload: the ranks' :func:`weighted_sums` added.

    For a server that reads the uploads only through Σ_n ω_n u_n (``server_reads="mean"``)
    each rank sends its own senders' weighted sum, not their rows. Sums that came with the
    round's records (:func:`sums_record`) are added here in rank order; larger ones by one
    ``all_reduce`` a dtype. Every rank makes the same choice: it depends only on the parts'
    shapes. Returns that mean as the round's one upload (:class:`MeanUpload`, of weight 1),
    and whether anyone uploaded.

    Args:
        ranks: the run's processes.
        sampled: the round's senders over all ranks, ascending.
        sums: this rank's :func:`weighted_sums` (empty without senders).
        records: every rank's :func:`sums_record`, in rank order.
    """
    known: dict[str, list] = {}
    for layout, _ in records:  # a rank without senders learns the parts here
        known.update(layout)
    if not known:
        return {}, False
    device = next(iter(sums.values())).device if sums else ranks.device
    zeros = {k: torch.zeros(shape, dtype=getattr(torch, d)) for k, (shape, d) in known.items()}
    if all(inline is not None for layout, inline in records if layout):
        total = zeros
        for _, inline in records:
            if inline is not None:
                got = load_tensors(base64.b64decode(inline))
                total = {k: v + got[k] if k in got else v for k, v in total.items()}
        return MeanUpload({k: v.to(device) for k, v in total.items()}, sampled), True
    flats: dict[str, list[torch.Tensor]] = {}  # dtype -> each part's sum, flat
    for name in sorted(known):
        mine = sums[name] if name in sums else zeros[name].to(device)
        flats.setdefault(known[name][1], []).append(mine.reshape(-1))
    out = {}
    for dtype, totals in flats.items():  # one all_reduce a dtype
        wire = torch.cat(totals).to(ranks.device)
        dist.all_reduce(wire)
        wire = wire.to(device)
        names = [k for k in sorted(known) if known[k][1] == dtype]
        for name, piece in zip(names, wire.split([t.numel() for t in totals]), strict=True):
            out[name] = piece.reshape(known[name][0])
    return MeanUpload(out, sampled), True
