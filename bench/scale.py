"""Scale: a large fleet switched colocated -> split -> colocated by many agents at once, on one PostgreSQL.

Prints one JSON object. A fleet of `--gpus` rollout GPUs (TP2, spread evenly over `--agents` nodes)
is imported serving colocated. One agent thread per node, with two connections of its own as the
agent has (one for claims and reports, one listening for NOTIFY wake-ups), claims its node's ready steps
(`plan_store.claim_steps`), enacts each with a zero-latency effect and reports it
(tests/plan_support.enact: the effect under its claim, then `complete_step`), every step in a
transaction of its own. Two plans run one after the other: colocated -> a split with a quarter of
the workers prefill, and back. A monitor samples the server's connections to the database.

Reported (the keys the scale target is read from):
- `plan_write_s`: orchestrating and writing the larger of the two plans (with its commit);
- `reconcile_s`: the slower plan's apply -> succeeded, wall time;
- `reports_per_s`: step reports over the wall time of both reconciles (every agent together);
- `claim_p50_ms` / `claim_p99_ms`: one claim transaction that returned steps;
- `peak_connections`: the most connections to the database at any sample;
- `status_json_s`: `pearlctl status --json`'s query and JSON (`fleet_status.read_fleet_status`)
  on the fleet after the switches, the median of 3;
- `violations`: the invariant checker's count after both plans (0 expected).

    .venv/bin/python bench/scale.py [--gpus 4096] [--agents 256] [--database-url URL] [--quick]

Without `--database-url` the run has an embedded server of its own, with room for the agents'
connections (max_connections 600; a stock server allows 100).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from typing import Any

from db_support import REPO, BenchServer, machine, ms
from pearl.controlplane.core.domain import Activity, PlanStatus, Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.errors import DatabaseUnavailable
from pearl.controlplane.store import invariants, plan_store
from pearl.controlplane.store.db import make_engine, transaction
from pearl.controlplane.store.fleet_status import read_fleet_status
from pearl.controlplane.store.notifications import listen, step_channel
from pearl.controlplane.store.schema import Node, Plan, Worker
from pearl.controlplane.store.snapshot import load_snapshot
from sqlalchemy import Engine, func, select, text

sys.path.insert(0, str(REPO / "tests"))
from plan_graph import TP, serving_colocated  # noqa: E402  (the fleet every worker serving colocated)
from plan_support import enact  # noqa: E402  (tests/plan_support.py: an agent with no servers)

POLL_S = 5.0  # an idle agent looks for ready steps again after this, or when NOTIFY wakes it
CLAIM_LIMIT = 32


class Agent(threading.Thread):
    """One node's agent: claim ready steps, enact and report them one by one, until told to stop. A
    statement the database gives up on (a lock wait past the statement timeout) or a dropped
    connection is tried again, as the agent does: the claimed steps keep their leases."""

    def __init__(self, url: str, node_id: int, stop: Any) -> None:
        super().__init__(daemon=True, name=f"agent-{node_id}")
        self.url, self.node_id, self.stop = url, node_id, stop
        self.claims: list[float] = []
        self.reports: list[float] = []
        self.retries = 0
        self.errors: list[str] = []

    def run(self) -> None:
        engine = make_engine(self.url, pool_size=1, max_overflow=0)
        pending: list[dict[str, Any]] = []
        wake = threading.Event()
        listener = threading.Thread(target=listen, daemon=True, args=(
            engine, (step_channel(self.node_id), "pearl_plans"), lambda channel, payload: wake.set(),
            self.stop, wake.set))
        listener.start()
        try:
            while not self.stop.is_set():
                try:
                    if pending:
                        r0 = time.perf_counter()
                        with transaction(engine, actor="bench agent") as session:
                            enact(session, pending[0])
                        self.reports.append(time.perf_counter() - r0)
                        pending.pop(0)
                        continue
                    c0 = time.perf_counter()
                    with transaction(engine, actor="bench agent") as session:
                        pending = plan_store.claim_steps(session, self.node_id, None, lease_s=3600,
                                                         limit=CLAIM_LIMIT)
                    if pending:
                        self.claims.append(time.perf_counter() - c0)
                    else:
                        wake.wait(POLL_S)
                        wake.clear()
                except DatabaseUnavailable:  # DatabaseBusy included: nothing was kept, try again
                    self.retries += 1
                    self.stop.wait(0.05)
        except Exception as exc:  # reported in the JSON: a bench run must not hang on one agent's error
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            listener.join(timeout=5)
            engine.dispose()


def agent_process(url: str, node_ids: list[int], stop: Any, out: Any) -> None:
    """One process running the agents of `node_ids` as threads (each with its own connection);
    puts what they measured on `out` once `stop` is set."""
    agents = [Agent(url, node_id, stop) for node_id in node_ids]
    for agent in agents:
        agent.start()
    for agent in agents:
        agent.join()
    out.put({"claims": [c for a in agents for c in a.claims], "reports": [r for a in agents for r in a.reports],
             "retries": sum(a.retries for a in agents), "errors": [e for a in agents for e in a.errors]})


class Monitor(threading.Thread):
    """Samples the server's connections to one database."""

    def __init__(self, engine: Engine, database: str, stop: threading.Event) -> None:
        super().__init__(daemon=True, name="monitor")
        self.engine, self.database, self.stop, self.peak = engine, database, stop, 0

    def run(self) -> None:
        while not self.stop.is_set():
            with self.engine.connect() as conn:
                n = conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d"),
                                 {"d": self.database}).scalar() or 0
            self.peak = max(self.peak, int(n))
            self.stop.wait(0.25)


