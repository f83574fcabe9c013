"""Client-level DP on the uplink (fedexp.privacy): the mechanisms' properties and every
algorithm under them (issue: differential privacy for every algorithm's uploads)."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp import streams
from fedexp.contract import StackedUpdates
from fedexp.engine.config_check import check_groups
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.privacy.mechanisms import adaptive_clip
from fedexp.privacy.mechanisms import clip_factors
from fedexp.privacy.mechanisms import joint_norms
from fedexp.privacy.settings import Privacy
from fedexp.privacy.uplink import PrivateUplink
from fedexp.tracking.base import NullTracker
from helpers import CONF
from helpers import SMALL
from helpers import assert_resume_exact
from helpers import compose_config
from helpers import needs
from helpers import run_cli

ALGORITHMS = sorted(p.stem for p in (CONF / "algorithm").glob("*.yaml"))
TINY = [*SMALL, "num_clients=10", "batch_size=8", "tracker=none"]


def _uplink(mode="central", reads="mean", kinds=None, n=50, q=0.2, **kw) -> PrivateUplink:
    return PrivateUplink(Privacy(mode=mode, **kw), reads, kinds or {}, n, q, rounds=10, seed=0)


# ---------------------------------------------------------------- the mechanisms
def test_clipped_norms_never_exceed_the_bound():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(200, 37, generator=g) * torch.logspace(-3, 3, 200)[:, None]
    for bound in (1e-3, 0.5, 1.0, 7.0, 1e3):
        clipped = rows * clip_factors(joint_norms([rows]), bound).to(rows)[:, None]
        assert float(clipped.norm(dim=1).max()) <= bound
        inside = rows.norm(dim=1) <= bound * (1 - 1e-5)
        assert torch.equal(clipped[inside], rows[inside])  # rows within C are left alone
    assert torch.equal(
        clip_factors(joint_norms([rows]), math.inf), torch.ones(200, dtype=torch.float64)
    )


def test_joint_norms_in_blocks_of_rows_are_the_whole_stacks_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    for shapes in ([(5, 300_000)], [(40_000, 31)], [(7, 3), (7, 200_001)], [(0, 5)]):
        parts = [torch.randn(*s, generator=g) for s in shapes]
        whole = torch.sqrt(sum(p.double().square().sum(dim=1) for p in parts))
        assert torch.equal(joint_norms(parts), whole), shapes


def test_named_parts_are_clipped_jointly_and_exact_parts_left_alone():
    up = _uplink(kinds={"a": "update", "b": "update", "c": "exact"}, clip=1.0)
    g = torch.Generator().manual_seed(1)
    parts = {"a": torch.randn(8, 5, generator=g) * 3, "b": torch.randn(8, 2, 3, generator=g)}
    parts["c"] = torch.arange(8.0)
    out, _ = up.client_side(0, list(range(8)), parts, {})
    joint = joint_norms([out["a"], out["b"].reshape(8, -1)])
    assert float(joint.max()) <= 1.0 and float(joint.min()) > 0.99  # every row was above C
    assert torch.equal(out["c"], parts["c"])
    # the direction is kept: each part scaled by the same factor
    ratio = out["a"] / parts["a"]
    torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))


def test_a_model_part_is_clipped_as_its_change_from_what_the_client_received():
    up = _uplink(kinds={"": "model"}, clip=0.5)
    received = torch.full((4, 6), 10.0)
    sent = received + torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    refs = up.references({"": sent}, received, torch.zeros(6))
    out, _ = up.client_side(0, [0, 1, 2, 3], sent, refs)
    assert float((out - received).norm(dim=1).max()) <= 0.5


def test_central_noise_on_the_sum_has_std_z_c_over_the_expected_cohort():
    z, clip, n, q = 1.5, 0.8, 50, 0.2
    up = _uplink(clip=clip, noise_multiplier=z, n=n, q=q)
    clients = [3, 7, 11]
    draws = []
    for t in range(400):
        zeros = StackedUpdates(clients, torch.zeros(3, 64))
        got, weights, _ = up.server_side(t, clients, zeros, {}, lossy=False)
        mean = sum(weights[c] * got[c] for c in clients)
        draws.append(mean)
        rows = torch.stack([got[c] for c in clients])
        assert torch.allclose(rows, rows[:1].expand_as(rows))  # one draw, shared by the rows
    std = float(torch.stack(draws).std())
    assert std == pytest.approx(z * clip / (q * n), rel=0.03)


@pytest.mark.parametrize("mode,reads", [("local", "mean"), ("central", "each")])
def test_noise_on_each_upload_has_std_z_c(mode, reads):
    z, clip = 0.7, 2.0
    up = _uplink(mode=mode, reads=reads, clip=clip, noise_multiplier=z)
    clients = list(range(40))
    zeros = torch.zeros(40, 500)
    if mode == "local":
        noisy, _ = up.client_side(0, clients, zeros, {})
    else:
        got, _, _ = up.server_side(0, clients, StackedUpdates(clients, zeros), {}, lossy=False)
        noisy = got.stack
    assert float(noisy.std()) == pytest.approx(z * clip, rel=0.02)
    assert abs(float(noisy.mean())) < 0.02
    corr = torch.corrcoef(noisy[:5])  # independent across clients
    assert float((corr - torch.eye(5)).abs().max()) < 0.15


@pytest.mark.parametrize("mode,reads", [("local", "mean"), ("central", "each")])
@pytest.mark.parametrize("parts", [("",), ("a", "b")])
def test_a_clients_noise_does_not_depend_on_the_rest_of_its_cohort(mode, reads, parts):
    """Each upload's noise is a function of (seed, round, client, part) alone: the same drawn
    alone or with any cohort; other clients, parts and rounds get other noise. d = 140,001
    spans three of add_gaussian_rows' blocks (an odd d: a pair cut in half)."""
    up = _uplink(mode=mode, reads=reads, clip=1.0, noise_multiplier=0.5)
    d = 140_001

    def noise(t: int, clients: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        rows = {p: torch.zeros(len(clients), d) for p in parts}
        if mode == "local":
            out, _ = up.client_side(t, clients, rows[""] if parts == ("",) else rows, {})
            out = out if isinstance(out, dict) else {"": out}
            return {n: {p: out[p][i] for p in parts} for i, n in enumerate(clients)}
        if parts == ("",):
            sent = StackedUpdates(clients, rows[""])
        else:
            sent = {n: {p: rows[p][i] for p in parts} for i, n in enumerate(clients)}
        got, _, _ = up.server_side(t, clients, sent, {}, lossy=False)
        return {n: {p: got[n] if parts == ("",) else got[n][p] for p in parts} for n in clients}

    alone = noise(2, [7])[7]
    for cohort in ([3, 7, 11], [7, 40], list(range(50))):
        together = noise(2, cohort)[7]
        assert all(torch.equal(alone[p], together[p]) for p in parts), cohort
    first = parts[0]
    assert float(alone[first].std()) == pytest.approx(0.5, rel=0.02)
    assert not torch.equal(noise(3, [7])[7][first], alone[first])  # another round
    assert not torch.equal(noise(2, [7, 8])[8][first], alone[first])  # another client
    if len(parts) == 2:
        assert not torch.equal(alone["a"], alone["b"])  # another part


def test_the_counter_based_gaussian_draws_are_standard_normal():
    from scipy import stats

    from fedexp.privacy.mechanisms import normal_pairs

    keys = streams.stream_keys(0, streams.PRIVACY_CLIENT, 0, list(range(4)))
    draws = normal_pairs(keys, 0, 25_000)
    assert draws.shape == (4, 50_000) and draws.dtype == torch.float64
    for row in draws:
        assert stats.kstest(row.numpy(), "norm").pvalue > 1e-3
    assert torch.equal(normal_pairs(keys, 10, 20), draws[:, 20:40])  # a range: the same draws
    scaled = normal_pairs(keys, 3, 9, std=2.5)
    torch.testing.assert_close(scaled, 2.5 * draws[:, 6:18], rtol=1e-15, atol=0)
    # the documented definition: Box-Muller over SplitMix64's values mix64(key + j·φ)
    j = torch.arange(40, dtype=torch.int64)
    values = streams.mix64(keys[:, None] + j[None, :] * streams._GOLDEN)
    u = (streams._srl(values, 11).double() + 0.5) * 2.0**-53
    radius, angle = torch.sqrt(-2 * torch.log(u[:, 0::2])), 2 * math.pi * u[:, 1::2]
    pairs = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=2)
    assert torch.equal(pairs.flatten(1), draws[:, :40])


