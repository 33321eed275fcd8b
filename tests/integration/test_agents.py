"""Node agents enact plans against a real PostgreSQL: two agents (one per node), in this process, with
an in-process driver whose servers really change state (tests/agent_support.py)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from agent_support import ALL, FAST, TWO_NODES, FakeDriver, FakeFrontDoor, FakeServers
from db_faults import refuse_first, refused
from pearl.agents.agent import Agent, AgentConfig
from pearl.agents.drivers.base import DriverError
from pearl.controlplane.core.domain import Activity, GPUState, PlanStatus, Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.errors import IllegalTransition, NodeTaken
from pearl.controlplane.store import agent_registry, plan_store, reaper
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.fleet_status import read_fleet_status
from pearl.controlplane.store.schema import GPU, Worker
from plan_support import import_cluster, propose
from sqlalchemy import Engine, select, text

pytestmark = pytest.mark.integration



def target(**counts: int) -> Target:
    return Target(ALL, {Role(r): n for r, n in counts.items()}, reason="test")


class Fleet:
    """Agents in threads over fake servers; stop them all at the end."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.servers = FakeServers()
        self.front_door = FakeFrontDoor()
        self.drivers: dict[str, FakeDriver] = {}  # one per node, shared by the agents of that node
        self.agents: list[tuple[Agent, threading.Thread]] = []

    def start(self, node: str, **overrides: object) -> Agent:
        config = AgentConfig(node=node, driver="fake", **{**FAST, **overrides})  # type: ignore[arg-type]
        driver = self.drivers.setdefault(node, FakeDriver(self.servers, node))
        agent = Agent(self.engine, config, driver, client=self.servers.client, front_door=lambda: self.front_door)
        thread = threading.Thread(target=_run, args=(agent,), name=f"agent-{node}", daemon=True)
        thread.start()
        self.agents.append((agent, thread))
        return agent

    def stop(self) -> None:
        for agent, _ in self.agents:
            agent.stop()
        for _, thread in self.agents:
            thread.join(timeout=30)
            assert not thread.is_alive()
        assert agent_threads(self.agents) == []  # `run` returned with its listener and watch passes ended


def agent_threads(agents: list[tuple[Agent, threading.Thread]]) -> list[str]:
    """The live threads an agent of these nodes starts besides its loop (listener, watch passes)."""
    nodes = {agent.config.node for agent, _ in agents}
    return [t.name for t in threading.enumerate()
            if t.name.partition("-")[0] in ("listen", "watch", "relist") and t.name.partition("-")[2] in nodes]


def _run(agent: Agent) -> None:
    with contextlib.suppress(NodeTaken):  # superseded: `agent.superseded` says so
        agent.run()


@pytest.fixture
def fleet(db_engine: Engine) -> Iterator[Fleet]:
    import_cluster(db_engine, TWO_NODES)
    f = Fleet(db_engine)
    try:
        yield f
    finally:
        f.stop()


def apply_and_wait(engine: Engine, t: Target, timeout_s: float = 30) -> dict:
    plan_id = propose(engine, t)
    plan_store.apply(engine, plan_id)
    return plan_store.wait_plan(engine, plan_id, timeout_s=timeout_s, poll_s=0.05)


def roles(engine: Engine) -> dict[int, tuple[Activity, Role]]:
    with transaction(engine) as session:
        return {w.id: (w.activity, w.role) for w in session.scalars(select(Worker).order_by(Worker.id))}


