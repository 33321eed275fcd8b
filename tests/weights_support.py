"""Helpers of the weight-sync tests: a live fleet of simulated servers brought up by real agents (the
sim driver), the nodes' weight-sync Celery workers as `pearlctl worker` processes, snapshots, and
waiting on the rows."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pearl.agents.agent import Agent, AgentConfig
from pearl.agents.drivers import make_driver
from pearl.agents.server_client import ServerClient
from pearl.agents.steps import NoFrontDoor, Timeouts
from pearl.controlplane.api import ControlPlane
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import Worker
from pearl.controlplane.weights import write_snapshot
from plan_support import PEARLCTL, REPO, import_cluster, propose
from sqlalchemy import Engine, select, text

TWO_NODES = {
    "model": "qwen3-8b", "gpu": "h800", "tp": 2,
    "nodes": [
        {"name": "node-a", "zone": "rollout", "gpus": 4, "address": "127.0.0.1"},  # workers 1, 2
        {"name": "node-b", "zone": "rollout", "gpus": 4, "address": "127.0.0.1"},  # workers 3, 4
    ],
}
SPEED = 20.0
TENSORS = ("model.embed_tokens.weight", "model.layers.0.mlp.weight", "model.layers.1.mlp.weight", "lm_head.weight")


def snapshot(directory: Path, version: int) -> Path:
    """A small real snapshot for `version` (different bytes every version)."""
    rng = np.random.default_rng(version)
    write_snapshot({name: rng.standard_normal((32, 64)).astype(np.float16) for name in TENSORS}, directory,
                   version=version)
    return directory


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)


def client(endpoint: str, fence: int | None = None) -> ServerClient:
    return ServerClient(endpoint, timeout_s=30.0, fence=fence)


class LiveFleet:
    """Agents (threads, sim driver) and Celery workers (processes) over one database and broker."""

    def __init__(self, engine: Engine, database_url: str, broker: str, run_dir: Path, env: dict[str, str],
                 sim_args: tuple[str, ...] = ("--weight-load-s", "2"), weights_s: float = 60.0,
                 lease_s: float = 5.0) -> None:
        self.engine, self.database_url, self.broker, self.run_dir = engine, database_url, broker, run_dir
        self.env = {**env, "PEARL_DATABASE_URL": database_url, "PEARL_BROKER_URL": broker,
                    "PEARL_SYNC_VISIBILITY_S": "5", "PEARL_SYNC_TIMEOUT_S": "30"}
        self.sim_args = sim_args
        self.weights_s = weights_s
        self.lease_s = lease_s
        self.drivers: dict[str, Any] = {}
        self.agents: list[tuple[Agent, threading.Thread]] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.cp = ControlPlane(engine=engine, broker_url=broker)

    def start_agent(self, node: str, crash_after_s: float = 60.0,
                    front_door: Callable[[], Any] = NoFrontDoor) -> None:
        driver = self.drivers.setdefault(node, make_driver("sim", self.run_dir / "servers" / node, speed=SPEED,
                                                           extra_args=self.sim_args))
        config = AgentConfig(node=node, driver="sim", lease_s=self.lease_s, poll_s=0.1, heartbeat_s=0.5,
                             watch_s=0.2, crash_after_s=crash_after_s,
                             timeouts=Timeouts(ready_s=30, idle_s=5, poll_s=0.02, weights_s=self.weights_s))
        agent = Agent(self.engine, config, driver, client=client, front_door=front_door)
        thread = threading.Thread(target=agent.run, name=f"agent-{node}", daemon=True)
        thread.start()
        self.agents.append((agent, thread))

    def start_worker(self, node: str, concurrency: int = 4, stall_s: float = 60.0,
                     metrics: bool = False) -> subprocess.Popen:
        log = (self.run_dir / f"worker-{node}.log").open("ab")
        proc = subprocess.Popen([str(PEARLCTL), "worker", "--node", node, "--concurrency", str(concurrency),
                                 "--resend-s", "2", "--stall-s", str(stall_s),
                                 *(("--metrics-port", "0") if metrics else ())],
                                env=self.env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.workers[node] = proc
        return proc

    def worker_log(self, node: str) -> str:
        with contextlib.suppress(OSError):
            return (self.run_dir / f"worker-{node}.log").read_text(errors="replace")[-3000:]
        return ""

    def serve(self, members: set[int], role: Role = Role.COLOCATED, timeout_s: float = 60.0) -> int:
        plan_id = propose(self.engine, Target(frozenset(members), {role: len(members)}, reason="test"))
        plan_store.apply(self.engine, plan_id)
        self.wait_plan(plan_id, timeout_s)
        return plan_id

    def wait_plan(self, plan_id: int, timeout_s: float, status: str = "succeeded") -> None:
        def done() -> bool:
            with transaction(self.engine) as s:
                now = s.execute(text("SELECT status, error FROM plans WHERE id = :id"), {"id": plan_id}).one()
            if now.status in ("failed", "aborted") and status != now.status:
                raise AssertionError(f"plan {plan_id} {now.status}: {now.error}")
            return now.status == status
        wait_for(done, timeout_s, f"plan {plan_id} {status}")

    def train(self, step: int, version: int) -> Path:
        """A training step that produces `version`, with its snapshot."""
        path = snapshot(self.run_dir / "snapshots" / f"v{version}", version)
        self.cp.training_begin(step, wait_s=0)
        self.cp.training_end(step, weights_version=version, snapshot=str(path))
        return path

    def versions(self) -> dict[int, int]:
        """Serving workers' weights versions."""
        with transaction(self.engine) as s:
            return dict(s.execute(select(Worker.id, Worker.weights_version)
                                  .where(Worker.activity == "active")).all())

    def endpoint(self, worker_id: int) -> str:
        with transaction(self.engine) as s:
            return s.scalar(select(Worker.endpoint).where(Worker.id == worker_id))

    def served(self, worker_id: int) -> dict[str, Any]:
        with client(self.endpoint(worker_id)) as api:
            info = api.model_info()
            state = api._json(api._call("GET", "/pearl/state"))
        return {"version": info["weight_version"], "checksum": info.get("weights_checksum"),
                "loads": state["weight_loads"], "paused": state["paused"]}

    def wait_versions(self, members: set[int], version: int, timeout_s: float = 60.0) -> None:
        try:
            wait_for(lambda: all(self.versions().get(w, -1) >= version for w in members), timeout_s,
                     f"workers {sorted(members)} at version {version}")
        except AssertionError as exc:
            logs = "\n".join(f"--- worker {node}:\n{self.worker_log(node)}" for node in self.workers)
            raise AssertionError(f"{exc} (now {self.versions()})\n{logs}") from None

    def assert_running(self, node: str) -> None:
        proc = self.workers[node]
        assert proc.poll() is None, f"worker {node} exited {proc.returncode}:\n{self.worker_log(node)}"

    def stop_worker(self, node: str, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        proc = self.workers.pop(node)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        try:
            return proc.wait(timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        for node in list(self.workers):
            self.stop_worker(node)
        for agent, _ in self.agents:
            agent.stop()
        for _, thread in self.agents:
            thread.join(timeout=30)
        for driver in self.drivers.values():
            for server in driver.servers():
                driver.stop(server.worker_id, grace_s=5.0)


def sync_rows(engine: Engine) -> list[dict[str, Any]]:
    with transaction(engine) as s:
        return [dict(r) for r in s.execute(text(
            "SELECT worker_id, version, state, method, attempts, error FROM weight_syncs ORDER BY worker_id, version"))
            .mappings()]


def version_moves(engine: Engine, worker_id: int, version: int) -> int:
    """How many times the rows moved the worker to `version` (the audit log)."""
    with transaction(engine) as s:
        return s.scalar(text(
            "SELECT count(*) FROM events WHERE entity = 'workers' AND entity_id = :w AND op = 'update' "
            "AND (new ->> 'weights_version')::bigint = :v AND (old ->> 'weights_version')::bigint < :v"),
            {"w": str(worker_id), "v": version})


def bring_up(engine: Engine, database_url: str, broker: str, tmp_path: Path, env: dict[str, str],
             **options: Any) -> LiveFleet:
    import_cluster(engine, TWO_NODES)
    return LiveFleet(engine, database_url, broker, tmp_path, env, **options)
