"""A run's state as a checkpoint's tree of tensors, and back.

What a checkpoint holds of an engine (:class:`fedexp.engine.round.engine.Engine`, whose
``state_tree`` and ``load_state_tree`` these are): the server's state, every client's state
(stacked by key, ``fedexp.engine.clients.states``), the channels' memories
(``Engine.transport``'s, each part's rows stacked), each client's best figures over the
evaluated rounds (pFedSOP's protocol), and the DP mechanism's and the simulated clock's states.
The round and the byte ledger's counters go in the checkpoint's metadata, beside the tree.

Over several processes saving is a collective: every rank's clients and memories go to rank
0, which merges them into the whole population's tree. A loaded tree is the whole population,
of which each rank keeps its own clients, so a checkpoint resumes on any number of processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fedexp.engine.clients.part_memory import PartKey
from fedexp.engine.clients.part_memory import merge_memories
from fedexp.engine.clients.states import merge_exports
from fedexp.engine.files.checkpoint import flatten_state
from fedexp.engine.files.checkpoint import unflatten_state

if TYPE_CHECKING:
    from fedexp.engine.round.engine import Engine


def state_tree(engine: Engine) -> dict[str, Any] | None:
    """Every tensor of ``engine``'s state, as a nested dict for ``checkpoint.save``.

    Over several processes a collective: every rank's clients' states and channel memories go
    to rank 0, which gets the whole tree; the other ranks get None.
    """
    clients = engine.client_states.export()
    kinds = engine.transport.memories()
    channel = {d: {k: m[d].export() for k, m in kinds.items()} for d in ("up", "down")}
    if engine.ranks is not None:
        got = engine.ranks.leader_gathers(flatten_state({"c": clients, "m": channel}))
        if got is None:
            return None
        trees = [unflatten_state(g) for g in got]
        clients = merge_exports([t.get("c", {}) for t in trees])
        channel = {
            d: {
                kind: merge_memories([t.get("m", {}).get(d, {}).get(kind, {}) for t in trees])
                for kind in kinds
            }
            for d in ("up", "down")
        }
    tree = {
        "server": engine.server,
        "clients": clients,
        "channel": channel,
        "best": dict(engine.best),
    }
    if engine.privacy is not None:
        tree["privacy"] = engine.privacy.state()
    if engine.clock is not None:
        tree["clock"] = engine.clock.state()
    return tree


def load_state_tree(engine: Engine, tree: dict[str, Any]) -> None:
    """Restore into ``engine`` what :func:`state_tree` saved (not the round nor the ledger)."""
    dev = engine.ctx.device
    engine.server = {k: v.to(dev) for k, v in tree.get("server", {}).items()}
    engine.client_states = engine.fresh_states()
    if "clients" in tree:
        engine.client_states.load(tree["clients"])
    else:  # a checkpoint of a version that saved each client's state on its own
        engine.client_states.load_per_client(tree.get("client", {}))
    _load_memories(engine, tree.get("channel", {}))
    engine.best = {}
    for key, value in tree.get("best", {}).items():
        if isinstance(value, dict):  # the validation split's "val/<m>", saved nested
            for m, t in value.items():
                engine.best[f"{key}/{m}"] = t.to("cpu", torch.float64)
        else:
            engine.best[key] = value.to("cpu", torch.float64)
    if engine.privacy is not None:
        engine.privacy.load_state(tree.get("privacy", {}))
    if engine.clock is not None:
        engine.clock.load_state(tree.get("clock", {}))


def _load_memories(engine: Engine, saved: dict[str, dict[str, Any]]) -> None:
    """The channels' memories emptied, then those ``saved`` (a rank keeps its own clients').

    ``saved``: direction -> kind -> ``PartMemory.export``; older checkpoints saved one tensor
    a (client, part), keyed by :func:`_state_key`.
    """
    transport, share, dev = engine.transport, engine.share, engine.ctx.device
    transport.clear()
    for kind, store in transport.memories().items():
        for d in ("up", "down"):
            tree = saved.get(d, {}).get(kind, {})
            store[d].load({k: v for k, v in tree.items() if isinstance(v, dict)})
            parts: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
            for text, v in tree.items():  # one tensor a (client, part): older checkpoints
                if isinstance(v, dict):
                    continue
                n, name = _parse_key(text)
                if share is None or share.owns(n):  # (a rank: its own)
                    parts.setdefault(name, ([], []))[0].append(n)
                    parts[name][1].append(v.to(dev))
            for name, (clients, values) in parts.items():
                store[d].write(clients, name, values)


def _state_key(key: PartKey) -> str:
    """An older checkpoint's key of a (client, part) memory: ``"<client>[:<part>]"``."""
    n, name = key
    return f"{n}:{name}" if name else str(n)


def _parse_key(text: str) -> PartKey:
    """:func:`_state_key` undone."""
    n, _, name = text.partition(":")
    return int(n), name