def test_a_lossy_codec_cannot_send_more_than_c_to_the_sum():
    up = _uplink(clip=1.0, noise_multiplier=0.0, sampling="fixed", n=4, q=1.0)
    clients = [0, 1, 2, 3]
    big = StackedUpdates(clients, torch.full((4, 9), 5.0))  # what error feedback may decode
    got, _, _ = up.server_side(0, clients, big, {}, lossy=True)
    assert float(got.stack.norm(dim=1).max()) <= 1.0


def test_adaptive_clip_moves_toward_the_target_quantile():
    # all updates unclipped (b̄ = 1 > γ): C shrinks; none (b̄ = 0): C grows; at γ: unchanged
    assert adaptive_clip(1.0, 10, 10, 10, 0.0, 0.5, 0.2) == pytest.approx(math.exp(-0.1))
    assert adaptive_clip(1.0, 0, 10, 10, 0.0, 0.5, 0.2) == pytest.approx(math.exp(0.1))
    assert adaptive_clip(1.0, 5, 10, 10, 0.0, 0.5, 0.2) == pytest.approx(1.0)


def test_adaptive_clipping_tracks_the_median_norm():
    """Andrew et al. 2021: with γ = ½ the bound settles at the median of the update norms."""
    up = _uplink(
        clip=0.01,
        noise_multiplier=0.0,
        adaptive=True,
        sampling="fixed",
        n=200,
        q=1.0,
        count_stddev=1e-6,
        clip_lr=0.2,
    )
    g = torch.Generator().manual_seed(3)
    clients = list(range(200))
    norms = torch.logspace(-1, 1, 200)  # median ≈ 1
    for t in range(300):
        rows = torch.randn(200, 16, generator=g)
        rows = rows / rows.norm(dim=1, keepdim=True) * norms[:, None]
        _, counts = up.client_side(t, clients, rows, {})
        up.end_round(t, clients, True, counts)
    assert up.clip == pytest.approx(float(norms.median()), rel=0.1)


