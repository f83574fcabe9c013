"""Open a fedexp run in MLflow's web UI with headless Chromium and check the view it shows.

    python scripts/check_mlflow_ui.py --out docs/figures/mlflow_ui.png   # or: make ui-check

Runs a 2-round fedexp run into a temporary SQLite store, serves it with ``mlflow server`` on
127.0.0.1 (a free port), opens the experiment link fedexp prints
(:func:`fedexp.tracking.links.experiment_url`, with ``?workflowType=machine_learning``) in
headless Chromium, and checks the rendered page: the runs table of the machine-learning view
("Model training": a ``Runs`` page listing the run by its name), not the GenAI overview
(traces, token usage). With ``--plain`` it opens the link without the query too and reports
which view MLflow picks by itself. Saves a screenshot (``--out``) to look at.

With ``--sweep`` it runs a sweep instead (by default the README's 24-job grid,
``algorithm=fedavg,local seed=0,1,2 partition.delta=1,2,4,7 rounds=5`` on the parallel
launcher: minutes on two cores; ``--grid`` for another), opens the link the sweep's summary
prints (:func:`fedexp.tracking.links.sweep_view_url`: the sweep's runs on a view stored with
the experiment, grouped by the varying keys, charts) and checks that the page groups the runs
(MLflow's "Group by: ..." button shows the grouping), then screenshots it (``--out``) and the
parent run's page (``--out-parent``: the sweep's summary table in its description)::

    python scripts/check_mlflow_ui.py --sweep --out docs/figures/mlflow_sweep.png \
        --out-parent docs/figures/mlflow_sweep_parent.png

Needs Chromium (Debian: ``apt-get install chromium``; ``make ui-check`` installs it).
Exit 0 when the check passes, 1 when the page shows the wrong view, 2 when it cannot run.
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def chromium() -> str | None:
    """The Chromium (or Chrome) binary on PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url}: no answer within {seconds:g} s")


