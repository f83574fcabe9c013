"""Per-part DP clipping (``privacy.part_clip``, fedexp.privacy.clipping): each part within its
share of C, the whole upload within C, the noise and ε those of joint clipping, adaptive
clipping's count per client, and the settings checked before round 0 (issue 66)."""

from __future__ import annotations

import math

import pytest
import torch

from fedexp.contract import StackedUpdates
from fedexp.engine.config_check import check_groups
from fedexp.engine.runner import build_engine
from fedexp.engine.runner import run
from fedexp.errors import ConfigError
from fedexp.privacy.clipping import JointClip
from fedexp.privacy.clipping import PartClip
from fedexp.privacy.mechanisms import clip_factors
from fedexp.privacy.mechanisms import joint_norms
from fedexp.privacy.settings import Privacy
from fedexp.privacy.uplink import PrivateUplink
from fedexp.tracking.base import NullTracker
from helpers import SMALL
from helpers import compose_config
from helpers import run_cli

TINY = [*SMALL, "num_clients=10", "batch_size=8", "tracker=none"]
SCAFFOLD = {"dy": "update", "dc": "update"}


def _uplink(shares=None, mode="central", reads="mean", kinds=SCAFFOLD, n=50, q=0.2, **kw):
    settings = Privacy(mode=mode, part_clip=shares, **kw)
    return PrivateUplink(settings, reads, kinds, n, q, rounds=10, seed=0)


def _uploads(m: int, seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Two parts of very different scales, each row's scale spread over six decades."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 3, m, dtype=torch.float64)[torch.randperm(m, generator=g)]
    dy = torch.randn(m, 13, generator=g, dtype=torch.float64) * scale[:, None]
    dc = torch.randn(m, 2, 3, generator=g, dtype=torch.float64) * 50 * scale.flip(0)[:, None, None]
    return {"dy": dy.to(dtype), "dc": dc.to(dtype)}


def _shares(seed: int, names=("dy", "dc")) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(len(names), generator=g, dtype=torch.float64) + 0.01
    w = (w / w.sum()).tolist()
    w[-1] = 1 - math.fsum(w[:-1])
    return dict(zip(names, w, strict=True))


def _joint(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    return joint_norms([v.reshape(v.shape[0], -1) for v in parts.values()])


# ---------------------------------------------------------------- the bound
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["central", "local"])
def test_each_part_within_its_share_and_the_whole_upload_within_c(dtype, mode):
    """‖clip(v)‖² = Σ_p f_p²‖v_p‖² ≤ Σ_p C²s_p = C², for random shares, bounds and uploads;
    parts within their bound are left alone, a clipped part keeps its direction."""
    for trial in range(20):
        shares = _shares(trial)
        clip = float(
            10 ** torch.empty(1).uniform_(-2, 2, generator=torch.Generator().manual_seed(trial))
        )
        up = _uplink(shares, mode=mode, clip=clip, noise_multiplier=0.0)
        parts = _uploads(64, trial, dtype)
        out, counts = up.client_side(0, list(range(64)), parts, {})
        assert float(_joint(out).max()) <= clip
        for name, v in parts.items():
            flat, got = v.reshape(64, -1), out[name].reshape(64, -1)
            bound = clip * math.sqrt(shares[name])
            assert float(joint_norms([got]).max()) <= bound
            inside = joint_norms([flat]) <= bound
            assert torch.equal(got[inside], flat[inside])
            ratio = got[~inside] / flat[~inside]  # one factor a row: the direction kept
            torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio))
            whole = float(inside.sum())
            assert counts[f"privacy/unclipped/{name}"] == whole
        both = [
            joint_norms([v.reshape(64, -1)]) <= clip * math.sqrt(shares[k])
            for k, v in parts.items()
        ]
        assert counts["privacy/unclipped"] == float((both[0] & both[1]).sum())


def test_part_clip_beats_joint_clipping_on_the_small_part():
    """Why the setting exists: a large Δy shrinks a small Δc as much as itself when clipped
    jointly; per part, Δc within its share is left whole."""
    parts = {"dy": torch.full((1, 4), 10.0), "dc": torch.full((1, 4), 0.1)}
    joint, _ = _uplink(None, clip=1.0, noise_multiplier=0.0).client_side(0, [0], dict(parts), {})
    apart, _ = _uplink({"dy": 0.5, "dc": 0.5}, clip=1.0, noise_multiplier=0.0).client_side(
        0, [0], dict(parts), {}
    )
    assert float(joint["dc"].norm()) < 0.02 and torch.equal(apart["dc"], parts["dc"])
    assert float(apart["dy"].norm()) == pytest.approx(math.sqrt(0.5), rel=1e-5)


