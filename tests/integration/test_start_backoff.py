"""A slot whose server fails to start is retried with growing pauses, not by every pass: the snapshot
offers it again 30 s after its first failed start, 60 s after its second, and at once after a start
succeeds; the policy pass neither starts it meanwhile nor forgets it when its pause ends."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pearl.controlplane.core.domain import PlanStatus, Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.fleet_status import read_fleet_status
from pearl.controlplane.store.schema import Plan
from pearl.controlplane.store.snapshot import START_BACKOFF_FIRST_S, load_snapshot
from pearl.policies.live.tick import tick
from plan_support import import_cluster, pin_clock, propose, run_plan, small_inventory
from sqlalchemy import Engine, select, text

pytestmark = pytest.mark.integration

ONE = Target(frozenset({1}), {Role.COLOCATED: 1}, reason="test: worker 1 alone")


def available(engine: Engine, worker: int, at: datetime) -> bool:
    with transaction(engine) as session:
        pin_clock(session, at)
        return load_snapshot(session).by_id()[worker].available


def start_once(engine: Engine, at: datetime, fail: bool) -> PlanStatus:
    plan_id = propose(engine, ONE)
    plan_store.apply(engine, plan_id)
    run_plan(engine, at, fail="w1.start" if fail else None)
    with transaction(engine) as session:
        return session.get(Plan, plan_id).status


def test_failed_starts_back_off_doubling_and_a_success_ends_it(db_engine: Engine) -> None:
    import_cluster(db_engine, small_inventory())
    t0 = datetime.now(UTC) - timedelta(seconds=600)  # the steps finish in the past: each pause is over by now
    first = START_BACKOFF_FIRST_S
    assert start_once(db_engine, t0, fail=True) is PlanStatus.FAILED
    assert not available(db_engine, 1, t0 + timedelta(seconds=first - 1))
    assert available(db_engine, 1, t0 + timedelta(seconds=first + 1))
    t1 = t0 + timedelta(seconds=first + 1)  # the second try fails too: twice the pause
    assert start_once(db_engine, t1, fail=True) is PlanStatus.FAILED
    assert not available(db_engine, 1, t1 + timedelta(seconds=2 * first - 1))
    assert available(db_engine, 1, t1 + timedelta(seconds=2 * first + 1))
    t2 = t1 + timedelta(seconds=2 * first + 1)
    assert start_once(db_engine, t2, fail=False) is PlanStatus.SUCCEEDED
    assert available(db_engine, 1, t2)  # serving; and no pause is left for a later start
    assert available(db_engine, 2, t0)  # the other slots never paused


def test_the_policy_pass_skips_a_backing_off_slot_and_takes_it_back_when_the_pause_ends(db_engine: Engine) -> None:
    import_cluster(db_engine, small_inventory())
    first = tick(db_engine)
    assert first.applied and first.decision is not None and first.decision["target"]["members"] == [1, 2, 3]
    run_plan(db_engine, datetime.now(UTC), fail="w2.start")  # its server does not come up
    with transaction(db_engine) as session:
        assert session.get(Plan, first.plan).status is PlanStatus.FAILED
    status = {w["id"]: w["start_backoff_until"] for w in read_fleet_status(db_engine)["workers"]}
    assert status[2] is not None and status[1] is None and status[3] is None  # `pearlctl status` shows it
    again = tick(db_engine)
    assert again.ran and again.decision is not None, again.note
    assert 2 not in again.decision["target"]["members"]
    run_plan(db_engine, datetime.now(UTC))
    quiet = tick(db_engine)
    assert quiet.plan is None and 2 not in quiet.decision["target"]["members"], quiet.note
    assert not tick(db_engine).ran  # nothing changed: the same state is not decided twice
    with transaction(db_engine) as session:  # the pause has run out (as if the failure were older)
        session.execute(text("UPDATE plan_steps SET finished_at = finished_at - make_interval(secs => :s) "
                             "WHERE status = 'failed'"), {"s": START_BACKOFF_FIRST_S + 1})
    later = tick(db_engine)
    assert later.ran and later.decision is not None, later.note
    assert 2 in later.decision["target"]["members"]
    with transaction(db_engine) as session:
        assert session.scalars(select(Plan.status).order_by(Plan.id.desc()).limit(1)).one() is PlanStatus.APPLYING
