"""An in-process stand-in for a node's servers, for agent tests that need no processes: a driver whose
servers are objects that really change state (role, memory released, weights, requests running, the
newest fence seen), a client that talks to them and refuses an older fence as the simulated server
does, and a front door that records which workers it routes to and its mode."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pearl.agents.drivers.base import DriverError, Server, ServerSpec
from pearl.agents.steps import Timeouts
from pearl.controlplane.core.domain import Role

_ports = itertools.count(40000)

# Two rollout nodes of two tp-2 workers each, and agent timings short enough for tests
TWO_NODES = {
    "model": "qwen3-8b", "gpu": "h800", "tp": 2,
    "nodes": [
        {"name": "node-a", "zone": "rollout", "gpus": 4, "address": "127.0.0.1"},  # workers 1, 2
        {"name": "node-b", "zone": "rollout", "gpus": 4, "address": "127.0.0.1"},  # workers 3, 4
    ],
}
FAST = dict(lease_s=2.0, poll_s=0.1, heartbeat_s=0.2, reap_every_s=0.3, agent_timeout_s=1.5,
            timeouts=Timeouts(ready_s=5, drain_s=0.2, idle_s=2, poll_s=0.01))
ALL = frozenset({1, 2, 3, 4})



@dataclass
class FakeServer:
    spec: ServerSpec
    endpoint: str
    role: Role
    alive: bool = True
    released: bool = False
    weight_version: int = 0
    running: int = 0  # requests in flight
    fence: int = 0  # the newest fence seen
    aborted: int = 0  # requests aborted by pause_generation
    hung: bool = False  # alive but answering nothing (a stuck collective, say)
    commands: list[str] = field(default_factory=list)
    graph_gb_told: float | None = None  # the decode graph memory its last role switch was told


class FakeServers:
    """Every fake server of a test, by endpoint (shared by the drivers of several nodes)."""

    def __init__(self) -> None:
        self.by_endpoint: dict[str, FakeServer] = {}
        self.lock = threading.Lock()
        self.launches = 0
        self.hang_launch = threading.Event()  # set: launch blocks until cleared (a step stuck mid-way)
        self.in_launch = 0  # launches blocked right now
        self.most_in_launch = 0
        self.refuse_switch = False  # set: a flip answers 400 as SGLang does without room for its decode graphs

    def client(self, endpoint: str, fence: int | None = None) -> FakeClient:
        return FakeClient(self, endpoint, fence)


class FakeDriver:
    name = "fake"

    def __init__(self, servers: FakeServers, node: str, run_dir: Path | None = None) -> None:
        self.servers_ = servers
        self.node = node
        self.run_dir = run_dir or Path("/nonexistent")
        self.by_worker: dict[int, FakeServer] = {}

    def _server(self, s: FakeServer) -> Server:
        return Server(s.spec.worker_id, 1, s.endpoint, s.role, s.spec.generation,
                      9000 if s.role is Role.PREFILL else None, "")

    def launch(self, spec: ServerSpec) -> Server:
        if self.servers_.hang_launch.is_set():
            with self.servers_.lock:
                self.servers_.in_launch += 1
                self.servers_.most_in_launch = max(self.servers_.most_in_launch, self.servers_.in_launch)
            while self.servers_.hang_launch.is_set():
                threading.Event().wait(0.02)
            with self.servers_.lock:
                self.servers_.in_launch -= 1
        with self.servers_.lock:
            old = self.by_worker.get(spec.worker_id)
            if old is not None and old.alive and old.spec.generation == spec.generation:
                return self._server(old)
            if old is not None:
                old.alive = False
            s = FakeServer(spec, f"http://{spec.host}:{next(_ports)}", spec.role, fence=spec.fence,
                           weight_version=spec.weights.version if spec.weights else 0)
            self.by_worker[spec.worker_id] = s
            self.servers_.by_endpoint[s.endpoint] = s
            self.servers_.launches += 1
            return self._server(s)

    def running(self, worker_id: int) -> Server | None:
        s = self.by_worker.get(worker_id)
        return self._server(s) if s is not None and s.alive else None

    def servers(self) -> list[Server]:
        return [self._server(s) for s in self.by_worker.values() if s.alive]

    def wait_ready(self, server: Server, timeout_s: float) -> None:
        if not self.by_worker[server.worker_id].alive:
            raise DriverError(f"worker {server.worker_id}: the server exited")

    def stop(self, worker_id: int, grace_s: float = 10.0, pid: int | None = None) -> bool:
        s = self.by_worker.get(worker_id)
        if s is None or not s.alive or (pid is not None and pid != 1):
            return False
        s.alive = False
        return True

    def record_role(self, worker_id: int, role: Role) -> None:
        self.by_worker[worker_id].role = role

    def log_tail(self, worker_id: int, lines: int = 20) -> str:
        return ""


class FakeClient:
    def __init__(self, servers: FakeServers, endpoint: str, fence: int | None = None) -> None:
        self.servers = servers
        self.endpoint = endpoint
        self.fence = fence

    def _s(self, command: str = "") -> FakeServer:
        fence = self.fence if command else None
        s = self.servers.by_endpoint.get(self.endpoint)
        if s is None or not s.alive or s.hung:
            raise DriverError(f"{self.endpoint} does not answer")
        if fence is not None:
            if fence < s.fence:
                raise DriverError(f"{self.endpoint}: 409 stale fence {fence} < {s.fence}", status=409)
            s.fence = fence
        if command:
            s.commands.append(command)
        return s

    def health(self) -> bool:
        return not self._s().released

    def is_idle(self) -> bool:
        return self._s().running == 0

    def model_info(self) -> dict[str, Any]:
        s = self._s()
        return {"weight_version": s.weight_version, "disaggregation_mode": s.role.value}

    def pause_generation(self, mode: str = "abort") -> None:
        s = self._s(f"pause:{mode}")
        s.aborted += s.running
        s.running = 0

    def continue_generation(self) -> None:
        self._s("continue")

    def release_memory_occupation(self) -> None:
        s = self._s("release")
        if s.running:
            raise DriverError(f"{self.endpoint}: cannot release memory with {s.running} request(s) running")
        s.released = True

    def resume_memory_occupation(self) -> None:
        self._s("resume").released = False

    def pd_role_switch(self, new_role: str, decode_cuda_graph_memory_gb: float | None = None) -> None:
        s = self._s(f"switch:{new_role}")
        if s.running:
            raise DriverError(f"{self.endpoint}: a role switch needs an idle server")
        if self.servers.refuse_switch:
            raise DriverError(f"{self.endpoint}/pd_role_switch: 400: insufficient decode CUDA graph headroom",
                              status=400)
        s.graph_gb_told = decode_cuda_graph_memory_gb
        s.role = Role(new_role)

    def graph_memory_gb(self) -> float:
        return 2.0 if self._s().role is Role.DECODE else 0.0

    def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        self._s(f"load:{weight_version}").weight_version = weight_version


@dataclass
class FakeFrontDoor:
    workers: dict[str, str] = field(default_factory=dict)  # url -> role
    mode: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    down: int = 0  # the next calls that find no front door answering (it is restarting)

    def _answers(self) -> None:
        with self.lock:
            if self.down > 0:
                self.down -= 1
                raise DriverError("front door http://127.0.0.1:1: no answer (ConnectError: refused)")

    def register(self, url: str, role: str, bootstrap_port: int | None = None) -> None:
        self._answers()
        with self.lock:
            self.workers[url] = role

    def deregister(self, url: str) -> None:
        self._answers()
        with self.lock:
            self.workers.pop(url, None)

    def set_mode(self, mode: str) -> None:
        self.mode = mode

    def started(self) -> None:
        """Never restarted, so the server watch has nothing to register again (as with no front door)."""
        return None

    def listed(self) -> None:
        return None
