"""Node agents and leaders as rows: who runs where, who is alive, who leads.

An agent registers a row of `agents` when it starts (its node, host, pid and driver), heartbeats it,
and marks it stopped when it exits cleanly. The reaper (`reaper.py`) treats an agent whose heartbeat
is older than its timeout as gone.

One agent per node: a second one would drive the same servers (the same run directory, the same
GPUs) beside the first. A registration is refused while another agent of the node is alive (not
stopped, heartbeat within the timeout), unless that agent ran on this host and its process is gone
(killed: it is marked stopped, its claims expire and its leaderships end at once, so the new agent
carries its steps on without waiting for their leases). An agent that finds, at a heartbeat, a
newer agent of its node alive (it was silent so long that one took over) is superseded and stops.
Registrations and heartbeats of one node are serialised by a transaction-level advisory lock.

Leadership (the reaper inside the agents, the policy loop) is a row of `leader_leases` held until it
expires unless renewed (`hold_leader_lease`); every time comes from the database's clock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pearl.controlplane.errors import BadInput, NodeTaken
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.queries import query
from pearl.controlplane.store.schema import Agent, Node, Worker
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.orm import Session

DEFAULT_AGENT_TIMEOUT_S = 30.0  # an agent silent this long is gone (the reaper; a new agent may take its node)
_NODE_AGENT_LOCK = 0x70656172  # advisory lock class of "the agents of one node" (key 2: the node id)


@dataclass(frozen=True)
class Registration:
    agent_id: int
    node_id: int
    node: str
    address: str  # the node's address from the inventory (where its servers listen)


def register_agent(engine: Engine, node: str, *, host: str, pid: int, driver: str,
                   agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S) -> Registration:
    """A new `agents` row for this process on `node`. BadInput (naming --node) for an unknown node;
    NodeTaken while another agent of the node is alive (one of this host whose process is gone is
    marked stopped instead)."""
    with transaction(engine, actor=f"agent {node}", reason="agent start") as session:
        row = session.execute(select(Node.id, Node.address).where(Node.name == node)).first()
        if row is None:
            known = sorted(session.scalars(select(Node.name)))
            hint = f" (nodes: {', '.join(known)})" if known else "; import one with `pearlctl cluster import`"
            raise BadInput(f"--node: no node named {node!r} in the inventory{hint}")
        _lock_node_agents(session, row.id)
        for other in _alive_agents(session, row.id, agent_timeout_s):
            if other.host == host and _gone_process(other, pid):  # killed: its row says no more
                _gone(session, other.id, holder_name(other.host, other.pid, node))
                continue
            raise NodeTaken(f"--node: node {node!r} already has a running agent ({_who(other)}); stop it first, "
                            f"or start this one once it has been silent for {agent_timeout_s:g} s", field="--node")
        agent = Agent(node_id=row.id, host=host, pid=pid, driver=driver)
        session.add(agent)
        session.flush()
        _REGISTERED_HERE.add((agent.id, session.scalar(select(Agent.started_at).where(Agent.id == agent.id))))
        return Registration(agent.id, row.id, node, row.address)


def heartbeat(engine: Engine, agent_id: int, agent_timeout_s: float = DEFAULT_AGENT_TIMEOUT_S) -> None:
    """This agent is alive (the database's clock); its node's workers are reachable again. NodeTaken
    when a newer agent of its node is alive: this one was silent long enough to be replaced."""
    with transaction(engine) as session:
        node_id = session.scalar(select(Agent.node_id).where(Agent.id == agent_id))
        if node_id is None:
            raise NodeTaken(f"agent {agent_id}: its row is gone")
        _lock_node_agents(session, node_id)
        newer = [a for a in _alive_agents(session, node_id, agent_timeout_s) if a.id > agent_id]
        if newer:
            raise NodeTaken(f"agent {agent_id}: superseded by a newer agent of its node ({_who(newer[0])})")
        session.execute(update(Agent).where(Agent.id == agent_id)
                        .values(heartbeat_at=func.pearl_now(), stopped_at=None))
        if session.scalar(select(func.count()).where(Worker.node_id == node_id, Worker.unreachable_since.is_not(None))):
            session.execute(text("SELECT set_config('pearl.actor', :a, true)"), {"a": f"agent {agent_id}"})
            session.execute(update(Worker).where(Worker.node_id == node_id, Worker.unreachable_since.is_not(None))
                            .values(unreachable_since=None).execution_options(synchronize_session=False))


_REGISTERED_HERE: set[tuple[int, object]] = set()  # (id, started_at) of the agents this process registered


def _gone_process(other: object, pid: int) -> bool:
    """Whether the agent `other` of this host no longer runs: its pid is gone, or it is this process's
    own pid without being one of its agents (a restarted container's agent keeps pid 1, say)."""
    their = other.pid  # type: ignore[attr-defined]
    if their == pid:
        return (other.id, other.started_at) not in _REGISTERED_HERE  # type: ignore[attr-defined]
    return not process_alive(their)


def holder_name(host: str, pid: int, node: str) -> str:
    """How the agent `pid` on `host` running `node` names itself as a leader (`hold_leader_lease`)."""
    return f"{host}:{pid}:{node}"


def _gone(session: Session, agent_id: int, holder: str) -> None:
    """An agent whose process is known to be gone: stopped, its claims expired now and its leaderships
    given up, so the next reaper pass (the new agent's first) hands its steps on at once instead of
    after their leases and the leader lease run out. Its fences stay: nothing it did is undone."""
    session.execute(update(Agent).where(Agent.id == agent_id).values(stopped_at=func.pearl_now()))
    session.execute(text("UPDATE plan_steps SET lease_until = pearl_now() WHERE claimed_by = :a "
                         "AND status = 'running' AND lease_until > pearl_now()"), {"a": agent_id})
    session.execute(text("UPDATE leader_leases SET expires_at = pearl_now() WHERE holder = :h "
                         "AND expires_at > pearl_now()"), {"h": holder})


def process_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def _lock_node_agents(session: Session, node_id: int) -> None:
    session.execute(text("SELECT pg_advisory_xact_lock(:c, :n)"), {"c": _NODE_AGENT_LOCK, "n": node_id})


def _alive_agents(session: Session, node_id: int, timeout_s: float) -> list:
    return list(session.execute(text(
        "SELECT id, host, pid, started_at, extract(epoch FROM pearl_now() - heartbeat_at) AS age_s FROM agents "
        "WHERE node_id = :n AND stopped_at IS NULL AND heartbeat_at >= pearl_now() - make_interval(secs => :t) "
        "ORDER BY id"), {"n": node_id, "t": timeout_s}))


def _who(agent: object) -> str:
    return (f"agent {agent.id}, pid {agent.pid} on {agent.host}, "  # type: ignore[attr-defined]
            f"heartbeat {float(agent.age_s):.1f} s ago")  # type: ignore[attr-defined]


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
