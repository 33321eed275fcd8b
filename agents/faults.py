"""The fault matrix: one fault injected into a live run, and what it cost (`bench/faults.py`).

A fault run is `pearlctl demo`'s run (agents.demo: the embedded PostgreSQL and Redis, the front door,
an agent and a weight-sync worker per node, the loop, the trainer emulator with steady traffic,
borrowing plans and weight syncs; the preemptible notice `NOTICE_S`, longer by the outage for the
partition: `notice_s`) with one fault injected `at_s` wall seconds after the trainer starts, at the
first moment after that when a plan applies and a weight sync is under way (the row's
`detail.at_injection` says what was); a process the fault kills is started again a second later, as
a supervisor would. The run lasts `steps` training steps and, past
the fault, until the fleet has recovered (or `settle_s` more).

  fault               what is done
  agent_sigkill       SIGKILL to the training node's agent (its servers keep running)
  worker_sigkill      SIGKILL to the training node's weight-sync worker
  loop_sigkill        SIGKILL to the policy loop
  frontdoor_sigkill   SIGKILL to the front door's process group under load (its routers with it)
  server_sigkill      SIGKILL to one serving simulated SGLang server of the rollout node
  postgres_restart    the embedded PostgreSQL stopped (fast shutdown) and started again
  broker_restart      the embedded Redis stopped and started again (it keeps nothing: queued syncs are lost)
  database_partition  every fleet process reaches PostgreSQL through a TCP proxy, frozen for `hold_s`
                      (connections stay open, nothing passes: the kernel keeps ACKing)
  clock_skew          the training node's agent and servers see the wall clock 30 s ahead, the rollout
                      node's 30 s behind, for the whole run (`time.time` and `time.time_ns` shifted at
                      interpreter start by a `sitecustomize` on their PYTHONPATH; the monotonic clock,
                      as on a host whose clock is off, is not: libfaketime cannot be used, its
                      interposed `clock_nanosleep` fails CPython's sleeps with EINVAL)

What the row reports (`FaultReport`): `recovered_s`, from the injection until every process is up
(a process started again has registered: its agent row and its metrics endpoint heartbeat, the loop
leads), no claim is past its lease, the front door and the server of every worker in service answer,
and the trainer has had a request answered since the fault ended; plans failed; steps whose success the audit log shows
twice; GPUs held by two live server processes at once (sampled every half second from the servers'
own environments); borrowed GPUs returned late; requests lost (failed for good), and apart from them
those answered after a resubmission or a retry; servers whose reported weights version differs from
their worker's row at the end; and `pearlctl check`'s violations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from pearl.agents.demo import NODES, Demo, DemoConfig
from pearl.agents.drivers import make_driver
from pearl.agents.drivers.process import TAG
from pearl.agents.fleet import Proc
from pearl.controlplane.core.domain import NodeZone
from pearl.controlplane.services import embedded
from pearl.controlplane.services.settings import Settings
from pearl.controlplane.store import fault_view, invariants
from pearl.controlplane.store.secrets import control_token

FAULTS = ("agent_sigkill", "worker_sigkill", "loop_sigkill", "frontdoor_sigkill", "server_sigkill",
          "postgres_restart", "broker_restart", "database_partition", "clock_skew")
SKEW_S = 30.0
SKEWED_CLOCK = """\
import os
import time

