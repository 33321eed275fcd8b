"""Step claims: claim throughput and latency of the step protocol against procrastinate's job fetch,
and the wake-up latency from `pearlctl apply` to an agent's first claim.

Prints one JSON object. For each concurrency (8, 64 and 256 agent connections on one PostgreSQL),
side by side in the same run and on the same server:
- pearl: one node per connection, one worker per node, the node's steps all ready in one applying
  plan. Each connection is the agent of its node: it claims one step at a time with the
  `claim_steps` statement (limit 1), commits, then marks it finished with the `finish_step`
  statement and commits, so its worker frees up for the next claim.
- procrastinate: its schema (procrastinate's schema.sql) in a database of its own on the same server,
  one queue per "node", the same number of jobs per queue; each connection (a registered worker)
  fetches with `procrastinate_fetch_job_v2` and finishes with `procrastinate_finish_job_v1`.
Both sides send their statements over plain psycopg connections (no ORM), so the figures compare
what the two protocols cost the database. Reported: claims per second (claims / wall time from the
start barrier to the last finish), p50/p99 of one claim (statement + commit) and of one finish, and
pearl/procrastinate ratios (throughput: above 1 means pearl claims more per second; latency: below 1
means pearl's claim is faster). The median and spread are over `--repeat` runs.

Beside them, `pearl_reported` (one run, a few steps per agent): the same claims, each reported as the
agent does it (`plan_store.complete_step`: the fleet row, the fenced effect check, the dependents,
the plan's progress), with how many claims came back empty while steps were ready.

`backlog`: claims/s at 8 connections as each node's backlog of ready steps grows (4, 32, 256).
pearl's claim ranks every ready step of its node (one step per worker), so it slows as the backlog
grows; a real plan readies about one step per worker at a time (a node's few workers).

Wake-up: agents (agents/agent.py, over in-process fake servers) wait on LISTEN `pearl_steps_<node id>`; each
repetition applies a plan (`plan_store.apply`, what `pearlctl apply` runs) and times the first claim
of one of its steps, from the call to apply and from the moment it returned. The baseline is a
LISTEN loop on procrastinate's queue channel: from the call that inserts a job, and from its return,
to its fetch. The ratios compare the figures from the call: the listener hears the commit as soon as
the caller does, so a wake-up timed from the call's return can be zero or negative.

256 connections need `max_connections` above PostgreSQL's default of 100: without `--database-url`
the benchmark starts an embedded server of its own with 400.

    .venv/bin/python bench/step_claims.py [--quick] [--database-url URL] [--repeat 3] [--connections 8,64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any

import psycopg
from db_support import REPO, BenchServer, machine, ms, psycopg_url
from pearl.controlplane.core.domain import Role, StepAction
from pearl.controlplane.core.fleet import Plan, PlanStep, Target
from pearl.controlplane.core.inventory import parse_inventory
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.store import agent_registry, plan_store
from pearl.controlplane.store.db import make_engine, transaction
from pearl.controlplane.store.inventory_import import import_inventory
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.snapshot import load_snapshot
from pearl.controlplane.store.transitions import lock_fleet
from sqlalchemy import Engine, text
from sqlalchemy.dialects import postgresql

sys.path.insert(0, str(REPO / "tests"))
from agent_support import FakeDriver, FakeFrontDoor, FakeServers  # noqa: E402  (tests/agent_support.py)
from pearl.agents.agent import Agent, AgentConfig  # noqa: E402
from pearl.agents.steps import StepContext, Timeouts  # noqa: E402

LEASE_S = 30.0


def _psycopg_sql(name: str) -> str:
    """A named query of queries.sql with psycopg's %(name)s placeholders."""
    return str(query(name).compile(dialect=postgresql.psycopg.dialect()))


CLAIM = _psycopg_sql("claim_steps")
FINISH = _psycopg_sql("finish_step")
FETCH = "SELECT id FROM procrastinate_fetch_job_v2(%(queues)s::varchar[], %(worker)s)"
DONE = "SELECT procrastinate_finish_job_v1(%(job)s, 'succeeded', false)"


@dataclass
class Worker:
    """What one connection did."""

    claims: list[float] = field(default_factory=list)  # seconds per claim (statement + commit)
    finishes: list[float] = field(default_factory=list)
    empty: int = 0  # claims that came back empty while work was left
    ended: float = 0.0
    error: BaseException | None = None


