"""Least privilege (migration 0012, controlplane/store/roles.py): each component's database role may do
its job and nothing past it. Logins as the roles themselves against the test server (trust auth on
the embedded server and on the machine's PostgreSQL)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Callable, Iterator

import pytest
from agent_support import ALL, FAST, TWO_NODES, FakeDriver, FakeFrontDoor, FakeServers
from pearl.agents.agent import Agent, AgentConfig
from pearl.controlplane.core.domain import Activity, PlanStatus, Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.errors import ClaimLost, NodeTaken, NotPermitted
from pearl.controlplane.store import invariants, plan_store, roles
from pearl.controlplane.store.db import make_engine, transaction
from pearl.controlplane.store.secrets import token_matches
from pearl.controlplane.store.step_effects import claimed_step
from plan_support import import_cluster, propose
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError

pytestmark = pytest.mark.integration



class Logins:
    """Engines logged in as pearl's roles on the test database; disposed at the end."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engines: list[Engine] = []

    def as_role(self, role: str) -> Engine:
        engine = make_engine(make_url(self.url).set(username=role).render_as_string(hide_password=False))
        self.engines.append(engine)
        return engine

    def dispose(self) -> None:
        for engine in self.engines:
            engine.dispose()


@pytest.fixture
def logins(database_url: str, db_engine: Engine) -> Iterator[Logins]:
    import_cluster(db_engine, TWO_NODES)
    for node in ("node-a", "node-b"):
        roles.ensure_node_role(db_engine, node)
    found = Logins(database_url)
    try:
        yield found
    finally:
        found.dispose()


def _refused(engine: Engine, sql: str, **params: object) -> str:
    """The database's refusal of `sql` (42501, insufficient privilege), as its message."""
    with pytest.raises((ProgrammingError, NotPermitted)) as caught, engine.begin() as conn:
        conn.execute(text(sql), params)
    exc = caught.value
    if isinstance(exc, ProgrammingError):
        assert exc.orig.sqlstate == "42501", exc
    return str(exc)


def _applying_plan(engine: Engine, target: Target) -> int:
    plan_id = propose(engine, target)
    plan_store.apply(engine, plan_id)
    return plan_id


def test_roles_and_node_roles_exist_with_the_migration(db_engine: Engine, logins: Logins) -> None:
    with db_engine.connect() as conn:
        found = dict(conn.execute(text(
            "SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname LIKE 'pearl\\_%'")).all())
        owners = set(conn.scalars(text(
            "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = current_schema()")))
        mapped = dict(conn.execute(text(
            "SELECT r.role_name, n.name FROM node_roles r JOIN nodes n ON n.id = r.node_id")).all())
    assert {"pearl_owner", "pearl_policy", "pearl_agent", "pearl_frontdoor", "pearl_audit"} <= set(found)
    assert found["pearl_owner"] is False and found["pearl_agent"] is False and found["pearl_policy"] is True
    assert owners == {"pearl_owner"}  # no table belongs to a superuser or to a component
    assert mapped == {roles.node_role("node-a"): "node-a", roles.node_role("node-b"): "node-b"}
    assert roles.node_role("x" * 63) != roles.node_role("x" * 62 + "y") and len(roles.node_role("x" * 63)) <= 63


