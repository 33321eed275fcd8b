"""The plan store against real PostgreSQL: writing, superseding, applying (stale refused), the steps'
progression through the fenced finish, failure and the expansion group, and the audit events."""

from __future__ import annotations

import pytest
from pearl.controlplane.core.domain import GPUState, PlanStatus, Role, StepAction, StepStatus
from pearl.controlplane.core.fleet import Plan as FleetPlan
from pearl.controlplane.core.fleet import PlanStep as PlanStep_
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.core.orchestrator import orchestrate
from pearl.controlplane.errors import BadInput, ClaimLost, IllegalTransition, StalePlan
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import GPU, Plan, PlanStep
from pearl.controlplane.store.snapshot import load_snapshot
from pearl.controlplane.store.transitions import set_gpu_states
from plan_support import COLOCATED_3, claim_ready, node_id, pin_clock, propose, report, run_plan
from sqlalchemy import Engine, select, text
from sqlalchemy.exc import IntegrityError

pytestmark = pytest.mark.integration

# cluster_engine (conftest): workers 1, 2 overlap on train-0; 3 dedicated on roll-0; 4 on spot-0 (not granted)
SPLIT_3 = Target(frozenset({1, 2, 3}), {Role.PREFILL: 1, Role.DECODE: 2}, reason="test: 1P2D")


def rows(engine: Engine, plan_id: int) -> tuple[Plan, list[PlanStep]]:
    with transaction(engine) as session:
        plan = session.get(Plan, plan_id)
        steps = session.scalars(select(PlanStep).where(PlanStep.plan_id == plan_id).order_by(PlanStep.id)).all()
        return plan, list(steps)


def fleet_state(engine: Engine) -> tuple[int, list[tuple], list[tuple]]:
    """(state_version, workers, gpus): what a refused apply must leave alone."""
    with engine.connect() as conn:
        version = conn.execute(text("SELECT pearl_state_version()")).scalar_one()
        workers = conn.execute(text("SELECT id, role, activity FROM workers ORDER BY id")).all()
        gpus = conn.execute(text("SELECT id, state, worker_id FROM gpus ORDER BY id")).all()
    return version, workers, gpus


def test_a_plan_is_stored_with_its_steps_and_supersedes_older_proposals(cluster_engine: Engine) -> None:
    first = propose(cluster_engine)
    with transaction(cluster_engine) as session:
        expected = orchestrate(load_snapshot(session), SPLIT_3)
    second = propose(cluster_engine, SPLIT_3)
    old, _ = rows(cluster_engine, first)
    plan, steps = rows(cluster_engine, second)
    assert old.status is PlanStatus.SUPERSEDED and old.error == f"superseded by plan {second}"
    assert plan.status is PlanStatus.PROPOSED and plan.base_version == expected.base_version
    assert (plan.d_worker, plan.d_role) == (expected.d_worker, expected.d_role) == (3, 0)
    assert [s.key for s in steps] == [s.key for s in expected.steps]
    assert all(s.status is StepStatus.BLOCKED for s in steps)
    by_key = {s.key: s for s in steps}
    for step in expected.steps:
        row = by_key[step.key]
        assert (row.action, row.worker_id, row.depends_on, row.args) == (
            step.action, step.worker_id, list(step.after), dict(step.args))
        assert row.expansion_group == (f"plan{second}.{step.group}" if step.group else None)
    with cluster_engine.connect() as conn:
        decision = conn.execute(text("SELECT policy, inputs, target FROM decisions WHERE id = :d"),
                                {"d": plan.decision_id}).one()
    assert decision.policy == "test" and decision.inputs == {"note": "test", "inf": None}
    assert decision.target["counts"] == {"prefill": 1, "decode": 2}


def test_an_empty_plan_writes_no_plan_row(cluster_engine: Engine) -> None:
    with transaction(cluster_engine) as session:
        empty = orchestrate(load_snapshot(session), Target(frozenset(), {}, reason="nothing"))
        assert empty.empty and plan_store.write_plan(session, empty, None) is None
    with cluster_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM plans")).scalar() == 0