def switch(engine: Engine, target: Target) -> tuple[int, float, int]:
    """Orchestrate and write the plan to `target`; (plan id, seconds with the commit, steps)."""
    t0 = time.perf_counter()
    with transaction(engine, actor="bench") as session:
        plan = orchestrate(load_snapshot(session), target)
        plan_id = plan_store.write_plan(session, plan, None)
    return plan_id, time.perf_counter() - t0, len(plan.steps)


def reconcile(engine: Engine, plan_id: int, processes: list[Any], timeout_s: float) -> float:
    """Apply the plan and wait until it is no longer applying; its wall seconds."""
    t0 = time.perf_counter()
    plan_store.apply(engine, plan_id, actor="bench")
    while time.perf_counter() - t0 < timeout_s:
        with transaction(engine) as session:
            status = session.get(Plan, plan_id).status
        if status is not PlanStatus.APPLYING:
            break
        if not all(p.is_alive() for p in processes):
            raise RuntimeError("an agent process died")
        time.sleep(0.2)
    else:
        raise RuntimeError(f"plan {plan_id} still applying after {timeout_s} s")
    if status is not PlanStatus.SUCCEEDED:
        raise RuntimeError(f"plan {plan_id} ended {status.value}")
    return time.perf_counter() - t0


def run(server: BenchServer, gpus: int, agents_n: int, processes_n: int, timeout_s: float) -> dict[str, Any]:
    url = server.pearl_database("bench_scale")
    engine = make_engine(url, pool_size=2, max_overflow=0)
    ctx = mp.get_context("fork")  # before any connection of this process is shared: each child opens its own
    stop, out = ctx.Event(), ctx.Queue()
    processes: list[Any] = []
    monitor_stop = threading.Event()
    try:
        workers = serving_colocated(engine, gpus, gpus // agents_n)
        with transaction(engine) as session:
            node_ids = session.scalars(select(Node.id).order_by(Node.id)).all()
        engine.dispose()
        processes = [ctx.Process(target=agent_process, args=(url, node_ids[i::processes_n], stop, out), daemon=True)
                     for i in range(min(processes_n, len(node_ids)))]
        for p in processes:
            p.start()
        monitor = Monitor(engine, str(engine.url.database), monitor_stop)
        monitor.start()
        everyone = frozenset(range(1, workers + 1))
        prefill = workers // 4
        targets = [Target(everyone, {Role.PREFILL: prefill, Role.DECODE: workers - prefill}, reason="bench: split"),
                   Target(everyone, {Role.COLOCATED: workers}, reason="bench: colocated")]
        writes, reconciles, steps = [], [], 0
        for target in targets:
            plan_id, write_s, n = switch(engine, target)
            writes.append(write_s)
            steps += n
            reconciles.append(reconcile(engine, plan_id, processes, timeout_s))
        stop.set()
        measured = [out.get(timeout=60) for _ in processes]
        for p in processes:
            p.join(timeout=30)
        monitor_stop.set()
        monitor.join(timeout=5)
        statuses = []
        for _ in range(3):
            t0 = time.perf_counter()
            json.dumps(read_fleet_status(engine))
            statuses.append(time.perf_counter() - t0)
        report = invariants.check(engine)
        with transaction(engine) as session:
            roles = dict(session.execute(select(Worker.role, func.count()).where(
                Worker.activity == Activity.ACTIVE).group_by(Worker.role)).all())
        claim = ms([c for m in measured for c in m["claims"]])
        reports = [r for m in measured for r in m["reports"]]
        return {
            "gpus": gpus,
            "agents": agents_n,
            "agent_processes": len(processes),
            "workers": workers,
            "steps": steps,
            "plan_write_s": round(max(writes), 3),
            "reconcile_s": round(max(reconciles), 3),
            "reconcile_each_s": [round(r, 3) for r in reconciles],
            "reports": len(reports),
            "reports_per_s": round(len(reports) / sum(reconciles), 1),
            "report": ms(reports),
            "claim_p50_ms": claim["p50_ms"],
            "claim_p99_ms": claim["p99_ms"],
            "retries": sum(m["retries"] for m in measured),
            "peak_connections": monitor.peak,
            "status_json_s": round(statistics.median(statuses), 3),
            "violations": len(report.violations),
            "active_after": {str(r.value): n for r, n in roles.items()},
            "agent_errors": [e for m in measured for e in m["errors"]],
        }
    finally:
        stop.set()
        monitor_stop.set()
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        engine.dispose()
        server.drop(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4096)
    parser.add_argument("--agents", type=int, default=256)
    parser.add_argument("--database-url", help="a maintenance database of the server to use (default: an "
                        "embedded server of this run's own)")
    parser.add_argument("--processes", type=int, default=16, help="agent processes the agents share as threads")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="the most one plan may take")
    parser.add_argument("--quick", action="store_true", help="a small version for a smoke test (64 GPUs, 4 agents)")
    args = parser.parse_args()
    gpus, agents_n, processes_n = (64, 4, 2) if args.quick else (args.gpus, args.agents, args.processes)
    if processes_n < 1:
        parser.error(f"--processes: at least 1, got {processes_n}")
    if agents_n < 1 or gpus % (agents_n * TP):
        parser.error(f"--gpus: {gpus} must split evenly into --agents {agents_n} nodes of TP{TP} workers")
    t0 = time.perf_counter()
    with BenchServer(args.database_url, max_connections=600) as server:
        result = run(server, gpus, agents_n, processes_n, args.timeout_s)
        settings = server.settings()
    print(json.dumps({"bench": "scale", "quick": args.quick, **result, "database": settings, "machine": machine(),
                      "wall_s": round(time.perf_counter() - t0, 1)}, indent=2))


if __name__ == "__main__":
    main()