def test_one_share_for_the_only_clipped_part_is_joint_clipping_bit_for_bit():
    kinds = {"d": "update", "a": "exact"}  # FedNova's parts
    parts = {"d": _uploads(40, 1)["dy"], "a": torch.arange(40.0)[:, None]}
    joint, cj = _uplink(None, kinds=kinds, clip=0.3, noise_multiplier=0.0).client_side(
        0, list(range(40)), dict(parts), {}
    )
    one, co = _uplink({"d": 1.0}, kinds=kinds, clip=0.3, noise_multiplier=0.0).client_side(
        0, list(range(40)), dict(parts), {}
    )
    assert torch.equal(joint["d"], one["d"]) and torch.equal(one["a"], parts["a"])
    assert cj["privacy/unclipped"] == co["privacy/unclipped"] == co["privacy/unclipped/d"]


def test_joint_clipping_is_todays_formula_bit_for_bit():
    parts = {k: v.reshape(50, -1) for k, v in _uploads(50, 2).items()}
    old = clip_factors(joint_norms(list(parts.values())), 0.7)
    got = JointClip().clip(parts, 0.7)
    assert all(torch.equal(f, old) for f in got.factors.values())
    assert got.keys == () and got.flags.tolist() == [1, int((old == 1).sum())]
    assert all(torch.equal(f, old) for f in JointClip().factors(parts, 0.7).values())


def test_a_lossy_uplink_cannot_send_more_than_a_parts_share():
    shares = {"dy": 0.9, "dc": 0.1}
    up = _uplink(shares, clip=2.0, noise_multiplier=0.0, sampling="fixed", n=4, q=1.0)
    clients = [0, 1, 2, 3]
    big = StackedUpdates(clients, {"dy": torch.full((4, 9), 5.0), "dc": torch.full((4, 3), 7.0)})
    got, _, _ = up.server_side(0, clients, big, {}, lossy=True)
    parts = got.parts()
    assert float(parts["dy"].norm(dim=1).max()) <= 2.0 * math.sqrt(0.9)
    assert float(parts["dc"].norm(dim=1).max()) <= 2.0 * math.sqrt(0.1)
    assert float(_joint(parts).max()) <= 2.0


def test_an_upload_part_without_a_share_is_refused():
    with pytest.raises(ValueError, match=r"part\(s\) 'extra', which have no share"):
        PartClip({"dy": 1.0}).clip({"dy": torch.ones(2, 3), "extra": torch.ones(2, 1)}, 1.0)
    # a declared part a round does not send leaves its share unused (still within C)
    got = PartClip({"dy": 0.5, "dc": 0.5}).factors({"dy": torch.full((1, 4), 9.0)}, 1.0)
    assert float(got["dy"][0] * 18) <= math.sqrt(0.5)


# ---------------------------------------------------------------- noise and ε unchanged
@pytest.mark.parametrize(
    "kw",
    [
        {"mode": "central", "target_epsilon": 3.0},
        {"mode": "central", "noise_multiplier": 1.1, "sampling": "fixed"},
        {"mode": "local", "target_epsilon": 8.0},
        {"mode": "central", "adaptive": True, "noise_multiplier": 1.3, "count_stddev": 2.0},
        {"mode": "central", "noise_multiplier": 0.8, "accountant": "rdp"},
    ],
)
def test_the_noise_multiplier_and_epsilon_are_those_of_joint_clipping(kw):
    joint, apart = _uplink(None, **kw), _uplink({"dy": 0.7, "dc": 0.3}, **kw)
    assert apart.noise_multiplier == joint.noise_multiplier
    assert apart.update_multiplier == joint.update_multiplier
    assert apart.aggregate_noise() == joint.aggregate_noise()
    assert apart.plan() == joint.plan()
    for up in (joint, apart):
        up.participations[:] = 1
    for t in (1, 5, 10):
        assert apart.epsilon(t) == joint.epsilon(t)