def test_poisson_sampling_rate_and_independence_from_the_population_order():
    draws = [len(streams.poisson_sample(0, t, 1000, 0.1)) for t in range(200)]
    assert sum(draws) / len(draws) == pytest.approx(100, rel=0.03)
    a = streams.poisson_sample(5, 3, 1000, 0.1)
    b = streams.poisson_sample(5, 3, 2000, 0.1)  # a bigger population: the first 1000 coins agree
    assert a == [n for n in b if n < 1000]


# ---------------------------------------------------------------- runs
def _final_server(cfg) -> dict[str, torch.Tensor]:
    engine = build_engine(cfg)
    engine.setup()
    for _ in range(3):
        engine.run_round()
    return engine.server


@pytest.mark.parametrize("algorithm", ["fedavg", "fedamp", "feddwa", "ifca", "pfednet", "tdpfed"])
def test_no_noise_and_no_clipping_is_the_run_without_dp_exactly(algorithm):
    extra = ["algorithm.k=3"] if algorithm == "pfednet" else []
    if "weighting" in compose_config(f"algorithm={algorithm}").algorithm:
        extra.append("algorithm.weighting=uniform")  # a DP run weighs uniformly
    base = [*TINY, f"algorithm={algorithm}", "participation=0.5", *extra]
    plain = _final_server(compose_config(*base))
    dp = _final_server(
        compose_config(
            *base,
            "privacy=central",
            "privacy.noise_multiplier=0",
            "privacy.clip=inf",
            "privacy.sampling=fixed",
        )
    )
    assert plain.keys() == dp.keys()
    for key in plain:
        assert torch.equal(plain[key], dp[key]), key


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_runs_with_central_dp(algorithm, tmp_path):
    extra = ["algorithm.k=3"] if algorithm == "pfednet" else []
    cfg = compose_config(
        *TINY,
        f"algorithm={algorithm}",
        "privacy=central",
        "participation=0.5",
        *extra,
        *needs(algorithm),
        output_dir=tmp_path,
    )
    tracker = NullTracker()
    result = run(cfg, tracker=tracker)
    assert math.isfinite(result.metrics["acc/mean"])
    eps = [v for _, v in sorted(tracker.metrics["privacy/epsilon"].items())]
    if algorithm == "local":  # nothing leaves a client: nothing spent
        assert eps == [0.0, 0.0, 0.0]
    else:
        assert len(eps) == 3 and all(0 < a <= b for a, b in zip(eps, eps[1:], strict=False))


