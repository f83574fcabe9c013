"""FedRoD against the properties its paper implies (Chen & Chao 2022; docs/algorithms.md)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fedexp.algorithms.fedrod import FedRoD
from fedexp.algorithms.fedrod import class_counts
from fedexp.algorithms.fedrod import cohort_class_counts
from fedexp.algorithms.fedrod import log_priors
from fedexp.algorithms.fedrod import prior_adjusted
from fedexp.contract import Cohort
from fedexp.data.federated import ClientData
from fedexp.engine.clients.pool import TrainPool
from fedexp.engine.runner import build_engine
from fedexp.engine.solver.objective import Objective
from fedexp.errors import ConfigError
from fedexp.models.task import SegmentationTask
from helpers import assert_eval_stack_is_eval_params

MLP = ("model=mlp", "model.hidden=8")


def _rounds(engine, n):
    for _ in range(n):
        metrics = engine.run_round()
    return metrics


def _balanced(clients):
    """Each client's training data cut to the same number of samples of every class."""
    out = []
    for c in clients:
        per_class = [torch.nonzero(c.y_train == k).flatten() for k in range(2)]
        m = min(len(i) for i in per_class)
        idx = torch.sort(torch.cat([i[:m] for i in per_class])).values
        out.append(ClientData(c.x_train[idx], c.y_train[idx], c.x_test, c.y_test))
    return out


# ------------------------------------------------------------------ the loss
def test_balanced_softmax_with_uniform_counts_is_the_task_loss():
    torch.manual_seed(0)
    logits, y = torch.randn(16, 3), torch.randint(3, (16,))
    uniform = log_priors(torch.tensor([7.0, 7.0, 7.0]))
    torch.testing.assert_close(
        F.cross_entropy(prior_adjusted(logits, uniform), y), F.cross_entropy(logits, y)
    )
    one, yb = torch.randn(16, 1), torch.randint(2, (16,)).float()
    bce = F.binary_cross_entropy_with_logits
    adjusted = prior_adjusted(one, log_priors(torch.tensor([4.0, 4.0])))
    assert torch.equal(bce(adjusted[:, 0], yb), bce(one[:, 0], yb))  # log(π1/π0) = 0 exactly


def test_one_logit_balanced_softmax_is_the_two_logit_one_over_zero_and_z():
    torch.manual_seed(1)
    z, y = torch.randn(16, 1), torch.randint(2, (16,))
    log_prior = log_priors(torch.tensor([9.0, 2.0]))
    ours = F.binary_cross_entropy_with_logits(prior_adjusted(z, log_prior)[:, 0], y.float())
    two = torch.cat([torch.zeros_like(z), z], dim=1) + log_prior  # softmax over [0, z] + log π
    torch.testing.assert_close(ours, F.cross_entropy(two, y))


def test_segmentation_logits_are_adjusted_per_pixel_and_empty_classes_floored():
    masks = torch.tensor([[[0, 0], [2, 2]], [[0, 2], [2, 2]]])
    counts = class_counts(masks, 3)
    assert counts.tolist() == [3.0, 0.0, 5.0]  # pixels of each class
    log_prior = log_priors(counts)  # the empty class counts as one pixel
    assert torch.isfinite(log_prior).all()
    torch.testing.assert_close(log_prior.exp(), torch.tensor([3.0, 1.0, 5.0]) / 9)
    logits = torch.randn(2, 3, 2, 2)
    adjusted = prior_adjusted(logits, log_prior)
    torch.testing.assert_close(adjusted[:, 1], logits[:, 1] + log_prior[1])
    task, y2 = SegmentationTask(2), (masks > 0).long()
    uniform = prior_adjusted(logits[:, :2], log_priors(torch.tensor([4.0, 4.0])))
    torch.testing.assert_close(task.loss(uniform, y2), task.loss(logits[:, :2], y2))
    with pytest.raises(ValueError, match="4 outputs for 3 classes"):
        prior_adjusted(torch.randn(2, 4), log_prior)


def test_a_cohorts_class_counts_are_each_clients_own():
    """Read from the pool at once: rows of unequal lengths, an empty client, masks, a label ≥ C."""
    torch.manual_seed(3)
    sizes = [5, 0, 2, 7]
    data = [
        ClientData(torch.randn(n, 1, 2, 2), torch.randint(4, (n, 1, 2, 2)), None, None)
        for n in sizes
    ]
    pool = TrainPool(data)
    rows = torch.tensor([3, 1, 0])
    cohort = Cohort([3, 1, 0], [data[3], data[1], data[0]], rows, rows, rows, pool)
    counts = cohort_class_counts(cohort, 3)
    assert counts.dtype == torch.float32 and counts.shape == (3, 3)
    for row, n in zip(counts, [3, 1, 0], strict=True):
        assert torch.equal(row, class_counts(data[n].y_train, 3))
    assert counts[0].sum() < 7 * 4  # the label 3 ≥ C left out, as class_counts does