def test_two_agents_enact_colocated_2p2d_1p3d_colocated(fleet: Fleet) -> None:
    fleet.start("node-a")
    fleet.start("node-b")
    shapes = [(target(colocated=4), {Role.COLOCATED: 4}, "colocated"),
              (target(prefill=2, decode=2), {Role.PREFILL: 2, Role.DECODE: 2}, "split"),
              (target(prefill=1, decode=3), {Role.PREFILL: 1, Role.DECODE: 3}, "split"),
              (target(colocated=4), {Role.COLOCATED: 4}, "colocated")]
    for t, counts, mode in shapes:
        summary = apply_and_wait(fleet.engine, t)
        assert summary["status"] == "succeeded", summary["error"]
        # the rows show the effect: every worker active in its role, holding its GPUs
        now = roles(fleet.engine)
        assert all(a is Activity.ACTIVE for a, _ in now.values())
        assert Counter(r for _, r in now.values()) == counts
        with transaction(fleet.engine) as session:
            assert set(session.scalars(select(GPU.state))) == {GPUState.BOUND}
            endpoints = dict(session.execute(select(Worker.id, Worker.endpoint)).all())
        # and so do the servers and the front door
        for wid, (_, role) in now.items():
            server = fleet.servers.by_endpoint[endpoints[wid]]
            assert server.alive and server.role is role and not server.released
            assert fleet.front_door.workers[endpoints[wid]] == role.value
        assert fleet.front_door.mode == mode
    # 2P2D -> 1P3D flipped one prefill server in place, telling it a decode peer's graph memory; the
    # mode changes restarted every server
    flipped = [s for s in fleet.servers.by_endpoint.values() if "switch:decode" in s.commands]
    flips = [c for s in fleet.servers.by_endpoint.values() for c in s.commands if c.startswith("switch:")]
    assert flips == ["switch:decode"] and flipped[0].graph_gb_told == 2.0
    assert fleet.servers.launches == 4 + 4 + 4  # colocated, split, colocated again


def test_admits_and_drains_wait_for_a_front_door_that_is_restarting(fleet: Fleet) -> None:
    """A front door killed and started again gives no answer for a moment: the admits and drains of a
    plan try again (finding its new address) instead of failing the plan."""
    fleet.start("node-a")
    fleet.start("node-b")
    fleet.front_door.down = 6
    assert apply_and_wait(fleet.engine, target(colocated=4))["status"] == "succeeded"
    fleet.front_door.down = 6
    summary = apply_and_wait(fleet.engine, target(prefill=2, decode=2))
    assert summary["status"] == "succeeded", summary["error"]
    assert fleet.front_door.down == 0 and len(fleet.front_door.workers) == 4


def test_a_server_that_refuses_a_role_switch_is_restarted_in_the_new_role(fleet: Fleet) -> None:
    """SGLang refuses a flip to decode without room for its decode graphs (400): the step restarts the
    server in the new role, and the rows carry the new server's endpoint."""
    fleet.start("node-a")
    fleet.start("node-b")
    assert apply_and_wait(fleet.engine, target(prefill=2, decode=2))["status"] == "succeeded"
    launches = fleet.servers.launches
    fleet.servers.refuse_switch = True
    summary = apply_and_wait(fleet.engine, target(prefill=1, decode=3))
    assert summary["status"] == "succeeded", summary["error"]
    assert fleet.servers.launches == launches + 1
    with transaction(fleet.engine) as session:
        endpoints = dict(session.execute(select(Worker.id, Worker.endpoint)).all())
    for wid, (activity, role) in roles(fleet.engine).items():
        server = fleet.servers.by_endpoint[endpoints[wid]]
        assert activity is Activity.ACTIVE and server.alive and server.role is role
        assert fleet.front_door.workers[endpoints[wid]] == role.value
    assert Counter(r for _, r in roles(fleet.engine).values()) == {Role.PREFILL: 1, Role.DECODE: 3}


