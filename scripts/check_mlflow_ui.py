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
prints (:func:`fedexp.tracking.links.sweep_view_url`: the runs tab on the view stored with the
experiment, ``mlflow.sharedViewState.<parent run id>``) in headless Chromium driven over the
DevTools protocol, waits for the page to draw its charts and checks that MLflow applied the view:
the share key is still in the page's URL, MLflow's group-by button names the view's first key
("Group by: choice.algorithm") and there is a group row per configuration, labelled as MLflow
labels it from the view's group-by keys and the child runs' values
("Group: choice.algorithm: local, partition.delta: 2"). Then it screenshots the view (``--out``;
the runs list dragged wider than MLflow's 295 px so that the groups' names show, as a user
would) and the parent run's page (``--out-parent``: the sweep's summary table in its
description)::

    python scripts/check_mlflow_ui.py --sweep --out docs/figures/mlflow_sweep_grouped.png \
        --out-parent docs/figures/mlflow_sweep_parent.png

MLflow's assistant panel opens by itself on a browser's first visit to a local server; the
sweep's page is opened as on a later visit (MLflow's "opened once" flag set), without it.

Needs Chromium (Debian: ``apt-get install chromium``; ``make ui-check`` installs it).
Exit 0 when the check passes, 1 when the page shows the wrong view, 2 when it cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
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


#: Chromium's flags: headless, offline (no background networking, QUIC, sync or updates).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)
#: The sweep's screenshot: its size in CSS pixels, and how wide the runs list is dragged.
VIEWPORT, RUN_LIST_WIDTH = (1600, 900), 720