def test_counts_of_clients_joining_later_are_their_own(small_cfg):
    e = build_engine(small_cfg("algorithm=fedrod", "participation=0.4"))
    joined = []
    for _ in range(3):
        e.run_round()
        joined.append(sum("counts" in s for s in e.client_states))
    assert 0 < joined[0] < joined[-1]  # a round of kept counts and first participations
    for s, c in zip(e.client_states, e.clients, strict=True):
        if "counts" in s:
            assert torch.equal(s["counts"], class_counts(c.y_train, 2))


def test_gradients_split_as_a_hand_autograd_computation(small_cfg):
    """θ gets only ∇BSM, p only ∇CE(g(z).detach() + p(z.detach())): an independent torch
    computation with the MLP's modules and a separate linear personal head."""
    engine = build_engine(small_cfg("algorithm=fedrod", *MLP))
    ctx, algo, data = engine.ctx, engine.algorithm, engine.clients[0]
    torch.manual_seed(2)
    theta = ctx.model.initial() + 0.1 * torch.randn(ctx.model.layout.numel)
    p = torch.randn(9)  # head.weight (1×8) and head.bias
    counts = class_counts(data.y_train, 2)
    log_prior = log_priors(counts)
    objective = Objective(algo._joint(ctx).loss, aux={"log_prior": log_prior})
    x, y = data.x_train[:20], data.y_train[:20]
    loss, grad, _ = ctx.loss_grad_post(objective, torch.cat([theta, p]), x, y, None)

    net = copy.deepcopy(ctx.model.module)
    torch.nn.utils.vector_to_parameters(theta, net.parameters())
    personal = torch.nn.Linear(8, 1)
    torch.nn.utils.vector_to_parameters(p, personal.parameters())
    z = net.body(x)
    g = net.head(z)
    target = y.float()
    bsm = F.binary_cross_entropy_with_logits(g[:, 0] + log_prior[1] - log_prior[0], target)
    ce = F.binary_cross_entropy_with_logits((g.detach() + personal(z.detach()))[:, 0], target)
    grad_theta = torch.autograd.grad(bsm, list(net.parameters()))
    grad_p = torch.autograd.grad(ce, list(personal.parameters()))
    torch.testing.assert_close(loss, (bsm + ce).detach())
    torch.testing.assert_close(grad[: theta.numel()], torch.cat([t.flatten() for t in grad_theta]))
    torch.testing.assert_close(grad[theta.numel() :], torch.cat([t.flatten() for t in grad_p]))


# ---------------------------------------------- the paper's properties (docs/algorithms.md)
@pytest.mark.parametrize("model", [(), MLP], ids=["logreg", "mlp"])
def test_zero_personal_head_is_the_generic_model_at_round_0(small_cfg, model):
    rod = build_engine(small_cfg("algorithm=fedrod", *model))
    avg = build_engine(small_cfg("algorithm=fedavg", *model))
    assert all(not s["p"].any() for s in rod.client_states)
    (out_rod, rows_rod), (out_avg, rows_avg) = rod.evaluate(), avg.evaluate()

    # FedRoD's per-client vectors go through one vmapped pass, FedAvg's shared one through a
    # plain pass (Engine._evaluate_many): equal up to float rounding
    # rounding; a gain is a difference of two such figures (FedAvg's exactly 0: its personal
    # model is the global one), so it is held to the rounding of the figures it subtracts
    def split(figures: dict) -> tuple[dict, dict]:
        gains = {k: v for k, v in figures.items() if k.startswith("gain/")}
        return {k: v for k, v in figures.items() if k not in gains}, gains

    for a, b in [(out_rod, out_avg), *zip(rows_rod, rows_avg, strict=True)]:
        (a_own, a_gain), (b_own, b_gain) = split(a), split(b)
        assert a_own == pytest.approx(b_own, rel=1e-6, abs=1e-9, nan_ok=True)
        assert a_gain == pytest.approx(b_gain, abs=1e-6, nan_ok=True)
    params = rod.algorithm.eval_params(rod.ctx, rod.server, rod.client_states[0], 0)
    x = rod.clients[0].x_test
    assert torch.equal(rod.algorithm.predict(rod.ctx, params, x), rod.ctx.model(rod.x0, x))


