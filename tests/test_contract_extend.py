"""What a researcher's own method builds on (issue 66): the contract's extension points.

- ``Objective.linear``: a per-client linear term ⟨c_n, θ⟩ (SCAFFOLD's correction, FedDyn's
  −∇L̃_n), the same as writing it into the loss, on every path of the solver;
- ``ctx.senders``: the round's senders whatever the slices (tests/test_memory_budget.py runs
  SCAFFOLD and FedDyn sliced against whole) and ranks;
- ``update_scale`` by part; the names an algorithm file imports, from one module.
"""

from __future__ import annotations

import pytest
import torch

from fedexp.engine.runner import build_engine
from fedexp.engine.solver.objective import Objective
from helpers import cohort_of

pytestmark = pytest.mark.usefixtures("one_thread")


class _WithLinear:
    """The task loss plus ⟨c, θ⟩ written into the loss (``aux["c"]``): the reference."""

    def __init__(self, ctx) -> None:  # noqa: ANN001
        self.ctx = ctx

    def __call__(self, params, x, y, aux, u):  # noqa: ANN001, ANN204
        loss, post = self.ctx.model_loss(params, x, y, aux, u)
        return loss + (aux["c"] * params).sum(), post


@pytest.mark.parametrize(
    ("model", "path"),
    [
        ((), "stacked"),  # logistic regression: the loss's own batched twin
        (("model=mlp", "model.hidden=8"), "stacked"),
        (("model=mlp", "model.hidden=8", "model.norm=batch"), "vmap"),  # running statistics
        (("model=mlp", "model.hidden=8"), "rowwise"),
    ],
    ids=["lr-twin", "mlp-twin", "mlp-batchnorm-vmap", "mlp-rowwise"],
)
def test_a_linear_term_equals_writing_it_into_the_loss(small_cfg, model, path):
    engine = build_engine(small_cfg("algorithm=fedavg", "local_steps=4", *model))
    ctx = engine.ctx
    if path == "rowwise":
        ctx.vmap_ok = False
    clients = [0, 2, 3]
    x = engine.server["x"].expand(len(clients), -1).clone()
    c = 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    base = ctx.model_objective()
    if path != "stacked":
        base = Objective(base.loss, frozen=base.frozen)
    got = ctx.train(x, cohort_of(engine, clients), objective=base.with_linear(c))
    ref = Objective(_WithLinear(ctx), aux={"c": c}, frozen=base.frozen)
    want = ctx.train(x, cohort_of(engine, clients), objective=ref)
    torch.testing.assert_close(got.params, want.params, rtol=1e-5, atol=1e-6)
    moved = ctx.train(x, cohort_of(engine, clients), objective=base)
    assert (got.params - moved.params).abs().max() > 1e-3  # the term did something


def test_linear_terms_add():
    a, b = torch.ones(2, 3), 2 * torch.ones(2, 3)
    obj = Objective(lambda *args: None).with_linear(a).with_linear(b)
    assert torch.equal(obj.linear, a + b)
    assert Objective(lambda *args: None).with_linear(None).linear is None


def test_the_senders_share_is_the_rounds(small_cfg):
    """|S|/N uniform; Σ_S n_n / Σ n_n by samples; the server step reads it after the round."""
    engine = build_engine(small_cfg("algorithm=scaffold", "participation=0.6"))
    engine.run_round()
    senders = engine.ctx.senders
    sizes = [d.num_train for d in engine.clients]
    assert senders.clients == engine.last_sampled
    assert senders.count == len(engine.last_sampled) == 3
    assert senders.share("uniform") == pytest.approx(3 / 5)
    assert senders.samples == sum(sizes[n] for n in senders.clients)
    assert senders.share("samples") == pytest.approx(senders.samples / sum(sizes))


def test_update_scale_by_part():
    from fedexp.contract import part_scale

    assert part_scale("gradient", "anything") == "gradient"
    assert part_scale({"dc": "gradient"}, "dc") == "gradient"
    assert part_scale({"dc": "gradient"}, "dy") == "step"


def test_scaffold_runs_cer_with_each_part_at_its_scale(small_cfg):
    """CER's γ on SCAFFOLD's Δy at the step scale and its Δc at the gradient scale."""
    from fedexp.engine.round import transport

    seen = []
    keep = transport.part_scale
    engine = build_engine(small_cfg("algorithm=scaffold", "compressor=cer"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            transport,
            "part_scale",
            lambda s, name: seen.append((name, keep(s, name))) or keep(s, name),
        )
        engine.run_round()
    assert ("dy", "step") in seen and ("dc", "gradient") in seen


def test_an_algorithm_file_imports_the_contract_from_one_module():
    import fedexp.algorithms.base as base

    for name in ("update_parts", "parts_updates", "Senders", "StackedUpdates", "weighted_mean"):
        assert name in base.__all__ and hasattr(base, name)
