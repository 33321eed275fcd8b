"""Writers of different nodes run at once; whole-fleet writers and decisions still see no writer in
flight (migration 0014, `transitions.lock_fleet` / `lock_node`, `plan_store.conclude`).

On the small cluster: overlap workers 1, 2 on train-0, dedicated worker 3 on roll-0."""

from __future__ import annotations

import threading
import time

import pytest
from pearl.controlplane.core.domain import PlanStatus, Role, StepStatus
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.errors import DatabaseBusy, StalePlan
from pearl.controlplane.store import plan_store, step_effects
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import Plan
from pearl.controlplane.store.snapshot import load_snapshot
from pearl.controlplane.store.transitions import state_version
from plan_support import COLOCATED_3, claim_ready, enact, in_threads, pin_clock, propose, report
from sqlalchemy import Engine, text

pytestmark = pytest.mark.reliability


class OpenReport(threading.Thread):
    """A report whose effect is written and whose transaction stays open until `release` is set."""

    def __init__(self, engine: Engine, step: dict, now) -> None:
        super().__init__(daemon=True)
        self.engine, self.step, self.now = engine, step, now
        self.written, self.release = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with transaction(self.engine, actor="test agent") as session:
                pin_clock(session, self.now)
                enact(session, self.step)
                self.written.set()
                self.release.wait(30)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc
            self.written.set()


def _starts(engine: Engine, clock) -> dict[int, dict]:
    plan_store.apply(engine, propose(engine))
    return {s["worker_id"]: s for s in claim_ready(engine, clock())}


def _report_within(engine: Engine, step: dict, now, lock_timeout_ms: int) -> None:
    with transaction(engine, actor="test agent") as session:
        session.execute(text(f"SET LOCAL lock_timeout = {lock_timeout_ms}"))
        pin_clock(session, now)
        enact(session, step)


def test_a_report_waits_for_a_writer_of_its_node_only(cluster_engine: Engine, clock) -> None:
    starts = _starts(cluster_engine, clock)
    held = OpenReport(cluster_engine, starts[1], clock())  # train-0, open
    held.start()
    assert held.written.wait(10) and held.error is None
    try:
        t0 = time.monotonic()
        _report_within(cluster_engine, starts[3], clock(), 5000)  # roll-0: goes through beside it
        assert time.monotonic() - t0 < 5
        with pytest.raises(DatabaseBusy):  # train-0 again: waits for the open one (here: gives up)
            _report_within(cluster_engine, starts[2], clock(), 300)
    finally:
        held.release.set()
        held.join(10)
    assert held.error is None
    _report_within(cluster_engine, starts[2], clock(), 5000)  # once it committed
    with transaction(cluster_engine) as session:
        done = session.execute(text("SELECT worker_id FROM plan_steps WHERE action = 'start' "
                                    "AND status = 'succeeded' ORDER BY worker_id")).scalars().all()
    assert done == [1, 2, 3]


def test_a_decision_waits_for_the_writers_in_flight_and_plans_against_what_they_wrote(
        cluster_engine: Engine, clock) -> None:
    starts = _starts(cluster_engine, clock)
    held = OpenReport(cluster_engine, starts[3], clock())  # roll-0's worker starts, not committed
    held.start()
    assert held.written.wait(10) and held.error is None
    seen: dict = {}

    def decide() -> None:
        with transaction(cluster_engine, isolation_level="REPEATABLE READ", whole_fleet=True) as session:
            snapshot = load_snapshot(session)
            seen["version"] = snapshot.state_version
            seen["w3"] = next(w.activity.value for w in snapshot.workers if w.id == 3)

    decider = threading.Thread(target=decide, daemon=True)
    decider.start()
    decider.join(0.5)
    assert decider.is_alive()  # it waits for the report in flight ...
    with transaction(cluster_engine) as session:
        during = state_version(session)  # ... whose version is already taken
    held.release.set()
    held.join(10)
    decider.join(10)
    assert held.error is None and not decider.is_alive()
    assert seen["w3"] == "transitioning" and seen["version"] >= during  # ... and sees what it wrote


def test_a_plan_computed_before_a_node_writer_committed_is_stale(cluster_engine: Engine, clock) -> None:
    starts = _starts(cluster_engine, clock)
    later = propose(cluster_engine, Target(frozenset({1, 2}), {Role.COLOCATED: 2}, reason="test: two colocated"))
    _report_within(cluster_engine, starts[3], clock(), 5000)  # a node's report moves the version
    with pytest.raises(StalePlan, match="was computed at state_version"):
        plan_store.apply(cluster_engine, later)
    with transaction(cluster_engine) as session:
        assert session.get(Plan, later).status is PlanStatus.STALE


def test_the_last_reports_of_a_plan_at_once_always_finish_it(cluster_engine: Engine, clock) -> None:
    """The final steps of each plan (the three admits, then the three releases) are reported by three
    threads at once: inside their transactions each may see the others' steps still running, and the
    plan still succeeds every time, without the reaper."""
    release_all = Target(frozenset(), {}, reason="test: release every worker")
    for round_ in range(6):
        plan_id = propose(cluster_engine, COLOCATED_3 if round_ % 2 == 0 else release_all)
        plan_store.apply(cluster_engine, plan_id)
        while True:
            claimed = claim_ready(cluster_engine, clock())
            with transaction(cluster_engine) as session:
                left = session.scalar(text("SELECT count(*) FROM plan_steps WHERE plan_id = :p AND status IN "
                                           "('blocked', 'ready')"), {"p": plan_id})
            if left == 0:  # the last ones, all claimed: report them at once
                results = in_threads(*[(lambda s=s: report(cluster_engine, s, StepStatus.SUCCEEDED, clock()))
                                       for s in claimed])
                assert not [r for r in results if isinstance(r, Exception)], results
                break
            for step in claimed:
                report(cluster_engine, step, StepStatus.SUCCEEDED, clock())
        with transaction(cluster_engine) as session:
            assert session.get(Plan, plan_id).status is PlanStatus.SUCCEEDED, round_


def test_a_node_scoped_writer_cannot_change_another_nodes_worker(cluster_engine: Engine, clock) -> None:
    starts = _starts(cluster_engine, clock)
    with pytest.raises(Exception, match="outside this transaction's nodes"), \
            transaction(cluster_engine, actor="test agent") as session:
        pin_clock(session, clock())
        step_effects.claimed_step(session, starts[3]["id"], starts[3]["fence"])  # roll-0
        other = step_effects.claimed_step(session, starts[3]["id"], starts[3]["fence"])
        step_effects.begin(session, step_effects.ClaimedStep(**{**other.__dict__, "worker_id": 1}))
