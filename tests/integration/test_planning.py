"""The policy engine adapter against real PostgreSQL: snapshot, profile, signals and memory in; the
PEARL policy's decision and plan out as rows (or nothing, with dry_run)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pearl.controlplane.core.domain import GPUState, LeaseKind, PlanStatus, Role, StepAction
from pearl.controlplane.core.profile import Provenance
from pearl.controlplane.core.telemetry import parse_telemetry
from pearl.controlplane.errors import StalePlan
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.profile_store import NoInventory, NoWorkload
from pearl.controlplane.store.schema import GPU, Decision, Lease, Plan, PolicyMemory, TrainingStep
from pearl.controlplane.store.telemetry_store import ingest_telemetry
from pearl.controlplane.store.transitions import admit_worker, set_gpu_states, start_worker
from pearl.policies.live import policy_pass
from plan_support import import_cluster, run_plan, small_inventory, telemetry
from sqlalchemy import Engine, func, select, text

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet_engine(db_engine: Engine) -> Engine:
    """SMALL inventory with the paper workload: overlap slots 1, 2; dedicated 3 (roll-0), 4 (spot-0)."""
    import_cluster(db_engine, small_inventory())
    return db_engine


def written(engine: Engine) -> tuple[int, int, int]:
    """(decisions, plans, policy memories)."""
    with engine.connect() as conn:
        return tuple(conn.execute(text(
            "SELECT (SELECT count(*) FROM decisions), (SELECT count(*) FROM plans), "
            "(SELECT count(*) FROM policy_memory)")).one())


def test_a_dry_run_decides_and_writes_nothing(fleet_engine: Engine) -> None:
    planned = policy_pass.plan(fleet_engine, dry_run=True)
    assert written(fleet_engine) == (0, 0, 0)
    assert planned.decision_id is None and planned.plan_id is None
    # nothing runs and nothing trains: the dedicated slot and the borrowable overlap slots, all to start
    assert planned.target.members == {1, 2, 3} and not planned.plan.empty
    assert planned.plan.base_version == planned.snapshot.state_version
    assert planned.profile.provenance is Provenance.CATALOG and planned.memory_note == "initial"
    assert planned.selection is not None and planned.selection.candidates[0].config.workers == 3
    assert planned.gate is not None and planned.gate.borrow
    assert planned.as_dict()["plan"]["id"] is None


def test_a_pass_writes_the_decision_the_plan_and_the_memory(fleet_engine: Engine) -> None:
    first = policy_pass.plan(fleet_engine)
    assert written(fleet_engine) == (1, 1, 1)
    with transaction(fleet_engine) as session:
        decision = session.get(Decision, first.decision_id)
        plan = session.get(Plan, first.plan_id)
        memory = session.get(PolicyMemory, policy_pass.POLICY)
        summary = plan_store.plan_summary(session, first.plan_id)
    assert decision.policy == "pearl" and decision.state_version == first.snapshot.state_version
    assert decision.reason == first.target.reason and decision.target["members"] == [1, 2, 3]
    assert decision.inputs["selection"]["chosen"] == first.selection.chosen.label
    assert decision.inputs["gate"]["borrow"] is True and decision.inputs["profile"]["provenance"] == "catalog"
    assert decision.predicted_target_s == pytest.approx(first.selection.candidates[0].predicted_s)
    assert decision.predicted_current_s is None  # nothing was running
    assert (plan.status, plan.base_version, plan.decision_id) == (
        PlanStatus.PROPOSED, first.snapshot.state_version, first.decision_id)
    assert [s["key"] for s in summary["steps"]] == [s.key for s in first.plan.steps]
    assert memory.decision_id == first.decision_id and "profile" in memory.memory
    second = policy_pass.plan(fleet_engine)
    assert second.memory_note == f"stored (decision {first.decision_id})"
    assert second.target == first.target  # a pure function of the same rows
    with transaction(fleet_engine) as session:
        assert session.get(Plan, first.plan_id).status is PlanStatus.SUPERSEDED
    out = second.as_dict(policy_pass.written_plan(fleet_engine, second))
    assert out["plan"]["id"] == second.plan_id and out["decision"]["id"] == second.decision_id


def test_the_fitted_profile_is_what_the_policy_plans_with(fleet_engine: Engine) -> None:
    ingest_telemetry(fleet_engine, parse_telemetry(telemetry(0)))
    fitted = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(1)))
    planned = policy_pass.plan(fleet_engine, dry_run=True)
    assert planned.profile.row_id == fitted.profile_id and planned.profile.provenance is Provenance.FITTED
    assert planned.memory.profile is planned.profile.profile  # the stored profile, not a refit of its own
    assert planned.memory.fitted_step == 1 and planned.signals.telemetry.step == 1
    assert planned.signals.rollout_step == 2


def test_training_takes_the_overlap_slots_back(fleet_engine: Engine) -> None:
    with transaction(fleet_engine, actor="trainer") as session:
        session.add(TrainingStep(step=7, requested_at=func.now(), started_at=func.now()))
    planned = policy_pass.plan(fleet_engine, dry_run=True)
    assert planned.signals.training and not planned.signals.training_wanted
    assert planned.target.members == {3} and planned.gate is None
    assert "training runs or wants its GPUs" in planned.target.reason
    with transaction(fleet_engine, actor="trainer") as session:
        session.execute(text("UPDATE training_steps SET ended_at = now() WHERE step = 7"))
        session.add(TrainingStep(step=8, requested_at=func.now()))  # asked for, waiting for its GPUs
    waiting = policy_pass.plan(fleet_engine, dry_run=True)
    assert waiting.signals.training_wanted and waiting.target.members == {3}
    assert waiting.signals.last_training_s is not None


def test_a_worker_under_a_preemption_notice_leaves_the_target(fleet_engine: Engine) -> None:
    with transaction(fleet_engine, actor="provider") as session:
        spot = session.scalars(select(GPU.id).where(GPU.zone == "preemptible")).all()
        set_gpu_states(session, spot, [GPUState.UNAVAILABLE], GPUState.FREE)
        start_worker(session, 4, Role.COLOCATED)
        admit_worker(session, 4)
        deadline = session.scalar(select(func.now())) + timedelta(seconds=30)
        session.add_all(Lease(gpu_id=g, kind=LeaseKind.PREEMPTIBLE, deadline=deadline) for g in spot)
    planned = policy_pass.plan(fleet_engine)
    assert list(planned.signals.deadlines) == [4] and planned.signals.deadlines[4] > planned.signals.now
    assert 4 not in planned.target.members and 4 in planned.plan.remove
    assert [s.action for s in planned.plan.steps if s.worker_id == 4] == [
        StepAction.DRAIN, StepAction.INTERRUPT, StepAction.RELEASE]
    assert "before their notice runs out" in planned.target.reason


def test_measured_step_durations_reach_the_signals(fleet_engine: Engine, clock) -> None:
    policy_pass.plan(fleet_engine)
    plan_store.apply(fleet_engine)
    run_plan(fleet_engine, clock())
    durations = policy_pass.plan(fleet_engine, dry_run=True).signals.step_durations
    assert {"start_overlap", "start_dedicated", "load_weights", "admit", "router_sync"} <= set(durations)


def test_an_unreadable_stored_memory_is_replaced_and_said_so(fleet_engine: Engine) -> None:
    policy_pass.plan(fleet_engine)
    with transaction(fleet_engine) as session:
        session.execute(text("UPDATE policy_memory SET memory = '{\"profile\": {}}'::jsonb"))
    planned = policy_pass.plan(fleet_engine, dry_run=True)
    assert planned.memory_note.startswith("initial: the stored memory was unreadable (")


def test_without_an_inventory_or_a_workload_block_there_is_no_plan(db_engine: Engine) -> None:
    with pytest.raises(NoInventory, match="cluster import"):
        policy_pass.plan(db_engine)
    import_cluster(db_engine, small_inventory(workload=False))
    with pytest.raises(NoWorkload, match="workload: the inventory has no `workload` block"):
        policy_pass.plan(db_engine)
    assert written(db_engine) == (0, 0, 0)


def decided(engine: Engine) -> policy_pass.Planned:
    """Read and decide, as the first half of a pass does."""
    with transaction(engine, isolation_level="REPEATABLE READ") as session:
        return policy_pass.decide(session)


def grant_spot(engine: Engine) -> None:
    with transaction(engine, actor="provider") as session:
        spot = session.scalars(select(GPU.id).where(GPU.zone == "preemptible")).all()
        set_gpu_states(session, spot, [GPUState.UNAVAILABLE], GPUState.FREE)


def test_a_fleet_change_between_decide_and_write_writes_nothing(fleet_engine: Engine) -> None:
    planned = decided(fleet_engine)
    grant_spot(fleet_engine)
    with pytest.raises(StalePlan, match=rf"the fleet moved on while planning \(state_version "
                                        rf"{planned.snapshot.state_version} -> \d+\); nothing was written") as stale:
        policy_pass.write_planned(fleet_engine, planned)
    assert "run `pearlctl plan` again" in str(stale.value) and stale.value.exit_code == 1
    assert written(fleet_engine) == (0, 0, 0)
    assert policy_pass.plan(fleet_engine).plan_id is not None  # the remedy: plan again


def test_a_pass_never_overwrites_the_memory_of_a_pass_that_wrote_meanwhile(fleet_engine: Engine) -> None:
    first, second = decided(fleet_engine), decided(fleet_engine)
    wrote = policy_pass.write_planned(fleet_engine, first)
    with pytest.raises(StalePlan, match=f"another planning pass wrote the policy's memory meanwhile "
                                        f"\\(decision {wrote.decision_id}\\)"):
        policy_pass.write_planned(fleet_engine, second)
    assert written(fleet_engine) == (1, 1, 1)
    with transaction(fleet_engine) as session:
        assert session.get(PolicyMemory, policy_pass.POLICY).decision_id == wrote.decision_id


def test_a_training_step_moves_the_state_version_and_is_audited(fleet_engine: Engine) -> None:
    planned = decided(fleet_engine)
    written_before = policy_pass.plan(fleet_engine)
    with transaction(fleet_engine, actor="trainer", reason="training-begin") as session:
        session.add(TrainingStep(step=7, requested_at=func.now()))
    with transaction(fleet_engine, actor="trainer") as session:
        session.execute(text("UPDATE training_steps SET started_at = now() WHERE step = 7"))
    with fleet_engine.connect() as conn:
        version = conn.execute(text("SELECT pearl_state_version()")).scalar_one()
        events = conn.execute(text("SELECT op, entity_id, state_version, actor, reason FROM events "
                                   "WHERE entity = 'training_steps' ORDER BY id")).all()
    assert version == planned.snapshot.state_version + 2
    assert [(e.op, e.entity_id, e.state_version, e.actor) for e in events] == [
        ("insert", "7", version - 1, "trainer"), ("update", "7", version, "trainer")]
    assert events[0].reason == "training-begin"
    # a pass decided before the training began writes nothing; a plan written before it is stale
    with pytest.raises(StalePlan, match="the fleet moved on while planning"):
        policy_pass.write_planned(fleet_engine, planned)
    with pytest.raises(StalePlan, match=f"plan {written_before.plan_id} was computed at state_version"):
        plan_store.apply(fleet_engine, written_before.plan_id)


def test_pearlctl_plan_exits_1_when_the_fleet_moves_while_it_plans(
    fleet_engine: Engine, database_url: str, pearlctl_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pearl.cli.app import app
    from typer.testing import CliRunner

    write = policy_pass.write_planned

    def grant_then_write(engine, planned, **kwargs):  # the provider grants spot-0 once the pass decided
        grant_spot(fleet_engine)  # (not while it decides: the pass holds the whole fleet then)
        return write(engine, planned, **kwargs)

    monkeypatch.setattr(policy_pass, "write_planned", grant_then_write)
    env = {"PEARL_HOME": pearlctl_env["PEARL_HOME"], "PEARL_DATABASE_URL": database_url}
    result = CliRunner().invoke(app, ["plan"], env=env)
    assert result.exit_code == 1, result.stderr
    assert "the fleet moved on while planning" in " ".join(result.stderr.split())
    assert written(fleet_engine) == (0, 0, 0)
