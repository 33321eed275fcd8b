"""Helpers of the worker and front-door tests: simulated servers, the front door, a multi-turn load.

Everything here runs real processes on the loopback address: `pearlctl simworker` servers (through the
sim driver), the front door with its two real sglang-router children, and client threads that play
multi-turn trajectories through the front door (each turn's input is the previous input, its output
and some environment tokens, as an agentic rollout sends them).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from pearl.agents.drivers.base import ServerSpec
from pearl.agents.drivers.process import free_port
from pearl.agents.router_client import FrontDoorClient
from pearl.controlplane.core.domain import Role

SPEED = 25.0  # simulated seconds per wall second in these tests


def spec(worker: int, role: Role, generation: int = 1, fence: int = 1, overlap: bool = False,
         weights=None) -> ServerSpec:
    return ServerSpec(worker, "node-a", "127.0.0.1", role, (worker,), 1, "qwen3-8b", "h100", generation, fence,
                      overlap, weights)


@dataclass
class FrontDoorProcess:
    proc: subprocess.Popen
    url: str  # the clients'
    run_dir: Path
    log: Path
    admin_url: str = ""  # the admin API's (the agents')
    token: str | None = None  # what the admin API needs (registered in a database: the control token)

    @property
    def client(self) -> FrontDoorClient:
        return FrontDoorClient(self.admin_url, token=self.token)

    def children(self) -> list[int]:
        return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_front_door(run_dir: Path, port: int | None = None, mode: str | None = "colocated", hold_s: float = 60.0,
                     timeout_s: float = 90.0, env: dict[str, str] | None = None) -> FrontDoorProcess:
    """`pearlctl router serve` as a process; with `env` naming a database (PEARL_DATABASE_URL) it
    registers itself there, without it it runs alone (--no-register)."""
    port = port or free_port()
    admin_port = free_port()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "frontdoor.log"
    with log.open("ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pearl.cli.router", "serve", "--port", str(port),
                                 "--admin-port", str(admin_port),
                                 *(["--mode", mode] if mode else []), "--run-dir", str(run_dir),
                                 "--hold-s", str(hold_s),
                                 "--register" if env else "--no-register"],
                                stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                env={**os.environ, **env} if env else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"front door exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return FrontDoorProcess(proc, url, run_dir, log, f"http://127.0.0.1:{admin_port}",
                                        _token(env) if env else None)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"front door not up in {timeout_s} s: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def _token(env: dict[str, str]) -> str:
    from pearl.controlplane.store.db import make_engine
    from pearl.controlplane.store.secrets import control_token

    engine = make_engine(env["PEARL_DATABASE_URL"])
    try:
        return control_token(engine)
    finally:
        engine.dispose()


@dataclass
class Load:
    """Client threads playing multi-turn trajectories through `url` until stopped."""

    url: str
    trajectories: int = 8
    seed: int = 0
    failures: list[str] = field(default_factory=list)
    turns: int = 0
    resubmitted: int = 0
    kept_tokens: int = 0
    routers: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Load:
        for i in range(self.trajectories):
            t = threading.Thread(target=self._play, args=(self.seed * 1000 + i,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _play(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set():
                ids = [rng.randrange(1, 30000) for _ in range(rng.randint(50, 400))]
                for _ in range(rng.randint(2, 5)):
                    if self._stop.is_set():
                        return
                    want = rng.randint(20, 250)
                    try:
                        resp = http.post(self.url + "/generate",
                                         json={"input_ids": ids, "sampling_params": {"max_new_tokens": want}})
                    except httpx.HTTPError as exc:
                        self._fail(f"no answer: {exc}")
                        break
                    if resp.status_code != 200:
                        self._fail(f"{resp.status_code}: {resp.text[:300]}")
                        break
                    answer = resp.json()
                    meta = answer["meta_info"]
                    if len(answer["output_ids"]) != want or meta["finish_reason"]["type"] != "length":
                        self._fail(f"asked {want} tokens, got {len(answer['output_ids'])} ({meta['finish_reason']})")
                        break
                    with self._lock:
                        self.turns += 1
                        self.resubmitted += meta["pearl"]["resubmitted"]
                        self.kept_tokens += meta["pearl"]["kept_tokens"]
                        self.routers[meta["pearl"]["router"]] = self.routers.get(meta["pearl"]["router"], 0) + 1
                    ids = ids + answer["output_ids"] + [rng.randrange(1, 30000) for _ in range(rng.randint(5, 40))]
                    time.sleep(rng.uniform(0, 0.02))  # the environment

    def _fail(self, message: str) -> None:
        with self._lock:
            self.failures.append(message)

    def wait_turns(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        start = self.turns
        while self.turns - start < n:
            assert time.monotonic() < deadline, f"fewer than {n} turns in {timeout_s} s"
            assert not self.failures, self.failures[:3]
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def gone(pids: list[int]) -> bool:
    """Every pid has exited (zombies of this process reaped)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