def test_apply_makes_the_dependency_free_steps_ready_and_wakes_their_nodes(cluster_engine: Engine) -> None:
    import psycopg

    plan_id = propose(cluster_engine)
    url = cluster_engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    channels = {f"pearl_steps_{node_id(cluster_engine, node)}": node for node in ("roll-0", "train-0", "spot-0")}
    with psycopg.connect(url, autocommit=True) as listener:
        for channel in channels:
            listener.execute(f"LISTEN {channel}")
        applied = plan_store.apply(cluster_engine, plan_id)
        heard = {(n.channel, n.payload) for n in listener.notifies(timeout=2)}
    plan, steps = rows(cluster_engine, plan_id)
    assert plan.status is PlanStatus.APPLYING and plan.applied_at is not None
    ready = [s.key for s in steps if s.status is StepStatus.READY]
    assert sorted(ready) == list(applied.ready) == ["w1.start", "w2.start", "w3.start"]
    assert all(s.status is StepStatus.BLOCKED for s in steps if s.key not in ready)
    assert applied.nodes == ("roll-0", "train-0")
    woken = {s.node_id for s in steps if s.status is StepStatus.READY}
    assert heard == {(f"pearl_steps_{n}", str(n)) for n in woken}  # each node on its own channel only
    assert {channels[c] for c, _ in heard} == {"roll-0", "train-0"}  # spot-0, with nothing ready, hears nothing


def test_a_stale_plan_is_refused_and_nothing_changes(cluster_engine: Engine) -> None:
    plan_id = propose(cluster_engine)
    with transaction(cluster_engine, actor="provider") as session:  # the fleet moves on: spot-0 is granted
        spot = session.scalars(select(GPU.id).where(GPU.zone == "preemptible")).all()
        set_gpu_states(session, spot, [GPUState.UNAVAILABLE], GPUState.FREE)
    before = fleet_state(cluster_engine)
    plan, _ = rows(cluster_engine, plan_id)
    with pytest.raises(StalePlan) as refused:
        plan_store.apply(cluster_engine, plan_id)
    message = str(refused.value)
    assert f"plan {plan_id} was computed at state_version {plan.base_version}, the fleet is at {before[0]}" in message
    assert "run `pearlctl plan` again" in message
    assert fleet_state(cluster_engine) == before
    plan, steps = rows(cluster_engine, plan_id)
    assert plan.status is PlanStatus.STALE and plan.error == message and plan.applied_at is None
    assert all(s.status is StepStatus.BLOCKED for s in steps)
    with pytest.raises(plan_store.PlanNotApplicable, match="is stale"):
        plan_store.apply(cluster_engine, plan_id)


def test_a_superseded_plan_cannot_be_applied(cluster_engine: Engine) -> None:
    old = propose(cluster_engine)
    new = propose(cluster_engine, SPLIT_3)
    with pytest.raises(StalePlan, match=f"plan {old} was superseded by plan {new}"):
        plan_store.apply(cluster_engine, old)
    assert plan_store.apply(cluster_engine).plan_id == new  # the latest proposed one is the newer


def test_one_plan_applies_at_a_time(cluster_engine: Engine) -> None:
    first = propose(cluster_engine)
    plan_store.apply(cluster_engine, first)
    second = propose(cluster_engine, SPLIT_3)
    with pytest.raises(plan_store.PlanNotApplicable, match=f"plan {first} is still applying"):
        plan_store.apply(cluster_engine, second)
    assert rows(cluster_engine, second)[0].status is PlanStatus.PROPOSED


def test_unknown_plans_and_nothing_proposed(cluster_engine: Engine) -> None:
    with pytest.raises(plan_store.NoPlan, match="PLAN_ID: plan 42 does not exist") as refused:
        plan_store.apply(cluster_engine, 42)
    assert refused.value.exit_code == 2
    with pytest.raises(plan_store.NothingToApply, match="No proposed plan: run `pearlctl plan` first"):
        plan_store.apply(cluster_engine)


