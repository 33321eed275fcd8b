"""`pearlctl demo`: the whole system live on one machine, beside the simulator's figures for the same work.

1. Services: the embedded PostgreSQL and Redis (the weight-sync broker) under PEARL_HOME (started if
   needed, stopped at the end if the demo started them), or the servers PEARL_DATABASE_URL /
   PEARL_BROKER_URL name. The demo's
   rows go to a database of their own, `pearl_demo`, created afresh on that server (left there after
   the run, for the SQL views).
2. The schema, and an inventory from the scenario: a training node (its GPUs are the overlap zone), a
   rollout node (the reserved GPUs) and a preemptible node, all on this host, with the scenario's
   workload as the prior and `time_scale` = the speed.
3. As separate processes (`agents.fleet.LocalFleet`): the front door over the real sglang-router, one
   agent per node with the `sim` driver (which launches the simulated SGLang servers, `speed` times
   faster than the wall clock, with the scenario's start-up, role-switch and weight-load times), one
   weight-sync Celery worker per node (`pearlctl worker`), and the policy loop.
4. The trainer emulator (`agents.trainer`): the scenario's batches through the front door, progress,
   telemetry, training begin and end with a snapshot per step, and the preemptible trace replayed
   as grants and revocations with notice. Meanwhile the simulator runs the same scenario for every
   system (`pearlctl sim compare`), at low priority. The run lasts the duration, or ends after
   `steps` training steps when that is given (then without the simulator: its window is the duration).
5. A live view while it runs; at the end, a summary from the database beside the simulator's figures.
   Ctrl-C, SIGTERM, or any component dying (named, with its last log lines) stops everything: no
   process is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pearl.agents.drivers.process import free_port
from pearl.agents.fleet import LocalFleet, Proc
from pearl.agents.trainer import TrainerEmulator, TrainerStats, summary
from pearl.controlplane.api import ControlPlane
from pearl.controlplane.core.domain import NodeZone
from pearl.controlplane.core.inventory import Inventory, InventoryNode, RolloutLoop
from pearl.controlplane.errors import PearlError
from pearl.controlplane.services import embedded
from pearl.controlplane.services.settings import Settings, get_settings, redact_url
from pearl.controlplane.store import invariants, roles
from pearl.controlplane.store.db import make_engine, recreate_database, transaction, upgrade
from pearl.controlplane.store.fleet_status import activity_timeline, read_fleet_status, run_summary
from pearl.controlplane.store.inventory_import import import_inventory
from pearl.controlplane.weights import write_demo_snapshot
from pearl.sim.scenario import Scenario, load_scenario

DEMO_DATABASE = "pearl_demo"
DEFAULT_SCENARIO = "demo-qwen3-30b-a3b-seg2"
NODES = {NodeZone.TRAINING: "train-0", NodeZone.ROLLOUT: "roll-0", NodeZone.PREEMPTIBLE: "spot-0"}
QUERIES = (
    ("the steps of the last plan, with how long each ran",
     "SELECT step_id, key, action, node, status, seconds FROM plan_timeline "
     "WHERE plan_id = (SELECT max(id) FROM plans) ORDER BY step_id;"),
    ("every borrow of a training GPU: activation, return and lateness",
     "SELECT worker_id, granted_at, activation_s, return_s, late_s FROM borrow_cycles ORDER BY granted_at;"),
    ("why the policy switched, each time",
     "SELECT id, created_at, reason, predicted_current_s, predicted_target_s FROM decisions ORDER BY id;"),
)


class ComponentDied(PearlError):
    """A component of the live system died."""


@dataclass
class DemoConfig:
    scenario: str = DEFAULT_SCENARIO
    speed: float = 10.0  # model seconds per wall second
    duration_s: float | None = None  # model seconds; None: the scenario's
    simulate: bool = True  # run the simulator beside (the `systems` and `simulated_tokens_per_s`)
    steps: int | None = None  # end the run after this many training steps (then no simulator beside)
    loop_interval_s: float = 1.0
    overrides: tuple[str, ...] = ()  # `KEY=VALUE` changes to the scenario (as `sim compare --set`)
    settings: Settings = field(default_factory=get_settings)


@dataclass
class DemoRun:
    """What a run produced: the summary, and where to look."""

    summary: dict[str, Any]
    database_url: str
    run_dir: Path
    died: Proc | None = None
    stopped_servers: tuple[str, ...] = ()
    activity: list[dict[str, Any]] = field(default_factory=list)  # worker activity changes (the plot)
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (wall s, tokens generated so far)
    started_at: float = 0.0  # when the trainer's clock started (epoch s)


def inventory_for(sc: Scenario, speed: float) -> Inventory:
    """The scenario's cluster as one node per zone on this host."""
    gpus = {NodeZone.TRAINING: sc.cluster.training_gpus, NodeZone.ROLLOUT: sc.cluster.reserved_rollout_gpus,
            NodeZone.PREEMPTIBLE: sc.max_preemptible_gpus - sc.max_preemptible_gpus % sc.tp}
    nodes = tuple(InventoryNode(name=NODES[z], zone=z, gpus=n, address="127.0.0.1") for z, n in gpus.items() if n)
    loop = RolloutLoop(**dataclasses.asdict(sc.training.rollout()))
    return Inventory(model=sc.model, gpu=sc.gpu, tp=sc.tp, nodes=nodes, workload=sc.workload, rollout=loop,
                     time_scale=speed)


