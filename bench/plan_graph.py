"""Plan graph: a colocated -> split switch at 1024 and 4096 GPUs, written and reconciled step by step.

Prints one JSON object. For each size, a fleet is imported (rollout nodes of 8 GPUs, TP2: 4 workers a
node), every worker serving colocated, and the target is the split with a quarter of the workers
prefill. Reported:
- the plan: steps, dependency edges (plan_step_deps rows), seconds to orchestrate it, to write it
  (`plan_store.write_plan`, and the commit), and to apply it;
- the full reconcile, from the apply to the plan's success: every ready step is claimed
  (`claim_steps`, by node, in a transaction of its own as an agent would), then enacted and reported
  one after another, as tests/plan_support.enact does (the step's effect written under its claim,
  then `plan_store.complete_step`): total seconds, reports per second, p50/p99 of one report, the
  slowest report (the last load, which succeeds the barrier and readies every admit), and the time
  spent claiming.
The baseline measured in the same run is the smallest size: `scaling` gives each figure at a larger
size over the smallest (a linear graph and constant-time reports keep the totals in proportion to
the GPUs and one report's p50 flat).

    .venv/bin/python bench/plan_graph.py [--quick] [--gpus 1024,4096] [--write-only] [--database-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from db_support import REPO, BenchServer, machine, ms
from pearl.controlplane.core.domain import Activity, GPUState, PlanStatus, Role, StepAction
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.core.inventory import parse_inventory
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.db import make_engine, transaction
from pearl.controlplane.store.inventory_import import import_inventory
from pearl.controlplane.store.schema import GPU, Plan, PlanStep, PlanStepDep, Worker
from pearl.controlplane.store.snapshot import load_snapshot
from pearl.controlplane.store.transitions import lock_fleet
from sqlalchemy import Engine, func, select, update

sys.path.insert(0, str(REPO / "tests"))
from plan_support import enact  # noqa: E402  (tests/plan_support.py: an agent with no servers)

GPUS_PER_NODE = 8
TP = 2


def serving_colocated(engine: Engine, gpus: int, gpus_per_node: int = GPUS_PER_NODE) -> int:
    """Import `gpus` rollout GPUs and bring every worker up serving colocated, as a finished plan
    leaves them (through the transition triggers: inactive -> transitioning -> active, GPUs bound).
    Returns the number of workers."""
    nodes = gpus // gpus_per_node
    inventory = parse_inventory({"model": "qwen3-8b", "gpu": "h800", "tp": TP, "nodes": [
        {"name": f"n{i}", "zone": "rollout", "gpus": gpus_per_node, "address": "127.0.0.1"} for i in range(nodes)]})
    with transaction(engine, actor="bench", reason="fleet serving colocated") as session:
        import_inventory(session, inventory)
        lock_fleet(session)
        session.execute(update(GPU).values(state=GPUState.BOUND, worker_id=GPU.slot_id))
        session.execute(update(Worker).values(activity=Activity.TRANSITIONING, role=Role.COLOCATED,
                                              generation=Worker.generation + 1,
                                              endpoint=func.concat("http://127.0.0.1:1/w", Worker.id)))
        session.execute(update(Worker).values(activity=Activity.ACTIVE))
        return session.scalar(select(func.count()).select_from(Worker)) or 0


def reconcile(engine: Engine, plan_id: int) -> dict[str, Any]:
    """Claim every ready step (by node), enact and report each, until the plan is no longer applying."""
    reports: list[float] = []
    slowest: tuple[float, str] = (0.0, "")
    claiming = 0.0
    claims = rounds = 0
    t0 = time.perf_counter()
    while True:
        c0 = time.perf_counter()
        with transaction(engine) as session:
            nodes = session.scalars(select(PlanStep.node_id).where(
                PlanStep.plan_id == plan_id, PlanStep.status == "ready").distinct()).all()
        claimed = []
        for node in nodes:
            with transaction(engine, actor="bench agent") as session:
                claimed += plan_store.claim_steps(session, node, None, lease_s=3600, limit=100)
        claiming += time.perf_counter() - c0
        if not claimed:
            break
        rounds += 1
        claims += len(claimed)
        for step in claimed:
            r0 = time.perf_counter()
            with transaction(engine, actor="bench agent") as session:
                enact(session, step)
            took = time.perf_counter() - r0
            reports.append(took)
            if took > slowest[0]:
                slowest = (took, step["key"])
    total = time.perf_counter() - t0
    with transaction(engine) as session:
        status = session.get(Plan, plan_id).status
    return {
        "status": status.value,
        "total_s": round(total, 3),
        "rounds": rounds,
        "claims": claims,
        "claiming_s": round(claiming, 3),
        "reports": len(reports),
        "reports_per_s": round(len(reports) / sum(reports), 1) if reports else None,
        "report": ms(reports),
        "slowest_report": {"key": slowest[1], "ms": round(slowest[0] * 1e3, 3)},
    }


def one_size(server: BenchServer, gpus: int, reconcile_it: bool = True) -> dict[str, Any]:
    url = server.pearl_database("bench_plan_graph")
    engine = make_engine(url)
    try:
        workers = serving_colocated(engine, gpus)
        prefill = workers // 4
        target = Target(frozenset(range(1, workers + 1)), {Role.PREFILL: prefill, Role.DECODE: workers - prefill},
                        reason="bench: colocated -> split")
        with transaction(engine, actor="bench") as session:
            t0 = time.perf_counter()
            plan = orchestrate(load_snapshot(session), target)
            t1 = time.perf_counter()
            plan_id = plan_store.write_plan(session, plan, None)
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        with transaction(engine) as session:
            steps = session.scalar(select(func.count()).where(PlanStep.plan_id == plan_id))
            edges = session.scalar(select(func.count()).select_from(PlanStepDep).join(
                PlanStep, PlanStep.id == PlanStepDep.step_id).where(PlanStep.plan_id == plan_id))
            actions = dict(session.execute(select(PlanStep.action, func.count()).where(
                PlanStep.plan_id == plan_id).group_by(PlanStep.action)).all())
        written = {"gpus": gpus, "workers": workers, "steps": steps, "edges": edges,
                   "orchestrate_s": round(t1 - t0, 3), "write_plan_s": round(t2 - t1, 3),
                   "write_plan_with_commit_s": round(t3 - t1, 3)}
        if not reconcile_it:
            return written
        a0 = time.perf_counter()
        applied = plan_store.apply(engine, plan_id, actor="bench")
        a1 = time.perf_counter()
        result = reconcile(engine, plan_id)
        with transaction(engine) as session:
            roles = dict(session.execute(select(Worker.role, func.count()).where(
                Worker.activity == Activity.ACTIVE).group_by(Worker.role)).all())
        if result["status"] != PlanStatus.SUCCEEDED.value or roles != {Role.PREFILL: prefill,
                                                                        Role.DECODE: workers - prefill}:
            raise RuntimeError(f"{gpus} GPUs: the plan ended {result['status']} with {roles} active")
        return {
            "gpus": gpus,
            "workers": workers,
            "nodes": gpus // GPUS_PER_NODE,
            "target": f"{prefill}P:{workers - prefill}D",
            "steps": steps,
            "edges": edges,
            "edges_per_step": round(edges / steps, 3),
            "actions": {str(a.value if isinstance(a, StepAction) else a): n for a, n in sorted(actions.items())},
            "orchestrate_s": round(t1 - t0, 3),
            "write_plan_s": round(t2 - t1, 3),
            "write_plan_with_commit_s": round(t3 - t1, 3),
            "apply_s": round(a1 - a0, 3),
            "ready_on_apply": len(applied.ready),
            "reconcile": result,
        }
    finally:
        engine.dispose()
        server.drop(url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small version for a smoke test")
    parser.add_argument("--gpus", default=None, help="comma-separated (default 1024,4096)")
    parser.add_argument("--database-url", help="a maintenance database of the server to use (default: an "
                        "embedded server of the benchmark's own)")
    parser.add_argument("--write-only", action="store_true",
                        help="write each size's plan and stop there (no apply, no reconcile)")
    args = parser.parse_args()
    sizes = [int(g) for g in (args.gpus or ("32,64" if args.quick else "1024,4096")).split(",")]
    started = time.perf_counter()
    with BenchServer(args.database_url) as server:
        out: dict[str, Any] = {"bench": "plan_graph", "quick": args.quick, "tp": TP, "gpus_per_node": GPUS_PER_NODE,
                               "database": server.settings(), "machine": machine(), "sizes": []}
        for gpus in sizes:
            out["sizes"].append(one_size(server, gpus, reconcile_it=not args.write_only))
    base = out["sizes"][0]
    for row in out["sizes"][1:] if not args.write_only else ():
        row["scaling"] = {
            "over_gpus": base["gpus"],
            "gpus": round(row["gpus"] / base["gpus"], 3),
            "steps": round(row["steps"] / base["steps"], 3),
            "edges": round(row["edges"] / base["edges"], 3),
            "write_plan_s": round(row["write_plan_s"] / base["write_plan_s"], 3),
            "reconcile_total_s": round(row["reconcile"]["total_s"] / base["reconcile"]["total_s"], 3),
            "report_p50": round(row["reconcile"]["report"]["p50_ms"] / base["reconcile"]["report"]["p50_ms"], 3),
        }
    out["machine"]["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
