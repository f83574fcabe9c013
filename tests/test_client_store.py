"""The clients' states stacked by key (fedexp.engine.clients.states) and their data as one table
(fedexp.engine.clients.pool.ClientTable), in memory or memory-mapped on disk (issue 25: populations
larger than memory)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedexp.engine.clients.pool import ClientTable
from fedexp.engine.clients.states import ClientStates
from fedexp.engine.clients.states import merge_exports
from fedexp.engine.clients.states import scratch_folder
from fedexp.engine.processes.share import ALONE
from fedexp.engine.processes.share import Share
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.tracking.base import NullTracker
from helpers import compose_config
from helpers import deterministic


def _init(n: int) -> dict[str, torch.Tensor]:
    return {"v": torch.full((3,), float(n)), "k": torch.tensor([n], dtype=torch.int64)}


@pytest.fixture(params=["memory", "disk"])
def store(request, tmp_path) -> ClientStates:
    folder = None if request.param == "memory" else tmp_path / "states"
    return ClientStates(5, _init, "cpu", folder)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def test_a_client_never_written_reads_as_its_initial_state_and_costs_nothing(store):
    assert store.nbytes == 0  # nothing stored before a client is written
    assert all(_equal(store[n], _init(n)) for n in range(5))
    assert _equal(store[-1], _init(4)) and len(store[1:3]) == 2
    with pytest.raises(IndexError):
        store[5]
    assert store.nbytes == 0


def test_written_states_read_back_with_their_keys_dtypes_and_values(store):
    a = {"v": torch.tensor([1.0, 2.0, 3.0]), "opt.m": torch.ones(3, dtype=torch.float64)}
    b = {"v": torch.tensor([4.0, 5.0, 6.0])}  # no optimiser state: the key is unset
    store.write([3, 1], [a, b])
    assert _equal(store[3], a) and _equal(store[1], b)
    assert _equal(store[0], _init(0))  # others untouched
    store[3] = b  # a key missing from the new state goes
    assert _equal(store[3], b)
    # a value whose shape differs from its column's is kept aside, for that client only
    odd = {"v": torch.arange(5.0)}
    store[2] = odd
    assert _equal(store[2], odd) and _equal(store[1], b)
    store[2] = b
    assert _equal(store[2], b)
    assert [sorted(s) for s in store] == [["k", "v"], ["v"], ["v"], ["v"], ["k", "v"]]


def test_export_and_load_carry_the_written_states_only(store, tmp_path):
    store.write([0, 2], [{"v": torch.ones(3)}, {"v": torch.arange(7.0)}])  # 2: loose
    tree = store.export()
    assert tree["written"].tolist() == [0, 2]
    other = ClientStates(5, _init, "cpu", tmp_path / "other")
    other.load(tree)
    assert all(_equal(store[n], other[n]) for n in range(5))
    part = ClientStates(5, _init, "cpu")
    part.load(store.export([2, 3]))  # client 3 was never written: not carried
    assert _equal(part[2], store[2]) and _equal(part[0], _init(0))
    old = ClientStates(5, _init, "cpu")  # a checkpoint of an earlier version: per client
    old.load_per_client({"1": {"v": torch.zeros(3)}})
    assert _equal(old[1], {"v": torch.zeros(3)})


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_each_rank_holds_its_own_clients_states_and_their_exports_merge_to_the_whole(
    where, tmp_path
):
    """Over P processes a rank's columns hold its own clients' rows (n mod P == rank); the
    ranks' exports merged are one process's, and a rank loads its own of a whole export."""
    size, procs = 8, 3
    folder = (lambda r: tmp_path / f"r{r}") if where == "disk" else (lambda r: None)
    whole = ClientStates(size, _init, "cpu", folder("whole"))
    ranks = [
        ClientStates(size, _init, "cpu", folder(r), share=Share(r, procs)) for r in range(procs)
    ]
    written = {n: {"v": torch.full((3,), 10.0 * n), "k": torch.tensor([-n])} for n in (0, 2, 3, 7)}
    written[5] = {"v": torch.arange(4.0)}  # a value that does not fit its column: kept aside
    whole.write(list(written), list(written.values()))
    for r, part in enumerate(ranks):
        own = [n for n in written if n % procs == r]
        part.write(own, [written[n] for n in own])
    merged, one = merge_exports([p.export() for p in ranks]), whole.export()
    assert torch.equal(merged["written"], one["written"]) and merged["loose"].keys() == {"5"}
    for key in one["rows"]:
        assert torch.equal(merged["rows"][key], one["rows"][key])
        assert torch.equal(merged["values"][key], one["values"][key])
    assert ranks[1].nbytes < whole.nbytes  # rows of 3 of the 8 clients
    for r, part in enumerate(ranks):
        fresh = ClientStates(size, _init, "cpu", folder(f"fresh{r}"), share=Share(r, procs))
        fresh.load(one)  # every client's: it keeps its own
        for n in part.own():
            assert _equal(fresh[n], part[n]) and _equal(part[n], whole[n])
    with pytest.raises(RuntimeError, match="client 4's state is on rank 1: rank 0 of 3"):
        ranks[0].rows([0, 4])


def test_a_share_owns_the_clients_n_mod_p_and_one_alone_owns_every_client():
    """:class:`Share`'s arithmetic on ints and arrays agrees; a rank outside [0, P) is refused."""
    share, ids = Share(1, 3), np.arange(10)
    assert share.mine(ids.tolist()) == list(share.own(10)) == [1, 4, 7]
    assert ids[share.owns(ids)].tolist() == [1, 4, 7] and share.owns(4) and not share.owns(5)
    assert share.row(np.array([1, 4, 7])).tolist() == [0, 1, 2] and share.owner(8) == 2
    assert list(ALONE.own(4)) == ALONE.mine(range(4)) == [0, 1, 2, 3]
    assert "rank 1 of 3 holds those of clients n with n mod 3 == 1 only" == share.holds()
    for rank, size in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="expected 0 <= rank < size"):
            Share(rank, size)