def test_an_agent_that_dies_mid_step_is_rescued_and_the_step_takes_effect_once(fleet: Fleet) -> None:
    fleet.servers.hang_launch.set()  # the first agent's launch hangs: it will look dead
    dead = fleet.start("node-a", heartbeat_s=0.2)
    plan_id = propose(fleet.engine, Target(frozenset({1}), {Role.COLOCATED: 1}))
    plan_store.apply(fleet.engine, plan_id)
    _wait_for(lambda: _step(fleet.engine, plan_id, "w1.start")["status"] == "running")
    _wait_for(lambda: roles(fleet.engine)[1][0] is Activity.TRANSITIONING)  # it took the GPUs, then hung
    first = _step(fleet.engine, plan_id, "w1.start")
    with transaction(fleet.engine) as session:
        generation = session.scalar(select(Worker.generation).where(Worker.id == 1))
    # the agent dies (SIGKILL-like: no hand-back, no report): it stops heartbeating and renewing
    dead._heartbeat = lambda: None  # type: ignore[method-assign]
    dead._stop.set()
    # another agent of the node takes over once the dead one has been silent for agent_timeout_s and
    # the claim's lease has run out
    _wait_for(lambda: _silent(fleet.engine, dead, FAST["agent_timeout_s"]))
    fleet.start("node-a")
    _wait_for(lambda: _step(fleet.engine, plan_id, "w1.start")["attempts"] == 2, timeout_s=15)
    fleet.servers.hang_launch.clear()
    summary = plan_store.wait_plan(fleet.engine, plan_id, timeout_s=30, poll_s=0.05)
    assert summary["status"] == "succeeded", summary["error"]
    second = _step(fleet.engine, plan_id, "w1.start")
    assert second["fence"] > first["fence"]
    with transaction(fleet.engine) as session:
        w = session.get(Worker, 1)
        assert w.activity is Activity.ACTIVE and w.generation == generation  # started once: the re-run adds none
        assert w.last_fence is not None and w.last_fence >= second["fence"]
    alive = [s for s in fleet.servers.by_endpoint.values() if s.alive and s.spec.worker_id == 1]
    assert len(alive) == 1  # one server serves the worker, whoever launched it


def test_an_aborted_plans_running_step_stops_and_its_cleanup_frees_the_gpus(fleet: Fleet) -> None:
    fleet.servers.hang_launch.set()
    fleet.start("node-a")
    plan_id = propose(fleet.engine, Target(frozenset({1, 2}), {Role.COLOCATED: 2}))
    plan_store.apply(fleet.engine, plan_id)
    _wait_for(lambda: _step(fleet.engine, plan_id, "w1.start")["status"] == "running"
              and _step(fleet.engine, plan_id, "w2.start")["status"] == "running")
    _wait_for(lambda: roles(fleet.engine)[1][0] is Activity.TRANSITIONING)  # the starts took their GPUs
    progress = plan_store.abort(fleet.engine, plan_id, actor="operator")
    assert progress.cleanup is not None and progress.release == (1, 2)
    fleet.servers.hang_launch.clear()  # the launches return; the steps see their plan stopped
    _wait_for(lambda: _step(fleet.engine, plan_id, "w1.start")["status"] == "cancelled"
              and _step(fleet.engine, plan_id, "w2.start")["status"] == "cancelled")
    summary = plan_store.wait_plan(fleet.engine, progress.cleanup, timeout_s=30, poll_s=0.05)
    assert summary["status"] == "succeeded", summary["error"]
    assert all(a is Activity.INACTIVE for a, _ in roles(fleet.engine).values())
    with transaction(fleet.engine) as session:
        assert set(session.scalars(select(GPU.state))) == {GPUState.FREE}
    assert not any(s.alive for s in fleet.servers.by_endpoint.values())


@pytest.mark.parametrize("hang", ["no-answer", "requests-never-end"])
def test_a_hung_server_is_stopped_so_its_worker_still_gives_its_gpus_back(fleet: Fleet, hang: str) -> None:
    fleet.start("node-a")
    fleet.start("node-b")
    assert apply_and_wait(fleet.engine, target(colocated=4))["status"] == "succeeded"
    stuck = fleet.drivers["node-a"].by_worker[1]
    stuck.running = 3
    if hang == "no-answer":
        stuck.hung = True
    else:  # it answers, but an abort ends nothing
        original = fleet.servers.client

        def client(endpoint: str, fence: int | None = None):
            c = original(endpoint, fence)
            if endpoint == stuck.endpoint:
                c.pause_generation = lambda mode="abort": stuck.commands.append(f"pause:{mode}")
            return c

        for agent, _ in fleet.agents:
            agent.client = client
    summary = apply_and_wait(fleet.engine, Target(frozenset({2, 3, 4}), {Role.COLOCATED: 3}, reason="test"))
    assert summary["status"] == "succeeded", summary["error"]
    assert not stuck.alive  # stopped: what it ran ends, the front door resubmits it
    assert roles(fleet.engine)[1][0] is Activity.INACTIVE
    with transaction(fleet.engine) as session:
        assert set(session.scalars(select(GPU.state).where(GPU.slot_id == 1))) == {GPUState.FREE}


