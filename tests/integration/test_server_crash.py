"""A server that dies under an active worker between plans: the node agent's watch takes the worker out
of service and frees its GPUs (agents/server_watch.py, controlplane/store/crashes.py), and a plan brings
the capacity back. Real agents (threads) driving simulated servers, on a real PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pearl.agents.server_watch import ServerWatch
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.store import crashes, plan_store
from pearl.controlplane.store.db import transaction
from plan_support import propose
from sqlalchemy import Engine, text
from weights_support import LiveFleet, bring_up, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.reliability]


class RecordingFrontDoor:
    """The front door's part the agent calls: what it lists (url -> role, bootstrap port), and what it was
    asked. `up` False: it gives no answer to what it lists; `gate` cleared: a registration waits for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.listing: dict[str, tuple[str, int | None]] = {}
        self.registered: list[str] = []
        self.deregistered: list[str] = []
        self.up = True
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = 0  # registrations waiting at the gate
        self.start = 1  # which start of it runs
        self.asked = 0  # how many times it was asked what it lists

    def register(self, url: str, role: str, bootstrap_port: int | None = None) -> None:
        if not self.gate.is_set():
            with self.lock:
                self.waiting += 1
            assert self.gate.wait(30)
        with self.lock:
            self.registered.append(url)
            self.listing[url] = (Role(role).value, bootstrap_port)

    def deregister(self, url: str) -> None:
        with self.lock:
            self.deregistered.append(url)
            self.listing.pop(url, None)

    def set_mode(self, mode: str) -> None:
        return None

    def started(self) -> int:
        return self.start

    def listed(self) -> set[tuple[str, Role]] | None:
        with self.lock:
            self.asked += 1
            return {(url, Role(role)) for url, (role, _) in self.listing.items()} if self.up else None

    def forget(self) -> None:
        """Restarted without its state: a new start of it, listing nothing."""
        with self.lock:
            self.listing.clear()
            self.start += 1


def worker(engine: Engine, worker_id: int) -> dict:
    with transaction(engine) as s:
        return dict(s.execute(text("SELECT activity, role, endpoint, generation FROM workers WHERE id = :w"),
                              {"w": worker_id}).mappings().one())


def gpus(engine: Engine, worker_id: int) -> list[tuple[str, int | None]]:
    with transaction(engine) as s:
        return [tuple(r) for r in s.execute(text(
            "SELECT state, worker_id FROM gpus WHERE slot_id = :w ORDER BY device_index"), {"w": worker_id})]


@pytest.fixture
def live(db_engine: Engine, database_url: str, broker_url: str, tmp_path: Path, pearlctl_env: dict[str, str]):
    fleet = bring_up(db_engine, database_url, broker_url, tmp_path, pearlctl_env)
    try:
        yield fleet
    finally:
        fleet.stop()


def test_a_server_killed_between_plans_is_taken_out_of_service_and_a_plan_brings_it_back(live: LiveFleet) -> None:
    door = RecordingFrontDoor()
    live.start_agent("node-a", crash_after_s=1.0, front_door=lambda: door)
    live.serve({1, 2})
    before = worker(live.engine, 2)
    dead = live.drivers["node-a"].running(2)
    assert dead is not None and before["activity"] == "active"

    os.kill(dead.pid, signal.SIGKILL)
    wait_for(lambda: worker(live.engine, 2)["activity"] == "inactive", 30, "worker 2 out of service")

    assert worker(live.engine, 2)["endpoint"] is None
    assert gpus(live.engine, 2) == [("free", None), ("free", None)]  # no GPU lost with its server
    assert worker(live.engine, 1)["activity"] == "active"  # its neighbour's server still answers
    assert door.deregistered == [before["endpoint"]]
    with transaction(live.engine) as s:
        reasons = s.scalars(text("SELECT DISTINCT reason FROM events WHERE entity = 'workers' AND entity_id = '2' "
                                 "AND op = 'update' AND new ->> 'activity' = 'inactive'")).all()
    assert len(reasons) == 1 and "is gone: no process, no answer" in reasons[0]

    live.serve({1, 2})  # the policy's next plan starts it again on the same GPUs
    after = worker(live.engine, 2)
    assert after["activity"] == "active" and after["generation"] == before["generation"] + 1
    assert gpus(live.engine, 2) == [("bound", 2), ("bound", 2)]
    assert live.drivers["node-a"].running(2) is not None