def test_a_disk_store_keeps_its_columns_in_files(tmp_path):
    disk = ClientStates(1000, _init, "cpu", tmp_path / "s")
    disk.write(list(range(0, 1000, 10)), [{"v": torch.ones(3)}] * 100)
    files = list((tmp_path / "s").glob("*.bin"))
    assert len(files) == 1 and files[0].stat().st_size == 1000 * 3 * 4
    assert torch.equal(disk[990]["v"], torch.ones(3)) and _equal(disk[991], _init(991))


def test_the_table_reads_each_split_as_views_of_one_array():
    engine = build_engine(compose_config("num_clients=4", "val_fraction=0.25", "device=cpu"))
    table = engine.clients
    assert isinstance(table, ClientTable) and len(table) == 4
    assert engine.pool is table.pool  # the engine's training pool is the table's
    for n, c in enumerate(table):
        assert c.x_train._base is table.pool.x and c.x_test._base is table.test.x
        assert c.num_train == int(table.pool.size[n]) and c.num_val > 0
        assert c.pooled(table.pool).row == n
    with pytest.raises(IndexError):
        table[4]


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm=ditto",),
        ("algorithm=fedrep", "compressor=stc", "participation=0.5"),  # residuals, sub-cohorts
        ("algorithm=ifca", "algorithm.k=2"),  # an integer state
        ("algorithm=pfedsop", "optimizer=adam"),  # optimiser state in the client's
    ],
)
@pytest.mark.slow
def test_a_run_with_its_clients_on_disk_equals_the_run_in_memory(overrides, tmp_path):
    results = {}
    for store in ("memory", "disk"):
        cfg = compose_config(
            *overrides,
            "rounds=3",
            "num_clients=6",
            f"store={store}",
            f"store_dir={tmp_path / 'store'}",
            output_dir=tmp_path / store,
        )
        results[store] = run(cfg, tracker=NullTracker())
    a, b = results["memory"], results["disk"]
    assert a.metrics.pop("time/eval_s") >= 0 and b.metrics.pop("time/eval_s") >= 0
    assert deterministic(a.metrics) == deterministic(b.metrics) and a.per_client == b.per_client
    assert list((tmp_path / "store").iterdir()) == []  # the run's files went with it


def test_a_checkpoint_saves_the_states_stacked_and_resumes(tmp_path):
    args = ("algorithm=ditto", "num_clients=6", "participation=0.5", "store=disk")
    whole = run(compose_config(*args, "rounds=4", output_dir=tmp_path / "a"), tracker=NullTracker())
    run(
        compose_config(*args, "rounds=2", "checkpoint_every=2", output_dir=tmp_path / "b"),
        tracker=NullTracker(),
    )
    ckpt = tmp_path / "b" / "checkpoints"
    cfg = compose_config(*args, "rounds=4", f"resume={ckpt}", output_dir=tmp_path / "c")
    again = run(cfg, tracker=NullTracker())
    assert again.metrics["acc/mean"] == pytest.approx(whole.metrics["acc/mean"], rel=1e-6)