@pytest.mark.parametrize("model", [(), MLP], ids=["logreg", "mlp"])
def test_generic_model_is_fedavg_when_every_client_is_balanced(small_cfg, model):
    """Uniform priors: the BSM loss is the task loss and p never reaches θ, so the server's
    model is FedAvg's bit for bit; with the partition's skewed priors it is not."""
    engines = {}
    for name in ("fedrod", "fedavg"):
        cfg = small_cfg(f"algorithm={name}", *model)
        for balanced in (True, False) if not model else (True,):
            e = build_engine(cfg)
            if balanced:  # the engine trains on its pool: rebuilt of the new data
                e.clients = _balanced(e.clients)
                e.pool = TrainPool.of(e.clients)
            _rounds(e, 3)
            engines[name, balanced] = e
    rod, avg = engines["fedrod", True], engines["fedavg", True]
    assert torch.equal(rod.server["x"], avg.server["x"])
    assert all(s["counts"][0] == s["counts"][1] for s in rod.client_states)
    assert all(s["p"].any() for s in rod.client_states)  # the personal heads did train
    if not model:
        skewed = engines["fedrod", False].server["x"], engines["fedavg", False].server["x"]
        assert not torch.allclose(*skewed)


def test_state_bytes_and_the_two_evaluations(small_cfg):
    e = build_engine(small_cfg("algorithm=fedrod", *MLP, "optimizer.momentum=0.9"))
    m = _rounds(e, 2)
    d = e.x0.numel()
    assert m["bytes/up"] == 5 * 4 * d and m["bytes/down"] == 5 * 4 * d  # p never crosses
    for s, c in zip(e.client_states, e.clients, strict=True):
        assert s["p"].shape == (9,) and s["p"].any()
        assert s["counts"].tolist() == torch.bincount(c.y_train, minlength=2).float().tolist()
        assert s["opt.momentum"].shape == (d + 9,)  # the optimiser state of [θ ; p]
    personal, _ = e.evaluate()
    e.algorithm.evaluate_with = "generic"
    generic, per_client = e.evaluate()
    ref = e.ctx.evaluate(e.server["x"], e.clients[0])["loss"]
    assert per_client[0]["loss"] == pytest.approx(ref, rel=1e-6)
    assert personal["loss/mean"] != generic["loss/mean"]


def test_batchnorm_statistics_follow_the_generic_forward(small_cfg):
    e = build_engine(small_cfg("algorithm=fedrod", *MLP, "model.norm=batch"))
    layout = e.ctx.model.layout
    assert layout.num_buffers == 16
    assert all(s["p"].shape == (9,) for s in e.client_states)  # the head's parameters only
    ctx, n, d = e.ctx, layout.num_params, layout.numel
    ctx.model.module.train()
    x, y, p = e.clients[0].x_train[:16], e.clients[0].y_train[:16], torch.randn(9)
    aux = {"log_prior": log_priors(torch.tensor([3.0, 1.0]))}
    _, post = e.algorithm._joint(ctx).loss(torch.cat([e.x0, p]), x, y, aux, torch.zeros(0))
    assert torch.equal(post[n:d], ctx.model.forward_train(e.x0, x)[1])  # the generic forward's
    assert torch.equal(post[:n], e.x0[:n]) and torch.equal(post[d:], p)
    _rounds(e, 2)
    assert not torch.equal(e.server["x"][n:], e.x0[n:])
    assert torch.isfinite(e.server["x"]).all()


def test_copy_init_and_a_head_that_matches_nothing(small_cfg):
    e = build_engine(small_cfg("algorithm=fedrod", *MLP, "algorithm.personal_init=copy"))
    head = e.ctx.personal_idx
    assert torch.equal(e.client_states[3]["p"], e.x0[head])
    with pytest.raises(ConfigError, match="no entry of the model matches"):
        FedRoD(head=["nothing.*"]).init_client(e.ctx, e.x0, 0)
    with pytest.raises(ValueError, match="personal_init"):
        FedRoD(personal_init="random")


@pytest.mark.parametrize("evaluate_with", ["personal", "generic"])
def test_eval_stack_is_eval_params_client_by_client(small_cfg, evaluate_with):
    cfg = small_cfg(
        "algorithm=fedrod", "participation=0.6", f"algorithm.evaluate_with={evaluate_with}", *MLP
    )
    engine = build_engine(cfg)
    _rounds(engine, 2)
    stack = assert_eval_stack_is_eval_params(engine, personal=False)
    assert (stack.stride(0) == 0) == (evaluate_with == "generic")  # shared: one plain pass