def _drive(n: int, body: Callable[[int, threading.Barrier, Worker], None]) -> tuple[list[Worker], float]:
    """Run `body(i, barrier, worker)` in `n` threads; each connects, then waits at the barrier. Returns
    the workers and the wall time from the barrier's release to the last one's end."""
    barrier = threading.Barrier(n + 1)
    workers = [Worker() for _ in range(n)]

    def run(i: int) -> None:
        try:
            body(i, barrier, workers[i])
        except BaseException as exc:  # reported after the run
            workers[i].error = exc
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=300)
    except threading.BrokenBarrierError:
        pass  # a connection failed before the start: its error is raised below
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    failed = [w.error for w in workers if w.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} connections failed; the first: {failed[0]!r}") from failed[0]
    return workers, max(w.ended for w in workers) - t0


def _summary(workers: list[Worker], wall_s: float) -> dict[str, Any]:
    claims = [x for w in workers for x in w.claims]
    return {"claims": len(claims), "wall_s": round(wall_s, 3), "claims_per_s": round(len(claims) / wall_s, 1),
            "claim": ms(claims), "finish": ms([x for w in workers for x in w.finishes]),
            "empty_claims": sum(w.empty for w in workers)}


# -- pearl -----------------------------------------------------------------------------------------


def pearl_fleet(url: str, nodes: int, per_node: int) -> tuple[Engine, list[tuple[int, int]]]:
    """`nodes` rollout nodes of one TP2 worker each; one applying plan with `per_node` independent
    steps on each worker; an agent row per node. Returns the engine and (node id, agent id) per node."""
    engine = make_engine(url, pool_size=2, max_overflow=0)
    inventory = parse_inventory({"model": "qwen3-8b", "gpu": "h800", "tp": 2, "nodes": [
        {"name": f"n{i}", "zone": "rollout", "gpus": 2, "address": "127.0.0.1"} for i in range(nodes)]})
    with transaction(engine, actor="bench") as session:
        import_inventory(session, inventory)
        workers = session.execute(text("SELECT w.id, n.name FROM workers w JOIN nodes n ON n.id = w.node_id "
                                       "ORDER BY w.id")).all()
        version = lock_fleet(session)
        steps = tuple(PlanStep(f"w{wid}.s{k}", StepAction.INTERRUPT, wid, node)
                      for wid, node in workers for k in range(per_node))
        plan = Plan(version, frozenset(), frozenset(), {}, {}, steps, Target(frozenset(), {}, reason="bench"))
        plan_id = plan_store.write_plan(session, plan, None)
    plan_store.apply(engine, plan_id, actor="bench")
    agents = [agent_registry.register_agent(engine, f"n{i}", host="bench", pid=0, driver="none")
              for i in range(nodes)]
    return engine, [(a.node_id, a.agent_id) for a in agents]


def pearl_claims(url: str, agents: list[tuple[int, int]]) -> tuple[list[Worker], float]:
    conninfo = psycopg_url(url)

    def body(i: int, barrier: threading.Barrier, w: Worker) -> None:
        node_id, agent_id = agents[i]
        params = {"node_id": node_id, "agent_id": agent_id, "lease_s": LEASE_S, "limit": 1, "busy": []}
        with psycopg.connect(conninfo) as conn:
            barrier.wait()
            while True:
                t0 = time.perf_counter()
                step = _claimed(conn.execute(CLAIM, params))
                conn.commit()
                t1 = time.perf_counter()
                if step is None:
                    break
                w.claims.append(t1 - t0)
                conn.execute(FINISH, {**step, "status": "succeeded", "error": None})
                conn.commit()
                w.finishes.append(time.perf_counter() - t1)
            w.ended = time.perf_counter()

    return _drive(len(agents), body)


def _claimed(cur: psycopg.Cursor) -> dict[str, int] | None:
    """The id and fence of the step a claim returned, or None."""
    row = cur.fetchone()
    if row is None:
        return None
    names = [c.name for c in cur.description]
    return {"step_id": row[names.index("id")], "fence": row[names.index("fence")]}


