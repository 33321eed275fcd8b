"""Admission waits on the trainer's current weights: a worker is admitted (active, on the front door)
only once its server has the version, and the step fails clearly when the version never arrives.
The steps run in this process against a real PostgreSQL, on in-process servers (tests/agent_support.py);
the sync runs as a node's Celery worker runs it (`agents.weight_sync.run_sync`)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from agent_support import FakeClient, FakeDriver, FakeFrontDoor, FakeServers
from db_faults import refuse_first, refused
from pearl.agents.drivers.base import DriverError, ServerSpec
from pearl.agents.steps import StepContext, Timeouts, admit, load_weights
from pearl.agents.weight_sync import run_sync
from pearl.controlplane.api import ControlPlane
from pearl.controlplane.core.domain import Role, StepStatus
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.store import plan_store
from pearl.controlplane.store import weights as rows
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.fleet_status import read_fleet_status
from plan_support import PEARLCTL, REPO, claim_ready, import_cluster, propose, report
from sqlalchemy import Engine, text
from weights_support import TWO_NODES, snapshot, sync_rows

pytestmark = pytest.mark.integration


@pytest.fixture
def no_broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No broker: the syncs stay queued in the rows (this test runs them itself)."""
    monkeypatch.delenv("PEARL_BROKER_URL", raising=False)
    monkeypatch.setenv("PEARL_HOME", str(tmp_path / "home"))


def up_to_admit(engine: Engine, servers: FakeServers, driver: FakeDriver, action: str = "admit",
                imported: bool = False) -> dict[str, Any]:
    """Serve worker 1 by a plan, enacting every step as an agent would, up to its `action` (claimed, not run)."""
    if not imported:
        import_cluster(engine, TWO_NODES)
    plan_id = propose(engine, Target(frozenset({1}), {Role.COLOCATED: 1}, reason="test"))
    plan_store.apply(engine, plan_id)
    for _ in range(20):
        for step in claim_ready(engine, datetime.now(UTC)):
            if step["action"] == action:
                with transaction(engine) as s:
                    endpoint = s.scalar(text("SELECT endpoint FROM workers WHERE id = 1"))
                server = driver.launch(_spec())
                servers.by_endpoint[endpoint] = driver.by_worker[1]  # the server answers where the rows say
                assert server.worker_id == 1
                return step
            report(engine, step, StepStatus.SUCCEEDED, datetime.now(UTC))
    raise AssertionError(f"no {action} step")


def _spec():
    from weights_support import TWO_NODES as _  # noqa: F401

    return ServerSpec(1, "node-a", "127.0.0.1", Role.COLOCATED, (0, 1), 2, "qwen3-8b", "h800", 1, 1, False, None)


def context(engine: Engine, step: dict[str, Any], servers: FakeServers, driver: FakeDriver,
            front_door: FakeFrontDoor, weights_s: float) -> StepContext:
    return StepContext(engine=engine, step=step, driver=driver, client=servers.client, front_door=lambda: front_door,
                       node_address="127.0.0.1", actor="test agent",
                       timeouts=Timeouts(weights_s=weights_s, poll_s=0.02))