def test_a_server_restarted_by_other_means_or_alive_but_silent_is_not_declared_crashed(live: LiveFleet) -> None:
    live.start_agent("node-a", crash_after_s=60.0)
    live.serve({1, 2})
    seen = {s.worker_id: s for s in _serving(live)}
    driver = live.drivers["node-a"]
    clock = [0.0]
    answers = {seen[1].endpoint: False, seen[2].endpoint: True}
    watch = ServerWatch(live.engine, "node-a", driver, lambda ep: answers[ep], RecordingFrontDoor,
                        crash_after_s=5.0, clock=lambda: clock[0])
    assert watch.check() == []  # worker 1: its process runs, silent or not; worker 2 answers
    driver.stop(2, grace_s=5.0)  # worker 2's process is gone, but something answers at its endpoint
    for clock[0] in (0.0, 10.0, 20.0):
        assert watch.check() == []
    answers[seen[2].endpoint] = False  # now nothing answers: down from here, crashed 5 s later
    clock[0] = 30.0
    assert watch.check() == [] and worker(live.engine, 2)["activity"] == "active"
    clock[0] = 35.0
    assert watch.check() == [2] and worker(live.engine, 2)["activity"] == "inactive"
    assert worker(live.engine, 1)["activity"] == "active"


def test_a_server_serving_older_weights_than_its_row_is_taken_out_of_service(live: LiveFleet) -> None:
    """A server restarted by other means on the same address answers, with the weights it was launched
    with: its row's weights version would be a lie, so the worker leaves service (a newer version than
    the row is a sync on its way, not a fault)."""
    live.start_agent("node-a", crash_after_s=60.0)
    live.serve({1, 2})
    for agent, thread in live.agents:  # only this test's watch looks
        agent.stop()
        thread.join(30)
    live.agents.clear()
    with transaction(live.engine) as s:
        s.execute(text("UPDATE workers SET weights_version = 3 WHERE id IN (1, 2)"))
    seen = {s.worker_id: s for s in _serving(live)}
    served = {seen[1].endpoint: 3, seen[2].endpoint: 3}
    watch = ServerWatch(live.engine, "node-a", live.drivers["node-a"], lambda ep: True, RecordingFrontDoor,
                        crash_after_s=5.0, served=lambda ep: served[ep])
    assert watch.check() == []
    served[seen[1].endpoint] = 4  # ahead of its row: a sync whose record is on its way
    served[seen[2].endpoint] = 0  # restarted with its launch weights
    assert watch.check() == [2]
    assert worker(live.engine, 2)["activity"] == "inactive" and worker(live.engine, 1)["activity"] == "active"


def test_the_rows_refuse_a_crash_that_does_not_match_what_was_seen(live: LiveFleet) -> None:
    live.start_agent("node-a", crash_after_s=60.0)
    live.serve({1, 2})
    seen = {s.worker_id: s for s in _serving(live)}
    stale = crashes.Serving(2, seen[2].endpoint, seen[2].generation - 1)  # an older start of the slot
    moved = crashes.Serving(2, "http://127.0.0.1:1", seen[2].generation)
    for wrong in (stale, moved):
        with transaction(live.engine) as s:
            assert not crashes.mark_crashed(s, wrong)
    assert worker(live.engine, 2)["activity"] == "active"
    # a step of a plan running on the worker: the step deals with its server, the watch leaves it be
    for agent, thread in live.agents:  # no agent enacts it: the step stays running
        agent.stop()
        thread.join(30)
    live.agents.clear()
    plan_id = propose(live.engine, Target(frozenset({1}), {Role.COLOCATED: 1}, reason="test"))
    plan_store.apply(live.engine, plan_id)
    with transaction(live.engine) as s:
        node_id, agent_id = s.execute(text("SELECT node_id, max(id) FROM agents GROUP BY node_id")).one()
        claimed = plan_store.claim_steps(s, node_id, agent_id, lease_s=60, limit=8)
    assert [r["worker_id"] for r in claimed] == [2]
    with transaction(live.engine) as s:
        assert crashes.serving(s, "node-a") == [seen[1]]
        assert not crashes.mark_crashed(s, seen[2])
    assert worker(live.engine, 2)["activity"] == "active"


