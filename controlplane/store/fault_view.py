"""The reads the fault matrix judges a live run by (agents/faults.py): whether the fleet is back, what
was under way when the fault came, and what the run left in the rows and the audit log."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pearl.controlplane.store.db import transaction
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url


@dataclass(frozen=True)
class FleetHealth:
    agents: frozenset[tuple[str, int]]  # (node, pid) of agents registered and heartbeating (5 s)
    metrics_pids: frozenset[int]  # processes whose metrics endpoint heartbeated in the last 10 s
    policy_leader: str | None  # the holder of the policy loop's leader lease, while it holds
    expired_claims: int  # running steps past their lease
    front_door: str | None  # the live front door's URL
    serving: tuple[str, ...]  # the endpoints of the workers in service


def fleet_health(engine: Engine) -> FleetHealth:
    with transaction(engine) as session:
        agents = frozenset(session.execute(text(
            "SELECT n.name, a.pid FROM agents a JOIN nodes n ON n.id = a.node_id WHERE a.stopped_at IS NULL "
            "AND a.heartbeat_at > pearl_now() - interval '5 seconds'")).tuples())
        pids = frozenset(session.scalars(text(
            "SELECT pid FROM metrics_endpoints WHERE heartbeat_at > pearl_now() - interval '10 seconds'")))
        leader = session.scalar(text("SELECT holder FROM leader_leases WHERE name = 'policy' "
                                     "AND expires_at > pearl_now()"))
        expired = session.scalar(text("SELECT count(*) FROM plan_steps WHERE status = 'running' "
                                      "AND lease_until < pearl_now()")) or 0
        front_door = session.scalar(text("SELECT url FROM routers WHERE stopped_at IS NULL "
                                         "ORDER BY started_at DESC LIMIT 1"))
        serving = tuple(session.scalars(text("SELECT endpoint FROM workers WHERE activity = 'active' "
                                             "AND endpoint IS NOT NULL ORDER BY id")))
    return FleetHealth(agents, pids, leader, int(expired), front_door, serving)


def under_way(engine: Engine) -> dict[str, bool]:
    """Whether a plan applies and a weight sync is queued or running now."""
    with transaction(engine) as session:
        row = session.execute(text(
            "SELECT EXISTS (SELECT 1 FROM plans WHERE status = 'applying') AS plan_applying, "
            "EXISTS (SELECT 1 FROM weight_syncs WHERE state IN ('queued', 'running')) AS sync_in_flight")).one()
    return {"plan_applying": bool(row.plan_applying), "sync_in_flight": bool(row.sync_in_flight)}


def serving_weights(engine: Engine) -> list[tuple[int, str, int]]:
    """(worker, endpoint, weights version) of every worker in service."""
    with transaction(engine) as session:
        return [tuple(r) for r in session.execute(text(
            "SELECT id, endpoint, weights_version FROM workers WHERE activity = 'active' AND endpoint IS NOT NULL "
            "ORDER BY id"))]


def failed_plans(engine: Engine) -> list[tuple[int, str | None]]:
    with transaction(engine) as session:
        return [tuple(r) for r in session.execute(text("SELECT id, error FROM plans WHERE status = 'failed' "
                                                       "ORDER BY id"))]


def steps_succeeded_twice(engine: Engine) -> int:
    """Steps whose success the audit log records more than once."""
    with transaction(engine) as session:
        return int(session.scalar(text("""
            SELECT count(*) FROM (SELECT entity_id FROM events WHERE entity = 'plan_steps' AND op = 'update'
                                  AND new->>'status' = 'succeeded' AND old->>'status' IS DISTINCT FROM 'succeeded'
                                  GROUP BY entity_id HAVING count(*) > 1) twice""")) or 0)


def through_proxy(database: str, port: int) -> str:
    """`database` reached at 127.0.0.1:`port` (a proxy in front of its server)."""
    url = make_url(database)
    query = {k: v for k, v in url.query.items() if k != "host"}
    return url.set(host="127.0.0.1", port=port, query=query).render_as_string(hide_password=False)


def server_address(database: str) -> str | tuple[str, int]:
    """Where `database`'s server listens: its unix socket's path, or (host, port)."""
    url = make_url(database)
    socket_dir = url.query.get("host")
    if socket_dir:
        found = [p for p in sorted(Path(str(socket_dir)).glob(".s.PGSQL.*")) if not p.name.endswith(".lock")]
        return str(found[0])
    return (url.host or "127.0.0.1", url.port or 5432)
