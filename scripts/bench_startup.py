"""Start-up times of the ``fedexp`` command, as ratios, in one run (issue 12, "fast to start").

Every figure is the median wall time of a child process (``--repeats`` runs of each, taken in
turn so that a change of machine load hits every kind alike, after one untimed warm-up each),
measured from just before the process is started:

    (a) ``python -c "import hydra"``                         to its exit
    (b) ``fedexp --help``                                     to its exit
    (c) ``fedexp run lr=-1`` (a bad top-level value)          to its exit (error, exit 2)
    (d) ``fedexp run rounds=1 tracker=none`` (the default     to the log line ``round 1/1``:
        run: FedAvg, logistic regression, breast cancer,      round 0's evaluation, round 1's
        5 clients, 5 local SGD steps of batch 32)             training and evaluation done
    (e) a plain PyTorch script doing the work of (d), its     to the line it prints after its
        imports (torch, scikit-learn) included                evaluation

(d) stops before what a run does after its last round (checkpoint, CSVs, plots, the table):
``(d) whole`` is the same command to its exit. (e) loads scikit-learn's breast-cancer table,
scales it to [-1, 1], splits it over 5 clients (80/20 train/test each), trains
``nn.Linear(30, 2)`` one round (5 steps of ``torch.optim.SGD`` lr 0.1 on a ``DataLoader`` of
batch 32 per client, ``state_dict`` averaging) and evaluates every client's test split with
accuracy, balanced accuracy and AUC (``sklearn.metrics``, as fedexp does).

    .venv/bin/python scripts/bench_startup.py               # 5 repeats
    .venv/bin/python scripts/bench_startup.py --repeats 9 --json outputs/bench_startup.json

Targets (issue 12): (c)/(d) < 0.10, (b)/(a) ≈ 1 (≤ 1.1), (d)/(e) ≤ 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (e): the plain PyTorch loop, run as ``python -c``; prints ``ROUND1 <mean acc>`` at the end.
PLAIN = """
import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.metrics import balanced_accuracy_score, roc_auc_score
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
bunch = load_breast_cancer()
x = bunch.data.astype(np.float64)
lo, hi = x.min(axis=0), x.max(axis=0)
x = (2.0 * (x - lo) / np.where(hi > lo, hi - lo, 1.0) - 1.0).astype(np.float32)
y = (bunch.target == 0).astype(np.int64)
clients = []
for idx in np.array_split(np.random.default_rng(0).permutation(len(y)), 5):
    n_test = round(0.2 * len(idx))
    te, tr = idx[:n_test], idx[n_test:]
    clients.append([torch.from_numpy(a) for a in (x[tr], y[tr], x[te], y[te])])
model = nn.Linear(30, 2)
loss_fn = nn.CrossEntropyLoss()
start = {k: v.clone() for k, v in model.state_dict().items()}
new = {k: torch.zeros_like(v) for k, v in start.items()}
total = sum(len(c[1]) for c in clients)
for x_tr, y_tr, _, _ in clients:
    model.load_state_dict(start)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x_tr, y_tr), batch_size=32, shuffle=True)
    batches = iter(loader)
    for _ in range(5):  # 5 local steps; a new epoch when the loader runs out
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(loader)
            xb, yb = next(batches)
        opt.zero_grad()
        loss_fn(model(xb), yb).backward()
        opt.step()
    for k, v in model.state_dict().items():
        new[k] += len(y_tr) / total * v
model.load_state_dict(new)
accs = []
with torch.no_grad():
    for _, _, x_te, y_te in clients:
        logits = model(x_te)
        pred = logits.argmax(1)
        prob = torch.softmax(logits, 1)[:, 1]
        accs.append(float((pred == y_te).float().mean()))
        balanced_accuracy_score(y_te.numpy(), pred.numpy())
        roc_auc_score(y_te.numpy(), prob.numpy())