def test_a_server_left_running_under_a_worker_out_of_service_is_stopped_and_taken_off_the_front_door(
        live: LiveFleet) -> None:
    """The rows took worker 2 out of service while its server still ran (as a revocation whose notice ran
    out does): the agent stops that server and deregisters it, so its GPUs are not used after they left."""
    door = RecordingFrontDoor()
    live.start_agent("node-a", crash_after_s=60.0, front_door=lambda: door)
    live.serve({1, 2})
    seen = {s.worker_id: s for s in _serving(live)}
    driver = live.drivers["node-a"]
    left, kept = driver.running(2), driver.running(1)
    assert left is not None and kept is not None
    with transaction(live.engine) as s:  # out of service in the rows alone
        assert crashes.mark_crashed(s, seen[2])
    wait_for(lambda: driver.running(2) is None, 30, "the leftover server of worker 2 stopped")
    assert door.deregistered == [left.endpoint]
    assert not _alive(left.pid) and driver.running(1) == kept  # its neighbour untouched
    live.serve({1, 2})  # a plan starts it again: a server of its own
    assert worker(live.engine, 2)["activity"] == "active" and driver.running(2).pid != left.pid


def test_a_worker_a_step_is_at_work_on_is_not_out_of_service_for_the_watch(live: LiveFleet) -> None:
    live.start_agent("node-a", crash_after_s=60.0)
    live.serve({1, 2})
    seen = {s.worker_id: s for s in _serving(live)}
    for agent, thread in live.agents:  # no agent enacts what follows
        agent.stop()
        thread.join(30)
    live.agents.clear()
    with transaction(live.engine) as s:
        assert crashes.mark_crashed(s, seen[2])
        assert crashes.out_of_service(s, "node-a", [1, 2]) == [2]
    plan_id = propose(live.engine, Target(frozenset({1, 2}), {Role.COLOCATED: 2}, reason="test"))
    plan_store.apply(live.engine, plan_id)
    with transaction(live.engine) as s:
        node_id, agent_id = s.execute(text("SELECT node_id, max(id) FROM agents GROUP BY node_id")).one()
        claimed = plan_store.claim_steps(s, node_id, agent_id, lease_s=60, limit=8)
    assert [(r["worker_id"], r["action"]) for r in claimed] == [(2, "start")]
    with transaction(live.engine) as s:  # the start deals with the server it finds
        assert crashes.out_of_service(s, "node-a", [1, 2]) == []
    live.drivers["node-a"].stop(2, grace_s=5.0)


def test_the_watch_registers_again_the_serving_workers_a_restarted_front_door_does_not_list(
        live: LiveFleet) -> None:
    door = RecordingFrontDoor()
    live.start_agent("node-a", crash_after_s=60.0, front_door=lambda: door)
    plan_id = propose(live.engine, Target(frozenset({1, 2}), {Role.PREFILL: 1, Role.DECODE: 1}, reason="test"))
    plan_store.apply(live.engine, plan_id)
    live.wait_plan(plan_id, 60)
    driver = live.drivers["node-a"]
    servers = [driver.running(1), driver.running(2)]
    wanted = {s.endpoint: (s.role.value, s.bootstrap_port) for s in servers}
    assert door.listing == wanted and sorted(door.registered) == sorted(wanted)  # each admitted once
    assert {r for r, _ in wanted.values()} == {"prefill", "decode"}
    assert any(port is not None for _, port in wanted.values())  # the prefill server's bootstrap port

    door.up = False  # a front door that gives no answer: nothing is registered around it
    door.forget()
    time.sleep(1.0)
    assert len(door.registered) == 2
    door.up = True  # it answers, listing nothing: the watch registers both again, as the driver has them
    wait_for(lambda: door.listing == wanted, 30, "both workers registered again")
    time.sleep(1.0)  # listed again: registered no more
    assert sorted(door.registered) == sorted(2 * list(wanted)) and door.deregistered == []
    assert worker(live.engine, 1)["activity"] == worker(live.engine, 2)["activity"] == "active"


def test_no_step_of_a_worker_runs_while_the_watch_registers_it_again(live: LiveFleet) -> None:
    """The agent holds a worker aside for the watch only while no step of it is in hand; a step of it that
    becomes ready meanwhile is left unclaimed, and enacted once the worker is no longer aside."""
    door = RecordingFrontDoor()
    live.start_agent("node-a", crash_after_s=60.0, front_door=lambda: door)
    agent = live.agents[0][0]
    door.gate.clear()  # the admits wait: a step of each worker in hand
    plan_id = propose(live.engine, Target(frozenset({1, 2}), {Role.COLOCATED: 2}, reason="test"))
    plan_store.apply(live.engine, plan_id)
    wait_for(lambda: door.waiting == 2, 60, "both admits in hand")
    with agent._held_aside(1) as held, agent._held_aside(2) as held_too:
        assert not held and not held_too
    door.gate.set()
    live.wait_plan(plan_id, 60)
    endpoint = live.endpoint(2)
    wait_for(lambda: not agent._in_hand, 30, "the admits reported")

    with agent._held_aside(2) as held:  # as the watch does while it registers worker 2 again
        assert held
        plan_id = propose(live.engine, Target(frozenset({1}), {Role.COLOCATED: 1}, reason="test"))
        plan_store.apply(live.engine, plan_id)  # worker 2 leaves service: its drain must wait
        wait_for(lambda: _drain_ready(live, 2), 30, "the drain of worker 2 ready")
        time.sleep(1.0)  # the agent claims every poll_s, and at once on the plan's NOTIFY
        assert _drain_ready(live, 2) == (0, None)  # never claimed
        assert worker(live.engine, 2)["activity"] == "active" and endpoint in door.listing
    live.wait_plan(plan_id, 60)
    assert worker(live.engine, 2)["activity"] == "inactive"
    assert door.deregistered == [endpoint] and endpoint not in door.listing