def test_an_overlap_server_that_cannot_release_its_memory_is_stopped_and_the_loan_closes(db_engine: Engine) -> None:
    from plan_support import small_inventory

    import_cluster(db_engine, small_inventory())
    fleet = Fleet(db_engine)
    try:
        for node in ("train-0", "roll-0"):
            fleet.start(node)
        borrowed = Target(frozenset({1, 3}), {Role.COLOCATED: 2}, reason="test")
        assert apply_and_wait(db_engine, borrowed)["status"] == "succeeded"
        stuck = fleet.drivers["train-0"].by_worker[1]
        original = fleet.servers.client

        def client(endpoint: str, fence: int | None = None):
            c = original(endpoint, fence)
            if endpoint == stuck.endpoint:
                def refuse() -> None:
                    raise DriverError(f"{endpoint}: 500 release_memory_occupation failed")
                c.release_memory_occupation = refuse
            return c

        for agent, _ in fleet.agents:
            agent.client = client
        summary = apply_and_wait(db_engine, Target(frozenset({3}), {Role.COLOCATED: 1}, reason="test"))
        assert summary["status"] == "succeeded", summary["error"]
        assert not stuck.alive
        with transaction(db_engine) as session:
            assert set(session.scalars(select(GPU.state).where(GPU.slot_id == 1))) != {GPUState.BORROWED}
            assert session.scalar(text(
                "SELECT count(*) FROM leases WHERE returned_at IS NULL AND kind = 'borrowed'")) == 0
    finally:
        fleet.stop()


