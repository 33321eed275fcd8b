"""Requests through the real router to simulated workers, and the time a role switch takes.

Prints one JSON object:
- `throughput`: for 2, 8 and 32 colocated simulated workers (`pearlctl simworker`, sim driver), a
  closed loop of `--concurrency` clients sending short requests for `--seconds`, three ways measured
  in the same run: through the front door (which forwards to the colocated sglang-router child), to
  the sglang-router child directly, and to one worker directly (the servers alone). Requests per
  second, p50 and p99 latency (ms), and the front door's rate as a ratio of the router's. Generation
  is compressed `--speed` times so that the plumbing, not the simulated GPU, is what is measured.
- `role_switch`: from the start of the drain of an idle prefill worker to its first request served
  as a decode worker (deregister, wait idle, `/pd_role_switch`, register, one request through the
  front door), the median over `--switches` flips, and each part; the simulated switch itself is
  `role_switch_s` simulated seconds at `--speed`.
- `router_start`: a child router from its spawn to its first answer (`/liveness`), the median over
  `--starts` starts, through the front door's launcher (`python -m pearl.agents.router_process`)
  and, as the baseline in the same run, through the package's (`python -m
  sglang_router.launch_router`); a child that died is down at least this long.
Everything runs on this machine's loopback; the load generator shares its CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from pearl.agents.drivers.process import free_port  # noqa: E402
from pearl.agents.drivers.sim import SimDriver  # noqa: E402
from pearl.agents.server_client import ServerClient  # noqa: E402
from pearl.controlplane.core.domain import Role  # noqa: E402
from workers_support import spec, start_front_door  # noqa: E402


async def closed_loop(url: str, concurrency: int, seconds: float, tokens: int) -> dict:
    lat: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(i: int) -> None:
            nonlocal errors
            ids = list(range(i * 1000, i * 1000 + 64))
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                async with session.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
                        "max_new_tokens": tokens}}) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                lat.append(time.perf_counter() - t0)

        t0 = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.monotonic() - t0
    lat.sort()
    return {"requests_per_s": round(len(lat) / wall, 1), "p50_ms": round(1000 * lat[len(lat) // 2], 2),
            "p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 2), "requests": len(lat), "errors": errors}


def throughput(root: Path, workers: int, args: argparse.Namespace) -> dict:
    driver = SimDriver(root / f"node-{workers}", speed=args.speed)
    door = start_front_door(root / f"fd-{workers}")
    try:
        t0 = time.monotonic()
        servers = [driver.launch(spec(w, Role.COLOCATED)) for w in range(workers)]
        for s in servers:
            driver.wait_ready(s, 300)
        started = time.monotonic() - t0
        with door.client as front:
            for s in servers:
                front.register(s.endpoint, Role.COLOCATED)
            child = front.state()["children"]["colocated"]["url"]
        row = {"workers": workers, "start_all_s": round(started, 2)}
        for name, url in (("front_door", door.url), ("router", child), ("one_worker", servers[0].endpoint)):
            row[name] = asyncio.run(closed_loop(url, args.concurrency, args.seconds, args.tokens))
        row["front_door_vs_router"] = round(row["front_door"]["requests_per_s"] / row["router"]["requests_per_s"], 3)
        return row
    finally:
        door.stop()
        for s in driver.servers():
            driver.stop(s.worker_id, grace_s=5)


def role_switch(root: Path, args: argparse.Namespace) -> dict:
    driver = SimDriver(root / "node-switch", speed=args.speed)
    door = start_front_door(root / "fd-switch", mode="split")
    parts: dict[str, list[float]] = {k: [] for k in ("drain", "switch", "register", "first_request", "total")}
    try:
        servers = {w: driver.launch(spec(w, role)) for w, role in ((0, Role.PREFILL), (1, Role.DECODE),
                                                                  (2, Role.PREFILL))}
        for s in servers.values():
            driver.wait_ready(s, 120)
        front = door.client
        for s in servers.values():
            front.register(s.endpoint, s.role, s.bootstrap_port)
        role = Role.PREFILL
        for i in range(args.switches):
            new = Role.DECODE if role is Role.PREFILL else Role.PREFILL
            s = servers[2]
            client = ServerClient(s.endpoint, fence=i + 2)
            t0 = time.perf_counter()
            front.deregister(s.endpoint)
            client.wait_idle(60, poll_s=0.005)
            t1 = time.perf_counter()
            client.pd_role_switch(new.value)
            t2 = time.perf_counter()
            front.register(s.endpoint, new, s.bootstrap_port)
            t3 = time.perf_counter()
            with aiohttp_free_request(door.url) as ok:
                assert ok
            t4 = time.perf_counter()
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
                parts[k].append(v)
            role = new
        front.close()
        return {"switches": args.switches, "speed": args.speed, "simulated_switch_s": 1.0,
                **{f"{k}_s_median": round(statistics.median(v), 4) for k, v in parts.items()},
                "total_s_max": round(max(parts["total"]), 4)}
    finally:
        door.stop()
        for s in driver.servers():
            driver.stop(s.worker_id, grace_s=5)


class aiohttp_free_request:  # noqa: N801 - a context manager that sends one request with httpx
    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> bool:
        import httpx

        resp = httpx.post(self.url + "/generate", timeout=60,
                          json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        return resp.status_code == 200

    def __exit__(self, *exc: object) -> None:
        return None


def router_start(starts: int) -> dict:
    def once(module: str) -> float:
        port = free_port()
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                                 "--prometheus-port", str(free_port()), "--log-level", "warn"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while proc.poll() is None:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/liveness", timeout=0.5)
                    return time.monotonic() - t0
                except httpx.TransportError:
                    time.sleep(0.005)
            raise RuntimeError(f"{module} exited with {proc.returncode} before it answered")
        finally:
            proc.terminate()
            proc.wait()

    modules = {"pearl": "pearl.agents.router_process", "package_launcher": "sglang_router.launch_router"}
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(starts):  # interleaved, so that a change in the machine's load falls on both
        for name, module in modules.items():
            times[name].append(once(module))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"starts": starts, **{f"{name}_p50_s": round(m, 3) for name, m in medians.items()},
            "ratio_p50": round(medians["pearl"] / medians["package_launcher"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, action="append", help="default: 2, 8 and 32")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--speed", type=float, default=1000.0)
    parser.add_argument("--switches", type=int, default=5)
    parser.add_argument("--starts", type=int, default=7)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="pearl-bench-frontdoor-"))
    out = {"cpus": os.cpu_count(), "concurrency": args.concurrency, "seconds": args.seconds,
           "max_new_tokens": args.tokens, "speed": args.speed,
           "throughput": [throughput(root, n, args) for n in (args.workers or [2, 8, 32])],
           "role_switch": role_switch(root, argparse.Namespace(**{**vars(args), "speed": 25.0})),
           "router_start": router_start(args.starts)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