def test_an_agent_role_cannot_touch_another_nodes_steps_or_workers(db_engine: Engine, logins: Logins) -> None:
    plan_id = _applying_plan(db_engine, Target(ALL, {Role.COLOCATED: 4}, reason="test"))
    agent_a = logins.as_role(roles.node_role("node-a"))
    with db_engine.connect() as conn:
        ids = dict(conn.execute(text("SELECT name, id FROM nodes")).all())
        b_step = conn.execute(text("SELECT id, key FROM plan_steps WHERE node_id = :b AND status = 'ready' "
                                   "ORDER BY id LIMIT 1"), {"b": ids["node-b"]}).one()
    # claiming node-b's step by hand, or through the claim query with node-b's id, is refused
    message = _refused(agent_a, "UPDATE plan_steps SET status = 'running', fence = nextval('plan_step_fence'), "
                                "lease_until = now() + interval '1 minute', attempts = attempts + 1 WHERE id = :s",
                       s=b_step.id)
    assert "node-b" not in message or "cannot claim" in message
    with pytest.raises(NotPermitted), transaction(agent_a) as session:
        plan_store.claim_steps(session, ids["node-b"], None, lease_s=5, limit=4)
    # its own node's steps it claims
    with transaction(agent_a) as session:
        mine = plan_store.claim_steps(session, ids["node-a"], None, lease_s=5, limit=4)
    assert mine and {r["node_id"] for r in mine} == {ids["node-a"]}
    # node-b's workers, agents and GPUs' leases: refused
    _refused(agent_a, "UPDATE workers SET endpoint = 'http://127.0.0.1:1' WHERE node_id = :b", b=ids["node-b"])
    _refused(agent_a, "INSERT INTO agents (node_id, host, pid, driver) VALUES (:b, 'h', 1, 'sim')", b=ids["node-b"])
    # a step of node-b claimed by node-b's agent cannot be reported by node-a's
    agent_b = logins.as_role(roles.node_role("node-b"))
    with transaction(agent_b) as session:
        theirs = plan_store.claim_steps(session, ids["node-b"], None, lease_s=5, limit=4)
    assert theirs
    step = theirs[0]
    with pytest.raises((NotPermitted, ClaimLost)), transaction(agent_a) as session:
        claimed_step(session, step["id"], step["fence"])
        session.execute(text("UPDATE plan_steps SET status = 'failed', finished_at = now() WHERE id = :s"),
                        {"s": step["id"]})
    # nor can it write a plan of its own (only the cleanup of a failed one)
    _refused(agent_a, "INSERT INTO plans (status, base_version) VALUES ('proposed', 0)")
    with db_engine.connect() as conn:
        assert conn.scalar(text("SELECT status FROM plans WHERE id = :p"), {"p": plan_id}) == "applying"
        assert conn.scalar(text("SELECT status FROM plan_steps WHERE id = :s"), {"s": step["id"]}) == "running"


def test_an_agent_gives_up_only_its_own_nodes_leadership(db_engine: Engine, logins: Logins) -> None:
    """A restarted agent expires the leader lease its dead predecessor on the node held; no other."""
    with db_engine.begin() as conn:
        conn.execute(text("INSERT INTO leader_leases (name, holder, acquired_at, expires_at) VALUES "
                          "('reaper', 'h:1:node-a', now(), now() + interval '1 minute'), "
                          "('other', 'h:2:node-b', now(), now() + interval '1 minute')"))
    agent_a = logins.as_role(roles.node_role("node-a"))
    with agent_a.begin() as conn:
        conn.execute(text("UPDATE leader_leases SET expires_at = now() WHERE holder = 'h:1:node-a'"))
    _refused(agent_a, "UPDATE leader_leases SET expires_at = now() WHERE holder = 'h:2:node-b'")
    _refused(agent_a, "UPDATE leader_leases SET expires_at = now() + interval '1 hour' WHERE name = 'reaper'")
    _refused(agent_a, "UPDATE leader_leases SET holder = 'h:9:node-a' WHERE name = 'other'")
    with db_engine.begin() as conn:
        conn.execute(text("UPDATE leader_leases SET holder = 'loop:h:node-a' WHERE name = 'other'"))
    _refused(agent_a, "UPDATE leader_leases SET expires_at = now() WHERE name = 'other'")  # not the reaper's
    with db_engine.connect() as conn:
        left = dict(conn.execute(text("SELECT name, expires_at > now() FROM leader_leases")).all())
    assert left == {"reaper": False, "other": True}


def test_no_component_writes_gpus_the_audit_log_or_the_triggers(db_engine: Engine, logins: Logins) -> None:
    agent_a = logins.as_role(roles.node_role("node-a"))
    policy, frontdoor, audit = (logins.as_role(r) for r in ("pearl_policy", "pearl_frontdoor", "pearl_audit"))
    with db_engine.connect() as conn:
        b_worker = conn.scalar(text("SELECT w.id FROM workers w JOIN nodes n ON n.id = w.node_id "
                                    "WHERE n.name = 'node-b' ORDER BY w.id LIMIT 1"))
        before = conn.scalar(text("SELECT count(*) FROM events"))
    for engine in (agent_a, frontdoor, audit):
        _refused(engine, "UPDATE gpus SET state = 'unavailable' WHERE id = 1")
    # through the functions: an agent only for its own node's workers; the audit role not at all
    _refused(agent_a, "SELECT pearl_hold_slot(:w, 'bound')", w=b_worker)
    _refused(agent_a, "SELECT pearl_free_held(:w)", w=b_worker)
    _refused(audit, "SELECT pearl_drain_held(1)")
    for engine in (agent_a, policy, frontdoor, audit):
        _refused(engine, "DELETE FROM events")
        _refused(engine, "INSERT INTO events (state_version, entity, entity_id, op) VALUES (0, 'gpus', '1', 'update')")
        _refused(engine, "TRUNCATE events")
        _refused(engine, "UPDATE fleet SET model = 'x'")
        _refused(engine, "SELECT setval('fleet_versions', 0)")  # the version only moves forward, by triggers
        _refused(engine, "ALTER TABLE workers DISABLE TRIGGER workers_guard")
        _refused(engine, "ALTER TABLE events DISABLE TRIGGER ALL")
        _refused(engine, "SET session_replication_role = replica")
        _refused(engine, "DROP TRIGGER events_append_only ON events")
        _refused(engine, "INSERT INTO node_roles (role_name, node_id) VALUES ('x', 1)")
    _refused(frontdoor, "UPDATE workers SET endpoint = NULL WHERE id = 1")
    _refused(audit, "UPDATE routers SET mode = 'split'")
    _refused(audit, "SELECT value FROM control_secrets")
    with db_engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM events")) == before
        token = conn.scalar(text("SELECT value FROM control_secrets WHERE name = 'control'"))
    # the audit role checks a token without reading it
    assert token_matches(audit, token) and not token_matches(audit, token + "x")


