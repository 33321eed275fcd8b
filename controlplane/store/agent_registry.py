"""Node agents and leaders as rows: who runs where, who is alive, who leads.

An agent registers a row of `agents` when it starts (its node, host, pid and driver), heartbeats it,
and marks it stopped when it exits cleanly. The reaper (`reaper.py`) treats an agent whose heartbeat
is older than its timeout as gone. Leadership (the reaper inside the agents, the policy loop) is a
row of `leader_leases` held until it expires unless renewed (`hold_leader_lease`); every time
comes from the database's clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from pearl.controlplane.errors import BadInput
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import Agent, Node, Worker
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.orm import Session


@dataclass(frozen=True)
class Registration:
    agent_id: int
    node_id: int
    node: str
    address: str  # the node's address from the inventory (where its servers listen)


def register_agent(engine: Engine, node: str, *, host: str, pid: int, driver: str) -> Registration:
    """A new `agents` row for this process on `node`. BadInput (naming --node) for an unknown node."""
    with transaction(engine, actor=f"agent {node}", reason="agent start") as session:
        row = session.execute(select(Node.id, Node.address).where(Node.name == node)).first()
        if row is None:
            known = sorted(session.scalars(select(Node.name)))
            hint = f" (nodes: {', '.join(known)})" if known else "; import one with `pearlctl cluster import`"
            raise BadInput(f"--node: no node named {node!r} in the inventory{hint}")
        agent = Agent(node_id=row.id, host=host, pid=pid, driver=driver)
        session.add(agent)
        session.flush()
        return Registration(agent.id, row.id, node, row.address)


def heartbeat(engine: Engine, agent_id: int) -> None:
    """This agent is alive (the database's clock); its node's workers are reachable again."""
    with transaction(engine) as session:
        node_id = session.execute(
            update(Agent).where(Agent.id == agent_id)
            .values(heartbeat_at=func.pearl_now(), stopped_at=None).returning(Agent.node_id)
        ).scalar_one()
        if session.scalar(select(func.count()).where(Worker.node_id == node_id, Worker.unreachable_since.is_not(None))):
            session.execute(text("SELECT set_config('pearl.actor', :a, true)"), {"a": f"agent {agent_id}"})
            session.execute(update(Worker).where(Worker.node_id == node_id, Worker.unreachable_since.is_not(None))
                            .values(unreachable_since=None).execution_options(synchronize_session=False))


def mark_stopped(engine: Engine, agent_id: int) -> None:
    """The agent exits cleanly."""
    with transaction(engine) as session:
        session.execute(update(Agent).where(Agent.id == agent_id).values(stopped_at=func.pearl_now()))


def hold_leader_lease(engine: Engine, name: str, holder: str, ttl_s: float) -> bool:
    """Take or renew leadership `name` for `ttl_s` seconds; True while `holder` leads."""
    with transaction(engine) as session:
        row = session.execute(query("hold_leader_lease"), {"name": name, "holder": holder, "ttl_s": ttl_s}).first()
        return row is not None


def release_leader_lease(engine: Engine, name: str, holder: str) -> None:
    """Give leadership `name` up at once (a clean exit), if `holder` has it."""
    with transaction(engine) as session:
        session.execute(text("UPDATE leader_leases SET expires_at = pearl_now() WHERE name = :n AND holder = :h"),
                        {"n": name, "h": holder})


def leader(session: Session, name: str) -> str | None:
    """Who holds leadership `name` now (None: nobody, or the lease ran out)."""
    return session.scalar(text("SELECT holder FROM leader_leases WHERE name = :n AND expires_at > pearl_now()"),
                          {"n": name})
