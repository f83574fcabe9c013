"""The engine's transport as an object (issue 71, item 3): the ledger it counts into is handed
to it, never swapped on the engine; a round summed in slices reaches the server as its mean
upload, of weight 1."""

from __future__ import annotations

import torch

from fedexp.contract import MeanUpload
from fedexp.engine.round.engine import _ROUND_COPIES
from fedexp.engine.round.exchange import Alone
from fedexp.engine.round.ledger import ByteLedger
from fedexp.engine.round.stages import UplinkStage
from fedexp.engine.runner import build_engine


def test_the_transport_counts_into_the_ledger_it_is_handed(small_cfg):
    engine = build_engine(small_cfg("compressor=stc"))
    transport, mine = engine.transport, ByteLedger()
    g = torch.Generator().manual_seed(0)
    ups = 0.01 * torch.randn(3, engine.x0.numel(), generator=g)
    received = transport.send_cohort("up", [0, 2, 4], ups, 0, mine)
    assert received is not None and received.shape == ups.shape
    assert mine.messages["up"] == 3 and 0 < mine.total["up"] < 3 * 4 * engine.x0.numel()
    assert engine.ledger.messages == {"up": 0, "down": 0}  # the run's: untouched
    assert set(dict(transport.residual["up"].items())) == {(0, ""), (2, ""), (4, "")}
    row, _ = transport.send("down", 1, engine.x0, 0, mine)
    assert mine.messages["down"] == 1 and row.shape == engine.x0.shape


class _OwnLedger(Alone):
    """One process that counts a round in a ledger of its own, as a rank does."""

    def __init__(self) -> None:
        self.rounds: list[ByteLedger] = []

    def round_ledger(self, run: ByteLedger) -> ByteLedger:
        self.rounds.append(ByteLedger())
        return self.rounds[-1]

    def combine(self, who, up, mine, run):
        run.merge([mine.round_record()])
        return super().combine(who, up, mine, run)


class _Spy(UplinkStage):
    def __init__(self, engine) -> None:
        self.engine, self.seen = engine, []

    def client(self, round_, who, up):
        self.seen.append((self.engine.ledger, up.ledger))
        return up


def test_a_round_hands_its_ledger_down_and_never_swaps_the_runs(small_cfg):
    plain = build_engine(small_cfg("compressor=stc", "participation=0.6"))
    engine = build_engine(small_cfg("compressor=stc", "participation=0.6"))
    engine.exchange = _OwnLedger()
    spy = _Spy(engine)
    engine.stages.insert(0, spy)
    run = engine.ledger
    for _ in range(2):
        a, b = plain.run_round(), engine.run_round()
        assert {k: v for k, v in a.items() if k.startswith("bytes/")} == {
            k: v for k, v in b.items() if k.startswith("bytes/")
        }
    assert engine.ledger is run
    assert [s for s, _ in spy.seen] == [run, run]  # the engine's ledger, during the round too
    assert [r for _, r in spy.seen] == engine.exchange.rounds  # the round's, handed down
    assert all(r.messages["up"] == 3 and r.messages["down"] == 3 for r in engine.exchange.rounds)
    assert run.messages == plain.ledger.messages


def test_a_round_in_slices_reaches_the_server_as_its_mean_of_weight_one(small_cfg):
    cfg = ("num_clients=6", "model=mlp", "model.hidden=8")
    whole = build_engine(small_cfg(*cfg))
    x0 = whole.x0  # a budget of two clients' stacks a slice (Engine._round_slices)
    budget = 2.5 * _ROUND_COPIES * x0.numel() * x0.element_size() / 2**30
    sliced = build_engine(small_cfg(*cfg, f"memory_budget={budget}"))
    got = []
    for engine in (whole, sliced):
        inner = engine.algorithm.server_update

        def spy(ctx, server, updates, weights, inner=inner):
            got.append((updates, dict(weights), list(ctx.senders.clients)))
            return inner(ctx, server, updates, weights)

        engine.algorithm.server_update = spy
        engine.run_round()
    (each, w_each, heard), (mean, w_mean, heard_sliced) = got
    assert not isinstance(each, MeanUpload) and len(each) == 6
    assert isinstance(mean, MeanUpload) and w_mean == {0: 1.0} == mean.weights
    assert heard_sliced == heard == list(range(6))  # who sent: the round's senders
    total = sum(w_each[n] * each[n] for n in each)
    torch.testing.assert_close(mean[0], total, rtol=1e-5, atol=1e-6)
