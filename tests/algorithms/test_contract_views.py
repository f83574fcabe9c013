"""The contract asks each thing once: ``downlinks`` and ``eval_stack`` for the cohort.

``Algorithm.downlink`` and ``Algorithm.eval_params`` are one client's views of them, derived in
``fedexp/algorithms/base.py``; a subclass that writes a view is refused. The per-algorithm
suites check each method's stack against its views on a trained engine
(``helpers.assert_eval_stack_is_eval_params``); these check the base's defaults and helpers
without an engine.
"""

from __future__ import annotations

import pytest
import torch

from fedexp.algorithms.base import Algorithm
from fedexp.algorithms.base import CohortStates
from fedexp.algorithms.base import StackedUpdates
from fedexp.algorithms.base import broadcast
from fedexp.algorithms.base import gather_rows
from fedexp.algorithms.base import scatter_rows
from fedexp.algorithms.fedavg import FedAvg
from fedexp.algorithms.finetune import FedAvgFT
from fedexp.algorithms.ifca import IFCA
from fedexp.algorithms.local import LocalOnly
from fedexp.algorithms.scaffold import Scaffold


def test_default_downlinks_is_the_global_model_expanded_and_downlink_its_row():
    x = torch.randn(5)
    msgs = FedAvg().downlinks(None, {"x": x}, [0, 2, 7])
    assert isinstance(msgs, StackedUpdates) and msgs.clients == [0, 2, 7]
    assert msgs.stack.shape == (3, 5) and msgs.stack.stride(0) == 0  # one message, not copied
    assert msgs.stack.data_ptr() == x.data_ptr()
    assert torch.equal(FedAvg().downlink(None, {"x": x}, 7), x)
    assert len(FedAvg().downlinks(None, {"x": x}, [])) == 0


def test_named_parts_are_broadcast_part_by_part():
    server = {"x": torch.randn(4), "c": torch.randn(4)}
    msgs = Scaffold().downlinks(None, server, [1, 3])
    assert set(msgs.stack) == {"x", "c"}
    assert all(p.shape == (2, 4) and p.stride(0) == 0 for p in msgs.stack.values())
    one = Scaffold().downlink(None, server, 3)
    assert torch.equal(one["x"], server["x"]) and torch.equal(one["c"], server["c"])
    clusters = torch.randn(3, 4)
    assert broadcast([0, 1], {"clusters": clusters}).stack["clusters"].shape == (2, 3, 4)


def test_nothing_sent_is_none_for_every_client():
    assert dict(LocalOnly().downlinks(None, {}, [0, 4])) == {0: None, 4: None}
    assert LocalOnly().downlink(None, {}, 4) is None


def test_default_eval_stack_is_shared_and_eval_params_and_eval_models_derive_from_it():
    x = torch.randn(6)
    states = CohortStates(2, {"opt.m": torch.randn(2, 6)})
    stack = FedAvg().eval_stack(None, {"x": x}, states, [4, 1])
    assert stack.shape == (2, 6) and stack.stride(0) == 0
    assert torch.equal(FedAvg().eval_params(None, {"x": x}, {}, 4), x)

    class _Cohort:
        clients = [4, 1]

    models = FedAvg().eval_models(None, {"x": x}, states, _Cohort())  # type: ignore[arg-type]
    assert torch.equal(models, stack)


def test_fine_tuned_models_where_clients_have_one_else_the_global_model():
    alg = FedAvgFT(evaluate="last")
    x, ft = torch.zeros(3), torch.arange(12.0).reshape(4, 3)
    has = torch.tensor([True, False, True, False])
    stack = alg.eval_stack(None, {"x": x}, CohortStates(4, {"ft": ft}, {"ft": has}), [0, 1, 2, 3])
    expected = torch.stack([ft[0], x, ft[2], x])
    assert torch.equal(stack, expected)
    for i in range(4):  # one client's view: its own state dict
        state = {"ft": ft[i]} if has[i] else {}
        assert torch.equal(alg.eval_params(None, {"x": x}, state, i), expected[i])
    none = CohortStates(2, {"ft": ft[:2]}, {"ft": torch.tensor([False, False])})
    assert alg.eval_stack(None, {"x": x}, none, [5, 6]).stride(0) == 0  # one plain pass


def test_ifca_last_cluster_of_each_client_and_the_first_before_any():
    alg = IFCA(k=3, evaluate="last")
    clusters = torch.randn(3, 4)
    chosen = torch.tensor([[2], [-1], [1]])
    stack = alg.eval_stack(
        None, {"clusters": clusters}, CohortStates(3, {"cluster": chosen}), [0, 1, 2]
    )
    assert torch.equal(stack, clusters[[2, 0, 1]])
    assert torch.equal(
        alg.eval_params(None, {"clusters": clusters}, {"cluster": chosen[1]}, 1), clusters[0]
    )


def test_server_tables_gathered_and_scattered_by_client():
    table = torch.randn(6, 3)
    assert torch.equal(gather_rows(table, [4, 0, 4]), table[[4, 0, 4]])
    ups = torch.randn(2, 3, dtype=torch.float64)
    out = scatter_rows(table, StackedUpdates([1, 5], ups))
    expected = table.clone()
    expected[1], expected[5] = ups[0].float(), ups[1].float()
    assert torch.equal(out, expected) and out.dtype == table.dtype
    assert torch.equal(scatter_rows(table, {5: ups[1], 1: ups[0]}), expected)  # any order


@pytest.mark.parametrize(
    ("view", "stacked"), [("downlink", "downlinks"), ("eval_params", "eval_stack")]
)
def test_a_subclass_that_writes_one_clients_view_is_refused(view, stacked):
    with pytest.raises(TypeError, match=f"{view}: one client's view is derived; write {stacked}"):
        type("Mine", (FedAvg,), {view: lambda self, *a: None})
    assert issubclass(type("Fine", (Algorithm,), {stacked: lambda self, *a: None}), Algorithm)
