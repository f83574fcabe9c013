"""The Markdown summary (``summary.md``) of ``check.json``'s document."""

from __future__ import annotations

import math
from typing import Any

from .sizes import STEPS


def _f(value: object, fmt: str = ",.0f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, int | float):
        return format(value, fmt)
    return str(value)


def summary(doc: dict[str, Any]) -> str:
    """The Markdown summary of ``check.json``'s document."""
    steps = doc["steps"]
    env = steps.get("env", {})
    lines = [
        f"# fedexp device check: {env.get('device', '?')}",
        "",
        f"Mode `{doc['mode']}`, {env.get('date', '?')}, commit {env.get('commit') or '?'}"
        f"{' (with changes)' if env.get('dirty') else ''}; torch {env.get('torch', '?')}, "
        f"Python {env.get('python', '?')}; {doc['wall_s']:.0f} s of a {doc['budget_s']:.0f} s "
        "budget.",
        "",
        "| step | status | s | note |",
        "|---|---|---:|---|",
    ]
    for name in STEPS:
        if name in steps:
            r = steps[name]
            note = r.get("error", "") or ""
            lines.append(
                f"| {name} | {r.get('status')} | {_f(r.get('seconds'), '.1f')} | "
                f"{note[:120].replace('|', '/').replace(chr(10), ' ')} |"
            )
    if env.get("peak_fp32_tflops"):
        lines += [
            "",
            f"Peak used for the FLOP bound: {env['peak_fp32_tflops']:.3g} TFLOP/s float32 "
            f"({env.get('peak_source')}); TF32 {env.get('peak_tf32_tflops'):.3g}; a float32 "
            f"product measured {_f(env.get('matmul_fp32_tflops'), '.3g')} TFLOP/s"
            + (
                f", TF32 {_f(env.get('matmul_tf32_tflops'), '.3g')}"
                if env.get("matmul_tf32_tflops")
                else ""
            )
            + ".",
        ]
    rows, errors = [], []
    for model in ("cnn", "lr", "densenet", "unet", "densenet3d", "unet3d"):
        r = steps.get(f"bench_{model}", {})
        for n, c in r.get("cells", {}).items():
            errors += [f"- {model}, {n} clients, {k}: {v}" for k, v in c.items() if "error" in k]
            rows.append(
                f"| {model} | {n} | {_f(c.get('fedexp_updates_per_s'))} | "
                f"{_f(c.get('plain_updates_per_s'))} | {_f(c.get('fedexp_over_plain'), '.1f')}x | "
                f"{_f(c.get('step_bound_updates_per_s'))} | "
                f"{_f(c.get('fraction_of_step_bound'), '.1%')} | "
                f"{_f(c.get('flop_bound_updates_per_s'))} | "
                f"{_f(c.get('fraction_of_flop_bound'), '.2%')} | "
                f"{_f(c.get('peak_gpu_mib'))} | "
                f"{_f(c.get('fedexp_eager_updates_per_s'))} | "
                f"{_f(c.get('fedexp_captured_updates_per_s'))} | "
                f"{_f(c.get('captured_over_eager'), '.2f')} |"
            )
    if rows:
        lines += [
            "",
            "## Client updates per second",
            "",
            "fedexp: the captured rate where it ran, else the eager one (eager: the solver "
            "step by step; captured: a round's local steps replayed as CUDA graphs, "
            "capture=auto). "
            "Step bound: one SGD step of one model on every client's minibatch at once "
            "(scripts/gpu_cnn_rate.py's). FLOP bound: train FLOPs per sample (convolutions and "
            "matrix products, forward + backward) × samples per update ÷ the float32 peak.",
            "",
            "| model | clients | fedexp | plain loop | fedexp / plain | step bound | of it | "
            "FLOP bound | of it | peak GPU MiB | eager | captured | captured / eager |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            *([""] + errors if errors else []),
        ]
    sy = steps.get("syncs", {})
    if any(k in sy for k in ("cnn", "lr")):
        lines += ["", "## Host synchronisations in a round", ""]
        for w in ("cnn", "lr"):
            row = sy.get(w, {})
            counts = ", ".join(
                f"{n} clients: {v.get('syncs')} ({v.get('ops')} ops, {v.get('host_reads')} reads)"
                for n, v in row.items()
                if isinstance(v, dict)
            )
            lines.append(f"- {w}: {counts}; per client {_f(row.get('per_client'), '.2f')}")
            for n, v in row.items():
                if isinstance(v, dict) and v.get("sites"):
                    top = "; ".join(f"{k} ×{c}" for k, c in list(v["sites"].items())[:5])
                    lines.append(f"  - at {n} clients: {top}")
        dr = sy.get("draws")
        if dr:
            ms, sc = dr.get("round_ms", {}), dr.get("syncs", {})
            lines.append(
                f"- pass draws, LR: host kernel {_f(ms.get('host'), '.2f')} ms a round "
                f"({sc.get('host')} syncs), tensor path {_f(ms.get('tensor'), '.2f')} ms "
                f"({sc.get('tensor')} syncs): tensor / host {_f(dr.get('tensor_over_host'), '.2f')}"
            )
        cs = sy.get("census") or {}
        if cs:
            lines.append(
                "- syncs by case at 10 clients, training round / evaluation (the CPU's census "
                "reads in brackets): "
                + "; ".join(
                    f"{k} {v.get('train')}/{v.get('eval')} ({v.get('cpu_reads')})"
                    for k, v in cs.items()
                )
            )
    ct = steps.get("cuda_tests", {})
    if ct.get("counts") is not None:
        failed = [k for k, v in ct.get("tests", {}).items() if v in ("failed", "error")]
        lines += [
            "",
            f"## CUDA tests: {ct['counts']} (exit {ct.get('exit_code')})",
            *(f"- failed: {k}" for k in failed),
        ]
    g = steps.get("golden", {})
    if g.get("cases"):
        lines += [
            "",
            f"## Golden cases on `{g.get('device')}` against the CPU recording "
            f"(rel. {g.get('rtol')}, abs. {g.get('atol')}; TF32 off)",
            "",
        ]
        for name, c in g["cases"].items():
            if "ok" not in c:
                lines.append(f"- {name}: {c.get('status')}")
                continue
            lines.append(
                f"- {name}: {'within' if c['ok'] else 'OUTSIDE'} (worst {c['worst_ratio']:.3g} "
                f"of the tolerance, at {c['worst'] or '–'}; largest state gap "
                f"{c['max_abs_gap']:.2e})"
                + (f"; {'; '.join(c['problems'][:3])}" if c.get("problems") else "")
            )
    p = steps.get("profile", {})
    if p.get("top"):
        lines += [
            "",
            f"## One CNN round profiled ({p.get('clients')} clients)",
            "",
            f"{p.get('kernels')} kernels ({_f(p.get('kernels_per_client'), '.1f')} a client), "
            f"round {_f(p.get('round_s', 0) * 1e3, '.1f')} ms, device busy "
            f"{_f(p.get('device_busy_fraction'), '.1%')}; the top kernels (CPU: operators; "
            "kernels.txt has the profiler's tables):",
            "",
            *(
                f"- {e['name']}: {e['calls']} calls, "
                + (f"{e['device_ms']:.2f} ms" if "device_ms" in e else f"{e['cpu_ms']:.2f} ms CPU")
                for e in p["top"][:8]
            ),
        ]
    cg = steps.get("conv_gemm", {})
    if cg.get("cells"):
        lines += [
            "",
            "## Convolutions as matrix products (`conv_gemm`) against vmap's grouped ones",
            "",
            f"CNN, 10 clients, two rounds: server states {_f(cg.get('cnn_state_gap'), '.2e')} "
            "apart (relative to the largest entry; float32, TF32 off).",
            "",
            "| model | clients | grouped | products | ratio | peak MiB grouped | products |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *(
                f"| {c['model']} | {c['clients']} | {_f(c.get('grouped'))} | "
                f"{_f(c.get('gemm'))} | {_f(c.get('ratio'), '.2f')}x | "
                f"{_f(c.get('grouped_peak_mib'))} | {_f(c.get('gemm_peak_mib'))} |"
                + (f" {c['error'][:80]}" if c.get("error") else "")
                for c in cg["cells"].values()
            ),
        ]
    sw = steps.get("sweep", {})
    if sw.get("device"):
        lines += ["", f"## Sweep (pfednet_tables-style, {sw.get('rounds')} rounds a job)", ""]
        for key in ("device", "stacked", "cpu"):
            row = sw.get(key)
            if isinstance(row, dict):
                lines.append(
                    f"- {row['device']}, {row.get('launcher', 'basic')} launcher, "
                    f"{row.get('seeds', 1)} seed(s): {row['done']} of "
                    f"{row.get('total', len(row['algorithms']))} jobs, "
                    f"{_f(row.get('s_per_job'), '.2f')} s a job, {row['wall_s']:.1f} s in all "
                    f"(exit {row.get('exit_code')})"
                )
    return "\n".join(lines) + "\n"