def test_agents_on_their_node_roles_enact_plans_and_the_audit_names_them(db_engine: Engine, logins: Logins) -> None:
    servers, front_door = FakeServers(), FakeFrontDoor()
    reaper = logins.as_role("pearl_policy")
    started: list[tuple[Agent, threading.Thread]] = []
    for node in ("node-a", "node-b"):
        agent = Agent(logins.as_role(roles.node_role(node)), AgentConfig(node=node, driver="fake", **FAST),
                      FakeDriver(servers, node), client=servers.client, front_door=lambda: front_door,
                      reaper_engine=reaper)
        thread = threading.Thread(target=_run, args=(agent,), daemon=True)
        thread.start()
        started.append((agent, thread))
    try:
        policy = logins.as_role("pearl_policy")
        for counts in ({Role.COLOCATED: 4}, {Role.PREFILL: 2, Role.DECODE: 2}, {Role.COLOCATED: 4}):
            plan_id = propose(policy, Target(ALL, counts, reason="test"))
            plan_store.apply(policy, plan_id)
            summary = plan_store.wait_plan(policy, plan_id, timeout_s=30, poll_s=0.05)
            assert summary["status"] == PlanStatus.SUCCEEDED.value, summary["error"]
    finally:
        for agent, _ in started:
            agent.stop()
        for _, thread in started:
            thread.join(timeout=30)
    with db_engine.connect() as conn:
        serving = dict(conn.execute(text("SELECT role, count(*) FROM workers WHERE activity = :a GROUP BY role"),
                                    {"a": Activity.ACTIVE.value}).all())
        writers = dict(conn.execute(text(
            "SELECT db_user, count(*) FROM events WHERE entity = 'gpus' GROUP BY db_user")).all())
    assert serving == {Role.COLOCATED.value: 4}
    # the GPUs were taken and given back by the agents' own logins, through the owner's functions
    assert set(writers) >= {roles.node_role("node-a"), roles.node_role("node-b")}
    assert invariants.check(db_engine).ok


def test_login_url_follows_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "postgresql+psycopg://postgres@/pearl?host=/tmp/x"
    monkeypatch.setenv("PEARL_DATABASE_ROLES", "component")
    assert make_url(roles.login_url(url, "agent", "node-a")).username == "pearl_agent_node-a"
    assert make_url(roles.login_url(url, "audit")).username == "pearl_audit"
    assert make_url(roles.login_url(url, "owner")).username == "postgres"
    monkeypatch.setenv("PEARL_DATABASE_ROLES", "url")
    assert roles.login_url(url, "policy") == url
    monkeypatch.setenv("PEARL_DATABASE_ROLES", "everyone")
    with pytest.raises(Exception, match="PEARL_DATABASE_ROLES"):
        roles.login_url(url, "policy")


def _run(agent: Agent) -> None:
    with contextlib.suppress(NodeTaken):
        agent.run()


def test_db_roles_creates_the_agents_roles_and_names_a_bad_node(
        db_engine: Engine, pearlctl: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    import_cluster(db_engine, TWO_NODES)
    made = pearlctl("db", "roles", "--json")
    assert made.returncode == 0, made.stderr
    listing = json.loads(made.stdout)
    assert listing["agents"] == {"node-a": roles.node_role("node-a"), "node-b": roles.node_role("node-b")}
    assert listing["components"] == {"policy": "pearl_policy", "frontdoor": "pearl_frontdoor", "audit": "pearl_audit"}
    again = pearlctl("db", "roles", "--node", "node-a", "--json")  # idempotent
    assert again.returncode == 0 and json.loads(again.stdout)["agents"] == {"node-a": roles.node_role("node-a")}
    missing = pearlctl("db", "roles", "--node", "node-z")
    assert missing.returncode == 2 and "node-z" in missing.stderr
    with db_engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM node_roles")) == 2