def test_an_agent_outlives_an_error_that_is_not_the_database_being_away(fleet: Fleet,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from pearl.controlplane.store import reaper

    real, failures = reaper.reap, []

    def reap_failing_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise RuntimeError("deadlock detected")  # what an unmapped database error looks like to the loop
        return real(*args, **kwargs)

    monkeypatch.setattr(reaper, "reap", reap_failing_once)
    fleet.start("node-a")
    fleet.start("node-b")
    assert apply_and_wait(fleet.engine, target(colocated=4))["status"] == "succeeded"
    assert failures and all(thread.is_alive() for _, thread in fleet.agents)


def test_a_step_rescued_while_its_lapsed_thread_still_runs_is_not_claimed_beside_it(fleet: Fleet) -> None:
    """The claim of a step stuck in its server call lapses (a database away longer than the lease) and is
    rescued; the agent leaves the step ready (unclaimed) until that thread is done, instead of a second
    thread driving the same server, and does not hold back the steps of its other workers meanwhile."""
    from pearl.controlplane.store.queries import query

    fleet.servers.hang_launch.set()
    try:
        agent = fleet.start("node-a")
        plan_id = propose(fleet.engine, Target(frozenset({1}), {Role.COLOCATED: 1}))
        plan_store.apply(fleet.engine, plan_id)
        _wait_for(lambda: fleet.servers.in_launch == 1)
        with transaction(fleet.engine) as session:  # the lease ran out; a reaper takes the step back
            session.execute(text("UPDATE plan_steps SET lease_until = now() - interval '1 minute' "
                                 "WHERE status = 'running'"))
            assert session.execute(query("rescue_expired_steps"), {"max_attempts": 10}).all()
        passes = _claim_passes(agent)
        _wait_for(lambda: passes[0] >= 5)  # the agent looked for steps five times since
        rescued = _step(fleet.engine, plan_id, "w1.start")
        assert rescued["status"] == "ready" and rescued["attempts"] == 1, rescued
        assert rescued["error"] != "handed back by its agent"  # never claimed meanwhile
        assert fleet.servers.most_in_launch == 1  # never two threads on the one server
    finally:
        fleet.servers.hang_launch.clear()  # the old thread ends (its claim is gone); the step is enacted once
    summary = plan_store.wait_plan(fleet.engine, plan_id, timeout_s=30, poll_s=0.05)
    assert summary["status"] == "succeeded", summary["error"]
    assert fleet.servers.launches == 1 and fleet.servers.most_in_launch == 1


def test_the_steps_of_a_worker_held_aside_wait_without_holding_back_the_others(fleet: Fleet) -> None:
    agent = fleet.start("node-a")
    _wait_for(lambda: agent.registration is not None)
    with agent._held_aside(1) as held:
        assert held
        plan_id = propose(fleet.engine, Target(frozenset({1, 2}), {Role.COLOCATED: 2}))
        plan_store.apply(fleet.engine, plan_id)
        # worker 2 starts at once (both are then admitted together, an expansion group)
        _wait_for(lambda: _step(fleet.engine, plan_id, "w2.start")["status"] == "succeeded")
        passes = _claim_passes(agent)
        _wait_for(lambda: passes[0] >= 5)
        waiting = _step(fleet.engine, plan_id, "w1.start")
        assert (waiting["status"], waiting["attempts"], waiting["error"]) == ("ready", 0, None)
    summary = plan_store.wait_plan(fleet.engine, plan_id, timeout_s=30, poll_s=0.05)  # claimed once let go
    assert summary["status"] == "succeeded", summary["error"]
    assert _step(fleet.engine, plan_id, "w1.start")["attempts"] == 1


def test_a_step_claimed_in_the_instant_its_worker_is_held_aside_is_handed_back(
        fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hold begins between the claim's read of the busy workers and its statement: the step claimed
    is handed back (not enacted beside the watch), and claimed again once the hold ends."""
    from pearl.agents import agent as agent_module

    agent = fleet.start("node-a")
    _wait_for(lambda: agent.registration is not None)
    hold, held = contextlib.ExitStack(), []
    real = plan_store.claim_steps

    def claim_then_hold(session, node_id, agent_id, **kw):  # the real claim, then the watch's hold
        rows = real(session, node_id, agent_id, **kw)
        if any(r["worker_id"] == 1 for r in rows) and not held:
            held.append(hold.enter_context(agent._held_aside(1)))
            assert held == [True]
        return rows

    monkeypatch.setattr(agent_module.plan_store, "claim_steps", claim_then_hold)
    plan_id = propose(fleet.engine, Target(frozenset({1}), {Role.COLOCATED: 1}))
    plan_store.apply(fleet.engine, plan_id)
    _wait_for(lambda: _step(fleet.engine, plan_id, "w1.start")["error"] == "handed back by its agent")
    assert fleet.servers.launches == 0 and roles(fleet.engine)[1][0] is Activity.INACTIVE
    hold.close()
    summary = plan_store.wait_plan(fleet.engine, plan_id, timeout_s=30, poll_s=0.05)
    assert summary["status"] == "succeeded", summary["error"]
    assert fleet.servers.launches == 1


def test_a_stopped_agent_leaves_no_thread_and_no_connection_of_its_engine_in_use(db_engine: Engine) -> None:
    """`run` returns only once the listener and the watch passes have ended: a caller that disposes the
    engine then closes every connection. A thread left running would return its connection to the
    disposed pool, where it stays open until garbage collection (a ResourceWarning in a later test)."""
    import_cluster(db_engine, TWO_NODES)
    fleet = Fleet(db_engine)
    agent = fleet.start("node-a", watch_s=0.05)
    _wait_for(lambda: agent.registration is not None and len(agent_threads(fleet.agents)) == 3)
    time.sleep(0.3)  # watch passes under way
    agent.stop()
    fleet.agents[0][1].join(timeout=30)
    assert agent_threads(fleet.agents) == []
    assert db_engine.pool.checkedout() == 0


def test_a_second_agent_of_a_node_is_refused_while_the_first_is_alive(fleet: Fleet, database_url: str,
                                                                      tmp_path) -> None:
    from pearl.cli.app import app
    from typer.testing import CliRunner

    first = fleet.start("node-a")
    _wait_for(lambda: first.registration is not None)
    second = Agent(fleet.engine, AgentConfig(node="node-a", driver="fake",  # type: ignore[arg-type]
                                             **{**FAST, "agent_timeout_s": 60.0}),
                   fleet.drivers["node-a"], client=fleet.servers.client, front_door=lambda: fleet.front_door)
    with pytest.raises(NodeTaken, match=rf"--node: node 'node-a' already has a running agent \(agent "
                                        rf"{first.registration.agent_id}, pid {os.getpid()} on"):
        second.run()
    env = {"PEARL_DATABASE_URL": database_url, "PEARL_HOME": str(tmp_path)}
    refused = CliRunner().invoke(app, ["agent", "--node", "node-a", "--driver", "sim"], env=env)
    assert refused.exit_code == 1 and "--node: node 'node-a' already has a running agent" in refused.output
    assert _agent_rows(fleet.engine) == [(first.registration.agent_id, None)]  # nothing written
    fleet.start("node-b")  # another node's agent is welcome
    _wait_for(lambda: len(_agent_rows(fleet.engine)) == 2)


def test_an_agent_of_this_host_whose_process_is_gone_is_replaced_at_once(fleet: Fleet) -> None:
    """Killed an instant ago (its heartbeat fresh) while it held a step for an hour and led the reaper:
    the new agent starts at once and carries the step on without waiting for either lease."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    with transaction(fleet.engine) as session:
        dead = session.execute(text("INSERT INTO agents (node_id, host, pid, driver) SELECT id, :h, :p, 'fake' "
                                    "FROM nodes WHERE name = 'node-a' RETURNING id"), {"h": host, "p": gone.pid}
                               ).scalar_one()
        elsewhere = session.execute(text(  # the same pid on another host: alive as far as we can tell
            "INSERT INTO agents (node_id, host, pid, driver) SELECT id, 'elsewhere', :p, 'fake' "
            "FROM nodes WHERE name = 'node-b' RETURNING id"), {"p": gone.pid}).scalar_one()
    plan_id = propose(fleet.engine, Target(frozenset({1}), {Role.COLOCATED: 1}))
    plan_store.apply(fleet.engine, plan_id)
    with transaction(fleet.engine) as session:
        node_a = session.scalar(text("SELECT id FROM nodes WHERE name = 'node-a'"))
        (held,) = plan_store.claim_steps(session, node_a, dead, lease_s=3600, limit=8)
    its_name = agent_registry.holder_name(host, gone.pid, "node-a")
    assert agent_registry.hold_leader_lease(fleet.engine, "reaper", its_name, ttl_s=3600)
    agent = fleet.start("node-a", agent_timeout_s=60.0)  # the rows above stay alive meanwhile
    summary = plan_store.wait_plan(fleet.engine, plan_id, timeout_s=30, poll_s=0.05)
    assert summary["status"] == "succeeded", summary["error"]
    again = _step(fleet.engine, plan_id, held["key"])
    assert again["claimed_by"] == agent.registration.agent_id and again["fence"] > held["fence"]
    rows = _agent_rows(fleet.engine)
    assert rows == [(dead, "stopped"), (elsewhere, None), (agent.registration.agent_id, None)]
    with pytest.raises(NodeTaken, match="pid .* on elsewhere"):
        agent_registry.register_agent(fleet.engine, "node-b", host=host, pid=os.getpid(), driver="fake")


def test_a_restarted_container_agent_with_its_old_pid_replaces_its_dead_self(fleet: Fleet) -> None:
    """In a container the agent is pid 1 at every start: a row of this host with this pid that this
    process did not register is a previous incarnation, gone."""
    with transaction(fleet.engine) as session:
        before = session.execute(text("INSERT INTO agents (node_id, host, pid, driver) SELECT id, :h, :p, 'fake' "
                                      "FROM nodes WHERE name = 'node-a' RETURNING id"),
                                 {"h": socket.gethostname(), "p": os.getpid()}).scalar_one()
    registration = agent_registry.register_agent(fleet.engine, "node-a", host=socket.gethostname(),
                                                 pid=os.getpid(), driver="fake", agent_timeout_s=60.0)
    assert _agent_rows(fleet.engine) == [(before, "stopped"), (registration.agent_id, None)]


def test_an_agent_replaced_while_it_was_silent_stops_at_its_next_heartbeat(fleet: Fleet) -> None:
    old = fleet.start("node-a", heartbeat_s=3600.0)  # it beats once, at its start
    _wait_for(lambda: old.registration is not None and _agent_rows(fleet.engine) != [])
    time.sleep(0.5)
    with transaction(fleet.engine) as session:  # it was silent so long (a long pause, a partition)...
        session.execute(text("UPDATE agents SET heartbeat_at = pearl_now() - interval '1 hour'"))
    # ...that a new agent took the node over
    newer = agent_registry.register_agent(fleet.engine, "node-a", host="another-host", pid=1, driver="fake",
                                          agent_timeout_s=FAST["agent_timeout_s"])
    old._plan_changed.set()  # its next heartbeat, now
    old._wake.set()
    agent, thread = fleet.agents.pop()
    thread.join(timeout=10)
    assert not thread.is_alive() and isinstance(old.superseded, NodeTaken)
    assert f"superseded by a newer agent of its node (agent {newer.agent_id}" in str(old.superseded)
    assert _agent_rows(fleet.engine) == [(old.registration.agent_id, "stopped"), (newer.agent_id, None)]


@pytest.mark.reliability
def test_a_heartbeat_committing_while_the_reaper_stops_silent_agents_keeps_its_agent(fleet: Fleet) -> None:
    """The reaper finds an agent silent, but its heartbeat holds the row and commits: the agent was
    alive, so it is neither stopped nor are its node's workers marked unreachable."""
    with transaction(fleet.engine) as session:
        agent_id = session.execute(text(
            "INSERT INTO agents (node_id, host, pid, driver, heartbeat_at) SELECT id, 'elsewhere', 1, 'fake', "
            "pearl_now() - interval '1 hour' FROM nodes WHERE name = 'node-a' RETURNING id")).scalar_one()
    beat = fleet.engine.connect()
    beat.begin()
    beat.execute(text("UPDATE agents SET heartbeat_at = pearl_now() WHERE id = :a"), {"a": agent_id})
    reports: list[reaper.ReapReport] = []
    passing = threading.Thread(target=lambda: reports.append(reaper.reap(fleet.engine, agent_timeout_s=30.0)))
    passing.start()
    try:
        _wait_for(lambda: _waiting_on_a_lock(fleet.engine))  # the pass found it silent and waits for its row
    finally:
        beat.commit()
        beat.close()
        passing.join(timeout=30)
    assert reports and reports[0].silent_agents == () and reports[0].unreachable_workers == ()
    assert _agent_rows(fleet.engine) == [(agent_id, None)]


def _waiting_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                      "AND wait_event_type = 'Lock'")).scalar())