@pytest.mark.parametrize(
    "mode,reads", [("central", "mean"), ("central", "each"), ("local", "mean")]
)
def test_the_noise_is_drawn_as_with_joint_clipping(mode, reads):
    """Uploads within every bound get the very noise of joint clipping, bit for bit."""
    clients = [2, 5, 9]
    rows = {"dy": torch.full((3, 20), 1e-3), "dc": torch.full((3, 6), -1e-3)}
    outs = []
    for shares in (None, {"dy": 0.6, "dc": 0.4}):
        up = _uplink(shares, mode=mode, reads=reads, clip=1.5, noise_multiplier=0.9)
        sent, _ = up.client_side(4, clients, dict(rows), {})
        got, _, report = up.server_side(4, clients, StackedUpdates(clients, sent), {}, lossy=True)
        outs.append((got.parts(), report))
    (a, ra), (b, rb) = outs
    assert ra == rb and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["dy"], rows["dy"]) or (mode, reads) == ("local", "mean")


# ---------------------------------------------------------------- adaptive clipping
def test_adaptive_clipping_counts_a_client_whole_only_when_every_part_is():
    """One bit per client (sensitivity ½, Theorem 1 unchanged): C settles at the median of
    r_n = max_p ‖v_p‖/√s_p, not at the median of the joint norms."""
    shares = {"dy": 0.8, "dc": 0.2}
    m = 200
    up = _uplink(
        shares,
        clip=0.01,
        noise_multiplier=0.0,
        adaptive=True,
        sampling="fixed",
        n=m,
        q=1.0,
        count_stddev=1e-6,
        clip_lr=0.2,
    )
    g = torch.Generator().manual_seed(3)
    norms = {
        "dy": torch.logspace(-1, 1, m, dtype=torch.float64),
        "dc": torch.logspace(-1, 1, m, dtype=torch.float64)[torch.randperm(m, generator=g)],
    }
    r = torch.maximum(norms["dy"] / math.sqrt(0.8), norms["dc"] / math.sqrt(0.2))
    joint = (norms["dy"].square() + norms["dc"].square()).sqrt()
    for t in range(300):
        rows = {}
        for name, d in (("dy", 16), ("dc", 4)):
            v = torch.randn(m, d, generator=g, dtype=torch.float64)
            rows[name] = v / v.norm(dim=1, keepdim=True) * norms[name][:, None]
        _, counts = up.client_side(t, list(range(m)), rows, {})
        report = up.end_round(t, list(range(m)), True, counts)
    assert up.clip == pytest.approx(float(r.median()), rel=0.1)
    assert abs(up.clip / float(joint.median()) - 1) > 0.3  # (the two medians differ)
    assert set(report) >= {"privacy/clipped", "privacy/clipped/dy", "privacy/clipped/dc"}


# ---------------------------------------------------------------- settings and runs
@pytest.mark.parametrize(
    "value,expected",
    [
        (
            "{dy:0.8,dc:0.3}",
            r"privacy\.part_clip=\{dy: 0\.8, dc: 0\.3\}: the shares of C² must sum to 1",
        ),
        ("{dy:1.0,dc:0.0}", r"privacy\.part_clip\.dc=0\.0: expected a positive finite share"),
        ("{dy:1.5,dc:-0.5}", r"privacy\.part_clip\.dc=-0\.5: expected a positive finite share"),
        ("{dy:nan,dc:1.0}", r"privacy\.part_clip\.dy=nan: expected a positive finite share"),
        ("{dy:inf,dc:0.2}", r"privacy\.part_clip\.dy=inf: expected a positive finite share"),
        ("{dy:true}", r"privacy\.part_clip\.dy=True: expected a positive finite share"),
        ("0.5", r"privacy\.part_clip=0\.5: expected a share of C² for each upload part"),
        (
            "{dy:0.8,delta_c:0.2}",
            r"privacy\.part_clip=\{dy: 0\.8, delta_c: 0\.2\}: expected a share for each of "
            r"Scaffold's upload parts dy, dc \(no such part delta_c; no share for dc\)",
        ),
        ("{dy:1.0}", r"upload parts dy, dc \(no share for dc\)"),
    ],
)
def test_bad_part_clip_settings_are_refused_before_round_0_in_one_line(value, expected):
    cfg = compose_config(
        *TINY, "algorithm=scaffold", "privacy=central", f"+privacy.part_clip={value}"
    )
    with pytest.raises(ConfigError, match=expected) as err:
        check_groups(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=expected):
        build_engine(cfg)