_skew = float(os.environ.get("PEARL_FAULT_CLOCK_SKEW_S") or 0)
if _skew:  # this node's wall clock is off by _skew seconds (agents/faults.py, clock_skew)
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
"""
# The revocation notice of the runs, in model seconds: the demo's 30 s is 3 wall seconds at 10x, less than
# a pass, a drain and a release take on a 2-core machine busy with a fault's recovery and other tests
# (60 s, 6 wall seconds, was late once in CI after the partition); 120 s is 12.
NOTICE_S = 120.0


def notice_s(fault: str, hold_s: float, speed: float) -> float:
    """The run's preemptible notice in model seconds. The partition's row adds the outage to it: a notice
    that runs out while no process can reach the database cannot be honoured (the release, and the
    reaper's revocation at the deadline, are writes), so with the plain notice the row would fail
    whenever a revocation came in the 12 wall seconds before the freeze; what it holds to zero is what
    the outage itself loses."""
    return NOTICE_S + (hold_s * speed if fault == "database_partition" else 0.0)
RESTART_AFTER_S = 1.0  # a supervisor's pause before it starts a killed process again
WAIT_BUSY_S = 30.0  # how long past `at_s` a fault waits for a plan applying and a weight sync under way


@dataclass
class FaultReport:
    fault: str
    recovered_s: float | None  # None: not recovered before the run ended
    plans_failed: int
    steps_applied_twice: int
    gpus_double_held: int
    late_returns: int
    requests_lost: int
    requests_resubmitted: int
    weights_mismatched: int
    violations: int
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FreezingProxy:
    """A TCP proxy to PostgreSQL (a unix socket or host:port) that can freeze: while frozen it reads
    and forwards nothing, holding every connection open (what a partition behind a middlebox looks like
    from both ends)."""

    def __init__(self, upstream: str | tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="freezing-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> int:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self.port

    def freeze(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def thaw(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._open.set()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._server.close()
        tasks = asyncio.all_tasks(self._loop)  # the connections still open: closed with the proxy
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if isinstance(self.upstream, str):
                up_reader, up_writer = await asyncio.open_unix_connection(self.upstream)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        with contextlib.suppress(asyncio.CancelledError):  # the proxy stops: the connection ends with it
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                                 return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._open.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._open.wait()
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.close()


class FaultRun(Demo):
    """A demo run with one fault injected (module docstring)."""

    def __init__(self, config: DemoConfig, fault: str, *, steps: int = 4, at_s: float = 6.0, hold_s: float = 30.0,
                 settle_s: float = 60.0, max_wall_s: float = 300.0) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault: one of {', '.join(FAULTS)}, not {fault!r}")
        super().__init__(config)
        self.fault, self.at_s, self.hold_s, self.max_wall_s = fault, at_s, hold_s, max_wall_s
        # the run lasts `steps` training steps and, past the fault, until the fleet recovered (or `settle_s`)
        self.steps, self.settle_s = steps, settle_s
        self.trainer_engine: Any = None
        self.proxy: FreezingProxy | None = None
        self.injected_at: float | None = None
        self.fault_ended_at: float | None = None
        self.recovered_at: float | None = None
        self.double_held = 0
        self.weights_mismatched = 0
        self.restarted: list[str] = []
        self.busy_at_injection: dict[str, bool] = {}
        self.notes: list[str] = []

    # -- the environment of the fleet ---------------------------------------------------------------

    def _fleet_database_url(self, database: str) -> str:
        if self.fault != "database_partition":
            return database
        self.proxy = FreezingProxy(fault_view.server_address(database))
        return fault_view.through_proxy(database, self.proxy.start())

    def _trainer_engine(self, engine: Any, fleet_database: str) -> Any:
        if self.fault != "database_partition":
            return engine
        from pearl.controlplane.store.db import make_engine

        self.trainer_engine = make_engine(fleet_database)  # the trainer is cut off from the database too
        return self.trainer_engine

    def _agent_env(self, node: str) -> dict[str, str]:
        if self.fault != "clock_skew" or node not in (NODES[NodeZone.TRAINING], NODES[NodeZone.ROLLOUT]):
            return {}
        folder = self.run_dir / "skewed-clock"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sitecustomize.py").write_text(SKEWED_CLOCK)
        skew = SKEW_S if node == NODES[NodeZone.TRAINING] else -SKEW_S
        path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, "PEARL_FAULT_CLOCK_SKEW_S": repr(skew)}

    # -- the run ----------------------------------------------------------------------------------------

    async def _supervise(self, engine: Any) -> Proc | None:
        assert self.trainer is not None and self.fleet is not None
        run = asyncio.create_task(self.trainer.run())
        started = time.monotonic()
        inject = asyncio.create_task(self._inject(engine))
        died: Proc | None = None
        requests_at_end = -1
        while not run.done():
            now = time.monotonic()
            if inject.done() and inject.exception() is not None:
                self.notes.append(f"injection failed: {inject.exception()!r}")
                self.trainer.stop()
                break
            died = None if not inject.done() else self.fleet.check()
            if died is not None:
                self._stop_reason = f"{died.name} died"
                self.trainer.stop()
                break
            self.double_held = max(self.double_held, await asyncio.to_thread(self._gpus_double_held))
            if self.fault_ended_at is not None and self.recovered_at is None:
                if requests_at_end < 0:
                    requests_at_end = self.trainer.stats.requests
                if self.trainer.stats.requests > requests_at_end and await asyncio.to_thread(self._healthy, engine):
                    self.recovered_at = time.monotonic()
            settled = self.fault_ended_at is not None and (
                self.recovered_at is not None or now - self.fault_ended_at > self.settle_s)
            if settled and self.trainer.stats.training_steps >= self.steps:
                self.trainer.stop()  # enough steps, and the fault is over and recovered from (or never will be)
                break
            if now - started > self.max_wall_s:
                self.notes.append(f"stopped after {self.max_wall_s:g} s of wall time")
                self.trainer.stop()
                break
            await asyncio.wait([run], timeout=0.5)
        await run
        if not inject.done():
            inject.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await inject
        self.weights_mismatched = await asyncio.to_thread(self._weights_mismatched, engine)
        return died

    async def _inject(self, engine: Any) -> None:
        assert self.fleet is not None
        if self.fault == "clock_skew":  # in force from the start
            self.injected_at = self.fault_ended_at = time.monotonic()
            return
        await asyncio.sleep(self.at_s)
        # then at a moment when a plan applies and a weight sync is under way (or, failing that within
        # `WAIT_BUSY_S`, one of the two), as the matrix asks
        give_up = time.monotonic() + WAIT_BUSY_S
        while True:
            busy = await asyncio.to_thread(self._busy, engine)
            if all(busy.values()) or (time.monotonic() > give_up and any(busy.values())) \
                    or time.monotonic() > give_up + WAIT_BUSY_S:
                break
            await asyncio.sleep(0.05)
        self.busy_at_injection = busy
        self.injected_at = time.monotonic()
        f = self.fault
        if f in ("agent_sigkill", "worker_sigkill", "loop_sigkill", "frontdoor_sigkill"):
            name = {"agent_sigkill": f"agent {NODES[NodeZone.TRAINING]}",
                    "worker_sigkill": f"worker {NODES[NodeZone.TRAINING]}",
                    "loop_sigkill": "loop", "frontdoor_sigkill": "front door"}[f]
            proc = self.fleet.named(name)
            if f == "frontdoor_sigkill":
                os.killpg(proc.popen.pid, signal.SIGKILL)  # the process and the routers it runs
            else:
                os.kill(proc.popen.pid, signal.SIGKILL)
            await asyncio.to_thread(proc.popen.wait, 10)
            await asyncio.sleep(RESTART_AFTER_S)
            self.fleet.restart(proc)
            self.restarted.append(name)
        elif f == "server_sigkill":
            node = NODES[NodeZone.ROLLOUT]
            driver = make_driver("sim", self.fleet.run_dir / "servers" / node)
            servers = driver.servers()
            if not servers:
                raise RuntimeError(f"no server runs on {node} to kill")
            victim = servers[0]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(victim.pid, signal.SIGKILL)
            self.notes.append(f"killed the server of worker {victim.worker_id} (pid {victim.pid})")
        elif f == "postgres_restart":
            await asyncio.to_thread(embedded.stop_postgres, self.home)
            await asyncio.to_thread(embedded.start_postgres, self.home)
        elif f == "broker_restart":
            await asyncio.to_thread(embedded.stop_redis, self.home)
            await asyncio.to_thread(embedded.start_redis, self.home)
        elif f == "database_partition":
            assert self.proxy is not None
            self.proxy.freeze()
            await asyncio.sleep(self.hold_s)
            self.proxy.thaw()
        self.fault_ended_at = time.monotonic()

    # -- what the run looks like ---------------------------------------------------------------------

    def _busy(self, engine: Any) -> dict[str, bool]:
        try:
            return fault_view.under_way(engine)
        except Exception:  # noqa: BLE001 - a read that failed: not known busy
            return {"plan_applying": False, "sync_in_flight": False}

    def _healthy(self, engine: Any) -> bool:
        assert self.fleet is not None
        if self.fleet.check() is not None:
            return False
        try:
            h = fault_view.fleet_health(engine)
        except Exception:  # noqa: BLE001 - the database is still away: not healthy yet
            return False
        agents = {(p.name.removeprefix("agent "), p.popen.pid) for p in self.fleet.procs if p.name.startswith("agent ")}
        loop = self.fleet.named("loop").popen.pid
        if not agents <= h.agents:  # each node's agent process now is registered and beating
            return False
        if not {p.popen.pid for p in self.fleet.procs if p.name != "dashboard"} <= h.metrics_pids:
            return False  # a process started again has not come up (its metrics not recorded yet)
        if not (h.policy_leader or "").endswith(f":{loop}") or h.expired_claims or not h.front_door:
            return False  # the loop that runs now leads; no claim is past its lease; a front door is up
        try:  # the front door answers, and so does the server of every worker in service
            return all(httpx.get(f"{url}/health", timeout=2.0).status_code == 200
                       for url in [h.front_door, *h.serving])
        except httpx.HTTPError:
            return False

    def _gpus_double_held(self) -> int:
        """GPUs (node, device) two live server processes of this run hold at once, from the records of
        the servers and the tag each carries in its environment."""
        assert self.fleet is not None
        servers_root = str((self.fleet.run_dir / "servers").resolve())
        devices: dict[tuple[str, int], set[int]] = {}
        live_by_tag: dict[str, list[int]] = {}
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error):
                tag = proc.environ().get(TAG, "")
                if tag.startswith(servers_root) and os.getpgid(proc.pid) == proc.pid:
                    live_by_tag.setdefault(tag, []).append(proc.pid)
        for tag, pids in live_by_tag.items():  # two live servers of one worker hold its slot twice
            folder, _, worker = tag.rpartition(":")
            with contextlib.suppress(OSError, ValueError):
                record = json.loads((Path(folder) / f"worker-{worker}.json").read_text())
                for device in record.get("devices", []):
                    devices.setdefault((folder, int(device)), set()).update(pids)
        return sum(1 for pids in devices.values() if len(pids) > 1)

    def _weights_mismatched(self, engine: Any, settle_s: float = 20.0) -> int:
        """Serving workers whose server reports other weights than its row says, once no weight sync is
        queued or running (one in flight has loaded the server before it writes the row)."""
        token = control_token(engine)
        deadline = time.monotonic() + settle_s
        while fault_view.under_way(engine)["sync_in_flight"]:
            if time.monotonic() > deadline:
                self.notes.append(f"weight syncs still in flight {settle_s:g} s after the run")
                break
            time.sleep(0.25)
        mismatched = 0
        for worker, endpoint, version in fault_view.serving_weights(engine):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                info = httpx.get(f"{endpoint}/model_info", headers={"Authorization": f"Bearer {token}"},
                                 timeout=5.0).json()
                reported = str(info.get("weight_version", ""))
                if reported not in (str(version), "default" if version == 0 else ""):
                    mismatched += 1
                    self.notes.append(f"worker {worker}: server reports {reported}, row {version}")
        return mismatched

    def report(self, summary: dict[str, Any], engine: Any) -> FaultReport:
        failed = fault_view.failed_plans(engine)
        twice = fault_view.steps_succeeded_twice(engine)
        violations = invariants.check(engine).violations
        stats = self.trainer.stats if self.trainer is not None else None
        recovered = None
        if self.recovered_at is not None and self.injected_at is not None:
            recovered = round(self.recovered_at - self.injected_at, 2)
        return FaultReport(
            fault=self.fault, recovered_s=recovered, plans_failed=len(failed), steps_applied_twice=int(twice or 0),
            gpus_double_held=self.double_held, late_returns=int(summary.get("late_returns") or 0),
            requests_lost=stats.failed_requests if stats else 0,
            requests_resubmitted=(stats.resubmitted + stats.retried) if stats else 0,
            weights_mismatched=self.weights_mismatched, violations=len(violations),
            detail={"failed_plans": [{"plan": plan, "error": error} for plan, error in failed],
                    "at_injection": self.busy_at_injection,
                    "violations": [v.to_dict() for v in violations], "restarted": self.restarted,
                    "report_retries": stats.report_retries if stats else 0, "notes": self.notes,
                    "training_steps": summary.get("training_steps"), "requests": summary.get("requests"),
                    "tokens_per_s": summary.get("tokens_per_s"), "stopped": summary.get("stopped"),
                    "run_dir": str(self.run_dir)})


def run_fault(fault: str, home: Path, *, steps: int = 4, speed: float = 10.0, at_s: float = 6.0,
              hold_s: float = 30.0) -> FaultReport:
    """One fault run on embedded services of its own under `home`, stopped at the end."""
    from pearl.controlplane.store.db import make_engine

    embedded.start_postgres(home)  # started here, so the run leaves them up for the report
    embedded.start_redis(home)
    config = DemoConfig(speed=speed, steps=None, duration_s=1e6, simulate=False, settings=Settings(home=home),
                        overrides=(f"cluster.preemptible.notice_s={notice_s(fault, hold_s, speed):g}",))
    run = FaultRun(config, fault, steps=steps, at_s=at_s, hold_s=hold_s)
    engine = None
    try:
        result = run.run()
        engine = make_engine(result.database_url)
        return run.report(result.summary, engine)
    finally:
        if run.proxy is not None:
            run.proxy.stop()
        if run.trainer_engine is not None:
            run.trainer_engine.dispose()
        if engine is not None:
            engine.dispose()
        embedded.stop_redis(home)
        embedded.stop_postgres(home)