def pearl_reported(url: str, agents: list[tuple[int, int]], per_node: int) -> tuple[list[Worker], float]:
    """Claims and reports as the agent makes them: `claim_steps` in a transaction of its own, each step
    reported through `plan_store.complete_step`, one pooled connection per agent."""
    engine = make_engine(url, pool_size=len(agents), max_overflow=0)
    opened = [engine.connect() for _ in agents]  # the pool's connections, opened before the clock starts
    for conn in opened:
        conn.close()
    claim = query("claim_steps")
    try:
        def body(i: int, barrier: threading.Barrier, w: Worker) -> None:
            node_id, agent_id = agents[i]
            params = {"node_id": node_id, "agent_id": agent_id, "lease_s": LEASE_S, "limit": 1, "busy": []}
            barrier.wait()
            while len(w.claims) < per_node:
                t0 = time.perf_counter()
                with transaction(engine, actor=f"agent n{i}") as session:
                    row = session.execute(claim, params).mappings().first()
                t1 = time.perf_counter()
                if row is None:  # steps are ready, yet none was claimed: try again shortly
                    w.empty += 1
                    time.sleep(0.001)
                    continue
                w.claims.append(t1 - t0)
                with transaction(engine, actor=f"agent n{i}") as session:
                    plan_store.complete_step(session, row["id"], row["fence"])
                w.finishes.append(time.perf_counter() - t1)
            w.ended = time.perf_counter()

        return _drive(len(agents), body)
    finally:
        engine.dispose()


# -- procrastinate ---------------------------------------------------------------------------------


def procrastinate_queues(url: str, nodes: int, per_node: int) -> list[int]:
    """procrastinate's schema, one queue per node with `per_node` jobs, a registered worker per node."""
    schema = files("procrastinate.sql").joinpath("schema.sql").read_text()
    with psycopg.connect(psycopg_url(url), autocommit=True) as conn:
        conn.execute(schema)
        conn.execute(
            "SELECT procrastinate_defer_jobs_v1(ARRAY(SELECT ROW('n' || (g %% %(nodes)s), 'step', 0, NULL, NULL,"
            " '{}'::jsonb, NULL)::procrastinate_job_to_defer_v1 FROM generate_series(0, %(jobs)s - 1) AS g"
            " ORDER BY g))", {"nodes": nodes, "jobs": nodes * per_node})
        return [conn.execute("SELECT worker_id FROM procrastinate_register_worker_v1()").fetchone()[0]
                for _ in range(nodes)]


def procrastinate_fetches(url: str, workers: list[int]) -> tuple[list[Worker], float]:
    conninfo = psycopg_url(url)

    def body(i: int, barrier: threading.Barrier, w: Worker) -> None:
        params = {"queues": [f"n{i}"], "worker": workers[i]}
        with psycopg.connect(conninfo) as conn:
            barrier.wait()
            while True:
                t0 = time.perf_counter()
                job = conn.execute(FETCH, params).fetchone()[0]
                conn.commit()
                t1 = time.perf_counter()
                if job is None:
                    break
                w.claims.append(t1 - t0)
                conn.execute(DONE, {"job": job})
                conn.commit()
                w.finishes.append(time.perf_counter() - t1)
            w.ended = time.perf_counter()

    return _drive(len(workers), body)