def _browser(binary: str, url: str, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile every time
        flags = [*FLAGS, f"--user-data-dir={profile}", "--window-size=1400,900"]
        flags += ["--virtual-time-budget=20000", *args, url]
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


def group_labels(group_by: list[dict[str, str]], runs: list) -> list[str]:
    """MLflow's label of each group of ``runs`` (its runs table, a chart's legend).

    One key: the value (``local``); more: ``key: value`` joined by commas
    (``choice.algorithm: local, partition.delta: 2``). Runs without the keys are left out.
    """
    labels = []
    for run in runs:
        logged = {"tag": run.data.tags, "param": run.data.params}
        values = [logged[k["mode"]].get(k["groupByData"]) for k in group_by]
        if not any(values):
            continue
        if len(values) == 1:
            label = values[0]
        else:
            pairs = zip(group_by, values, strict=True)
            label = ", ".join(f"{k['groupByData']}: {v or '(none)'}" for k, v in pairs)
        if label not in labels:
            labels.append(label)
    return labels


def sweep_view_of(href: str, text: str, group_by: list[dict[str, str]], labels: list[str]) -> str:
    """Which view a sweep's page shows: "grouped", "not grouped", "no share key", "unknown".

    Grouped: the share key is still in the URL (the experiment's bare route drops it), MLflow's
    group-by button names the first key ("Group by: choice.algorithm") and every group has its
    row ("Group: <label>").
    """
    from fedexp.tracking.links import SHARE_PARAM

    if f"{SHARE_PARAM}=" not in href:
        return "no share key"
    first = group_by[0]["groupByData"] if group_by else None
    if first and f"Group by: {first}" in text and all(f"Group: {g}" in text for g in labels):
        return "grouped"
    return "not grouped" if "matching runs" in text else "unknown"


class _Tab:
    """A page of a headless Chromium, driven over the DevTools protocol (aiohttp's websocket)."""

    def __init__(self, ws: object) -> None:
        self.ws, self.calls = ws, 0

    async def call(self, method: str, **params: object) -> dict:
        """Send one DevTools command and return its result (events in between are skipped)."""
        self.calls += 1
        await self.ws.send_json({"id": self.calls, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json()
            if message.get("id") == self.calls:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    async def eval(self, expression: str) -> object:
        """The value of a JavaScript expression on the page."""
        done = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return done.get("result", {}).get("value")

    async def drag(self, start: tuple[float, float], dx: float) -> None:
        """Press the left button at ``start``, move it ``dx`` to the right, release."""
        x, y = start
        mouse = {"button": "left", "clickCount": 1}
        await self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        await self.call("Input.dispatchMouseEvent", type="mousePressed", x=x, y=y, **mouse)
        for step in range(1, 11):
            await self.call(
                "Input.dispatchMouseEvent", type="mouseMoved", x=x + dx * step / 10, y=y
            )
        await self.call("Input.dispatchMouseEvent", type="mouseReleased", x=x + dx, y=y, **mouse)
        await self.call("Input.dispatchMouseEvent", type="mouseMoved", x=1, y=y)  # off the bar


#: The page's URL, its text and how many chart traces it drew.
PAGE_JS = (
    "({href: location.href, text: document.body.innerText,"
    " traces: document.querySelectorAll('.js-plotly-plot .trace').length})"
)
#: The centre of the runs list's resize handle (MLflow's ew-resize bar at its right edge).
HANDLE_JS = """(() => {
  const bars = [...document.querySelectorAll('div')].filter(
    (d) => getComputedStyle(d).cursor === 'ew-resize' && d.getBoundingClientRect().height > 100);
  if (!bars.length) return null;
  const r = bars[0].getBoundingClientRect();
  return [r.x + r.width / 2, r.y + r.height / 2];
})()"""
#: MLflow's own flag "the assistant panel opened itself once" (useLocalStorage, version 1).
NO_ASSISTANT_JS = "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true')"


async def _open_sweep(
    binary: str, url: str, out: Path, ready: list[str], seconds: float = 180
) -> dict:
    """Open ``url``, wait until its text has every string of ``ready`` and a chart, screenshot.

    Returns the page's URL and text (:data:`PAGE_JS`) when it was ready, or at the deadline.
    """
    import aiohttp  # MLflow's own dependency

    with tempfile.TemporaryDirectory() as profile:
        flags = [*FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0"]
        flags.append(f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}")
        browser = subprocess.Popen(  # noqa: S603 - our own binary and arguments
            [binary, *flags, "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 30
            while not port_file.is_file() or not port_file.read_text().strip():
                if time.monotonic() > deadline:
                    raise TimeoutError("Chromium opened no DevTools port")
                await asyncio.sleep(0.2)
            port = port_file.read_text().split()[0]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                target = next(t for t in json.load(r) if t["type"] == "page")
            async with (
                aiohttp.ClientSession() as session,
                session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws,
            ):
                tab = _Tab(ws)
                width, height = VIEWPORT
                await tab.call(
                    "Emulation.setDeviceMetricsOverride",
                    width=width,
                    height=height,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                await tab.call("Page.enable")
                await tab.call("Page.addScriptToEvaluateOnNewDocument", source=NO_ASSISTANT_JS)
                await tab.call("Page.navigate", url=url)
                deadline = time.monotonic() + seconds
                page: dict = {}
                while time.monotonic() < deadline:
                    await asyncio.sleep(1)
                    page = await tab.eval(PAGE_JS) or {}
                    text = page.get("text", "")
                    if page.get("traces") and all(s in text for s in ready):
                        break
                await asyncio.sleep(3)  # the charts' last requests and redraws
                handle = await tab.eval(HANDLE_JS)
                if handle:
                    await tab.drag(tuple(handle), RUN_LIST_WIDTH - handle[0])
                    await asyncio.sleep(1)
                page = await tab.eval(PAGE_JS) or page
                shot = await tab.call("Page.captureScreenshot", format="png")
                out.write_bytes(base64.b64decode(shot["data"]))
                return page
        finally:
            browser.terminate()
            browser.wait(timeout=30)


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

    from fedexp.tracking.links import DEFAULT_UI
    from fedexp.tracking.links import SHARE_TAG_PREFIX
    from fedexp.tracking.links import read_shared_view
    from fedexp.tracking.links import run_url

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
        children = [r for r in runs if r is not parent]
        tag = exp.tags.get(f"{SHARE_TAG_PREFIX}{parent.info.run_id}")
        if tag is None:
            print(f"check_mlflow_ui: the sweep stored no view:\n{done.stdout}")
            return 1
        group_by = (read_shared_view(tag).get("groupBy") or {}).get("groupByKeys", [])
        labels = group_labels(group_by, children)
        first = f"Group by: {group_by[0]['groupByData']}" if group_by else "Group by"
        server, base = _server(store, tmp)
        try:
            url = found.group(1).replace(DEFAULT_UI, base)
            out.parent.mkdir(parents=True, exist_ok=True)
            ready = [first, *(f"Group: {g}" for g in labels)]
            page = asyncio.run(_open_sweep(binary, url, out, ready))
            seen = sweep_view_of(page.get("href", ""), page.get("text", ""), group_by, labels)
            print(f"{url}: {seen} view ({len(children)} runs, {len(labels)} groups: ", end="")
            print(f"{'; '.join(labels)}); screenshot {out}")
            if seen != "grouped":
                print(f"check_mlflow_ui: expected {ready} on {page.get('href')}")
            if parent_out is not None:
                page_url = run_url(base, exp.experiment_id, parent.info.run_id)
                parent_out.parent.mkdir(parents=True, exist_ok=True)
                _browser(binary, page_url, f"--screenshot={parent_out.resolve()}")
                print(f"{page_url}: the parent run; screenshot {parent_out}")
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
        server, base = _server(store, tmp)
        try:
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