def test_the_servers_that_declare_mean_read_only_the_weighted_mean(monkeypatch):
    """server_reads == "mean" (central DP then noises the sum once) is a claim about
    server_update: given rows with the same weighted mean, from other clients, with other
    weights, it returns the same state. FedAMP (declared "each") must fail the same check,
    so the check can fail."""
    checked = []
    for algorithm in [*ALGORITHMS, "fedamp"]:
        engine = build_engine(
            compose_config(*TINY, f"algorithm={algorithm}", "participation=0.5", *needs(algorithm))
        )
        engine.setup()
        if engine.algorithm.server_reads != "mean" and algorithm != "fedamp":
            continue
        seen = {}
        real = engine.algorithm.server_update

        def spy(ctx, server, updates, weights, seen=seen, real=real):
            seen.update(server=dict(server), updates=dict(updates), weights=dict(weights))
            return real(ctx, server, updates, weights)

        monkeypatch.setattr(engine.algorithm, "server_update", spy)
        engine.run_round()
        engine.run_round()
        monkeypatch.undo()
        if not seen["updates"]:
            continue  # uploads nothing (local training)
        up, w = seen["updates"], seen["weights"]
        first = next(iter(up.values()))
        if isinstance(first, dict):
            mean = {k: sum(w[n] * up[n][k] for n in up) for k in first}
        else:
            mean = sum(w[n] * up[n] for n in up)
        others = [n for n in range(10) if n not in up][: len(up)] or list(up)
        same = {n: mean for n in others}
        weights = {n: 1 / len(others) for n in others}
        a = engine.algorithm.server_update(engine.ctx, seen["server"], up, w)
        b = engine.algorithm.server_update(engine.ctx, seen["server"], same, weights)
        equal = all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
        assert equal == (algorithm != "fedamp"), algorithm
        checked.append(algorithm)
    assert "fedavg" in checked and "fedamp" in checked and len(checked) >= 10


def test_an_empty_poisson_cohort_releases_the_noise_alone():
    """The analysed mechanism adds N(0, z²C²) to the (empty) sum and divides by E: a round
    without clients moves FedAvg's model by that noise, of std zC/E, from the server's stream
    (before: the model was left as it was)."""
    z, clip = 2.0, 0.5
    cfg = compose_config(
        *TINY,
        "privacy=central",
        "participation=0.01",
        "num_clients=10",
        f"privacy.noise_multiplier={z}",
        f"privacy.clip={clip}",
    )
    engine = build_engine(cfg)
    engine.setup()
    expected = 0.01 * 10  # E = qN
    empty = [t for t in range(60) if not streams.poisson_sample(0, t, 10, 0.01)][:12]
    moves = []
    for t in empty:
        before = engine.server["x"].clone()
        engine.round = t
        metrics = engine.run_round()
        assert metrics["clients/sampled"] == 0 and metrics["privacy/epsilon"] > 0
        assert metrics["privacy/noise_std"] == pytest.approx(z * clip / expected)
        move = (before - engine.server["x"]) / engine.algorithm.server_lr
        gen = streams.generator(0, streams.PRIVACY_SERVER, t)
        draw = torch.randn(move.numel(), generator=gen, dtype=torch.float64) * z * clip / expected
        assert torch.allclose(move.double(), draw, rtol=1e-5, atol=1e-5)
        moves.append(move)
    std = float(torch.cat(moves).double().std())
    assert std == pytest.approx(z * clip / expected, rel=0.15)  # 12 rounds x 31 coordinates


