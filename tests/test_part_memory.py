"""The channels' per-client memories (error-feedback residuals, replicas, references) as rows
of state columns (fedexp.engine.clients.part_memory), in memory, on disk and split over ranks."""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.clients.part_memory import PartMemory
from fedexp.engine.processes.share import Share
from fedexp.engine.round.checkpointing import _state_key
from fedexp.engine.runner import build_engine
from helpers import SMALL
from helpers import compose_config


@pytest.fixture(params=["memory", "disk"])
def memory(request, tmp_path) -> PartMemory:
    return PartMemory(10, "cpu", None if request.param == "memory" else tmp_path / "m")


def test_a_memory_reads_as_a_mapping_of_client_and_part(memory):
    assert len(memory) == 0 and (3, "") not in memory and memory.get((3, "")) is None
    memory[3, ""] = torch.ones(4)
    memory.write([1, 7], "head", [torch.full((2,), 1.0), torch.full((2,), 7.0)])
    memory[9, "head"] = torch.arange(3.0)  # another shape: kept aside, still read back
    assert dict(memory.items()).keys() == {(3, ""), (1, "head"), (7, "head"), (9, "head")}
    assert torch.equal(memory[3, ""], torch.ones(4)) and len(memory) == 4
    assert [None if r is None else r.tolist() for r in memory.rows([7, 2, 1], "head")] == [
        [7.0, 7.0],
        None,
        [1.0, 1.0],
    ]
    assert torch.equal(memory[9, "head"], torch.arange(3.0))
    sent = torch.full((4,), 5.0)
    memory[3, ""] = sent
    sent += 1  # the memory holds a copy
    assert memory[3, ""].tolist() == [5.0] * 4
    del memory[1, "head"]
    assert (1, "head") not in memory and (7, "head") in memory
    with pytest.raises(KeyError):
        del memory[1, "head"]


def test_on_disk_each_part_is_files_and_a_rank_holds_its_own_clients(tmp_path):
    disk = PartMemory(10, "cpu", tmp_path / "m")
    disk.write([0, 5], "", [torch.ones(3), torch.zeros(3)])
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["part0"]
    assert any(f.suffix == ".bin" for f in (tmp_path / "m" / "part0").iterdir())
    rank = PartMemory(10, "cpu", None, share=Share(1, 2))
    rank[5, ""] = torch.ones(3)
    assert list(rank) == [(5, "")]
    with pytest.raises(RuntimeError, match="client 4's state is on rank 0: rank 1 of 2"):
        rank[4, ""] = torch.ones(3)


def test_an_engines_channel_memories_live_beside_its_states_on_disk(tmp_path):
    cfg = compose_config(
        *SMALL, "num_clients=6", "compressor=stc", "store=disk", f"store_dir={tmp_path}"
    )
    engine = build_engine(cfg)
    engine.run_round()
    residual = engine.transport.residual["up"]
    assert isinstance(residual, PartMemory) and len(residual) == len(engine.last_sampled)
    files = list(engine.store.rglob("*.bin"))
    assert any("channel" in f.parts and "residual-up" in f.parts for f in files)
    assert any("replica-down" in f.parts for f in files)


def test_a_checkpoint_saves_each_parts_memories_stacked_and_older_ones_still_load(tmp_path):
    cfg = compose_config(*SMALL, "num_clients=6", "compressor=stc", output_dir=tmp_path)
    engine = build_engine(cfg)
    for _ in range(2):
        engine.run_round()
    tree = engine.state_tree()
    saved = tree["channel"]["up"]["residual"]["~"]  # the bare tensor's part, stacked
    held = dict(engine.transport.residual["up"].items())
    assert saved["rows"]["v"].tolist() == sorted(n for n, _ in held)
    assert saved["values"]["v"].shape == (len(held), engine.x0.numel())
    # a checkpoint of the version before saved one tensor a (client, part): "<n>" / "<n>:<part>"
    older = {
        **tree,
        "channel": {
            d: {
                kind: {_state_key(k): v for k, v in memories[d].items()}
                for kind, memories in engine.transport.memories().items()
            }
            for d in ("up", "down")
        },
    }
    for source in (tree, older):
        other = build_engine(cfg)
        other.load_state_tree(source, engine.round, engine.ledger)
        for kind in ("residual", "replica", "reference"):
            for d in ("up", "down"):
                mine = dict(getattr(engine.transport, kind)[d].items())
                theirs = getattr(other.transport, kind)[d]
                assert dict(theirs.items()).keys() == mine.keys()
                assert all(torch.equal(theirs[k], v) for k, v in mine.items())


def test_a_cohorts_memories_are_read_and_written_as_one_stack(memory):
    assert memory.stack([1, 2], "") is None and not memory.has([1, 2], "").any()
    memory.write_stack([4, 1, 8], "", torch.arange(6.0).view(3, 2))
    assert memory.has([1, 2, 4, 8], "").tolist() == [True, False, True, True]
    stack = memory.stack([8, 2, 1], "")  # rows without a memory: zeros
    assert stack.tolist() == [[4.0, 5.0], [0.0, 0.0], [2.0, 3.0]]
    assert torch.equal(memory[4, ""], torch.tensor([0.0, 1.0]))  # the mapping reads the same
    values = torch.ones(2, 2)
    memory.write_stack([2, 4], "", values)
    values += 1  # copied in
    assert memory.stack([2, 4, 1], "").tolist() == [[1.0, 1.0], [1.0, 1.0], [2.0, 3.0]]
    del memory[4, ""]
    assert memory.has([4, 2], "").tolist() == [False, True]
    other = PartMemory(10, "cpu")
    other.load(memory.export())  # a checkpoint's memories: who holds one is known again
    assert other.has(list(range(10)), "").tolist() == [n in (1, 2, 8) for n in range(10)]
    rank = PartMemory(10, "cpu", share=Share(0, 2))
    rank.load(memory.export())  # a rank keeps its own clients
    assert rank.has([2, 8], "").tolist() == [True, True] and len(rank) == 2


def test_a_cohorts_pass_reads_no_memory_row_by_row():
    from fedexp.engine.round.census import Census

    memory = PartMemory(1000, "cpu")
    counts = []
    for m in (10, 500):
        clients = list(range(0, 2 * m, 2))
        memory.write_stack(clients, "", torch.ones(m, 3))
        with Census() as counted:
            memory.write_stack(clients, "", memory.stack(clients, "") + 1)
            memory.has(clients, "")
        counts.append((counted.total_ops, counted.total_reads))
    assert counts[0] == counts[1] and counts[0][1] == 0