def test_the_shares_may_miss_one_by_rounding_only():
    Privacy(mode="central", part_clip={"dy": 0.1, "dc": 0.2, "b": 0.7})  # fsum: 1 within 1e-9
    Privacy(mode="central", part_clip={"dy": 0.8 + 5e-10, "dc": 0.2})
    with pytest.raises(ValueError, match="must sum to 1"):
        Privacy(mode="central", part_clip={"dy": 0.8 + 2e-9, "dc": 0.2})


@pytest.mark.parametrize(
    "algorithm,parts",
    [("fedavg", "none"), ("ifca", "cluster \\(exact\\)")],
)
def test_an_algorithm_without_named_parts_to_clip_is_refused(algorithm, parts):
    cfg = compose_config(
        *TINY, f"algorithm={algorithm}", "privacy=central", "+privacy.part_clip={dy:0.8,dc:0.2}"
    )
    with pytest.raises(
        ConfigError, match=f"declares no named upload part to clip \\(its uplink parts: {parts}\\)"
    ):
        check_groups(cfg)


def test_scaffold_with_part_clip_spends_the_epsilon_of_joint_clipping():
    base = [
        *TINY,
        "algorithm=scaffold",
        "privacy=central",
        "privacy.noise_multiplier=1.2",
        "participation=0.5",
    ]
    trackers = []
    for extra in ([], ["+privacy.part_clip={dy:0.8,dc:0.2}"]):
        tracker = NullTracker()
        result = run(compose_config(*base, *extra), tracker=tracker)
        assert math.isfinite(result.metrics["acc/mean"])
        trackers.append(tracker)
    joint, apart = trackers
    assert apart.metrics["privacy/epsilon"] == joint.metrics["privacy/epsilon"]
    assert apart.metrics["privacy/noise_std"] == joint.metrics["privacy/noise_std"]
    assert apart.tags["fedexp.privacy"] == (
        joint.tags["fedexp.privacy"] + "; clipped per part: dy to C·√0.8, dc to C·√0.2"
    )
    assert set(apart.metrics) - set(joint.metrics) == {"privacy/clipped/dy", "privacy/clipped/dc"}


@pytest.mark.slow
def test_the_cli_names_the_algorithms_parts_in_one_line_before_any_folder(tmp_path):
    out = run_cli(
        "run",
        *TINY,
        "algorithm=scaffold",
        "privacy=central",
        "+privacy.part_clip={y:0.8,c:0.2}",
        cwd=tmp_path,
    )
    lines = [line for line in out.stderr.splitlines() if "INFO" not in line]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0] == (
        "fedexp: error: privacy.part_clip={y: 0.8, c: 0.2}: expected a share for each of "
        "scaffold's upload parts dy, dc (no such part y, c; no share for dy, dc)"
    )
    assert list(tmp_path.iterdir()) == []  # no run folder


def test_a_resume_that_adds_or_changes_part_clip_is_refused(tmp_path):
    base = [*TINY, "algorithm=scaffold", "privacy=central", "checkpoint_every=1"]
    cfg = compose_config(*base, "rounds=2", output_dir=tmp_path / "first")
    run(cfg, tracker=NullTracker())
    folder = tmp_path / "first" / "checkpoints"
    again = compose_config(
        *base,
        "rounds=3",
        "+privacy.part_clip={dy:0.5,dc:0.5}",
        f"resume={folder}",
        output_dir=tmp_path / "again",
    )
    with pytest.raises(ConfigError) as err:
        run(again, tracker=NullTracker())
    assert "privacy.part_clip={'dy': 0.5, 'dc': 0.5} but the checkpoint's run has " in str(
        err.value
    )
    assert "privacy.part_clip=(unset)" in str(err.value)


@pytest.mark.parametrize(
    "mode", ["central", "adaptive", pytest.param("local", marks=pytest.mark.slow)]
)
def test_per_part_clipping_is_constant_in_the_cohort_and_reads_as_joint(mode):
    """The round's ops do not grow with the cohort (``tests/test_round_census.py``'s count of
    SCAFFOLD's second round at 10 and 40 clients), and the clip's counts are still one host
    read: as many reads as joint clipping."""
    from test_round_census import census

    base = [f"privacy={mode}", "privacy.noise_multiplier=1.0"]
    split = [*base, "+privacy.part_clip={dy:0.5,dc:0.5}"]
    small, large = census("scaffold", 10, split)[0], census("scaffold", 40, split)[0]
    assert (small.total_ops, small.total_reads) == (large.total_ops, large.total_reads), (
        small.summary(),
        large.summary(),
    )
    joint = census("scaffold", 10, base)[0]
    assert small.total_reads == joint.total_reads