def test_an_empty_cohort_releases_nothing_where_no_sum_is_noised():
    each = _uplink(reads="each")
    assert each.empty_release(3, torch.ones(4)) == ({}, {}, {"privacy/clip": 1.0})
    summed = _uplink()
    assert summed.empty_release(3, None)[0] == {}  # the algorithm sends nothing
    updates, weights, _ = summed.empty_release(3, {"a": torch.ones(4), "b": torch.ones(2)})
    assert weights == {0: 1.0} and set(updates[0]) == {"a", "b"}
    assert not torch.equal(updates[0]["a"], updates[0]["b"][:2].repeat(2))  # a draw per part


def test_a_dp_run_with_adaptive_clipping_resumes_exactly(tmp_path):
    cfg = compose_config(
        *TINY,
        "rounds=5",
        "checkpoint_every=1",
        "privacy=adaptive",
        "privacy.count_stddev=1",
        "participation=0.5",
        output_dir=tmp_path / "a",
    )
    assert_resume_exact(cfg, tmp_path, stop_at=3)


@pytest.mark.parametrize(
    "override,expected",
    [
        ("privacy.clip=-1", "privacy.clip=-1"),
        ("privacy.noise_multiplier=nan", "privacy.noise_multiplier=nan"),
        ("privacy.delta=1", "privacy.delta=1"),
        ("privacy.sampling=shuffled", "privacy.sampling='shuffled'"),
        ("privacy.mode=global", "privacy.mode='global'"),
    ],
)
def test_bad_privacy_settings_are_refused_with_the_key_named(override, expected):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("'", "'?")):
        build_engine(compose_config(*TINY, "privacy=central", override))


def test_settings_an_algorithm_cannot_meet_are_refused():
    with pytest.raises(ConfigError, match="reads each upload"):
        build_engine(compose_config(*TINY, "privacy=adaptive", "algorithm=fedamp"))
    with pytest.raises(ConfigError, match="count_stddev"):
        build_engine(compose_config(*TINY, "privacy=adaptive", "privacy.count_stddev=0.1"))


# ---------------------------------------------------------------- fixed for a run's life
def _checkpointed(tmp_path, *privacy: str):
    cfg = compose_config(
        *TINY, "rounds=2", "checkpoint_every=1", *privacy, output_dir=tmp_path / "first"
    )
    run(cfg, tracker=NullTracker())
    return tmp_path / "first" / "checkpoints"


@pytest.mark.parametrize(
    ("first", "resumed", "key", "old", "new"),
    [
        ([], ["privacy=central"], "privacy.mode", "none", "central"),  # adding DP
        (["privacy=central"], [], "privacy.mode", "central", "none"),  # dropping it
        (["privacy=central"], ["privacy=central", "privacy.clip=2"], "privacy.clip", "1.0", "2"),
        (
            ["privacy=central", "privacy.target_epsilon=5"],
            ["privacy=central", "privacy.target_epsilon=5", "rounds=4"],
            "rounds",
            "2",
            "4",
        ),
    ],
)
def test_a_resume_with_other_dp_settings_is_refused(tmp_path, first, resumed, key, old, new):
    folder = _checkpointed(tmp_path, *first)
    cfg = compose_config(
        *TINY, "rounds=3", *resumed, f"resume={folder}", output_dir=tmp_path / "again"
    )
    with pytest.raises(ConfigError) as err:
        run(cfg, tracker=NullTracker())
    message = str(err.value)
    assert f"{key}={new} but the checkpoint's run has {key}={old}" in message
    assert "\n" not in message