print("ROUND1", sum(accs) / len(accs), flush=True)
"""


def _fedexp() -> list[str]:
    """The installed ``fedexp`` console script next to this Python, else its module."""
    script = Path(sys.executable).parent / "fedexp"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fedexp"]


def _time(cmd: list[str], cwd: Path, marker: str | None, code: int) -> tuple[float, float]:
    """Seconds from just before ``cmd`` starts to its first output line (stdout and stderr
    together) matching ``marker`` (None: to its exit), and to its exit."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("MLFLOW_TRACKING_URI", None)
    lines: list[str] = []
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if seen is None and marker is not None and re.search(marker, line):
            seen = time.perf_counter() - start
        lines.append(line)
    rc = proc.wait()
    done = time.perf_counter() - start
    if rc != code or (marker is not None and seen is None):
        tail = "".join(lines[-20:])
        raise SystemExit(
            f"{' '.join(cmd)[:80]}: exit {rc} (expected {code}), marker {marker!r}\n{tail}"
        )
    return (done if seen is None else seen), done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--json", type=Path, default=ROOT / "outputs" / "bench_startup.json", help="figures file"
    )
    args = parser.parse_args()
    fedexp = _fedexp()
    python = sys.executable
    kinds = {  # name: (command, marker, expected exit code)
        "a": ([python, "-c", "import hydra"], None, 0),
        "b": ([*fedexp, "--help"], None, 0),
        "c": ([*fedexp, "run", "lr=-1"], None, 2),  # (2: a usage error)
        "d": ([*fedexp, "run", "rounds=1", "tracker=none"], r"round 1/1", 0),
        "e": ([python, "-c", PLAIN], r"^ROUND1 ", 0),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    whole: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as tmp:
        cwd = Path(tmp)  # fedexp's outputs/ folders land here
        for rep in range(args.repeats + 1):  # the first pass warms the caches, untimed
            for name, (cmd, marker, code) in kinds.items():
                first, done = _time(cmd, cwd, marker, code)
                if rep:
                    times[name].append(first)
                    if name == "d":
                        whole.append(done)
            if rep:
                print(f"repeat {rep}: " + " ".join(f"{k}={v[-1]:.2f}s" for k, v in times.items()))
    med = {k: statistics.median(v) for k, v in times.items()}
    med["d_whole"] = statistics.median(whole)
    ratios = {
        "b/a": med["b"] / med["a"],
        "c/d": med["c"] / med["d"],
        "d/e": med["d"] / med["e"],
    }
    targets = {"b/a": "≈ 1 (≤ 1.1)", "c/d": "< 0.10", "d/e": "≤ 1"}
    met = {
        "b/a": ratios["b/a"] <= 1.1,
        "c/d": ratios["c/d"] < 0.10,
        "d/e": ratios["d/e"] <= 1.0,
    }
    import torch  # noqa: PLC0415 - only for the versions line

    print(
        f"\nmedian of {args.repeats} runs, seconds; python {sys.version.split()[0]}, "
        f"torch {torch.__version__}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}\n"
    )
    labels = {
        "a": '(a) python -c "import hydra"',
        "b": "(b) fedexp --help",
        "c": "(c) fedexp run lr=-1 (to the error)",
        "d": "(d) fedexp run rounds=1 tracker=none (to the end of round 1)",
        "d_whole": "(d) the same, to its exit",
        "e": "(e) plain PyTorch script (to the end of its evaluation)",
    }
    print("| command | median s | runs |")
    print("|---|---:|---|")
    for key, label in labels.items():
        runs = whole if key == "d_whole" else times[key]
        print(f"| {label} | {med[key]:.2f} | {', '.join(f'{t:.2f}' for t in runs)} |")
    print("\n| ratio | measured | target | met |")
    print("|---|---:|---|---|")
    for key, value in ratios.items():
        print(f"| {key} | {value:.2f} | {targets[key]} | {'yes' if met[key] else 'no'} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "repeats": args.repeats,
                "median_s": med,
                "runs_s": {**times, "d_whole": whole},
                "ratios": ratios,
                "met": met,
                "cores": os.cpu_count(),
                "loadavg": os.getloadavg(),
            },
            indent=2,
        )
    )
    print(f"\nfigures: {args.json}")


if __name__ == "__main__":
    main()