def test_steps_run_in_dependency_order_and_the_plan_succeeds(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine, SPLIT_3)
    plan_store.apply(cluster_engine, plan_id)
    _, steps = rows(cluster_engine, plan_id)
    after = {s.key: set(s.depends_on) for s in steps}
    # the borrowed workers 1, 2 and the dedicated worker 3 meet at their own barriers
    assert after["w1.admit"] == after["w2.admit"] == {"borrow.barrier"} and after["w3.admit"] == {"expand.barrier"}
    assert after["borrow.barrier"] == {"w1.load_weights", "w2.load_weights"}
    assert after["expand.barrier"] == {"w3.load_weights"}
    rounds = 0
    while claimed := claim_ready(cluster_engine, clock()):
        rounds += 1
        succeeded = {s.key for s in rows(cluster_engine, plan_id)[1] if s.status is StepStatus.SUCCEEDED}
        for step in claimed:
            assert after[step["key"]] <= succeeded, f"{step['key']} ran before {after[step['key']] - succeeded}"
            assert step["action"] != "barrier"  # a barrier is never claimed: it succeeds in the database
        for step in claimed:
            progress = report(cluster_engine, step, StepStatus.SUCCEEDED, clock.advance(1))
    assert rounds == 4  # start, load_weights, the group's admits, router_sync
    assert progress.status is PlanStatus.SUCCEEDED
    plan, steps = rows(cluster_engine, plan_id)
    assert plan.status is PlanStatus.SUCCEEDED and plan.finished_at is not None
    assert {s.status for s in steps} == {StepStatus.SUCCEEDED}


def test_a_failed_step_fails_the_plan_and_cancels_the_group(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    progress = run_plan(cluster_engine, clock(), fail="w2.load_weights")
    failed = [p for p in progress if p.status is PlanStatus.FAILED and p.cancelled]
    assert len(failed) == 1
    plan, steps = rows(cluster_engine, plan_id)
    assert plan.status is PlanStatus.FAILED
    assert plan.error == "step w2.load_weights (load_weights on worker 2) failed: boom"
    status = {s.key: s.status for s in steps}
    # no admit of the group ran: all-or-nothing; the members that took GPUs must give them back
    assert all(status[f"w{w}.admit"] is StepStatus.CANCELLED for w in (1, 2, 3))
    assert status["router_sync"] is StepStatus.CANCELLED
    assert status["w2.load_weights"] is StepStatus.FAILED
    assert set(failed[0].cancelled) | {"w3.load_weights"} == {
        k for k, s in status.items() if s is StepStatus.CANCELLED}
    assert failed[0].release == (1, 2, 3)
    # w3.load_weights was running: its success is refused once the plan failed, and its agent stops it
    assert status["w3.load_weights"] is StepStatus.CANCELLED
    with transaction(cluster_engine) as session:  # and reconciling again changes nothing
        assert plan_store.reconcile(session, plan_id) == plan_store.PlanProgress(plan_id, PlanStatus.FAILED)
    # the cleanup plan, applied with the failure, released every member that took GPUs
    cleanup, cleanup_steps = rows(cluster_engine, failed[0].cleanup)
    assert cleanup.cleans_up == plan_id and cleanup.status is PlanStatus.SUCCEEDED
    assert sorted(s.key for s in cleanup_steps) == sorted(f"w{w}.{a}" for w in (1, 2, 3)
                                                         for a in ("interrupt", "release"))
    with cluster_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM workers WHERE activity <> 'inactive'")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM gpus WHERE worker_id IS NOT NULL")).scalar() == 0


