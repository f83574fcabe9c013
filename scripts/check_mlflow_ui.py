"""Open a fedexp run in MLflow's web UI with headless Chromium and check the view it shows.

    python scripts/check_mlflow_ui.py --out docs/figures/mlflow_ui.png   # or: make ui-check

Runs a 2-round fedexp run into a temporary SQLite store, serves it with ``mlflow server`` on
127.0.0.1 (a free port), opens the experiment link fedexp prints
(:func:`fedexp.tracking.links.experiment_url`, with ``?workflowType=machine_learning``) in
headless Chromium, and checks the rendered page: the runs table of the machine-learning view
("Model training": a ``Runs`` page listing the run by its name), not the GenAI overview
(traces, token usage). With ``--plain`` it opens the link without the query too and reports
which view MLflow picks by itself. Saves a screenshot (``--out``) to look at.

Needs Chromium (Debian: ``apt-get install chromium``; ``make ui-check`` installs it).
Exit 0 when the check passes, 1 when the page shows the wrong view, 2 when it cannot run.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    sys.exit(check(args.out, args.plain))


if __name__ == "__main__":
    main()