class Demo:
    def __init__(self, config: DemoConfig, view: Any = None) -> None:
        self.cfg = config
        self.view = view  # called with (status, trainer stats, model seconds) every half second
        self.home = config.settings.home
        self.run_dir = self.home / "demo" / time.strftime("%Y%m%d-%H%M%S")
        self.fleet: LocalFleet | None = None
        self.trainer: TrainerEmulator | None = None
        self.started: list[str] = []  # embedded servers this demo started (stopped at the end)
        self.dashboard_url: str | None = None  # `pearlctl dashboard`, while the demo runs
        self._stop_reason: str | None = None

    # -- services ------------------------------------------------------------------------------------

    def _services(self) -> tuple[str, str]:
        s = self.cfg.settings
        if s.database_url:
            base = embedded.database_url(s)
        else:
            was = embedded.postgres_status(s).running
            base = embedded.start_postgres(self.home)
            if not was:
                self.started.append("postgresql")
        if s.broker_url:
            broker = embedded.broker_url(s)
        else:
            was = embedded.redis_status(s).running
            broker = embedded.start_redis(self.home)
            if not was:
                self.started.append("redis")
        return recreate_database(base, DEMO_DATABASE), broker

    def _stop_services(self) -> None:
        """Stop the embedded servers this demo started (those the user had running stay)."""
        for name, stop in (("redis", embedded.stop_redis), ("postgresql", embedded.stop_postgres)):
            if name not in self.started:
                continue
            for attempt in range(3):
                try:
                    stop(self.home)
                    break
                except PearlError as exc:
                    print(f"demo: stopping the embedded {name} (attempt {attempt + 1}): {exc}", file=sys.stderr)
                    time.sleep(1.0)

    # -- the run -------------------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        """Ctrl-C or SIGTERM: finish the run now."""
        self._stop_reason = self._stop_reason or reason
        if self.trainer is not None:
            self.trainer.stop()

    def run(self) -> DemoRun:
        """The whole run (module docstring). Ctrl-C or SIGTERM at any moment ends it: whatever was
        started is stopped, and the summary says where it stopped."""
        previous = {sig: signal.signal(sig, lambda *_, n=name: self.stop(n))
                    for sig, name in ((signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated"))}
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> DemoRun:
        sc = load_scenario(self.cfg.scenario, list(self.cfg.overrides))
        duration = self.cfg.duration_s if self.cfg.duration_s is not None else sc.duration_s
        sc = sc.model_copy(update={"duration_s": duration})
        engine = None
        sim: subprocess.Popen | None = None
        died: Proc | None = None
        killed: list[str] | None = None
        try:
            database, broker = self._services()
            engine = make_engine(database)
            upgrade(engine)
            with transaction(engine, actor="pearlctl demo", reason="demo inventory") as session:
                import_inventory(session, inventory_for(sc, self.cfg.speed))
            fleet_database = self._fleet_database_url(database)
            env = {"PEARL_DATABASE_URL": fleet_database, "PEARL_HOME": str(self.home), "PEARL_BROKER_URL": broker}
            if roles.mode() == "component":  # the embedded default: each process as its component's role
                env["PEARL_DATABASE_ROLES"] = "component"
                for node in inventory_for(sc, self.cfg.speed).nodes:
                    roles.ensure_node_role(engine, node.name)
            self.fleet = fleet = LocalFleet(self.run_dir, env, metrics=True)
            port = free_port()
            fleet.start_front_door(port)
            dashboard_port = free_port()
            fleet.start_dashboard(dashboard_port)
            self.dashboard_url = f"http://127.0.0.1:{dashboard_port}/"
            if self.view is None:
                print(f"demo: the dashboard is at {self.dashboard_url} while the demo runs", file=sys.stderr,
                      flush=True)
            r = sc.reconfig
            sim_args = ("--startup-s", repr(r.cold_start_s), "--role-switch-s", repr(r.role_switch_s),
                        "--weight-load-s", repr(sc.training.weight_sync_s))
            nodes = [n.name for n in inventory_for(sc, self.cfg.speed).nodes]
            for node in nodes:
                fleet.start_agent(node, speed=self.cfg.speed, sim_args=sim_args, env=self._agent_env(node))
                fleet.start_worker(node)
            if self.cfg.simulate and self.cfg.steps is None:  # the simulator's window is the duration
                sim = self._simulate(duration)
            self._wait_ready(engine, len(nodes))
            cp = ControlPlane(engine=self._trainer_engine(engine, fleet_database), broker_url=broker)
            spot = NODES[NodeZone.PREEMPTIBLE] if NODES[NodeZone.PREEMPTIBLE] in nodes else None
            self.trainer = TrainerEmulator(sc, cp, f"http://127.0.0.1:{port}", speed=self.cfg.speed,
                                           snapshot_dir=self.run_dir / "snapshots", preemptible_node=spot,
                                           write_snapshot=write_demo_snapshot, steps=self.cfg.steps)
            if self._stop_reason is None:
                # the simulator decides its first fleet with the trace's t=0 GPUs in place: so does the
                # loop, started once they are granted
                self.trainer.grant_initial()
            fleet.start_loop(self.cfg.loop_interval_s, lease_s=max(5.0, 5 * self.cfg.loop_interval_s))
            if self._stop_reason is None:
                self._warm_up(engine)  # the simulator starts with its first fleet in place: so does the run
            if self._stop_reason is None:
                died = asyncio.run(self._supervise(engine))
            killed = fleet.stop()
            simulated = self._simulated(sim) if died is None and self._stop_reason is None else None
            report = run_summary(engine)
            violations = [v.to_dict() for v in invariants.check(engine).violations]
            activity = activity_timeline(engine)
        finally:
            if self.fleet is not None and killed is None:
                killed = self.fleet.stop()
            if sim is not None and sim.poll() is None:
                sim.kill()
                sim.wait(10)
            if engine is not None:
                engine.dispose()
            self._stop_services()
        stats = self.trainer.stats if self.trainer is not None else TrainerStats()
        out = {
            **summary(stats, self.cfg.speed),
            "plans_applied": report["plans_applied"], "weight_syncs": report["weight_syncs"],
            "borrowed_returns": report["borrowed_returns"], "late_returns": report["late_returns"],
            "late_revocations": report["late_revocations"], "training_delay_s": report["training_delay_s"],
            "violations": violations,
            "scenario": sc.name, "speed": self.cfg.speed, "duration_s": duration, "steps": self.cfg.steps,
            **{f"simulated_{key}": simulated.get("pearl", {}).get(key) if simulated else None
               for key in ("tokens_per_s", "tokens_per_s_window", "tokens_per_s_ratio_of_sums")},
            "systems": simulated, "stopped": self._stop_reason, "killed": killed,
            "database": redact_url(database), "dashboard": self.dashboard_url,
        }
        return DemoRun(out, database, self.run_dir, died, tuple(killed or ()), activity, list(stats.timeline),
                       stats.started_at)

    def _fleet_database_url(self, database: str) -> str:
        """The database URL the fleet's processes are given (the demo's own; a fault run's proxy)."""
        return database

    def _trainer_engine(self, engine: Any, fleet_database: str) -> Any:
        """The engine the trainer reports through (the demo's own; a partition's, through its proxy)."""
        return engine

    def _agent_env(self, node: str) -> dict[str, str]:
        """What a node's agent adds to the fleet's environment (nothing; a fault run's skewed clock)."""
        return {}

    def _wait_ready(self, engine: Any, agents: int, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.fleet is not None
            dead = self.fleet.check()
            if dead is not None:
                raise ComponentDied(f"{dead.name} exited ({dead.popen.returncode}) while starting:\n{dead.tail()}")
            status = read_fleet_status(engine)
            live = [a for a in status["agents"] if a["stopped_at"] is None]
            if status["router"] is not None and status["router"]["running"] and len(live) >= agents:
                return
            if self._stop_reason:
                return
            if time.monotonic() > deadline:
                raise ComponentDied(f"the fleet did not come up within {timeout_s:g} s (front door "
                                    f"{'up' if status['router'] and status['router']['running'] else 'down'}, "
                                    f"{len(live)}/{agents} agents)")
            time.sleep(0.2)

    def _warm_up(self, engine: Any, timeout_s: float = 180.0) -> None:
        """Wait until the policy's first fleet serves (its first plan succeeded), as the simulator's run
        starts with it in place; the trainer's clock starts after."""
        assert self.fleet is not None
        deadline = time.monotonic() + timeout_s
        while self._stop_reason is None:
            dead = self.fleet.check()
            if dead is not None:
                raise ComponentDied(f"{dead.name} exited ({dead.popen.returncode}) while warming up:\n{dead.tail()}")
            status = read_fleet_status(engine)
            plan = status["plan"]
            if plan is not None and plan["status"] == "succeeded" and any(
                    w["activity"] == "active" for w in status["workers"]):
                return
            if time.monotonic() > deadline:
                raise ComponentDied(f"the first fleet did not come up within {timeout_s:g} s (latest plan: "
                                    f"{plan['id'] if plan else None} {plan['status'] if plan else ''})")
            if self.view is not None:
                self.view(status, None, 0.0)
            time.sleep(0.25)

    async def _supervise(self, engine: Any) -> Proc | None:
        """Run the trainer; watch the processes and refresh the view; stop on the first death."""
        assert self.trainer is not None and self.fleet is not None
        loop = asyncio.get_running_loop()
        for sig, name in ((signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")):
            loop.add_signal_handler(sig, self.stop, name)
        run = asyncio.create_task(self.trainer.run())
        died: Proc | None = None
        while not run.done():
            died = self.fleet.check()
            if died is not None:
                self._stop_reason = f"{died.name} died"
                self.trainer.stop()
                break
            if self.view is not None:
                with contextlib.suppress(PearlError):
                    status = await asyncio.to_thread(read_fleet_status, engine)
                    self.view(status, self.trainer.stats, self.trainer.model_s())
            await asyncio.wait([run], timeout=0.5)
        await run
        return died

    # -- the simulator beside ------------------------------------------------------------------------

    def _simulate(self, duration: float) -> subprocess.Popen:
        out = self.run_dir / "simulated.json"
        argv = [str(Path(sys.executable).with_name("pearlctl")), "sim", "compare", "--scenario", self.cfg.scenario,
                *[a for o in self.cfg.overrides for a in ("--set", o)], "--set", f"duration_s={duration!r}", "--json"]
        with out.open("w") as stdout, (self.run_dir / "simulated.log").open("w") as stderr:
            return subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                    preexec_fn=lambda: os.nice(10), start_new_session=True)

    def _simulated(self, sim: subprocess.Popen | None) -> dict[str, Any] | None:
        if sim is None:
            return None
        try:
            sim.wait(timeout=300)
        except subprocess.TimeoutExpired:
            sim.kill()
            sim.wait(5)
            return None
        with contextlib.suppress(OSError, ValueError):
            systems = json.loads((self.run_dir / "simulated.json").read_text())["systems"]
            return {name: {k: s[k] for k in ("tokens_per_s", "tokens_per_s_window", "tokens_per_s_ratio_of_sums",
                                             "rollout_steps", "gpu_seconds", "reconfigurations")}
                    for name, s in systems.items()}
        return None
