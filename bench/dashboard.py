"""Dashboard: how long `pearlctl dashboard` takes to show a fleet of 32 and of 4,096 GPUs.

Prints one JSON object. For each size, a fleet is imported (rollout nodes of 8 GPUs, TP2), every
worker serving colocated, and a colocated -> split switch written and applied (its steps on the
timeline: 12,290 at 4,096 GPUs). Reported, medians of `--repeat`:
- `read_s`: `store.dashboard.read_dashboard_state` (the rows and views, one transaction), and the
  JSON's size;
- `api_s`: `GET /api/state` from a running `pearlctl dashboard`;
- `first_draw_ms`: headless Chromium (driven over its DevTools protocol, in real time) loading the
  page, from the start of navigation to the fleet drawn (the page's own `performance.now()`), and
  `draw_ms` the drawing alone; `load_wall_s` is the same seen from outside (navigate sent to the
  fleet on screen). The browser is started once per size, outside the timings.
The baseline measured in the same run is the smallest size (`over_smallest`).

    .venv/bin/python bench/dashboard.py [--gpus 32,4096] [--repeat 5] [--database-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from db_support import BenchServer, machine
from pearl.agents.drivers.process import free_port
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.dashboard import read_dashboard_state
from pearl.controlplane.store.db import make_engine, transaction
from pearl.controlplane.store.snapshot import load_snapshot
from plan_graph import serving_colocated

PEARLCTL = Path(sys.executable).with_name("pearlctl")


def _median(xs: list[float], digits: int = 4) -> float:
    return round(statistics.median(xs), digits)


async def _page_loads(url: str, repeat: int) -> list[dict[str, float]]:
    """Load `url` `repeat` times in one headless Chromium over the DevTools protocol; per load the
    page's own marks and the wall time from `Page.navigate` to the fleet drawn."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no Chromium (apt-get install chromium)")
    proc = await asyncio.create_subprocess_exec(
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0", "about:blank",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        devtools = None
        while devtools is None:
            line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("Chromium exited before its DevTools answered")
            found = re.search(r"DevTools listening on (ws://[^/]+)/", line)
            devtools = found.group(1).replace("ws://", "http://") if found else None
        async with aiohttp.ClientSession() as http:
            async with http.get(devtools + "/json/list") as resp:
                page = next(t for t in await resp.json() if t["type"] == "page")
            async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                ids = itertools.count(1)

                async def call(method: str, **params: Any) -> dict[str, Any]:
                    i = next(ids)
                    await ws.send_json({"id": i, "method": method, "params": params})
                    while True:
                        msg = await ws.receive_json(timeout=60)
                        if msg.get("id") == i:
                            return msg.get("result", {})

                loads = []
                for _ in range(repeat):
                    await call("Page.navigate", url="about:blank")
                    t0 = time.perf_counter()
                    await call("Page.navigate", url=url)
                    while True:
                        got = await call("Runtime.evaluate", returnByValue=True, expression=(
                            "document.body && document.body.dataset.firstDrawMs ? "
                            "[+document.body.dataset.firstDrawMs, +document.body.dataset.drawMs] : null"))
                        value = got.get("result", {}).get("value")
                        if value:
                            break
                        if time.perf_counter() - t0 > 60:
                            raise RuntimeError("the page never drew the fleet")
                        await asyncio.sleep(0.01)
                    loads.append({"first_draw_ms": value[0], "draw_ms": value[1],
                                  "load_wall_s": time.perf_counter() - t0})
                return loads
    finally:
        proc.kill()
        await proc.wait()


def one_size(server: BenchServer, gpus: int, repeat: int) -> dict[str, Any]:
    url = server.pearl_database("bench_dashboard")
    engine = make_engine(url)
    proc = None
    try:
        workers = serving_colocated(engine, gpus)
        prefill = workers // 4
        target = Target(frozenset(range(1, workers + 1)), {Role.PREFILL: prefill, Role.DECODE: workers - prefill},
                        reason="bench: colocated -> split")
        with transaction(engine, actor="bench") as session:
            plan_id = plan_store.write_plan(session, orchestrate(load_snapshot(session), target), None)
        plan_store.apply(engine, plan_id, actor="bench")
        reads, size = [], 0
        for _ in range(repeat):
            t0 = time.perf_counter()
            state = read_dashboard_state(engine)
            reads.append(time.perf_counter() - t0)
            size = len(json.dumps(state, default=str))
        port = free_port()
        env = {**os.environ, "PEARL_DATABASE_URL": url}
        proc = subprocess.Popen([str(PEARLCTL), "dashboard", "--port", str(port)], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(base, timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        api = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            httpx.get(base + "api/state", timeout=60).raise_for_status()
            api.append(time.perf_counter() - t0)
        loads = asyncio.run(_page_loads(base, repeat))
        return {"gpus": gpus, "workers": workers, "plan_steps": state["plan"]["steps_total"],
                "plan_steps_sent": len(state["plan"]["steps"]), "json_bytes": size,
                "read_s": _median(reads), "api_s": _median(api),
                "first_draw_ms": _median([x["first_draw_ms"] for x in loads], 1),
                "draw_ms": _median([x["draw_ms"] for x in loads], 1),
                "load_wall_s": _median([x["load_wall_s"] for x in loads], 3)}
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        engine.dispose()
        server.drop(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="32,4096", help="comma-separated sizes (the first is the baseline)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--database-url", help="a maintenance database of the server to use (default: an "
                        "embedded server of the benchmark's own)")
    args = parser.parse_args()
    started = time.perf_counter()
    with BenchServer(args.database_url) as server:
        out: dict[str, Any] = {"bench": "dashboard", "repeat": args.repeat, "database": server.settings(),
                               "machine": machine(), "sizes": []}
        for gpus in (int(g) for g in args.gpus.split(",")):
            out["sizes"].append(one_size(server, gpus, args.repeat))
    base = out["sizes"][0]
    for row in out["sizes"][1:]:
        row["over_smallest"] = {k: round(row[k] / base[k], 2) if base[k] else None
                                for k in ("read_s", "api_s", "first_draw_ms", "load_wall_s")}
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
