"""What goes to the tracker each round (``round`` is the step; constant byte counts once),
the same after a resume, and the per-client plot's choice of clients."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from omegaconf import open_dict

from fedexp.engine.runner import loggable
from fedexp.engine.runner import run
from fedexp.figures.plots import CLIENTS_PER_GROUP
from fedexp.figures.plots import MAX_CLIENT_PANELS
from fedexp.figures.plots import pick_clients
from fedexp.figures.plots import plot_clients
from fedexp.tracking.base import NullTracker
from helpers import deterministic

pytestmark = pytest.mark.usefixtures("one_thread")


def test_loggable_drops_round_and_keeps_every_rounds_byte_counts():
    first = {"round": 1.0, "bytes/up": 10, "bytes/up_cum": 10, "bytes/up/idx": 4, "acc/mean": 0.5}
    assert loggable(first, {"round": 0.0, "bytes/setup_up": 0.0}) == {
        "bytes/up": 10,
        "bytes/up_cum": 10,
        "bytes/up/idx": 4,
        "acc/mean": 0.5,
    }
    same = {**first, "round": 2.0, "bytes/up_cum": 20, "bytes/up/idx_cum": 8}
    assert loggable(same, first) == {  # unchanged counts too: MLflow draws a line, not a dot
        "bytes/up": 10,
        "bytes/up_cum": 20,
        "bytes/up/idx": 4,
        "bytes/up/idx_cum": 8,
        "acc/mean": 0.5,
    }
    assert loggable({"round": 0.0, "bytes/setup_up": 0.0}, None) == {"bytes/setup_up": 0.0}


def test_resume_into_another_tracker_logs_what_an_uninterrupted_run_logs(small_cfg, tmp_path):
    cfg = small_cfg("rounds=4", "checkpoint_every=2", "compressor=topk", "model=mlp")
    full = NullTracker()
    run(cfg, tracker=full)
    assert "round" not in full.metrics and full.steps == {0, 1, 2, 3, 4}
    assert len(full.metrics["bytes/up"]) == 4  # top-k: its size varies every round
    assert list(full.metrics["bytes/up_dense"]) == [1, 2, 3, 4]  # constant, logged every round

    def stop(engine, metrics):
        if engine.round == 3:  # checkpoint at round 2, round 3 logged, then a "crash"
            raise KeyboardInterrupt

    with open_dict(cfg):
        cfg.output_dir = str(tmp_path / "cut")
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tracker=NullTracker(), callbacks=[stop])
    with open_dict(cfg):
        cfg.resume = str(tmp_path / "cut" / "checkpoints")
    fresh = NullTracker()  # e.g. tracker=none first, MLflow on resume: the history is replayed
    run(cfg, tracker=fresh)
    assert deterministic(fresh.metrics) == deterministic(full.metrics)
    assert fresh.steps == full.steps


def test_pick_clients_all_up_to_the_limit_then_worst_median_best():
    few = {n: 0.1 * n for n in range(5)}
    assert pick_clients(few, False) == ([(n, "") for n in range(5)], "all 5 clients")
    n = MAX_CLIENT_PANELS + 36  # 100 clients, client n scores n (client 7's score is NaN)
    final = {c: float(c) for c in range(n)}
    final[7] = math.nan
    chosen, said = pick_clients(final, False)
    k = CLIENTS_PER_GROUP
    labels = dict(chosen)
    assert len(chosen) == 3 * k and f"the {k} worst, {k} median and {k} best of {n}" in said
    assert [c for c, lab in chosen if lab == "worst"] == [0, 1, 2, 3, 4, 5, 6, 8]
    assert [c for c, lab in chosen if lab == "best"] == list(range(n - k, n))
    median = [c for c, lab in chosen if lab == "median"]
    assert len(median) == k and min(median) > 40 and max(median) < 60 and 7 not in labels
    # for a loss, the worst clients are those with the highest values
    chosen, _ = pick_clients(final, True)
    assert [c for c, lab in chosen if lab == "worst"] == list(range(n - 1, n - k - 1, -1))


def test_plot_clients_draws_a_panel_grid_or_nothing(tmp_path):
    rows = [
        {"round": float(t), "client": float(c), "acc": 0.5 + 0.01 * c * t, "loss": 1.0}
        for t in (0, 2, 4)
        for c in range(100)
    ]
    assert plot_clients(rows, tmp_path / "none.png", "iou") is None
    assert not (tmp_path / "none.png").exists()
    path = plot_clients(rows, tmp_path / "clients.png", "acc")
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR
    assert width > 2 * height  # three rows (worst, median, best) of CLIENTS_PER_GROUP panels
    small = plot_clients(rows[:4], tmp_path / "four.png", "acc")  # clients 0-3, round 0
    assert small.read_bytes()[:4] == b"\x89PNG"


def _history(seed: int, rounds: int) -> list[dict[str, float]]:
    """Rounds of curves.png's keys, scaled by ``seed`` (so that limits and ticks differ)."""
    scale = 1.0 + seed
    rows = []
    for t in range(rounds + 1):
        row = {"round": float(t), "bytes/up_cum": 1e3 * scale * t, "bytes/down_cum": 3e5 * t}
        if t % 2 == 0:
            row.update({f"acc/{k}": 0.4 + 0.05 * t / scale for k in ("mean", "weighted", "worst")})
            row["acc/best_mean"] = 0.5 + 0.01 * t  # (absent at odd rounds: gaps)
        if t:
            row["train/train_loss"] = scale / t
        rows.append(row)
    return rows