def _agent_rows(engine: Engine) -> list[tuple[int, str | None]]:
    with engine.connect() as conn:
        return [(i, None if stopped is None else "stopped") for i, stopped in conn.execute(
            text("SELECT id, stopped_at FROM agents ORDER BY id"))]


def _silent(engine: Engine, agent: Agent, for_s: float) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(text("SELECT heartbeat_at < pearl_now() - make_interval(secs => :s) FROM agents "
                                      "WHERE id = :a"), {"s": for_s, "a": agent.registration.agent_id}).scalar())


def _claim_passes(agent: Agent) -> list[int]:
    """Count the agent's claim passes from now on (one counter, read as `passes[0]`)."""
    passes, claim = [0], agent._claim

    def counted() -> None:
        claim()
        passes[0] += 1

    agent._claim = counted  # type: ignore[method-assign]
    return passes


def test_an_applied_plan_is_claimed_without_a_heartbeat_first(fleet: Fleet) -> None:
    """Only a failed plan needs the steps in hand renewed at once; an applied or finished plan wakes the
    agent to claim, not to heartbeat (a commit that would delay every first claim)."""
    agent = fleet.start("node-a", heartbeat_s=60.0, poll_s=60.0)
    _wait_for(lambda: agent.registration is not None)

    def beat() -> object:
        with fleet.engine.connect() as conn:
            return conn.execute(text("SELECT heartbeat_at FROM agents WHERE id = :a"),
                                {"a": agent.registration.agent_id}).scalar()

    first = beat()
    deadline = time.monotonic() + 10
    while True:  # the first pass of the loop (its heartbeat) is over once the beat stays put
        time.sleep(0.3)
        now = beat()
        if now == first:
            break
        first = now
        assert time.monotonic() < deadline, "the agent keeps heartbeating"
    summary = apply_and_wait(fleet.engine, Target(frozenset({1, 2}), {Role.COLOCATED: 2}), timeout_s=20)
    assert summary["status"] == "succeeded", summary["error"]
    assert beat() == first