def test_store_settings_a_run_cannot_meet_are_refused_in_one_line(tmp_path):
    assert scratch_folder("memory", None, torch.device("cpu")) is None
    with pytest.raises(ConfigError, match="store=disk.*device=cuda"):
        scratch_folder("disk", None, torch.device("cuda"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=f"store_dir={blocker}/sub"):
        scratch_folder("disk", str(blocker / "sub"), torch.device("cpu"))
    made = scratch_folder("disk", str(tmp_path / "new"), torch.device("cpu"))
    assert made is not None and Path(made).parent == tmp_path / "new"


@pytest.mark.parametrize(
    "overrides", [("algorithm=ditto",), ("algorithm=fedavg_ft", "val_fraction=0.25")]
)
def test_evaluating_the_clients_a_block_at_a_time_changes_no_figure(overrides, monkeypatch):
    from fedexp.engine.round import evaluation

    engine = build_engine(compose_config(*overrides, "num_clients=7", "device=cpu"))
    engine.setup()
    engine.run_round()
    whole = engine.evaluate()
    monkeypatch.setattr(evaluation, "_BLOCK", 3)  # blocks of 3, 3 and 1 clients
    engine.best = {}
    agg, rows = engine.evaluate()
    # (batched forward passes over other clients together: equal up to rounding)
    assert agg == pytest.approx(whole[0], rel=1e-6, abs=1e-9)
    assert len(rows) == len(whole[1]) == 7
    for got, want in zip(rows, whole[1], strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_the_end_of_run_table_lists_the_first_clients_of_a_large_run(capsys, monkeypatch):
    from types import SimpleNamespace

    from fedexp.cli.output import SHOWN_CLIENTS
    from fedexp.cli.output import print_table

    monkeypatch.setenv("COLUMNS", "120")
    row = {"acc": 0.5, "loss": 0.7, "num_test": 2.0}
    result = SimpleNamespace(
        per_client=[row] * (SHOWN_CLIENTS + 1234),
        metrics={"acc/mean": 0.5, "loss/mean": 0.7},
        output_dir=Path("/runs/x"),
        tracker=SimpleNamespace(describe=lambda: "MLflow run"),
    )
    print_table(result)
    out = capsys.readouterr().out
    cells = [ln.split("│")[1].strip() for ln in out.splitlines() if ln.count("│") > 2]
    assert cells[:SHOWN_CLIENTS] == [str(n) for n in range(SHOWN_CLIENTS)]
    assert cells[SHOWN_CLIENTS] == "… 1,234 more" and "/runs/x/clients.csv" in out


def _channel_data() -> tuple:
    """Images with 3 channels over 7 clients of different sizes, client 2 lacking channel 1."""
    from fedexp.data.dataset import ArrayDataset
    from fedexp.data.partitions import ClientSplit

    gen = torch.Generator().manual_seed(3)
    x = torch.rand(120, 3, 4, 4, generator=gen).numpy()
    y = (torch.arange(120) % 3).numpy()
    data = ArrayDataset("toy", x, y, 3)
    bounds = [0, 10, 24, 40, 52, 70, 95, 120]  # clients of 10 to 25 samples

    def partition(**_: object) -> ClientSplit:
        parts = [np.arange(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        return ClientSplit(parts, {2: (1,), 5: (0, 2)})

    return data, partition


@pytest.mark.parametrize("size", [2, 3])
def test_a_ranks_table_holds_its_own_clients_rows_and_every_clients_sizes(size):
    """distributed.nproc: rank r keeps clients n ≡ r (mod P): the same rows as the whole
    table (channels zeroed as there), every client's sizes, and a read of another rank's
    client's rows is refused rather than answered with someone else's values."""
    from fedexp.data.federated import federate

    data, partition = _channel_data()
    args = (data, partition, 7, 0.25, 0, torch.device("cpu"))
    whole = federate(*args, val_fraction=0.2)
    held = 0
    for rank in range(size):
        table = federate(*args, val_fraction=0.2, share=Share(rank, size))
        assert len(table) == len(whole) == 7
        for n in range(7):
            mine, full = table[n], whole[n]
            sizes = (mine.num_train, mine.num_test, mine.num_val)
            assert sizes == (full.num_train, full.num_test, full.num_val)
            if n % size == rank:
                for name in ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val"):
                    assert torch.equal(getattr(mine, name), getattr(full, name)), (n, name)
            else:
                with pytest.raises(RuntimeError, match=f"rank {rank} of {size}"):
                    _ = mine.x_train
                with pytest.raises(RuntimeError, match="another rank"):
                    _ = mine.y_test
        own = [n for n in range(7) if n % size == rank]
        assert table.pool.x.shape[0] == sum(whole[n].num_train for n in own)
        assert torch.equal(table.pool.size, whole.pool.size)
        held += table.pool.x.shape[0] + table.test.x.shape[0] + table.val.x.shape[0]
    assert held == whole.pool.x.shape[0] + whole.test.x.shape[0] + whole.val.x.shape[0]
    assert whole[2].x_train[:, 1].abs().sum() == 0 and whole[2].x_train[:, 0].abs().sum() > 0
