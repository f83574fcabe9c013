"""Benchmark the exact O(d) CER solver against the paper's ADMM (pFedNet's Algorithm 3).

Run: .venv/bin/python scripts/bench_cer.py [--max-exp 7] [--admm-max 4096] [--repeats 3]

For each d the input is the first d entries of one fixed random gradient (standard normal,
seed 0). Exact: ``cer_update`` (best of ``--repeats`` runs after a warm-up). ADMM:
``cer_admm_reference`` with rho = 1: the set-up time (eigendecomposition of
Lambda^T Lambda, dense eigenvectors), the mean time of one iteration (two dense d x d
products), and the iterations (and total time) until the ADMM iterate is within 1e-6 (max
abs) of the exact solution, checked every 10 iterations, capped at ``--admm-iters``.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedexp.comm.cer import cer_admm_reference
from fedexp.comm.cer import cer_update
from fedexp.comm.cer import difference


def _time_exact(g: np.ndarray, gamma: float, eta: float, repeats: int) -> tuple[float, np.ndarray]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = cer_update(g, gamma, eta)
        best = min(best, time.perf_counter() - start)
    return best, out


def _time_admm(
    g: np.ndarray, gamma: float, eta: float, exact: np.ndarray, max_iters: int
) -> tuple[float, float, int, float, float]:
    """(setup seconds, seconds per iteration, iterations to 1e-6, total seconds, last error).

    Setup (the eigendecomposition of Lambda^T Lambda) is the time to the end of the first
    iteration minus one iteration; the per-iteration time is measured between the first
    and the last callback.
    """
    state = {"iters": max_iters, "err": float("nan"), "t1": 0.0, "tj": 0.0}

    def stop(j: int, grad: np.ndarray) -> bool:
        now = time.perf_counter()
        if j == 1:
            state["t1"] = now
        state["tj"] = now
        if j % 10 and j != max_iters:
            return False
        state["err"] = float(np.abs(grad - exact).max())
        if state["err"] <= 1e-6:
            state["iters"] = j
            return True
        return False

    start = time.perf_counter()
    cer_admm_reference(g, gamma, eta, rho=1.0, iters=max_iters, callback=stop)
    total = time.perf_counter() - start
    per_iter = (state["tj"] - state["t1"]) / max(state["iters"] - 1, 1)
    setup = state["t1"] - start - per_iter
    return setup, per_iter, state["iters"], total, state["err"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-exp", type=int, default=7, help="largest d is 10**max_exp")
    parser.add_argument("--admm-max", type=int, default=4096, help="largest d for the ADMM")
    parser.add_argument("--admm-iters", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", type=float, default=0.5)
    parser.add_argument("--eta", type=float, default=0.1)
    args = parser.parse_args()

    g_all = np.random.default_rng(0).standard_normal(10**args.max_exp)
    cer_update(g_all[:10], args.gamma, args.eta)  # numba compilation (or cache load)
    sizes = sorted({10**e for e in range(3, args.max_exp + 1)} | {256, 1024, args.admm_max})
    print(f"gamma = {args.gamma}, eta = {args.eta}, g ~ N(0, 1), seed 0\n")
    print(
        "| d | exact (s) | exact ns/entry | runs | zeros of Λ∇ | ADMM set-up (s) "
        "| ADMM s/iter | ADMM iters to 1e-6 | ADMM total (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d in sizes:
        g = np.ascontiguousarray(g_all[:d])
        exact_s, exact = _time_exact(g, args.gamma, args.eta, args.repeats)
        runs = 1 + int(np.count_nonzero(exact[1:] != exact[:-1]))
        zeros = float(np.mean(difference(exact) == 0))
        row = f"| {d:,} | {exact_s:.4g} | {1e9 * exact_s / d:.1f} | {runs:,} | {zeros:.3f} |"
        if d <= args.admm_max:
            eig_s, per_iter, iters, total, err = _time_admm(
                g, args.gamma, args.eta, exact, args.admm_iters
            )
            reached = f"{iters:,}" if err <= 1e-6 else f">{iters:,} (err {err:.1e})"
            row += f" {eig_s:.3g} | {per_iter:.3g} | {reached} | {total:.3g} |"
        else:
            row += " — | — | — | — |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