def _step(engine: Engine, plan_id: int, key: str) -> dict:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT * FROM plan_steps WHERE plan_id = :p AND key = :k"),
                                 {"p": plan_id, "k": key}).mappings().one())


def _wait_for(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_succeeded_plan_never_applies_again_not_even_by_raw_sql(fleet: Fleet) -> None:
    fleet.start("node-a")
    fleet.start("node-b")
    assert apply_and_wait(fleet.engine, target(colocated=4))["status"] == PlanStatus.SUCCEEDED.value
    with pytest.raises(IllegalTransition, match="illegal plan transition: plan 1 succeeded -> applying"):
        with transaction(fleet.engine) as session:
            session.execute(text("UPDATE plans SET status = 'applying' WHERE id = 1"))


def test_status_shows_the_agents_and_who_holds_each_step_in_progress(fleet: Fleet) -> None:
    fleet.servers.hang_launch.set()
    agent = fleet.start("node-a")
    plan_id = propose(fleet.engine, Target(frozenset({1}), {Role.COLOCATED: 1}))
    plan_store.apply(fleet.engine, plan_id)
    _wait_for(lambda: _step(fleet.engine, plan_id, "w1.start")["status"] == "running")
    status = read_fleet_status(fleet.engine)
    fleet.servers.hang_launch.clear()
    assert agent.registration is not None
    (row,) = [a for a in status["agents"] if a["id"] == agent.registration.agent_id]
    assert row["node"] == "node-a" and row["driver"] == "fake" and row["stopped_at"] is None
    assert 0 <= row["heartbeat_age_s"] < 5
    assert status["plan"]["id"] == plan_id
    (running,) = status["plan"]["running"]
    assert (running["key"], running["agent"], running["node"]) == ("w1.start", agent.registration.agent_id, "node-a")
    assert status["router"] is None  # no front door registered in this fleet


def test_pearlctl_reap_rescues_a_dead_agents_step(fleet: Fleet, database_url: str, tmp_path) -> None:
    from pearl.cli.app import app
    from typer.testing import CliRunner

    fleet.servers.hang_launch.set()
    dead = fleet.start("node-a", lease_s=0.5, reap_every_s=3600)  # it will not reap by itself
    plan_id = propose(fleet.engine, Target(frozenset({1}), {Role.COLOCATED: 1}))
    plan_store.apply(fleet.engine, plan_id)
    _wait_for(lambda: _step(fleet.engine, plan_id, "w1.start")["status"] == "running")
    # it dies: it renews and claims nothing any more (its thread stays stuck in the hung launch)
    dead._heartbeat = lambda: None  # type: ignore[method-assign]
    dead._claim = lambda: None  # type: ignore[method-assign]
    try:
        time.sleep(1.0)
        env = {"PEARL_DATABASE_URL": database_url, "PEARL_HOME": str(tmp_path)}
        done = CliRunner().invoke(app, ["reap", "--json", "--agent-timeout", "60"], env=env)
        assert done.exit_code == 0, done.output
        out = json.loads(done.stdout)
        assert out["rescued"] == [{"step": _step(fleet.engine, plan_id, "w1.start")["id"], "status": "ready"}]
        assert out["failed_plans"] == [] and out["silent_agents"] == []
        again = CliRunner().invoke(app, ["reap"], env=env)
        assert again.exit_code == 0 and "nothing to reap" in again.stdout
    finally:
        fleet.servers.hang_launch.clear()


@pytest.mark.parametrize("sqlstate", ["40001", "57014", "08006"])
def test_a_database_error_inside_a_step_runs_the_step_again_and_fails_no_plan(fleet: Fleet, sqlstate: str) -> None:
    """The database gives up on the statement that reports a step's success (a serialization failure,
    a cancelled statement, a dropped connection): the step's handler runs again, the plan succeeds."""
    refuse_first(fleet.engine, "fail_once", "plan_steps", "UPDATE", [sqlstate] * 3,
                 when="NEW.status = 'succeeded' AND OLD.status = 'running'")
    fleet.start("node-a")
    fleet.start("node-b")
    summary = apply_and_wait(fleet.engine, target(colocated=4))
    assert summary["status"] == "succeeded", summary["error"]
    assert refused(fleet.engine, "fail_once") > 3  # the injected failures hit
    with fleet.engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM plans WHERE status = 'failed'")).scalar() == 0
