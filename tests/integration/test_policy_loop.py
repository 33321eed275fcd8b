"""The policy loop live: `tick` passes (cron), the long-running leader (`pearlctl loop`), what a pass
applies by itself, and every decision with the inputs that drove it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from db_faults import refuse_first, refused
from pearl.cli.app import app
from pearl.controlplane.api import ControlPlane, ReturnsLate
from pearl.controlplane.core.domain import Activity, PlanStatus
from pearl.controlplane.store import plan_store, signals, step_effects
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import Decision, Plan, Tick, TrainingStep, Worker
from pearl.policies.live.loop import LoopConfig, PolicyLoop
from pearl.policies.live.tick import tick
from plan_support import PEARLCTL, REPO, claim_ready, enact, import_cluster, in_threads, run_plan, small_inventory
from sqlalchemy import Engine, func, select, text
from typer.testing import CliRunner

pytestmark = pytest.mark.integration


@pytest.fixture
def cp(db_engine: Engine) -> Iterator[ControlPlane]:
    import_cluster(db_engine, small_inventory())
    yield ControlPlane(engine=db_engine)


def now() -> datetime:
    return datetime.now(UTC)


def count(engine: Engine, table: type) -> int:
    with transaction(engine) as session:
        return session.scalar(select(func.count()).select_from(table)) or 0


def active(engine: Engine) -> dict[int, str]:
    with transaction(engine) as session:
        return {w.id: w.role.value for w in session.scalars(select(Worker).where(Worker.activity == Activity.ACTIVE))}


def test_a_tick_decides_writes_and_applies_then_waits_for_the_plan(cp: ControlPlane) -> None:
    first = tick(cp.engine)
    assert first.ran and first.applied and first.plan is not None, first.note
    assert first.decision is not None and first.decision["id"] is not None
    waiting = tick(cp.engine)
    assert not waiting.ran and f"plan {first.plan} is applying" in waiting.note
    run_plan(cp.engine, now())  # the agents enact it
    with transaction(cp.engine) as session:
        assert session.get(Plan, first.plan).status is PlanStatus.SUCCEEDED
    decisions = count(cp.engine, Decision)
    quiet = tick(cp.engine)
    assert quiet.ran and quiet.plan is None and quiet.note.startswith("no change")
    assert count(cp.engine, Decision) == decisions  # a pass that changes nothing writes no decision row
    # the borrowed overlap workers serve beside the dedicated one (one dedicated worker alone is slow)
    assert set(active(cp.engine)) == {1, 2, 3}


def test_every_decision_records_the_inputs_that_drove_it(cp: ControlPlane) -> None:
    tick(cp.engine)
    with transaction(cp.engine) as session:
        d = session.scalars(select(Decision)).one()
        assert {"selection", "gate", "signals", "profile"} <= set(d.inputs)
        assert d.inputs["signals"]["remaining"] == d.inputs["signals"]["batch_size"]
        assert d.inputs["gate"]["borrow"] is True and "T_toggle" in d.inputs["gate"]["reason"]
        assert d.reason and d.target["members"] == [1, 2, 3]


def test_two_passes_at_once_never_plan_twice_for_one_state(cp: ControlPlane) -> None:
    results = in_threads(*[(lambda i=i: tick(cp.engine, holder=f"cron-{i}", manual=True)) for i in range(4)])
    assert not [r for r in results if isinstance(r, Exception)], results
    assert sum(1 for r in results if r.plan is not None) == 1
    assert count(cp.engine, Plan) == 1 and count(cp.engine, Decision) == 1
    again = tick(cp.engine, manual=True)  # the same state later: decided already
    assert not again.ran and "decided already" in again.note


@pytest.mark.parametrize("death", ["raised", "killed"])
def test_a_pass_that_died_after_taking_its_key_does_not_stop_the_state_being_decided(
        cp: ControlPlane, monkeypatch: pytest.MonkeyPatch, death: str) -> None:
    """The key says "this state was decided"; a pass that took it and then died decided nothing, so the
    next pass on the same state takes the key over and decides (else nothing is planned until a row
    changes: borrowed GPUs the trainer waits for would never be given back)."""
    from pearl.policies.live import policy_pass

    def lost(*_a, **_k):
        raise ConnectionError("the database went away while the plan was written")

    with monkeypatch.context() as m:
        m.setattr(policy_pass, "write_planned", lost)
        with pytest.raises(ConnectionError):
            tick(cp.engine)
    with transaction(cp.engine) as session:
        dead = session.scalars(select(Tick)).one()
        assert dead.finished_at is not None and "ConnectionError" in dead.error
        if death == "killed":  # SIGKILLed right after taking the key: the row never finished
            session.execute(text("UPDATE ticks SET finished_at = NULL, error = NULL"))
    if death == "killed":  # within a lease it may be a live pass (a slow one): its key stays its own
        busy = tick(cp.engine)
        assert not busy.ran and "decided already" in busy.note
        with transaction(cp.engine) as session:  # a lease later, it is a dead one
            session.execute(text("UPDATE ticks SET started_at = started_at - interval '1 minute'"))
    assert count(cp.engine, Plan) == 0
    retried = tick(cp.engine)  # the same state: decided, under the same key
    assert retried.ran and retried.applied and retried.plan is not None, retried.note
    assert retried.key == dead.key and retried.tick_id == dead.id
    with transaction(cp.engine) as session:
        row = session.get(Tick, dead.id)
        assert row.finished_at is not None and row.error is None and row.plan_id == retried.plan
    assert count(cp.engine, Plan) == 1


def test_manual_mode_leaves_borrowing_to_apply_but_returns_for_training_apply_at_once(cp: ControlPlane) -> None:
    proposed = tick(cp.engine, manual=True)
    assert proposed.plan is not None and not proposed.applied and "manual mode" in proposed.note
    plan_store.apply(cp.engine, proposed.plan)
    run_plan(cp.engine, now())
    assert set(active(cp.engine)) == {1, 2, 3}
    with pytest.raises(ReturnsLate):
        cp.training_begin(1, wait_s=0)
    urgent = tick(cp.engine, manual=True)
    assert urgent.applied and "urgent: workers [1, 2] must leave" in urgent.note
    run_plan(cp.engine, now())
    assert set(active(cp.engine)) == {3}
    with transaction(cp.engine) as session:
        assert session.get(TrainingStep, 1).started_at is not None  # it started with the last return


def test_an_urgent_return_amends_a_plan_that_keeps_the_borrowed_workers(cp: ControlPlane) -> None:
    first = tick(cp.engine)
    starts = claim_ready(cp.engine, now())
    for step in starts:  # the starts took their GPUs; the rest is slow
        with transaction(cp.engine) as session:
            step_effects.begin(session, step_effects.claimed_step(session, step["id"], step["fence"]))
    with pytest.raises(ReturnsLate):  # the request calls the borrowing off (plan_store.call_off_borrowing)
        cp.training_begin(1, wait_s=0)
    urgent = tick(cp.engine)  # and the pass finds the borrowed workers released already: no second amendment
    assert urgent.amended is None and f"plan {first.plan} is applying" in urgent.note, urgent.note
    with transaction(cp.engine) as session:
        plan = session.get(Plan, first.plan)
        assert plan.status is PlanStatus.APPLYING  # it goes on, releasing the borrowed workers within it
        keys = {k: st for k, st in session.execute(text(
            "SELECT key, status FROM plan_steps WHERE plan_id = :p"), {"p": first.plan}).all()}
    # the borrowed group cannot be admitted whole any more: its barrier and admits are cancelled, and its
    # members are drained and released after the starts still in hand; the dedicated worker 3 goes on
    assert keys["borrow.barrier"] == "cancelled" and all(keys[f"w{w}.admit"] == "cancelled" for w in (1, 2))
    assert keys["expand.barrier"] == "blocked" and keys["w3.admit"] == "blocked"
    assert {k for k in keys if ".amend" in k} == {f"w{w}.{a}.amend1" for w in (1, 2)
                                                  for a in ("drain", "interrupt", "release")}
    for step in starts:  # the starts in hand finish
        with transaction(cp.engine) as session:
            enact(session, step)
    run_plan(cp.engine, now())
    with transaction(cp.engine) as session:
        assert session.get(Plan, first.plan).status is PlanStatus.SUCCEEDED
        assert session.get(TrainingStep, 1).started_at is not None  # it started with the last return
        serving = session.scalars(select(Worker.id).where(Worker.activity != Activity.INACTIVE)).all()
    assert serving == [3]


def test_the_tick_command(cp: ControlPlane, database_url: str, tmp_path) -> None:
    env = {"PEARL_DATABASE_URL": database_url, "PEARL_HOME": str(tmp_path)}
    done = CliRunner().invoke(app, ["tick", "--json"], env=env)
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout)
    assert out["plan"] is not None and out["decision"]["reason"] and out["applied"] is True
    again = CliRunner().invoke(app, ["tick"], env=env)
    assert again.exit_code == 0 and f"plan {out['plan']} is applying" in again.stdout


# -- the loop: processes ------------------------------------------------------------------------


def _loop(database_url: str, tmp_path, *args: str) -> subprocess.Popen:
    """`pearlctl loop ARGS` in its own session, its log in tmp_path/loop-<pid>.log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEARL_")}
    env.update(PEARL_DATABASE_URL=database_url, PEARL_HOME=str(tmp_path))
    with open(tmp_path / f"loop-{time.monotonic_ns()}.log", "w") as log:
        p = subprocess.Popen([str(PEARLCTL), "loop", *args], env=env, cwd=REPO, stdout=log, stderr=log,
                             start_new_session=True)
    p.log = log.name  # type: ignore[attr-defined]
    return p


