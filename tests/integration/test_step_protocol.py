"""The step protocol's guarantees, each by the failure it rules out: a success without its effect, a
zombie's write, a rescue that fails a step and nobody fails the plan or frees its group, a step of an
aborted plan running on, a claim racing a plan failure, status changes by raw SQL, and a plan graph
that grows with the square of its size."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from pearl.controlplane.core.domain import Activity, PlanStatus, Role, StepAction, StepStatus, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, Target, WorkerSlot
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.errors import ClaimLost, IllegalTransition
from pearl.controlplane.store import plan_store, reaper, step_effects
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import GPU, Plan, PlanStep, Worker
from pearl.controlplane.store.transitions import lock_fleet
from plan_support import COLOCATED_3, claim_ready, enact, pin_clock, propose, report, run_plan
from sqlalchemy import Engine, func, select, text

pytestmark = pytest.mark.integration


def _by_key(claimed: list[dict]) -> dict[str, dict]:
    return {s["key"]: s for s in claimed}


def _worker(engine: Engine, wid: int) -> Worker:
    with transaction(engine) as session:
        return session.get(Worker, wid)


@pytest.mark.parametrize("action", ["start", "admit", "release"])
def test_a_success_without_its_effect_in_the_rows_is_refused(cluster_engine: Engine, clock, action: str) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    if action == "release":  # get the three serving, then plan to stop worker 3
        run_plan(cluster_engine, clock())
        plan_id = propose(cluster_engine, Target(frozenset({1, 2}), {Role.COLOCATED: 2}))
        plan_store.apply(cluster_engine, plan_id)
    while True:
        steps = _by_key(claim_ready(cluster_engine, clock()))
        key = next((k for k in steps if k.endswith(f".{action}")), None)
        if key is not None:
            break
        for step in steps.values():
            report(cluster_engine, step, StepStatus.SUCCEEDED, clock())
    step = steps[key]
    before = _worker(cluster_engine, step["worker_id"])
    with pytest.raises(step_effects.EffectMissing, match=f"step {key} .* cannot succeed: worker"):
        with transaction(cluster_engine) as session:
            plan_store.finish_step(session, step["id"], step["fence"], StepStatus.SUCCEEDED)
    after = _worker(cluster_engine, step["worker_id"])
    assert (after.activity, after.role) == (before.activity, before.role)
    with transaction(cluster_engine) as session:
        assert session.get(PlanStep, step["id"]).status is StepStatus.RUNNING
        assert session.get(Plan, plan_id).status is PlanStatus.APPLYING
    report(cluster_engine, step, StepStatus.SUCCEEDED, clock())  # with its effect it succeeds
    with transaction(cluster_engine) as session:
        assert session.get(PlanStep, step["id"]).status is StepStatus.SUCCEEDED
        assert step_effects.effect_missing(session, step_effects.ClaimedStep(
            step["id"], plan_id, key, step["worker_id"], step["node_id"], StepAction(step["action"]),
            step["args"], step["expansion_group"], step["fence"])) is None


def test_a_zombie_whose_claim_was_rescued_changes_nothing(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    zombie = _by_key(claim_ready(cluster_engine, clock()))["w3.start"]
    with transaction(cluster_engine) as session:  # its agent froze; the claim runs out and is rescued
        pin_clock(session, clock.advance(60))
        session.execute(query("rescue_expired_steps"), {"max_attempts": 3})
    live = _by_key(claim_ready(cluster_engine, clock()))["w3.start"]
    assert live["fence"] > zombie["fence"]
    with pytest.raises(ClaimLost, match="not running under fence"):
        with transaction(cluster_engine) as session:  # the zombie wakes up and tries to take the GPUs
            step_effects.begin(session, step_effects.claimed_step(session, zombie["id"], zombie["fence"]))
    assert _worker(cluster_engine, 3).activity is Activity.INACTIVE
    with transaction(cluster_engine) as session:  # the live claim starts the worker
        step_effects.begin(session, step_effects.claimed_step(session, live["id"], live["fence"]))
    for attempt in (lambda s: enact(s, zombie),
                    lambda s: plan_store.finish_step(s, zombie["id"], zombie["fence"], StepStatus.FAILED)):
        with pytest.raises(ClaimLost):
            with transaction(cluster_engine) as session:
                attempt(session)
    w = _worker(cluster_engine, 3)
    assert w.activity is Activity.TRANSITIONING and w.last_fence == live["fence"] and w.generation == 1
    # the fence a worker was last changed under never goes down, whoever writes
    with pytest.raises(ClaimLost, match="stale fence: worker 3"):
        with transaction(cluster_engine) as session:
            session.execute(text("UPDATE workers SET last_fence = :f WHERE id = 3"), {"f": zombie["fence"]})
    report(cluster_engine, live, StepStatus.SUCCEEDED, clock())  # the re-run completes it, once
    assert _worker(cluster_engine, 3).generation == 1


def test_a_step_failed_by_rescue_fails_its_plan_and_its_group_gives_the_gpus_back(cluster_engine: Engine,
                                                                                    clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    starts = claim_ready(cluster_engine, clock())
    for step in starts:  # the agents took the GPUs and then died, every time
        with transaction(cluster_engine) as session:
            step_effects.begin(session, step_effects.claimed_step(session, step["id"], step["fence"]))
    swept = reaper.reap(cluster_engine, max_attempts=1, now=clock.advance(60))  # every claim ran out
    assert sorted(st for _, st in swept.rescued) == ["failed"] * 3
    ((failed, cleanup),) = swept.failed_plans
    assert failed == plan_id and cleanup is not None
    with transaction(cluster_engine) as session:
        assert session.get(Plan, plan_id).status is PlanStatus.FAILED
        assert session.scalar(select(func.count()).where(GPU.worker_id.is_not(None))) == 6
    run_plan(cluster_engine, clock())  # the agents enact the cleanup
    with transaction(cluster_engine) as session:
        assert session.get(Plan, cleanup).status is PlanStatus.SUCCEEDED
        assert session.scalar(select(func.count()).where(GPU.worker_id.is_not(None))) == 0
        assert set(session.scalars(select(Worker.activity))) == {Activity.INACTIVE}


def test_renewal_tells_a_running_step_that_its_plan_was_aborted(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    step = claim_ready(cluster_engine, clock())[0]
    renew = {"step_id": step["id"], "fence": step["fence"], "lease_s": 30}
    with transaction(cluster_engine) as session:
        assert session.execute(query("renew_step_lease"), renew).one().plan_status == "applying"
    plan_store.abort(cluster_engine, plan_id)
    with transaction(cluster_engine) as session:
        assert session.execute(query("renew_step_lease"), renew).one().plan_status == "failed"
    with pytest.raises(step_effects.PlanStopped, match="the plan is failed; the step stops"):
        report(cluster_engine, step, StepStatus.SUCCEEDED, clock())
    report(cluster_engine, step, StepStatus.CANCELLED, clock())  # what the agent then reports
    with transaction(cluster_engine) as session:
        assert session.get(PlanStep, step["id"]).status is StepStatus.CANCELLED


def test_a_step_handed_back_after_its_plan_failed_is_cancelled_and_its_cleanup_runs(cluster_engine: Engine,
                                                                                     clock) -> None:
    """An agent stopping (SIGTERM) hands back the step it holds; if the plan failed meanwhile, the step
    must not become ready again: nothing of a failed plan runs, and a ready step of it would stand
    first in its worker's line for ever, so the cleanup plan's steps for that worker never run."""
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    held = _by_key(claim_ready(cluster_engine, clock()))["w3.start"]
    with transaction(cluster_engine) as session:  # the start took the GPUs; the server is starting
        step_effects.begin(session, step_effects.claimed_step(session, held["id"], held["fence"]))
    failed = plan_store.abort(cluster_engine, plan_id)
    assert failed.cleanup is not None and 3 in failed.release
    with transaction(cluster_engine) as session:  # the agent is stopped before it saw the plan fail
        row = session.execute(query("hand_back_step"), {"step_id": held["id"], "fence": held["fence"]}).one()
    assert row.status == StepStatus.CANCELLED.value
    with transaction(cluster_engine) as session:
        step = session.get(PlanStep, held["id"])
        assert step.status is StepStatus.CANCELLED and step.finished_at is not None
    claimed = _by_key(claim_ready(cluster_engine, clock()))
    assert claimed["w3.interrupt"]["plan_id"] == failed.cleanup  # the cleanup takes the worker over
    assert set(claimed) == {"w3.interrupt"}
    report(cluster_engine, claimed["w3.interrupt"], StepStatus.SUCCEEDED, clock())
    run_plan(cluster_engine, clock())
    with transaction(cluster_engine) as session:
        assert session.get(Plan, failed.cleanup).status is PlanStatus.SUCCEEDED
        assert session.scalar(select(func.count()).select_from(GPU).where(GPU.worker_id == 3)) == 0
    assert _worker(cluster_engine, 3).activity is Activity.INACTIVE


def test_a_step_handed_back_while_its_plan_applies_is_ready_again_with_its_attempt_returned(
        cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    held = _by_key(claim_ready(cluster_engine, clock()))["w3.start"]
    with transaction(cluster_engine) as session:
        row = session.execute(query("hand_back_step"), {"step_id": held["id"], "fence": held["fence"]}).one()
    assert row.status == StepStatus.READY.value
    again = _by_key(claim_ready(cluster_engine, clock()))["w3.start"]
    assert again["fence"] > held["fence"] and again["attempts"] == held["attempts"]


def test_a_claim_never_takes_a_step_of_a_plan_being_failed(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    failing = threading.Event()
    done = threading.Event()

    def fail_slowly() -> None:  # the abort holds the plan row while it cancels the steps
        with transaction(cluster_engine) as session:
            lock_fleet(session)
            plan = session.scalars(select(Plan).where(Plan.id == plan_id).with_for_update()).one()
            failing.set()
            done.wait(5)
            plan_store._fail(session, plan, "aborted while claims ran")

    t = threading.Thread(target=fail_slowly)
    t.start()
    assert failing.wait(5)
    assert claim_ready(cluster_engine, clock()) == []  # skipped, not waited for
    done.set()
    t.join(10)
    assert claim_ready(cluster_engine, clock()) == []
    with transaction(cluster_engine) as session:
        assert set(session.scalars(select(PlanStep.status).where(PlanStep.plan_id == plan_id))) == {
            StepStatus.CANCELLED}


@pytest.mark.parametrize(("sql", "message"), [
    ("UPDATE plan_steps SET status = 'succeeded' WHERE key = 'w1.start'", "blocked -> succeeded"),
    ("UPDATE plan_steps SET status = 'running' WHERE key = 'w1.start'", "blocked -> running"),
    ("UPDATE plans SET status = 'succeeded'", "proposed -> succeeded"),
    ("UPDATE plan_steps SET action = 'admit' WHERE key = 'w1.start'", "never change"),
], ids=["step-skips-running", "step-skips-claim", "plan-skips-applying", "step-action"])
def test_plans_and_steps_move_only_along_their_edges(cluster_engine: Engine, sql: str, message: str) -> None:
    propose(cluster_engine)
    with pytest.raises(IllegalTransition, match=message):
        with transaction(cluster_engine) as session:
            session.execute(text(sql))


def test_a_barrier_succeeds_in_the_database_the_moment_its_group_is_loaded(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    for _ in range(2):  # the starts, then the loads
        for step in claim_ready(cluster_engine, clock()):
            progress = report(cluster_engine, step, StepStatus.SUCCEEDED, clock())
    assert "borrow.barrier" in progress.readied or "expand.barrier" in progress.readied
    with transaction(cluster_engine) as session:
        for key in ("borrow.barrier", "expand.barrier"):  # the borrowed workers 1, 2; the dedicated worker 3
            barrier = session.scalars(select(PlanStep).where(PlanStep.plan_id == plan_id, PlanStep.key == key)).one()
            assert barrier.status is StepStatus.SUCCEEDED and barrier.fence is None and barrier.attempts == 0
        admits = session.scalars(select(PlanStep.status).where(PlanStep.plan_id == plan_id,
                                                               PlanStep.action == "admit")).all()
        assert admits == [StepStatus.READY] * 3
    with transaction(cluster_engine) as session:  # a barrier is never handed to an agent
        assert session.execute(text("SELECT count(*) FROM plan_steps WHERE action = 'barrier' "
                                    "AND claimed_by IS NOT NULL")).scalar() == 0


def _fleet(n_workers: int, active: bool) -> FleetSnapshot:
    return FleetSnapshot(1, tuple(
        WorkerSlot(i, f"n{(i - 1) // 4}", (2 * i, 2 * i + 1), WorkerZone.DEDICATED, Role.COLOCATED,
                   Activity.ACTIVE if active else Activity.INACTIVE) for i in range(1, n_workers + 1)), tp=2)


def test_a_mode_change_at_4096_gpus_has_a_linear_plan_graph() -> None:
    workers = 2048  # 4096 GPUs at TP2
    plan = orchestrate(_fleet(workers, active=True), Target(
        frozenset(range(1, workers + 1)), {Role.PREFILL: 512, Role.DECODE: workers - 512}))
    edges = sum(len(s.after) for s in plan.steps)
    assert len(plan.steps) == 6 * workers + 2  # a restart chain each, one barrier, one router sync
    assert edges <= 3 * len(plan.steps)  # O(steps), where one admit per member of every load was O(n^2)


def test_a_report_touches_only_its_dependents(db_engine: Engine, clock) -> None:
    from plan_support import import_cluster

    import_cluster(db_engine, {"model": "qwen3-8b", "gpu": "h800", "tp": 2, "nodes": [
        {"name": f"n{i}", "zone": "rollout", "gpus": 8, "address": "127.0.0.1"} for i in range(8)]})
    plan_id = propose(db_engine, Target(frozenset(range(1, 33)), {Role.COLOCATED: 32}))
    plan_store.apply(db_engine, plan_id)
    with db_engine.connect() as conn:
        deps = conn.execute(text("SELECT count(*) FROM plan_step_deps d JOIN plan_steps s ON s.id = d.step_id "
                                 "WHERE s.plan_id = :p"), {"p": plan_id}).scalar()
        steps = conn.execute(text("SELECT count(*) FROM plan_steps WHERE plan_id = :p"), {"p": plan_id}).scalar()
    assert steps == 3 * 32 + 2 and deps == 32 + 32 + 32 + 32  # load<-start, barrier<-loads, admit<-barrier, sync
    start = next(s for s in claim_ready(db_engine, clock()) if s["key"] == "w1.start")
    with db_engine.connect() as conn:  # count the plan's rows a report writes (xmin of the transaction)
        before = conn.execute(text("SELECT id, xmin::text FROM plan_steps WHERE plan_id = :p"),
                              {"p": plan_id}).all()
    report(db_engine, start, StepStatus.SUCCEEDED, clock())
    with db_engine.connect() as conn:
        after = dict(conn.execute(text("SELECT id, xmin::text FROM plan_steps WHERE plan_id = :p"),
                                  {"p": plan_id}).all())
    changed = {i for i, x in before if after[i] != x}
    assert changed == {start["id"], _id(db_engine, plan_id, "w1.load_weights")}


def _id(engine: Engine, plan_id: int, key: str) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT id FROM plan_steps WHERE plan_id = :p AND key = :k"),
                            {"p": plan_id, "k": key}).scalar_one()


def test_leases_come_from_the_databases_clock(cluster_engine: Engine) -> None:
    plan_id = propose(cluster_engine, COLOCATED_3)
    plan_store.apply(cluster_engine, plan_id)
    with transaction(cluster_engine) as session:
        db_now = session.scalar(text("SELECT clock_timestamp()"))
        rows = plan_store.claim_steps(session, 1, None, lease_s=30, limit=10)
    assert rows and all(abs((r["lease_until"] - db_now - timedelta(seconds=30)).total_seconds()) < 5 for r in rows)


def test_a_claim_made_while_another_step_is_reported_still_takes_its_ready_step(cluster_engine: Engine,
                                                                                 clock) -> None:
    """A report holds its plan's row until it commits; the agents of other nodes claiming meanwhile
    must still get their ready steps (skipping them would leave each to the next poll)."""
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    with transaction(cluster_engine) as session:
        pin_clock(session, clock())
        node = session.scalar(text("SELECT id FROM nodes WHERE name = 'train-0'"))
        (w1,) = plan_store.claim_steps(session, node, None, lease_s=30, limit=1)
    reporting, done = threading.Event(), threading.Event()

    def report_slowly() -> None:  # the report of w1's step, held open before its commit
        with transaction(cluster_engine) as session:
            pin_clock(session, clock())
            enact(session, dict(w1))
            reporting.set()
            done.wait(5)

    t = threading.Thread(target=report_slowly)
    t.start()
    try:
        assert reporting.wait(5)
        claimed = {s["key"] for s in claim_ready(cluster_engine, clock())}
    finally:
        done.set()
        t.join(10)
    assert claimed == {"w2.start", "w3.start"}
    with transaction(cluster_engine) as session:
        assert session.get(Plan, plan_id).status is PlanStatus.APPLYING
        assert session.scalars(select(PlanStep.status).where(PlanStep.id == w1["id"])).one() is StepStatus.SUCCEEDED
