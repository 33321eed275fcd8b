"""Races and kills around plans and profiles: one apply wins, an apply and a fleet change never both
take effect against one version, concurrent reports never lose a wake-up, refits never lose a step,
and a planner killed mid-write leaves nothing behind."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime

import pytest
from pearl.controlplane.core.domain import GPUState, PlanStatus, StepStatus
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.core.telemetry import parse_telemetry
from pearl.controlplane.errors import StalePlan
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import GPU, Plan, PlanStep
from pearl.controlplane.store.snapshot import load_snapshot
from pearl.controlplane.store.telemetry_store import ingest_telemetry
from pearl.controlplane.store.transitions import set_gpu_states
from plan_support import (
    COLOCATED_3,
    claim_ready,
    import_cluster,
    in_threads,
    pin_clock,
    propose,
    report,
    run_plan,
    small_inventory,
    telemetry,
)
from sqlalchemy import Engine, func, select, text

pytestmark = pytest.mark.reliability

def status_of(engine: Engine, plan_id: int) -> PlanStatus:
    with transaction(engine) as session:
        return session.get(Plan, plan_id).status


def test_concurrent_applies_of_one_plan_exactly_one_wins(cluster_engine: Engine) -> None:
    for _ in range(3):
        plan_id = propose(cluster_engine)
        results = in_threads(*[lambda p=plan_id: plan_store.apply(cluster_engine, p)] * 4)
        won = [r for r in results if isinstance(r, plan_store.AppliedPlan)]
        lost = [r for r in results if isinstance(r, plan_store.PlanNotApplicable)]
        assert len(won) == 1 and len(lost) == 3, results
        assert all(f"plan {plan_id} is applying" in str(r) for r in lost)
        with transaction(cluster_engine) as session:  # its dependency-free steps were readied once
            ready = session.scalar(select(func.count()).where(
                PlanStep.plan_id == plan_id, PlanStep.status == StepStatus.READY))
            assert ready == 3
            session.execute(text("UPDATE plans SET status = 'failed' WHERE id = :p"), {"p": plan_id})


def test_an_apply_racing_a_fleet_change_is_never_applied_against_a_moved_fleet(cluster_engine: Engine) -> None:
    with transaction(cluster_engine) as session:
        spot = session.scalars(select(GPU.id).where(GPU.zone == "preemptible")).all()
    for round_ in range(4):
        plan_id = propose(cluster_engine)
        edge = (GPUState.UNAVAILABLE, GPUState.FREE) if round_ % 2 == 0 else (GPUState.FREE, GPUState.REVOKED)

        def change(edge: tuple[GPUState, GPUState] = edge) -> str:
            with transaction(cluster_engine, actor="provider") as session:
                set_gpu_states(session, spot, [edge[0]], edge[1])
            return "changed"

        applied, changed = in_threads(lambda p=plan_id: plan_store.apply(cluster_engine, p), change)
        assert changed == "changed"
        with cluster_engine.connect() as conn:
            # the version the fleet had when the plan became applying (its audit event says)
            at_apply = conn.execute(text(
                "SELECT state_version FROM events WHERE entity = 'plans' AND entity_id = :p "
                "AND new ->> 'status' IN ('applying', 'stale') ORDER BY id LIMIT 1"), {"p": str(plan_id)}).scalar()
            base = conn.execute(text("SELECT base_version FROM plans WHERE id = :p"), {"p": str(plan_id)}).scalar()
        if isinstance(applied, plan_store.AppliedPlan):
            assert at_apply == base  # it was applied before the change, against its own version
            with transaction(cluster_engine) as session:
                session.execute(text("UPDATE plans SET status = 'failed' WHERE id = :p"), {"p": plan_id})
        else:
            assert isinstance(applied, StalePlan), applied
            assert at_apply != base and status_of(cluster_engine, plan_id) is PlanStatus.STALE
        if round_ % 2 == 1:
            with transaction(cluster_engine) as session:  # revoked -> unavailable, ready for the next grant
                set_gpu_states(session, spot, [GPUState.REVOKED], GPUState.UNAVAILABLE)


def test_concurrent_reports_of_the_last_dependencies_never_lose_the_wake_up(cluster_engine: Engine, clock) -> None:
    for _ in range(3):
        plan_id = propose(cluster_engine)
        plan_store.apply(cluster_engine, plan_id)
        for step in claim_ready(cluster_engine, clock()):  # the starts
            report(cluster_engine, step, StepStatus.SUCCEEDED, clock())
        loads = claim_ready(cluster_engine, clock())
        assert sorted(s["key"] for s in loads) == ["w1.load_weights", "w2.load_weights", "w3.load_weights"]
        # every admit waits for all three: the three agents report at once
        in_threads(*[(lambda s=s: report(cluster_engine, s, StepStatus.SUCCEEDED, clock())) for s in loads])
        with transaction(cluster_engine) as session:
            admits = session.execute(select(PlanStep.key, PlanStep.status).where(
                PlanStep.plan_id == plan_id, PlanStep.action == "admit")).all()
            assert sorted(admits) == [(f"w{w}.admit", StepStatus.READY) for w in (1, 2, 3)]
        # give the plan up; its cleanup releases the three workers, so the next round starts afresh
        cleanup = plan_store.abort(cluster_engine, plan_id).cleanup
        run_plan(cluster_engine, clock())
        with transaction(cluster_engine) as session:
            assert session.get(Plan, cleanup).status is PlanStatus.SUCCEEDED


def test_concurrent_ingestions_never_lose_a_step(db_engine: Engine) -> None:
    import_cluster(db_engine, small_inventory())
    bodies = [parse_telemetry(telemetry(step)) for step in range(4)]
    results = in_threads(*[(lambda b=b: ingest_telemetry(db_engine, b)) for b in bodies])
    assert all(r.outcome == "ingested" for r in results), results
    # one chain: each fit is based on the one before it, whatever the order they ran in
    chain = {r.based_on: r.profile_id for r in results}
    start = next(b for b in chain if b not in chain.values())
    ordered = [start]
    while ordered[-1] in chain:
        ordered.append(chain[ordered[-1]])
    assert len(ordered) == 5
    with db_engine.connect() as conn:
        observed = conn.execute(text("SELECT (params ->> 'steps_observed')::int FROM profiles WHERE id = :p"),
                                {"p": ordered[-1]}).scalar()
    assert observed == 4
    same = in_threads(*[lambda: ingest_telemetry(db_engine, parse_telemetry(telemetry(9)))] * 3)
    assert sorted(r.outcome for r in same) == ["ingested", "unchanged", "unchanged"]


def test_a_planner_killed_mid_write_leaves_nothing_behind(database_url: str, db_engine: Engine) -> None:
    import_cluster(db_engine, small_inventory())
    with transaction(db_engine) as session:
        earlier = plan_store.write_plan(session, orchestrate(load_snapshot(session), COLOCATED_3), None)
    script = (
        "import sys, time\n"
        "from pearl.controlplane.store.db import make_engine, transaction\n"
        "from pearl.policies.live.policy_pass import decide\n"
        "from pearl.controlplane.store.plan_store import write_decision, write_plan\n"
        "engine = make_engine(sys.argv[1])\n"
        "with transaction(engine, isolation_level='REPEATABLE READ') as session:\n"
        "    planned = decide(session)\n"
        "with transaction(engine) as session:\n"
        "    write_plan(session, planned.plan, write_decision(session, planned.record()))\n"
        "    session.flush()\n"
        "    print('written, not committed', flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, database_url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written, not committed"
    finally:
        proc.kill()  # SIGKILL: no cleanup in the process
        proc.wait(timeout=30)
        proc.stdout.close()
    with db_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM decisions")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM plans")).scalar() == 1
        assert conn.execute(text("SELECT status FROM plans WHERE id = :p"), {"p": earlier}).scalar() == "proposed"
        assert conn.execute(text("SELECT count(DISTINCT plan_id) FROM plan_steps")).scalar() == 1
    assert plan_store.apply(db_engine, earlier).plan_id == earlier  # the plan row it locked is free again


def test_a_rescue_racing_a_plan_failure_never_revives_a_step(cluster_engine: Engine, clock) -> None:
    for round_ in range(4):
        plan_id = propose(cluster_engine)
        plan_store.apply(cluster_engine, plan_id)
        starts = {s["key"]: s for s in claim_ready(cluster_engine, clock())}
        first = starts["w1.start"]
        with transaction(cluster_engine) as session:  # w1's agent is alive and heartbeats
            pin_clock(session, clock())
            session.execute(query("renew_step_lease"), {"step_id": first["id"], "fence": first["fence"],
                                                        "lease_s": 600})
        now = clock.advance(60)  # the claims of w2.start and w3.start ran out: their agents died

        def rescue(now: datetime = now, lag_s: float = 0.05 * (round_ % 2)) -> list:
            time.sleep(lag_s)  # every other round the failure most likely commits first
            with transaction(cluster_engine) as session:
                pin_clock(session, now)
                return session.execute(query("rescue_expired_steps"), {"max_attempts": 3}).all()

        failed, _ = in_threads(lambda s=first, t=now: report(cluster_engine, s, StepStatus.FAILED, t, "boom"), rescue)
        assert failed.status is PlanStatus.FAILED, failed
        rescue(lag_s=0)  # a later sweep: whatever the first one skipped while the plan row was being failed
        assert claim_ready(cluster_engine, clock()) == []
        with transaction(cluster_engine) as session:
            left = session.execute(select(PlanStep.key, PlanStep.status).where(PlanStep.plan_id == plan_id)).all()
        assert {k: s for k, s in left if s is not StepStatus.CANCELLED} == {"w1.start": StepStatus.FAILED}
