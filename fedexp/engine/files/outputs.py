"""The files a finished run leaves in its output folder, and its per-client table's rows.

:func:`_write_outputs` writes the config, the per-client and per-round CSV files, the plots
and the graph's edges; :data:`CLIENT_TABLE` is the artifact name of the per-client table
(:func:`_table_rows`) that the tracker logs as a table.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from omegaconf import OmegaConf

from fedexp.engine.round import stacking
from fedexp.engine.round.engine import Engine
from fedexp.figures.drawer import together

#: The per-client table's artifact name (MLflow's table API wants .json or .parquet).
CLIENT_TABLE = "clients_rounds.json"


#: Columns of the per-client table that count (written as integers, not ``3.0``).
_COUNTS = ("round", "client", "num_test")


def _table_rows(client_history: list[dict[str, float]]) -> list[dict[str, Any]]:
    """clients_rounds.csv's rows with ``round``, ``client`` and ``num_test`` as integers."""
    return [{**r, **{k: int(r[k]) for k in _COUNTS if k in r}} for r in client_history]


def _new_last(key: str) -> bool:
    """Sort key: a new client's metric (``new/<m>``) after the clients' own."""
    return key.startswith("new/")


def _write_outputs(
    out: Path,
    cfg: DictConfig,
    per_client: list[dict[str, float]],
    history: list[dict[str, float]],
    engine: Engine,
    client_history: list[dict[str, float]],
    models: torch.Tensor | None,
) -> list[Path]:
    """Write a run's result files into ``out``; returns those the tracker uploads.

    - ``config.yaml``: the resolved config.
    - ``clients.csv``: one row per client: its number of training samples, its final test
      metrics and its best value of each over the evaluated rounds (``best_<metric>``).
    - ``rounds.csv``: one row per round, every metric (``round`` included, an integer; a round
      without evaluation has empty test columns).
    - ``clients_rounds.csv``: one row per client and evaluated round (``round``, ``client``
      and ``num_test`` integers): its test metrics.
    - ``curves.png``: the test metric across clients, mean training loss and cumulative bytes
      per round.
    - ``clients.png``: each client's test metric over rounds
      (:func:`~fedexp.figures.plots.plot_clients`).
    - ``client_models_pca.png``: the clients' evaluated models in PCA coordinates (2+ clients;
      not when ``models`` is None). The three figures only with ``figures`` true (the default).
    - ``graph_edges.csv``: the similarity graph's edges (graph algorithms only).

    ``models``: every client's evaluated vector, ``[N, d]``, or None
    (:meth:`~fedexp.engine.round.evaluation.Evaluation.every_eval_vector`, which every rank of a run
    over several processes takes part in).
    """
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "config.yaml", out / "clients.csv", out / "rounds.csv"]
    if client_history:
        files.append(out / "clients_rounds.csv")
        keys = list(dict.fromkeys(k for row in client_history for k in row))
        with open(files[-1], "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=keys)
            writer.writeheader()
            writer.writerows(_table_rows(client_history))  # round 3, client 0: not 3.0, 0.0
    OmegaConf.save(cfg, files[0], resolve=True)
    # held-out clients' rows hold new/<m> (issue 68): every row's keys, the clients' own first
    columns = sorted(dict.fromkeys(k for row in per_client for k in row), key=_new_last)
    with open(files[1], "w", newline="") as fh:
        writer = csv.writer(fh)
        best = sorted(engine.best)
        writer.writerow(["client", "num_train", *columns, *(f"best_{k}" for k in best)])
        for n, row in enumerate(per_client):
            writer.writerow(
                [
                    n,
                    engine.clients[n].num_train,
                    *(row.get(k, "") for k in columns),
                    *(float(engine.best[k][n]) for k in best),
                ]
            )
    keys = sorted({k for row in history for k in row}, key=lambda k: (k != "round", k))
    with open(files[2], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows({**h, "round": int(h["round"])} if "round" in h else h for h in history)
    from fedexp.figures.plots import plot_client_models
    from fedexp.figures.plots import plot_clients
    from fedexp.figures.plots import plot_rounds

    edges = engine.server.get("edges")
    if edges is not None:
        files.append(out / "graph_edges.csv")
        with open(files[-1], "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["i", "j"])
            writer.writerows(edges.cpu().tolist())
    if not cfg.get("figures", True):
        return files
    headline = columns[0]
    with together(aside=stacking.aside) as drawn:  # asked for at once, waited for once
        plot_rounds(history, out / "curves.png", headline)
        plot_clients(client_history, out / "clients.png", headline)
        if models is not None:
            plot_client_models(models, out / "client_models_pca.png", edges)
    files.extend(png for png in drawn if png is not None)
    return files