def test_a_worker_that_left_service_around_its_registration_is_not_left_on_the_front_door(live: LiveFleet) -> None:
    door = RecordingFrontDoor()
    live.start_agent("node-a", crash_after_s=60.0, front_door=lambda: door)
    live.serve({1, 2})
    seen = {s.worker_id: s for s in _serving(live)}
    for agent, thread in live.agents:  # the watches below are the only ones
        agent.stop()
        thread.join(30)
    live.agents.clear()
    door.forget()

    @contextlib.contextmanager
    def a_drain_came_and_went(worker_id: int) -> Iterator[bool]:  # between the listing and the hold
        if worker_id == 1:
            with transaction(live.engine) as s:
                assert crashes.mark_crashed(s, seen[1])
        yield True

    class OutOfServiceWhileRegistering(RecordingFrontDoor):  # a notice enforced at its deadline, say
        def register(self, url: str, role: str, bootstrap_port: int | None = None) -> None:
            super().register(url, role, bootstrap_port)
            with transaction(live.engine) as s:
                assert crashes.mark_crashed(s, seen[2])

    door = OutOfServiceWhileRegistering()
    watch = ServerWatch(live.engine, "node-a", live.drivers["node-a"], lambda ep: True, lambda: door,
                        crash_after_s=60.0, aside=a_drain_came_and_went)
    assert watch.register_missing() == []
    assert door.registered == [seen[2].endpoint] and door.deregistered == [seen[2].endpoint]
    assert door.listing == {}  # worker 1 never registered, worker 2 taken off again
    assert worker(live.engine, 1)["activity"] == worker(live.engine, 2)["activity"] == "inactive"


def test_the_front_door_is_asked_what_it_lists_at_each_new_start_and_every_relist_s(live: LiveFleet) -> None:
    door = RecordingFrontDoor()
    live.start_agent("node-a", crash_after_s=60.0, front_door=lambda: door)
    live.serve({1, 2})
    for agent, thread in live.agents:
        agent.stop()
        thread.join(30)
    live.agents.clear()
    clock = [0.0]
    watch = ServerWatch(live.engine, "node-a", live.drivers["node-a"], lambda ep: True, lambda: door,
                        crash_after_s=60.0, clock=lambda: clock[0], relist_s=30.0)
    door.asked = 0
    assert watch.register_missing() == [] and door.asked == 1  # the first look
    for clock[0] in (2.0, 10.0, 20.0):
        assert watch.register_missing() == []
    assert door.asked == 1  # listed, and the same start of it: not asked again within relist_s
    door.forget()  # restarted: asked at once, and both registered again
    clock[0] = 22.0
    assert watch.register_missing() == [1, 2] and door.asked == 2
    clock[0] = 60.0  # past relist_s (jittered by at most a fifth): asked again
    assert watch.register_missing() == [] and door.asked == 3


def _drain_ready(live: LiveFleet, worker_id: int) -> tuple[int, str | None] | None:
    """(attempts, error) of the worker's ready drain step; None while it has none."""
    with transaction(live.engine) as s:
        row = s.execute(text("SELECT attempts, error FROM plan_steps WHERE worker_id = :w AND action = 'drain' "
                             "AND status = 'ready'"), {"w": worker_id}).first()
    return None if row is None else (row.attempts, row.error)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too
        return f.read().split(") ")[-1][0] != "Z"


def _serving(live: LiveFleet) -> list[crashes.Serving]:
    deadline = time.monotonic() + 30
    while True:
        with transaction(live.engine) as s:
            found = crashes.serving(s, "node-a")
        if len(found) == 2 or time.monotonic() > deadline:
            return found
        time.sleep(0.1)