def test_a_fully_admitted_group_is_not_released_when_a_later_step_fails(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    progress = run_plan(cluster_engine, clock(), fail="router_sync")
    failed = [p for p in progress if p.status is PlanStatus.FAILED]
    _, steps = rows(cluster_engine, plan_id)
    status = {s.key: s.status for s in steps}
    assert status["router_sync"] is StepStatus.FAILED
    assert all(status[f"w{w}.admit"] is StepStatus.SUCCEEDED for w in (1, 2, 3))
    # every member was admitted and serves: nothing of the group is given back
    assert len(failed) == 1 and failed[0].release == ()


def test_steps_of_a_failed_plan_are_never_rescued_or_claimed_again(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    starts = {s["key"]: s for s in claim_ready(cluster_engine, clock())}
    assert sorted(starts) == ["w1.start", "w2.start", "w3.start"]
    failed = report(cluster_engine, starts["w1.start"], StepStatus.FAILED, clock(), "boom")
    assert failed.status is PlanStatus.FAILED
    # the agents running w2.start and w3.start die: their claims expire and the rescuer runs
    assert failed.cleanup is None  # no start took its GPUs: nothing to clean up
    with transaction(cluster_engine) as session:
        pin_clock(session, clock.advance(60))
        rescued = session.execute(query("rescue_expired_steps"), {"max_attempts": 3}).all()
    assert sorted((r.id, r.status) for r in rescued) == sorted(
        (starts[k]["id"], "cancelled") for k in ("w2.start", "w3.start"))
    assert claim_ready(cluster_engine, clock()) == []
    _, steps = rows(cluster_engine, plan_id)
    assert not [s.key for s in steps if s.status in (StepStatus.READY, StepStatus.RUNNING)]
    assert all("no longer applying" in s.error for s in steps if s.key in ("w2.start", "w3.start"))
    # a finished step never comes back, not even by raw SQL: the step_transitions guard refuses it
    with pytest.raises(IllegalTransition, match="illegal step transition: .* cancelled -> ready"):
        with transaction(cluster_engine) as session:
            session.execute(text("UPDATE plan_steps SET status = 'ready', error = NULL WHERE plan_id = :p "
                                 "AND key = 'w2.start'"), {"p": plan_id})
    assert claim_ready(cluster_engine, clock()) == []


def test_a_report_under_a_lost_claim_changes_nothing(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    step = claim_ready(cluster_engine, clock())[0]
    with pytest.raises(ClaimLost, match=f"step {step['id']} is not running under fence"):
        report(cluster_engine, {**step, "fence": step["fence"] + 1000}, StepStatus.SUCCEEDED, clock())
    _, steps = rows(cluster_engine, plan_id)
    assert next(s for s in steps if s.id == step["id"]).status is StepStatus.RUNNING
    with pytest.raises(BadInput, match="status: step .* cannot be cancelled while plan .* applies"):
        report(cluster_engine, step, StepStatus.CANCELLED, clock())


def test_a_step_failed_by_the_rescuer_fails_the_plan_on_reconcile(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    claim_ready(cluster_engine, clock())
    with transaction(cluster_engine) as session:  # every claim expires past its last attempt
        pin_clock(session, clock.advance(60))
        session.execute(query("rescue_expired_steps"), {"max_attempts": 1})
        progress = plan_store.reconcile(session, plan_id)
    assert progress.status is PlanStatus.FAILED and "claim expired" in rows(cluster_engine, plan_id)[0].error


def test_plan_changes_are_in_the_events(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id, actor="operator")
    run_plan(cluster_engine, clock())
    with cluster_engine.connect() as conn:
        plan_events = conn.execute(text(
            "SELECT op, old_value, new_value, actor FROM transitions WHERE entity = 'plans' AND entity_id = :p "
            "AND (field = 'status' OR op = 'insert') ORDER BY event_id"), {"p": str(plan_id)}).all()
        step_events = conn.execute(text(
            "SELECT count(*) FROM events WHERE entity = 'plan_steps' AND new ->> 'plan_id' = :p"),
            {"p": str(plan_id)}).scalar()
    assert [(e.op, e.old_value, e.new_value) for e in plan_events] == [
        ("insert", None, None), ("update", "proposed", "applying"), ("update", "applying", "succeeded")]
    assert plan_events[1].actor == "operator" and plan_events[2].actor == "test agent"
    # each step: inserted, readied, claimed, finished; each of the two barriers: inserted, succeeded
    assert step_events == 4 * (len(rows(cluster_engine, plan_id)[1]) - 2) + 2 * 2


def test_wait_plan_returns_when_the_plan_finishes_and_times_out_otherwise(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    with pytest.raises(plan_store.PlanTimeout, match=f"plan {plan_id} is still applying after 0.2 s"):
        plan_store.wait_plan(cluster_engine, plan_id, timeout_s=0.2, poll_s=0.05)
    run_plan(cluster_engine, clock())
    assert plan_store.wait_plan(cluster_engine, plan_id, timeout_s=5)["status"] == "succeeded"


def _plan_of(snapshot_version: int, *steps: PlanStep_) -> FleetPlan:
    return FleetPlan(snapshot_version, frozenset(), frozenset(), {}, {}, steps, COLOCATED_3)


@pytest.mark.parametrize(("steps", "message"), [
    ((PlanStep_("a", StepAction.ROUTER_SYNC, 3, "roll-0", after=("nope",)),
      PlanStep_("b", StepAction.ROUTER_SYNC, 1, "train-0")),
     r"plan.steps\[a\].after: \['nope'\] are not keys of the plan"),
    ((PlanStep_("a", StepAction.ROUTER_SYNC, 3, "roll-0", after=("b",)),
      PlanStep_("b", StepAction.ROUTER_SYNC, 1, "train-0", after=("a",))),
     r"plan.steps.after: the steps \[.*\] wait for each other in a cycle"),
    ((PlanStep_("a", StepAction.START, 3, "train-0"),),
     r"plan.steps\[a\].worker: worker 3 does not live on node 'train-0'"),
], ids=["unknown-after-key", "cycle", "worker-on-another-node"])
def test_a_plan_that_could_never_finish_is_refused(cluster_engine: Engine, steps: tuple, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        with transaction(cluster_engine) as session:
            plan_store.write_plan(session, _plan_of(load_snapshot(session).state_version, *steps), None)
    with cluster_engine.connect() as conn:
        written = conn.execute(text("SELECT (SELECT count(*) FROM plans) + (SELECT count(*) FROM plan_steps)"))
        assert written.scalar() == 0


def test_the_database_refuses_a_step_on_a_node_its_worker_does_not_live_on(cluster_engine: Engine) -> None:
    plan_id = propose(cluster_engine)
    with pytest.raises(IntegrityError, match="fk_plan_steps_worker_id_node_id_workers"):
        with cluster_engine.begin() as conn:  # worker 3 lives on roll-0
            conn.execute(text("INSERT INTO plan_steps (plan_id, key, worker_id, node_id, action) "
                              "SELECT :p, 'x', 3, id, 'start' FROM nodes WHERE name = 'train-0'"), {"p": plan_id})


def test_an_applying_plan_is_aborted_and_the_next_one_applies(cluster_engine: Engine, clock) -> None:
    plan_id = propose(cluster_engine)
    plan_store.apply(cluster_engine, plan_id)
    starts = claim_ready(cluster_engine, clock())
    for step in starts[:2]:
        report(cluster_engine, step, StepStatus.SUCCEEDED, clock())
    # the third agent died mid-step: the plan cannot finish
    progress = plan_store.abort(cluster_engine, plan_id, actor="operator")
    plan, steps = rows(cluster_engine, plan_id)
    status = {s.key: s.status for s in steps}
    assert plan.status is PlanStatus.FAILED and plan.error == "aborted by operator"
    assert status[starts[2]["key"]] is StepStatus.RUNNING  # its agent may still report; rescue cancels it
    assert set(progress.cancelled) == {k for k, s in status.items() if s is StepStatus.CANCELLED}
    assert set(progress.cancelled) == set(status) - {s["key"] for s in starts}
    # the group was never admitted: every member that took GPUs gives them back (the third never did)
    assert progress.release == tuple(sorted(s["worker_id"] for s in starts[:2]))
    with transaction(cluster_engine) as session:
        pin_clock(session, clock.advance(60))
        rescued = session.execute(query("rescue_expired_steps"), {"max_attempts": 3}).all()
    assert [(r.id, r.status) for r in rescued] == [(starts[2]["id"], "cancelled")]
    run_plan(cluster_engine, clock())  # the agents enact the cleanup plan
    assert rows(cluster_engine, progress.cleanup)[0].status is PlanStatus.SUCCEEDED
    with pytest.raises(plan_store.PlanNotApplicable, match=f"plan {plan_id} is failed; only an applying plan"):
        plan_store.abort(cluster_engine, plan_id)
    with pytest.raises(plan_store.NoPlan, match="plan 42 does not exist"):
        plan_store.abort(cluster_engine, 42)
    assert plan_store.apply(cluster_engine, propose(cluster_engine, SPLIT_3)).plan_id > plan_id