def _browser(binary: str, url: str, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    flags += ["--window-size=1400,900", "--virtual-time-budget=20000", *args, url]
    return subprocess.run(  # noqa: S603 - our own binary and arguments
        [binary, *flags], capture_output=True, text=True, timeout=120, check=False
    )


def view_of(dom: str, run_name: str) -> str:
    """Which view a rendered experiment page shows: "ml", "genai" or "unknown"."""
    if run_name in dom and ">Runs<" in dom:
        return "ml"
    if "Traces" in dom and ("Usage" in dom or "No data available" in dom):
        return "genai"
    return "unknown"


#: The README's sweep: 24 jobs, two at a time.
SWEEP_GRID = (
    "algorithm=fedavg,local",
    "seed=0,1,2",
    "partition.delta=1,2,4,7",
    "rounds=5",
    "hydra/launcher=parallel",
)


def sweep_view_of(dom: str, names: list[str]) -> str:
    """Which view a sweep's page shows: "grouped", "ml" (runs, not grouped), "genai", "unknown".

    Grouped: MLflow's group-by button says what it groups by ("Group by: ..."), and the
    groups' values (the algorithms) are on the page.
    """
    if "Group by:" in dom and any(n in dom for n in names):
        return "grouped"
    if any(n in dom for n in names) and ">Runs<" in dom:
        return "ml"
    return view_of(dom, names[0]) if names else "unknown"


def _server(store: str, cwd: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    server = subprocess.Popen(  # noqa: S603
        [
            str(BIN / "mlflow"),
            "server",
            "--backend-store-uri",
            store,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=cwd,
    )
    base = f"http://127.0.0.1:{port}"
    _wait(f"{base}/health", 60)
    return server, base


def check_sweep(out: Path, parent_out: Path | None, grid: list[str]) -> int:
    """Run a sweep, serve it, open the link its summary prints, check the grouping."""
    binary = chromium()
    if binary is None:
        print("check_mlflow_ui: no Chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 2
    from mlflow.tracking import MlflowClient

    from fedexp.tracking.links import DEFAULT_UI, run_url

    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        done = subprocess.run(  # noqa: S603
            [
                str(BIN / "fedexp"),
                "run",
                "-m",
                *grid,
                "progress=none",
                "checkpoint_every=0",
                f"tracker.uri={store}",
                "tracker.experiment=ui-sweep",
                f"hydra.sweep.dir={tmp}/sweep",
            ],
            check=True,
            capture_output=True,
            text=True,
            cwd=tmp,
            timeout=1800,
        )
        found = re.search(r"then open (\S+)", done.stdout)
        if found is None:
            print(f"check_mlflow_ui: no link in the sweep's summary:\n{done.stdout}")
            return 1
        client = MlflowClient(store)
        exp = client.get_experiment_by_name("ui-sweep")
        runs = client.search_runs([exp.experiment_id])
        parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
        names = sorted({r.data.tags.get("choice.algorithm", "") for r in runs} - {""})
        server, base = _server(store, tmp)
        try:
            url = found.group(1).replace(DEFAULT_UI, base)
            dom = _browser(binary, url, "--dump-dom").stdout
            out.parent.mkdir(parents=True, exist_ok=True)
            _browser(binary, url, f"--screenshot={out.resolve()}")
            seen = sweep_view_of(dom, names)
            print(f"{url}: {seen} view ({len(runs) - 1} runs); screenshot {out}")
            if parent_out is not None:
                page = run_url(base, exp.experiment_id, parent.info.run_id)
                parent_out.parent.mkdir(parents=True, exist_ok=True)
                _browser(binary, page, f"--screenshot={parent_out.resolve()}")
                print(f"{page}: the parent run; screenshot {parent_out}")
        finally:
            server.terminate()
            server.wait(timeout=30)
    return 0 if seen == "grouped" else 1


def check(out: Path, plain: bool = False) -> int:
    """Run, serve, open, check; returns the exit code."""
    binary = chromium()
    if binary is None:
        print("check_mlflow_ui: no Chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 2
    from mlflow.tracking import MlflowClient

    from fedexp.tracking.links import experiment_url

    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/mlflow.db"
        subprocess.run(  # noqa: S603
            [
                str(BIN / "fedexp"),
                "run",
                "rounds=2",
                "progress=none",
                f"tracker.uri={store}",
                "tracker.experiment=ui-check",
                f"hydra.run.dir={tmp}/out",
            ],
            check=True,
            capture_output=True,
            cwd=tmp,
            timeout=300,
        )
        client = MlflowClient(store)
        exp = client.get_experiment_by_name("ui-check")
        run = client.search_runs([exp.experiment_id])[0]
        name = run.info.run_name
        port = _free_port()
        server = subprocess.Popen(  # noqa: S603
            [
                str(BIN / "mlflow"),
                "server",
                "--backend-store-uri",
                store,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            _wait(f"{base}/health", 60)
            url = experiment_url(base, exp.experiment_id)
            dom = _browser(binary, url, "--dump-dom").stdout
            out.parent.mkdir(parents=True, exist_ok=True)
            _browser(binary, url, f"--screenshot={out.resolve()}")
            seen = view_of(dom, name)
            print(f"{url}: {seen} view (run {name!r}); screenshot {out}")
            if plain:
                bare = url.split("?", 1)[0]
                print(
                    f"{bare}: {view_of(_browser(binary, bare, '--dump-dom').stdout, name)} "
                    "view without the query (MLflow's own default)"
                )
        finally:
            server.terminate()
            server.wait(timeout=30)
    return 0 if seen == "ml" else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("mlflow_ui.png"), help="screenshot")
    parser.add_argument("--plain", action="store_true", help="also open the bare link")
    parser.add_argument("--sweep", action="store_true", help="check a sweep's grouped link")
    parser.add_argument(
        "--grid", nargs="+", default=list(SWEEP_GRID), help="the sweep's overrides (--sweep)"
    )
    parser.add_argument("--out-parent", type=Path, help="screenshot of the sweep's parent run")
    args = parser.parse_args()
    if args.sweep:
        sys.exit(check_sweep(args.out, args.out_parent, args.grid))
    sys.exit(check(args.out, args.plain))


if __name__ == "__main__":
    main()