def _client_rows(clients: int, seed: int) -> list[dict[str, float]]:
    return [
        {"round": float(t), "client": float(c), "acc": 0.3 + 0.01 * c * t / (1 + seed)}
        for t in range(0, 4 + 3 * seed, 2)
        for c in range(clients)
    ]


def _models(seed: int) -> torch.Tensor:
    return torch.randn(6, 40, generator=torch.Generator().manual_seed(seed)) * (1 + seed)


def _edges(seed: int) -> torch.Tensor:
    return torch.tensor([[0, 1], [1, 2], [3, 4]] if seed else [[0, 5]])  # (as many or fewer)


def test_a_kept_figure_draws_the_png_a_fresh_one_draws(tmp_path):
    """A figure built once and refilled by the next run (``canvas._KEPT``) saves the same bytes
    as one built for that run alone: limits, ticks, titles and gaps of the new data only."""
    from fedexp.figures import canvas
    from fedexp.figures import plots

    def drawn(name: str, draw) -> bytes:
        path = tmp_path / name
        draw(path)
        return path.read_bytes()

    cases = [
        ("curves", lambda s: lambda p: plots.plot_rounds(_history(s, 4 + 5 * s), p)),
        ("few", lambda s: lambda p: plot_clients(_client_rows(5, s), p, "acc")),
        ("many", lambda s: lambda p: plot_clients(_client_rows(100, s), p, "acc")),
        ("pca", lambda s: lambda p: plots.plot_client_models(_models(s), p, _edges(s))),
        ("equal", lambda s: lambda p: plots.plot_client_models(torch.ones(4 + s, 9), p)),
    ]
    for name, draw in cases:
        canvas._KEPT.clear()
        fresh = drawn(f"{name}-fresh.png", draw(1))
        canvas._KEPT.clear()
        drawn(f"{name}-first.png", draw(0))  # builds the figure with another run's data
        assert len(canvas._KEPT) == 1
        kept = drawn(f"{name}-kept.png", draw(1))
        assert len(canvas._KEPT) == 1 and kept == fresh, name
        assert kept != drawn(f"{name}-other.png", draw(0)), name  # (the data do show)
    curves = cases[0][1](1)
    canvas._KEPT.clear()
    fresh = drawn("curves-fresh-again.png", curves)
    canvas.warm()  # (the helper's start: its curves.png of accuracy stays kept)
    assert ("rounds", "acc") in canvas._KEPT
    assert drawn("curves-after-warm.png", curves) == fresh


def test_the_round_axes_tick_whole_rounds_only(tmp_path):
    """A short run's figures put no tick at round 0.5 (every panel of clients.png too)."""
    from fedexp.figures import canvas
    from fedexp.figures import plots

    canvas._KEPT.clear()
    plots.plot_rounds(_history(0, 2), tmp_path / "curves.png")
    plot_clients(_client_rows(5, 0), tmp_path / "clients.png", "acc")  # rounds 0 and 2
    drawn = [canvas._KEPT[("rounds", "acc")].axes, canvas._KEPT[("clients", 5, 3)].axes]
    for ax in (ax for axes in drawn for ax in axes):
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(ticks) >= 2 and all(t == round(t) for t in ticks), ticks


def test_a_figures_png_holds_the_pixels_savefig_draws_without_its_opaque_alpha(tmp_path):
    """``canvas._save`` writes savefig's pixels as RGB (the alpha was 255 everywhere), at the
    figure's dpi; a figure with transparent pixels keeps its alpha."""
    import numpy as np
    from PIL import Image

    from fedexp.figures import canvas
    from fedexp.figures import plots

    plots.plot_rounds(_history(2, 9), tmp_path / "ours.png")
    drawn = canvas._KEPT[("rounds", "acc")].fig
    drawn.savefig(tmp_path / "savefig.png", dpi=drawn.dpi)
    with Image.open(tmp_path / "ours.png") as ours, Image.open(tmp_path / "savefig.png") as theirs:
        assert ours.mode == "RGB" and theirs.mode == "RGBA"
        assert np.asarray(theirs)[..., 3].min() == 255
        assert np.array_equal(np.asarray(ours), np.asarray(theirs)[..., :3])
        assert ours.info["dpi"] == theirs.info["dpi"]
    see_through = canvas._figure(2, 1, dpi=50)
    see_through.patch.set_alpha(0.0)
    canvas._save(see_through, tmp_path / "clear.png")
    with Image.open(tmp_path / "clear.png") as clear:
        assert clear.mode == "RGBA" and np.asarray(clear)[..., 3].min() == 0


def test_figures_false_writes_the_tables_and_no_figure(small_cfg, tmp_path, monkeypatch):
    """``figures=false``: the run's CSVs and metrics as ever, no PNG on disk or in MLflow, and
    the clients' models (``[N, d]``, for the PCA figure only) are not gathered."""
    from fedexp.engine.round.evaluation import Evaluation

    drawn, bare = NullTracker(), NullTracker()
    with_figures = small_cfg("rounds=2")
    run(with_figures, tracker=drawn)
    without = small_cfg("rounds=2", "figures=false")
    with open_dict(without):
        without.output_dir = str(tmp_path / "bare")

    def gathered(self):
        raise AssertionError("the clients' models were gathered for no figure")

    monkeypatch.setattr(Evaluation, "every_eval_vector", gathered)
    run(without, tracker=bare)
    pngs = {"curves.png", "clients.png", "client_models_pca.png"}
    assert pngs <= set(drawn.artifacts) and not pngs & set(bare.artifacts)
    assert sorted(bare.artifacts) == sorted(set(drawn.artifacts) - pngs)
    from pathlib import Path

    assert not list(Path(without.output_dir).glob("*.png"))
    assert deterministic(bare.metrics) == deterministic(drawn.metrics)