def in_background(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    """Run `fn` in a thread; what it raised lands in the list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def activity(engine: Engine) -> str:
    with transaction(engine) as s:
        return s.scalar(text("SELECT activity FROM workers WHERE id = 1"))


def test_a_version_that_never_arrives_fails_the_admission_clearly(db_engine: Engine, tmp_path: Path,
                                                                   no_broker: None) -> None:
    servers, front_door = FakeServers(), FakeFrontDoor()
    driver = FakeDriver(servers, "node-a")
    step = up_to_admit(db_engine, servers, driver)
    cp = ControlPlane(engine=db_engine)
    cp.training_begin(1, wait_s=0)
    queued = cp.training_end(1, weights_version=1, snapshot=str(snapshot(tmp_path / "v1", 1)))
    assert [(t.worker_id, t.node, t.version) for t in queued] == [(1, "node-a", 1)]  # being admitted: synced too
    with pytest.raises(DriverError, match=r"worker 1 has weights version 0, the trainer is at 1: version 1 did "
                                          r"not arrive within 0.3 s; not admitted \(its sync to version 1 is "
                                          r"queued; is the node's `pearlctl worker` running\?\)"):
        admit(context(db_engine, step, servers, driver, front_door, weights_s=0.3))
    assert activity(db_engine) == "transitioning" and front_door.workers == {}
    with transaction(db_engine) as s:  # the queued sync is sent again, unless a live attempt holds its worker
        assert [t.worker_id for t in rows.pending_syncs(s, node="node-a", idle_only=True)] == [1]
    with rows.sync_lock(db_engine, 1, timeout_s=1) as held, transaction(db_engine) as s:
        assert held and rows.pending_syncs(s, node="node-a", idle_only=True) == []
        assert [t.worker_id for t in rows.pending_syncs(s, node="node-a")] == [1]
    with transaction(db_engine) as s:  # the sync fails for good (a snapshot the server refused)
        job = rows.begin_sync(s, 1, 1)
        assert not isinstance(job, str)
        rows.fail_sync(s, job, "tensor lm_head.weight: checksum mismatch", final=True)
    t0 = time.monotonic()
    with pytest.raises(DriverError, match=r"worker 1: its sync to weights version 1 failed \(tensor lm_head.weight: "
                                          r"checksum mismatch\); not admitted"):
        admit(context(db_engine, step, servers, driver, front_door, weights_s=30))
    assert time.monotonic() - t0 < 5  # at once, not after the timeout


def test_a_newly_admitted_worker_serves_only_once_it_has_the_current_version(db_engine: Engine, tmp_path: Path,
                                                                            no_broker: None) -> None:
    servers, front_door, driver, _, step = admitting_at_v1(db_engine, tmp_path)
    thread, errors = in_background(lambda: admit(context(db_engine, step, servers, driver, front_door, weights_s=30)))
    thread.join(0.5)
    assert thread.is_alive() and activity(db_engine) == "transitioning" and front_door.workers == {}
    outcome = run_sync(db_engine, 1, 1, client=servers.client)  # the node's worker takes the queued sync
    thread.join(10)
    assert not thread.is_alive() and not errors, errors
    assert outcome.result == "done" and activity(db_engine) == "active" and len(front_door.workers) == 1
    assert driver.by_worker[1].weight_version == 1
    assert driver.by_worker[1].commands[-3:] == ["pause:retract", "load:1", "continue"]
    with transaction(db_engine) as s:  # when it became active, it had version 1 already
        became = s.execute(text(
            "SELECT new ->> 'weights_version' FROM events WHERE entity = 'workers' AND entity_id = '1' "
            "AND new ->> 'activity' = 'active' AND old ->> 'activity' = 'transitioning'")).scalars().all()
    assert became == ["1"]
    assert run_sync(db_engine, 1, 1, client=servers.client).result == "skipped"  # again: nothing more
    assert [r["state"] for r in sync_rows(db_engine)] == ["done"]


def test_a_server_left_paused_by_a_failed_resume_is_resumed_before_the_sync_is_done(db_engine: Engine, tmp_path: Path,
                                                                                     no_broker: None) -> None:
    """The load went through but `continue_generation` did not: the sync is not done until the server
    serves again (else every request routed to it waits for ever)."""
    servers, _, driver, _, _ = admitting_at_v1(db_engine, tmp_path)
    lost = [True]

    class ResumeLostOnce(FakeClient):
        def continue_generation(self) -> None:
            if lost and lost.pop():
                self._s("continue:timed-out")
                raise DriverError(f"{self.endpoint}: continue_generation timed out")
            super().continue_generation()

    outcome = run_sync(db_engine, 1, 1, client=lambda endpoint, fence: ResumeLostOnce(servers, endpoint, fence),
                       retry_s=0.05)
    assert outcome.result == "done" and outcome.attempts == 2
    assert driver.by_worker[1].commands[-4:] == ["pause:retract", "load:1", "continue:timed-out", "continue"]
    assert driver.by_worker[1].weight_version == 1 and [r["state"] for r in sync_rows(db_engine)] == ["done"]


def test_a_sync_whose_database_goes_away_after_the_load_is_recorded_once_it_is_back(
        db_engine: Engine, tmp_path: Path, no_broker: None) -> None:
    """The server loaded the new weights, then the database restarted (57P01) and gave up (40001) on
    recording it: the task tries again, finds the server at the version and records the sync done,
    without loading a second time."""
    servers, _, driver, _, _ = admitting_at_v1(db_engine, tmp_path)
    refuse_first(db_engine, "sync_done_refused", "weight_syncs", "UPDATE", ["57P01", "40001"],
                 when="NEW.state = 'done'")
    outcome = run_sync(db_engine, 1, 1, client=servers.client, retry_s=0.05)
    assert outcome.result == "done" and refused(db_engine, "sync_done_refused") == 3
    assert driver.by_worker[1].weight_version == 1 and driver.by_worker[1].commands.count("load:1") == 1
    assert [r["state"] for r in sync_rows(db_engine)] == ["done"]


def admitting_at_v1(engine: Engine, tmp_path: Path) -> tuple[FakeServers, FakeFrontDoor, FakeDriver, ControlPlane,
                                                             dict[str, Any]]:
    """Worker 1 up to its admit (claimed, not run), then the trainer publishes version 1."""
    servers, front_door = FakeServers(), FakeFrontDoor()
    driver = FakeDriver(servers, "node-a")
    step = up_to_admit(engine, servers, driver)
    cp = ControlPlane(engine=engine)
    cp.training_begin(1, wait_s=0)
    cp.training_end(1, weights_version=1, snapshot=str(snapshot(tmp_path / "v1", 1)))
    return servers, front_door, driver, cp, step


def at_load_weights(engine: Engine, tmp_path: Path) -> tuple[FakeServers, FakeFrontDoor, FakeDriver, ControlPlane,
                                                             dict[str, Any]]:
    """The trainer at version 1, and worker 1 starting, up to its load_weights (claimed, not run)."""
    servers, front_door = FakeServers(), FakeFrontDoor()
    driver = FakeDriver(servers, "node-a")
    import_cluster(engine, TWO_NODES)
    cp = ControlPlane(engine=engine)
    cp.training_begin(1, wait_s=0)
    cp.training_end(1, weights_version=1, snapshot=str(snapshot(tmp_path / "v1", 1)))
    return servers, front_door, driver, cp, up_to_admit(engine, servers, driver, "load_weights", imported=True)


def test_a_version_published_during_a_starting_workers_load_is_loaded_in_turn(db_engine: Engine, tmp_path: Path,
                                                                              no_broker: None) -> None:
    """The trainer publishes v2 while the new worker loads v1: the step loads v2 too and succeeds (it
    used to fail, failing the plan and its whole expansion group)."""
    servers, front_door, driver, cp, step = at_load_weights(db_engine, tmp_path)
    published: list[int] = []

    class PublishesMidLoad(FakeClient):
        def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
            super().update_weights_from_disk(model_path, weight_version)
            if not published:
                published.append(2)
                cp.training_begin(2, wait_s=0)
                cp.training_end(2, weights_version=2, snapshot=str(snapshot(tmp_path / "v2", 2)))

    ctx = StepContext(engine=db_engine, step=step, driver=driver,
                      client=lambda endpoint, fence: PublishesMidLoad(servers, endpoint, fence),
                      front_door=lambda: front_door, node_address="127.0.0.1", actor="test agent",
                      timeouts=Timeouts(weights_s=5, poll_s=0.02))
    load_weights(ctx)
    assert [c for c in driver.by_worker[1].commands if c.startswith("load")] == ["load:1", "load:2"]
    with transaction(db_engine) as s:
        assert s.scalar(text("SELECT weights_version FROM workers WHERE id = 1")) == 2
        assert s.scalar(text("SELECT status FROM plan_steps WHERE id = :id"), {"id": step["id"]}) == "succeeded"


def test_a_starting_workers_load_waits_for_a_weight_sync_of_the_same_server(db_engine: Engine, tmp_path: Path,
                                                                            no_broker: None) -> None:
    servers, front_door, driver, _, step = at_load_weights(db_engine, tmp_path)
    with rows.sync_lock(db_engine, 1, timeout_s=1) as held:  # a sync of worker 1 is at work
        assert held
        thread, errors = in_background(
            lambda: load_weights(context(db_engine, step, servers, driver, front_door, weights_s=10)))
        thread.join(0.5)
        assert thread.is_alive() and driver.by_worker[1].commands == []  # not touched meanwhile
        driver.by_worker[1].weight_version = 1  # what the sync did
    thread.join(10)
    assert not thread.is_alive() and not errors, errors
    assert driver.by_worker[1].commands == []  # already at the version: not loaded again
    with transaction(db_engine) as s:
        assert s.scalar(text("SELECT weights_version FROM workers WHERE id = 1")) == 1


def test_status_shows_each_workers_weights_version_and_lag(db_engine: Engine, database_url: str, tmp_path: Path,
                                                           no_broker: None, pearlctl_env: dict[str, str]) -> None:
    servers, _, driver, _, _ = admitting_at_v1(db_engine, tmp_path)
    status = read_fleet_status(db_engine)
    assert status["trainer_version"] == 1
    w1 = next(w for w in status["workers"] if w["id"] == 1)
    assert (w1["weights_version"], w1["weights_lag"], w1["sync"]) == (0, 1, {"version": 1, "state": "queued",
                                                                               "error": None})
    env = {**pearlctl_env, "PEARL_DATABASE_URL": database_url}
    done = subprocess.run([str(PEARLCTL), "status", "--json"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["workers"][0]["weights_lag"] == 1
    done = subprocess.run([str(PEARLCTL), "status"], env={**env, "COLUMNS": "200"}, cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "trainer at weights version 1" in done.stdout and "v1 queued" in done.stdout


@pytest.mark.parametrize("lost", ["lease", "newer_fence", "plan"])
def test_a_command_is_not_sent_once_the_claim_no_longer_holds(db_engine: Engine, tmp_path: Path, no_broker: None,
                                                              lost: str) -> None:
    """Stock SGLang ignores `X-Pearl-Fence`: before each command the step reads its claim in the rows,
    and one whose lease ran out, whose worker a newer claim changed, or whose plan stopped sends
    nothing more."""
    from pearl.agents.steps import StepCancelled

    servers, front_door, driver, _, step = at_load_weights(db_engine, tmp_path)
    with transaction(db_engine) as s:
        if lost == "lease":
            s.execute(text("UPDATE plan_steps SET lease_until = pearl_now() - interval '1 second' WHERE id = :id"),
                      {"id": step["id"]})
        elif lost == "newer_fence":
            s.execute(text("UPDATE workers SET last_fence = :f WHERE id = 1"), {"f": step["fence"] + 1})
    if lost == "plan":
        plan_store.abort(db_engine, step["plan_id"])
    ctx = context(db_engine, step, servers, driver, front_door, weights_s=5)
    with pytest.raises(StepCancelled) as stopped:
        load_weights(ctx)
    assert stopped.value.reason == ("plan" if lost == "plan" else "claim")
    assert not any(c.startswith("load") for s in servers.by_endpoint.values() for c in s.commands)


def test_a_load_waiting_for_a_weight_sync_stops_at_once_when_its_step_is_stopped(db_engine: Engine, tmp_path: Path,
                                                                                no_broker: None) -> None:
    """It used to wait out the whole timeout (600 s by default) for the sync's lock before it noticed."""
    from pearl.agents.steps import StepCancelled

    servers, front_door, driver, _, step = at_load_weights(db_engine, tmp_path)
    ctx = context(db_engine, step, servers, driver, front_door, weights_s=60)
    with rows.sync_lock(db_engine, 1, timeout_s=1) as held:  # a sync of worker 1 is at work
        assert held
        thread, errors = in_background(lambda: load_weights(ctx))
        thread.join(0.5)
        assert thread.is_alive()
        started = time.monotonic()
        ctx.stop("shutdown")
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - started < 5
    assert len(errors) == 1 and isinstance(errors[0], StepCancelled) and errors[0].reason == "shutdown"
    assert driver.by_worker[1].commands == []