# -- one concurrency -------------------------------------------------------------------------------


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput, with the spread of the throughput over all runs."""
    ordered = sorted(runs, key=lambda r: r["claims_per_s"])
    mid = dict(ordered[len(ordered) // 2])
    rates = [r["claims_per_s"] for r in runs]
    mid["claims_per_s_runs"] = rates
    mid["claims_per_s_median"] = round(statistics.median(rates), 1)
    return mid


def concurrency(server: BenchServer, n: int, per_node: int, repeat: int, reported: int) -> dict[str, Any]:
    """`n` connections with `per_node` jobs each, pearl and procrastinate alternating `repeat` times;
    then, unless `reported` is 0, one run of `pearl_reported` with `reported` steps per agent."""
    pearl, baseline = [], []
    for _ in range(repeat):
        url = server.pearl_database("bench_claims")
        engine, agents = pearl_fleet(url, n, per_node)
        engine.dispose()
        pearl.append(_summary(*pearl_claims(url, agents)))
        server.drop(url)

        url = server.empty_database("bench_procrastinate")
        workers = procrastinate_queues(url, n, per_node)
        baseline.append(_summary(*procrastinate_fetches(url, workers)))
        server.drop(url)
    p, b = _median_run(pearl), _median_run(baseline)
    out = {
        "connections": n,
        "jobs_per_connection": per_node,
        "pearl": p,
        "procrastinate": b,
        "ratio_pearl_to_procrastinate": {
            "claims_per_s": round(p["claims_per_s_median"] / b["claims_per_s_median"], 3),
            "claim_p50": round(p["claim"]["p50_ms"] / b["claim"]["p50_ms"], 3),
            "claim_p99": round(p["claim"]["p99_ms"] / b["claim"]["p99_ms"], 3),
        },
    }
    if reported:
        url = server.pearl_database("bench_reports")
        engine, agents = pearl_fleet(url, n, reported)
        engine.dispose()
        out["pearl_reported"] = {"jobs_per_connection": reported, **_summary(*pearl_reported(url, agents, reported))}
        server.drop(url)
    return out


def backlog(server: BenchServer, n: int, sizes: tuple[int, ...], repeat: int) -> list[dict[str, Any]]:
    """Claims/s with `n` connections as each node's (queue's) backlog of ready steps (jobs) grows:
    pearl's claim ranks the node's ready steps (one per worker), procrastinate's fetch takes the
    first job of its queue by index."""
    rows = []
    for per_node in sizes:
        runs: dict[str, list[dict[str, Any]]] = {"pearl": [], "procrastinate": []}
        for _ in range(repeat):
            url = server.pearl_database("bench_backlog")
            engine, agents = pearl_fleet(url, n, per_node)
            engine.dispose()
            runs["pearl"].append(_summary(*pearl_claims(url, agents)))
            server.drop(url)
            url = server.empty_database("bench_backlog_procrastinate")
            runs["procrastinate"].append(_summary(*procrastinate_fetches(url, procrastinate_queues(url, n, per_node))))
            server.drop(url)
        row: dict[str, Any] = {"connections": n, "ready_per_node": per_node}
        for side, rs in runs.items():
            m = _median_run(rs)
            row[side] = {"claims_per_s_median": m["claims_per_s_median"], "claim_p50_ms": m["claim"]["p50_ms"]}
        row["ratio_claims_per_s"] = round(row["pearl"]["claims_per_s_median"]
                                          / row["procrastinate"]["claims_per_s_median"], 3)
        rows.append(row)
    return rows


# -- wake-up ---------------------------------------------------------------------------------------


class TimedAgent(Agent):
    """An agent that notes when it first took a step of each plan."""

    first_claim: dict[int, float]

    def _enact(self, ctx: StepContext, claimed: float) -> None:
        self.first_claim.setdefault(int(ctx.step["plan_id"]), time.perf_counter())
        super()._enact(ctx, claimed)


def _propose(engine: Engine, target: Target) -> int:
    with transaction(engine, actor="bench") as session:
        snapshot = load_snapshot(session)
        plan_id = plan_store.write_plan(session, orchestrate(snapshot, target), None)
    assert plan_id is not None
    return plan_id


def pearl_wakeup(server: BenchServer, repeat: int) -> dict[str, Any]:
    """Two nodes of one worker each, an agent per node; plans alternate between serving on one and on
    the other (each starts one worker and stops the other)."""
    url = server.pearl_database("bench_wakeup")
    engine = make_engine(url)
    with transaction(engine, actor="bench") as session:
        import_inventory(session, parse_inventory({"model": "qwen3-8b", "gpu": "h800", "tp": 2, "nodes": [
            {"name": f"n{i}", "zone": "rollout", "gpus": 2, "address": "127.0.0.1"} for i in range(2)]}))
    servers, front_door = FakeServers(), FakeFrontDoor()
    first: dict[int, float] = {}
    agents = []
    for node in ("n0", "n1"):
        config = AgentConfig(node=node, driver="fake", poll_s=30.0, heartbeat_s=5.0, reap_every_s=30.0,
                             timeouts=Timeouts(ready_s=5, drain_s=0.2, idle_s=2, poll_s=0.01))
        agent = TimedAgent(engine, config, FakeDriver(servers, node), client=servers.client,
                           front_door=lambda: front_door)
        agent.first_claim = first
        thread = threading.Thread(target=agent.run, daemon=True)
        thread.start()
        agents.append((agent, thread))
    from_commit, from_call = [], []
    try:
        time.sleep(1.0)  # both agents registered and listening
        for r in range(repeat + 1):
            plan_id = _propose(engine, Target(frozenset({1 + r % 2}), {Role.COLOCATED: 1}, reason="bench"))
            t0 = time.perf_counter()
            plan_store.apply(engine, plan_id, actor="bench")
            t1 = time.perf_counter()
            summary = plan_store.wait_plan(engine, plan_id, timeout_s=30, poll_s=0.02)
            if summary["status"] != "succeeded":
                raise RuntimeError(f"plan {plan_id} {summary['status']}: {summary['error']}")
            if r:  # the first plan warms the agents up
                from_commit.append(first[plan_id] - t1)
                from_call.append(first[plan_id] - t0)
    finally:
        for agent, _ in agents:
            agent.stop()
        for _, thread in agents:
            thread.join(timeout=30)
        engine.dispose()
        server.drop(url)
    return {"plans": len(from_commit), "from_apply_commit": ms(from_commit), "from_apply_call": ms(from_call)}


def procrastinate_wakeup(server: BenchServer, repeat: int) -> dict[str, Any]:
    """A LISTEN loop on a procrastinate queue's channel: from a job's insert committing to its fetch."""
    url = server.empty_database("bench_procrastinate_wakeup")
    (worker,) = procrastinate_queues(url, 1, 0)
    conninfo = psycopg_url(url)
    fetched: dict[int, float] = {}
    stop = threading.Event()
    listening = threading.Event()

    def listen() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn, psycopg.connect(conninfo) as work:
            conn.execute('LISTEN "procrastinate_queue_v1#n0"')
            listening.set()
            while not stop.is_set():
                for _ in conn.notifies(timeout=0.5, stop_after=1):
                    while True:
                        job = work.execute(FETCH, {"queues": ["n0"], "worker": worker}).fetchone()[0]
                        work.commit()
                        if job is None:
                            break
                        fetched[job] = time.perf_counter()
                        work.execute(DONE, {"job": job})
                        work.commit()

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    listening.wait(10)
    from_commit, from_call = [], []
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            for r in range(repeat + 1):
                t0 = time.perf_counter()
                job = conn.execute("SELECT unnest(procrastinate_defer_jobs_v1(ARRAY[ROW('n0', 'step', 0, NULL, "
                                   "NULL, '{}'::jsonb, NULL)::procrastinate_job_to_defer_v1]))").fetchone()[0]
                t1 = time.perf_counter()
                deadline = time.monotonic() + 10
                while job not in fetched and time.monotonic() < deadline:
                    time.sleep(0.0005)
                if job not in fetched:
                    raise RuntimeError(f"procrastinate job {job} was never fetched")
                if r:
                    from_commit.append(fetched[job] - t1)
                    from_call.append(fetched[job] - t0)
                time.sleep(0.02)
    finally:
        stop.set()
        thread.join(timeout=10)
        server.drop(url)
    return {"jobs": len(from_commit), "from_insert_commit": ms(from_commit), "from_insert_call": ms(from_call)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small version for a smoke test")
    parser.add_argument("--database-url", help="a maintenance database on a server allowing 260+ connections "
                        "(default: an embedded server of the benchmark's own)")
    parser.add_argument("--connections", default=None, help="comma-separated (default 8,64,256)")
    parser.add_argument("--jobs-per-connection", type=int, default=None, help="claims per connection and run "
                        "(default 32)")
    parser.add_argument("--reported", type=int, default=None, help="steps per agent in the pearl_reported run "
                        "(default 4; 0: skip it)")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--wake-repeat", type=int, default=None)
    args = parser.parse_args()
    levels = [int(x) for x in (args.connections or ("2,4" if args.quick else "8,64,256")).split(",")]
    per_node = args.jobs_per_connection or (16 if args.quick else 32)
    reported = args.reported if args.reported is not None else 4
    repeat = args.repeat or (1 if args.quick else 3)
    wake_repeat = args.wake_repeat or (5 if args.quick else 50)
    backlog_sizes = (2, 32) if args.quick else (4, 32, 256)
    started = time.perf_counter()
    with BenchServer(args.database_url) as server:
        out: dict[str, Any] = {
            "bench": "step_claims",
            "quick": args.quick,
            "repeat": repeat,
            "database": server.settings(),
            "machine": machine(),
            "concurrency": [concurrency(server, n, per_node, repeat, reported) for n in levels],
            "backlog": backlog(server, 2 if args.quick else 8, backlog_sizes, repeat),
        }
        pearl, baseline = pearl_wakeup(server, wake_repeat), procrastinate_wakeup(server, wake_repeat)
        out["wakeup"] = {
            "pearl": pearl,
            "procrastinate": baseline,
            "ratio_pearl_to_procrastinate": {
                "p50": round(pearl["from_apply_call"]["p50_ms"] / baseline["from_insert_call"]["p50_ms"], 3),
                "p99": round(pearl["from_apply_call"]["p99_ms"] / baseline["from_insert_call"]["p99_ms"], 3),
            },
        }
    out["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