def test_a_resume_with_the_same_dp_settings_goes_on_and_keeps_its_tag(tmp_path):
    folder = _checkpointed(tmp_path, "privacy=adaptive", "privacy.count_stddev=1")
    cfg = compose_config(
        *TINY,
        "rounds=3",
        "privacy=adaptive",
        "privacy.count_stddev=1",
        f"resume={folder}",
        output_dir=tmp_path / "again",
    )
    tracker = NullTracker()
    run(cfg, tracker=tracker)
    assert sorted(tracker.metrics["privacy/epsilon"]) == [1, 2, 3]
    # the tag is made of the settings (the initial C), not of the resumed state
    up = _uplink(adaptive=True, clip=0.1, count_stddev=1.0)
    tag = up.describe()
    up.load_state({"clip": torch.tensor([0.037], dtype=torch.float64)})
    assert up.describe() == tag and "C=0.1 (adaptive, initial)" in tag


# ---------------------------------------------------------------- refused settings
@pytest.mark.parametrize(
    "overrides",
    [
        ["privacy=central", "privacy.clip=inf"],
        ["privacy=local", "privacy.clip=inf"],
        ["privacy=central", "privacy.clip=inf", "privacy.target_epsilon=3"],
    ],
)
def test_no_clip_bound_with_noise_is_refused_before_round_0(overrides):
    cfg = compose_config(*TINY, *overrides)
    with pytest.raises(ConfigError, match=r"privacy\.clip=inf: .*needs a finite clip bound"):
        check_groups(cfg)
    with pytest.raises(ConfigError, match=r"privacy\.clip=inf"):
        build_engine(cfg)


def test_noise_that_drowns_every_update_is_refused_naming_its_cause():
    # E = 10 uploads a round: z / E > 100
    with pytest.raises(ConfigError, match=r"privacy\.noise_multiplier=1500: the noise drowns"):
        check_groups(compose_config(*TINY, "privacy=central", "privacy.noise_multiplier=1500"))
    check_groups(compose_config(*TINY, "privacy=central", "privacy.target_epsilon=1e-9"))


@pytest.mark.slow
def test_the_cli_says_in_one_line_that_the_noise_drowns_every_update(tmp_path):
    out = run_cli(
        "run",
        *TINY,
        "privacy=local",
        "privacy.target_epsilon=1e-9",
        f"output_dir={tmp_path / 'o'}",
        cwd=tmp_path,
    )
    lines = [line for line in out.stderr.splitlines() if "INFO" not in line]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("fedexp: error: privacy.target_epsilon=1e-09: the noise drowns")
    assert "× privacy.clip=1" in lines[0] and "lr" not in lines[0].split("(or")[0]
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_run_reports_plds_epsilon_each_round_tight_and_exact_at_its_last(tmp_path):
    """The default accountant (``auto``: PLD for central + poisson) as a run logs it: never
    below the library's PLD epsilon of that round, within 5 % of it, exactly it at the
    schedule's points and at the last round; the run's tag says which accountant."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    from fedexp.privacy import accountant as acc

    rounds = 60  # (every count to 39 is a point of the schedule; some above are not)
    cfg = compose_config(
        *TINY, "privacy=central", "participation=0.5", f"rounds={rounds}", output_dir=tmp_path
    )
    assert cfg.privacy.accountant == "auto"
    tracker = NullTracker()
    run(cfg, tracker=tracker)
    logged = tracker.metrics["privacy/epsilon"]
    assert sorted(logged) == list(range(1, rounds + 1))
    plan = acc.PrivacyPlan(
        "central", "poisson", 10, 0.5, float(cfg.privacy.noise_multiplier), 1e-5, "pld"
    )
    for t in (1, 16, 39, 40, 45, 57, 59, rounds):  # (points; 40, 45, 57 are not; the last)
        value = logged[t]
        event = dp_accounting.SelfComposedDpEvent(acc.round_event(plan), t)
        library = PLDAccountant(value_discretization_interval=acc.PLD_DISCRETIZATION)
        tight = library.compose(event).get_epsilon(1e-5)
        assert tight * (1 - 1e-7) <= value <= 1.05 * tight, t
        if t == rounds or acc.pld_point(t) == t:
            assert value == pytest.approx(tight, rel=1e-7), t
    assert any(value > 1.001 * acc.epsilon(plan, t) for t, value in logged.items())  # (bounds)
    assert tracker.tags["fedexp.privacy"].endswith("ε by PLD")
