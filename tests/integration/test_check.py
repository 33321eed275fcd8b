"""The invariant checker (`pearlctl check`): silent on a fleet that ran plans, a loan and its return and a
training step; each violation planted past the database's guards (a trigger disabled, a constraint
dropped, a row written without its audit event) is found and named."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from pearl.cli.app import app
from pearl.controlplane.api import ControlPlane, ReturnsLate
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.store import invariants, plan_store
from pearl.controlplane.store.db import transaction
from plan_support import import_cluster, propose, run_plan, small_inventory
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session
from typer.testing import CliRunner

pytestmark = pytest.mark.integration

REPLICA = "SET LOCAL session_replication_role = replica"  # no trigger fires: neither guard nor audit


def serve(engine: Engine, members: set[int]) -> None:
    plan_store.apply(engine, propose(engine, Target(frozenset(members), {Role.COLOCATED: len(members)})))
    run_plan(engine, datetime.now(UTC))


@pytest.fixture
def ran(db_engine: Engine) -> Engine:
    """Workers 1 (overlap, borrowed) and 3 (dedicated) served, training step 0 asked for the loan back
    (late), the return, the step; then worker 3 alone serving."""
    import_cluster(db_engine, small_inventory())
    cp = ControlPlane(engine=db_engine)
    serve(db_engine, {1, 3})
    with pytest.raises(ReturnsLate):
        cp.training_begin(0, wait_s=0)
    serve(db_engine, {3})
    cp.training_end(0)
    cp.rollout_progress(1, 2, batch_size=4)
    return db_engine


def sql(*statements: str) -> Callable[[Session], None]:
    def plant(session: Session) -> None:
        for statement in statements:
            session.execute(text(statement))
    return plant


PLANTS: dict[str, Callable[[Session], None]] = {
    "gpu_held_by_another_slot": sql(
        REPLICA, "ALTER TABLE gpus DROP CONSTRAINT ck_gpus_held_by_its_slot",
        "UPDATE gpus SET worker_id = 3, state = 'borrowed' WHERE id = (SELECT min(id) FROM gpus WHERE slot_id = 2)"),
    "gpu_held_iff_in_use": sql(
        REPLICA, "ALTER TABLE gpus DROP CONSTRAINT ck_gpus_held_iff_in_use",
        "UPDATE gpus SET worker_id = NULL WHERE slot_id = 3"),
    "serving_worker_holds_its_gpus": sql(
        REPLICA, "UPDATE workers SET activity = 'active', role = 'colocated' WHERE id = 2"),
    "training_beside_a_loan": sql(
        REPLICA, "INSERT INTO leases (gpu_id, kind, granted_at, returned_at)"
        " SELECT min(id), 'borrowed', (SELECT started_at + interval '1 ms' FROM training_steps WHERE step = 0),"
        " (SELECT ended_at FROM training_steps WHERE step = 0) FROM gpus WHERE zone = 'training'"),
    "training_began_before_its_gpus_were_back": sql(
        REPLICA, "UPDATE leases SET returned_at = returned_at + interval '1 hour', late_s = 3600"
        " WHERE kind = 'borrowed'"),
    "lateness_recorded": sql(REPLICA, "UPDATE leases SET late_s = 0 WHERE kind = 'borrowed'"),
    "plan_applied_against_a_moved_state": sql(
        "INSERT INTO events (state_version, entity, entity_id, op, old, new)"
        " VALUES (5, 'plans', '99', 'update', '{\"status\": \"proposed\"}',"
        " '{\"status\": \"applying\", \"base_version\": 3}')"),
    "step_took_effect_twice": sql(
        "ALTER TABLE plan_steps DISABLE TRIGGER plan_steps_guard",
        "UPDATE plan_steps SET status = 'running', lease_until = now()"
        " WHERE id = (SELECT min(id) FROM plan_steps WHERE action = 'drain')",
        "UPDATE plan_steps SET status = 'succeeded'"
        " WHERE id = (SELECT min(id) FROM plan_steps WHERE action = 'drain')"),
    "fence_went_down": sql(
        "ALTER TABLE workers DISABLE TRIGGER workers_fence",
        "UPDATE workers SET last_fence = last_fence - 1 WHERE id = 3"),
    "one_running_step_per_worker": sql(
        REPLICA, "DROP INDEX uq_plan_steps_one_running_per_worker",
        "UPDATE plan_steps SET status = 'running', fence = 1, lease_until = now() WHERE worker_id = 3"),
    "change_without_audit": sql(REPLICA, "UPDATE nodes SET address = '127.0.0.2' WHERE name = 'roll-0'"),
    "state_version_behind_the_log": sql(  # an event from a version not taken yet
        REPLICA, "INSERT INTO events (state_version, entity, entity_id, op) "
                 "VALUES (pearl_state_version() + 1, 'fleet', '1', 'update')"),
    "group_admitted_despite_a_failure": sql(
        REPLICA, "UPDATE plan_steps SET status = 'failed', error = 'planted' WHERE id = (SELECT min(s.id)"
        " FROM plan_steps s JOIN plan_steps a ON a.plan_id = s.plan_id AND a.worker_id = s.worker_id"
        " AND a.action = 'admit' AND a.expansion_group IS NOT NULL AND a.status = 'succeeded'"
        " WHERE s.action = 'load_weights')"),
    "revoked_gpu_released_in_time": sql(
        REPLICA, "INSERT INTO leases (gpu_id, kind, granted_at, deadline, returned_at, late_s)"
        " SELECT min(id), 'preemptible', now() - interval '1 min', now() - interval '30 s', now(), 30"
        " FROM gpus WHERE zone = 'preemptible'"),
    "weights_the_trainer_never_made": sql(REPLICA, "UPDATE workers SET weights_version = 99 WHERE id = 3"),
}


def test_every_check_has_a_planted_violation() -> None:
    assert set(PLANTS) == set(invariants.checks())
    assert {inv for inv, _ in invariants.checks().values()} == {1, 2, 3, 4, 5, 6, 7}


def test_a_fleet_that_ran_plans_a_loan_and_training_violates_nothing(ran: Engine) -> None:
    report = invariants.check(ran)
    assert report.ok, report.violations
    with transaction(ran) as session:  # what it ran: the checks had rows to look at
        counts = session.execute(text(
            "SELECT (SELECT count(*) FROM leases WHERE late_s > 0), (SELECT count(*) FROM plan_steps"
            " WHERE status = 'succeeded'), (SELECT count(*) FROM training_steps WHERE ended_at IS NOT NULL)")).one()
    assert counts[0] >= 2 and counts[1] >= 10 and counts[2] == 1


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_planted_violation_is_found_and_named(ran: Engine, name: str) -> None:
    with transaction(ran) as session:
        PLANTS[name](session)
        report = invariants.inspect(session)
        session.rollback()
    found = {v.check for v in report.violations}
    assert name in found, report.violations
    hit = next(v for v in report.violations if v.check == name)
    assert hit.invariant == invariants.checks()[name][0] and hit.detail and hit.entity
    assert invariants.check(ran).ok  # rolled back: the fleet is clean again


def test_the_check_command(ran: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEARL_DATABASE_URL", database_url)
    runner = CliRunner()
    clean = runner.invoke(app, ["check", "--json"])
    assert clean.exit_code == 0, clean.output
    body = json.loads(clean.stdout)
    assert body["ok"] and body["violations"] == [] and len(body["checks"]) == len(PLANTS)
    with transaction(ran) as session:
        PLANTS["weights_the_trainer_never_made"](session)
    dirty = runner.invoke(app, ["check"])
    assert dirty.exit_code == 1
    assert "invariant 4 [weights_the_trainer_never_made] worker 3 has weights version 99" in dirty.stdout
    body = json.loads(runner.invoke(app, ["check", "--json"]).stdout)
    assert not body["ok"] and {v["check"] for v in body["violations"]} == {"weights_the_trainer_never_made",
                                                                          "change_without_audit"}