def _leader(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return conn.execute(text("SELECT holder FROM leader_leases WHERE name = 'policy' "
                                 "AND expires_at > clock_timestamp()")).scalar()


def _wait(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.reliability
def test_a_killed_loop_leader_is_replaced_within_its_lease(cp: ControlPlane, database_url: str, tmp_path) -> None:
    loops = [_loop(database_url, tmp_path, "--interval", "0.2", "--lease-s", "1.5") for _ in range(2)]
    try:
        _wait(lambda: _leader(cp.engine) is not None, 30)
        first = _leader(cp.engine)
        leader = next(p for p in loops if first.endswith(f":{p.pid}"))
        follower = next(p for p in loops if p is not leader)
        _wait(lambda: count(cp.engine, Tick) > 0, 30)  # the leader planned
        os.kill(leader.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _wait(lambda: (_leader(cp.engine) or "").endswith(f":{follower.pid}"), 10)
        assert time.monotonic() - killed_at < 1.5 + 1.5  # the lease, then the follower's next try
        leader.wait(5)
        # the follower leads: it keeps planning (the first plan applies; it waits for it)
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(10) == 0
        assert _leader(cp.engine) is None  # it gave the lease up on its way out
        with open(follower.log) as log:  # type: ignore[attr-defined]
            assert "leading the policy loop" in log.read()
    finally:
        for p in loops:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def test_the_loop_wakes_on_a_report_not_only_on_its_interval(cp: ControlPlane, database_url: str, tmp_path) -> None:
    loop = _loop(database_url, tmp_path, "--interval", "30", "--lease-s", "60")
    try:
        def applying() -> int | None:
            with cp.engine.connect() as conn:
                return conn.execute(text("SELECT max(id) FROM plans WHERE status = 'applying'")).scalar()

        _wait(lambda: applying() is not None, 30)  # its first pass, at start, applied a plan
        plan_id = applying()
        assert run_plan(cp.engine, now())  # the plan finishes: a wake-up (pearl_plans)
        _wait(lambda: count(cp.engine, Tick) >= 2, 20)  # well before its 30 s interval
        ticks = count(cp.engine, Tick)
        cp.rollout_progress(0, 3, batch_size=64)  # a report: a wake-up (pearl_signals), long before 30 s
        _wait(lambda: count(cp.engine, Tick) > ticks, 20)
        with transaction(cp.engine) as session:
            assert session.get(Plan, plan_id).status is PlanStatus.SUCCEEDED
            assert session.scalar(select(func.count()).select_from(Tick).where(Tick.error.is_not(None))) == 0
    finally:
        loop.send_signal(signal.SIGTERM)
        assert loop.wait(10) == 0


def _settle(loop: PolicyLoop, quiet_s: float = 1.5) -> None:
    """Wait until the loop has made no pass for `quiet_s`."""
    while True:
        before = loop.passes
        time.sleep(quiet_s)
        if loop.passes == before:
            return


def test_progress_within_a_step_wakes_a_pass_only_at_a_new_step_or_its_tail(cp: ControlPlane) -> None:
    """As the simulator decides: a report of a new step wakes a pass; more trajectories of the same
    step do not until the tail the last decision asked to be woken at; other reports always do."""
    loop = PolicyLoop(cp.engine, LoopConfig(interval_s=60, lease_s=180, min_gap_s=0.05))
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        _wait(lambda: loop.passes >= 1, 30)
        _settle(loop)  # the first plan's own wake-ups
        seen = loop.passes
        cp.rollout_progress(0, 1, batch_size=64)  # a new step
        _wait(lambda: loop.passes > seen, 20)
        _settle(loop)
        seen = loop.passes
        loop._recheck = 8  # the policy's tail threshold for this step
        for finished in range(2, 40, 4):  # mid-step: 62..26 remain, above the tail
            cp.rollout_progress(0, finished)
        time.sleep(2.0)
        assert loop.passes == seen
        loop._recheck = 8
        cp.rollout_progress(0, 57)  # 7 remain: the tail
        _wait(lambda: loop.passes > seen, 20)
        seen = loop.passes
        with transaction(cp.engine, actor="test") as session:  # a report of another kind
            signals.begin_training(session, 0)
        _wait(lambda: loop.passes > seen, 20)
    finally:
        loop.stop()
        runner.join(10)
    assert not runner.is_alive()
    assert "loop-listen" not in [t.name for t in threading.enumerate()]  # joined before `run` returned


def test_the_loop_outlives_statements_the_database_gives_up_on(cp: ControlPlane) -> None:
    """A cancelled statement, a deadlock and an error the loop has no name for each end one pass, not
    the loop: the next pass runs."""
    refuse_first(cp.engine, "refuse_tick", "ticks", "INSERT", ["57014", "40P01", "XX000"])
    loop = PolicyLoop(cp.engine, LoopConfig(interval_s=0.2, lease_s=30, min_gap_s=0.05))
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    try:
        _wait(lambda: loop.passes >= 1, 30)
        assert runner.is_alive()
    finally:
        loop.stop()
        runner.join(10)
    assert refused(cp.engine, "refuse_tick") >= 4
