"""What `pearlctl status` shows: the fleet at one state_version, as one JSON-ready dict.

Keys (docs/formats.md): `state_version`, `gpus` {`total`, `by_zone`, `by_state`}, `workers` [ {`id`, `node`,
`gpus`, `role`, `activity`, `zone`, `weights_version`} ], `plan` (latest or null), `leases` [].
Also `cluster` (model, gpu, tp, imported_at), `gpus.by_zone_state` (zone -> state -> count), the
plan's steps in progress with the agent holding each claim (`plan.running`), the node agents with
the age of their heartbeat (`agents`), and the front door (`router`: url, mode, started_at, stopped_at,
heartbeat_age_s, running: not stopped and heard from within `routers.SILENT_S`; null when none was ever
registered), and where every live process serves Prometheus metrics (`metrics`: [ {`component`, `node`,
`url`} ], `metrics_endpoints.live`).
Weights: `trainer_version` (the newest version the trainer produced), each worker's `weights_lag`
(versions behind it) and its newest weight sync (`sync`: version, state, error; null without one).
A slot whose server failed to start shows until when it is left out of targets (`start_backoff_until`,
null when it is not backing off: `snapshot.start_backoffs`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from pearl.controlplane.core.domain import StepStatus
from pearl.controlplane.store import metrics_endpoints, routers
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import GPU, Agent, Fleet, Lease, Node, Plan, PlanStep, Router, Worker
from pearl.controlplane.store.snapshot import start_backoffs
from pearl.controlplane.store.step_effects import trainer_version
from pearl.controlplane.store.transitions import state_version
from pearl.controlplane.store.weights import last_sync_states
from sqlalchemy import Engine, func, or_, select
from sqlalchemy.orm import Session


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def _latest_plan(session: Session) -> dict[str, Any] | None:
    plan = session.scalars(select(Plan).order_by(Plan.id.desc()).limit(1)).first()
    if plan is None:
        return None
    steps = dict(
        session.execute(
            select(PlanStep.status, func.count()).where(PlanStep.plan_id == plan.id).group_by(PlanStep.status)
        ).all()
    )
    return {
        "id": plan.id,
        "status": plan.status.value,
        "base_version": plan.base_version,
        "decision_id": plan.decision_id,
        "d_worker": plan.d_worker,
        "d_role": plan.d_role,
        "created_at": _iso(plan.created_at),
        "applied_at": _iso(plan.applied_at),
        "finished_at": _iso(plan.finished_at),
        "steps": {status.value: n for status, n in sorted(steps.items())},
        "error": plan.error,
        "cleans_up": plan.cleans_up,
        "running": [
            {"key": r.key, "action": r.action.value, "worker": r.worker_id, "node": r.node, "agent": r.claimed_by,
             "attempts": r.attempts, "fence": r.fence, "lease_until": _iso(r.lease_until)}
            for r in session.execute(
                select(PlanStep.key, PlanStep.action, PlanStep.worker_id, Node.name.label("node"), PlanStep.claimed_by,
                       PlanStep.attempts, PlanStep.fence, PlanStep.lease_until)
                .join(Node, Node.id == PlanStep.node_id)
                .where(PlanStep.plan_id == plan.id, PlanStep.status == StepStatus.RUNNING).order_by(PlanStep.id))
        ],
    }


def _agents(session: Session, nodes: dict[int, Node]) -> list[dict[str, Any]]:
    """Agents not stopped, and the latest of each node (stopped or not), with the age of their heartbeat."""
    now = session.scalar(select(func.pearl_now()))
    latest = select(func.max(Agent.id)).group_by(Agent.node_id)
    rows = session.scalars(select(Agent).where(or_(Agent.stopped_at.is_(None), Agent.id.in_(latest)))
                           .order_by(Agent.node_id, Agent.id)).all()
    return [{"id": a.id, "node": nodes[a.node_id].name, "host": a.host, "pid": a.pid, "driver": a.driver,
             "started_at": _iso(a.started_at), "heartbeat_age_s": round((now - a.heartbeat_at).total_seconds(), 3),
             "stopped_at": _iso(a.stopped_at)} for a in rows]


def _router(session: Session) -> dict[str, Any] | None:
    found = session.execute(select(Router, routers.running(), func.pearl_now() - Router.heartbeat_at)
                            .order_by(Router.stopped_at.is_not(None), Router.name).limit(1)).first()
    if found is None:
        return None
    r, running, age = found
    return {"name": r.name, "url": r.url, "admin_url": r.admin_url, "mode": r.mode, "pid": r.pid,
            "host": r.host, "started_at": _iso(r.started_at), "stopped_at": _iso(r.stopped_at),
            "heartbeat_age_s": round(age.total_seconds(), 3), "running": bool(running)}


def fleet_status(session: Session) -> dict[str, Any]:
    """The fleet as `pearlctl status --json` prints it (one consistent snapshot if the session's
    transaction is REPEATABLE READ)."""
    fleet = session.execute(select(Fleet).where(Fleet.id == 1)).scalar_one()
    nodes = {n.id: n for n in session.scalars(select(Node).order_by(Node.id))}
    # plain rows, not ORM objects: at 4,096 GPUs building the objects was half the read
    gpus = session.execute(select(GPU.id, GPU.slot_id, GPU.node_id, GPU.device_index, GPU.zone, GPU.state)
                           .order_by(GPU.node_id, GPU.device_index)).all()
    by_slot: dict[int, list[Any]] = defaultdict(list)
    for g in gpus:
        by_slot[g.slot_id].append(g)
    by_zone_state: dict[str, Counter[str]] = defaultdict(Counter)
    for g in gpus:
        by_zone_state[g.zone.value][g.state.value] += 1
    trainer = trainer_version(session)
    syncs = last_sync_states(session)
    backoffs = start_backoffs(session)
    workers = [
        {
            "id": w.id,
            "node": nodes[w.node_id].name,
            "slot": w.slot,
            "gpus": [g.id for g in by_slot[w.id]],
            "devices": [g.device_index for g in by_slot[w.id]],
            "gpu_states": [g.state.value for g in by_slot[w.id]],
            "role": w.role.value,
            "activity": w.activity.value,
            "zone": w.zone.value,
            "weights_version": w.weights_version,
            "weights_lag": max(0, trainer - w.weights_version),
            "sync": syncs.get(w.id),
            "endpoint": w.endpoint,
            "generation": w.generation,
            "start_backoff_until": _iso(backoffs.get(w.id)),
        }
        for w in session.execute(select(Worker.id, Worker.node_id, Worker.slot, Worker.role, Worker.activity,
                                        Worker.zone, Worker.weights_version, Worker.endpoint, Worker.generation)
                                 .order_by(Worker.id))
    ]
    gpu_by_id = {g.id: g for g in gpus}
    leases = [
        {
            "id": lease.id,
            "kind": lease.kind.value,
            "gpu": lease.gpu_id,
            "node": nodes[gpu_by_id[lease.gpu_id].node_id].name,
            "device": gpu_by_id[lease.gpu_id].device_index,
            "granted_at": _iso(lease.granted_at),
            "deadline": _iso(lease.deadline),
            "training_step": lease.training_step,
        }
        for lease in session.scalars(select(Lease).where(Lease.returned_at.is_(None)).order_by(Lease.id))
    ]
    return {
        "state_version": state_version(session),
        "cluster": {
            "model": fleet.model,
            "gpu": fleet.gpu,
            "tp": fleet.tp,
            "imported_at": _iso(fleet.imported_at),
            "nodes": [
                {"name": n.name, "zone": n.zone.value, "gpus": n.gpu_count, "address": n.address}
                for n in nodes.values()
            ],
        },
        "gpus": {
            "total": len(gpus),
            "by_zone": {zone: sum(c.values()) for zone, c in sorted(by_zone_state.items())},
            "by_state": dict(sorted(Counter(g.state.value for g in gpus).items())),
            "by_zone_state": {zone: dict(sorted(c.items())) for zone, c in sorted(by_zone_state.items())},
        },
        "trainer_version": trainer,
        "workers": workers,
        "plan": _latest_plan(session),
        "leases": leases,
        "agents": _agents(session, nodes),
        "router": _router(session),
        "metrics": metrics_endpoints.live(session),
    }


def read_fleet_status(engine: Engine) -> dict[str, Any]:
    """`fleet_status` in a REPEATABLE READ transaction of its own: every figure at one state_version."""
    with transaction(engine, isolation_level="REPEATABLE READ") as session:
        return fleet_status(session)


def run_summary(engine: Engine) -> dict[str, Any]:
    """What a run of the live system did (the `run_summary` query): plans applied, weight loads,
    borrowed GPUs returned and late, training steps and how long late returns delayed them."""
    from pearl.controlplane.store.queries import query

    with transaction(engine) as session:
        row = session.execute(query("run_summary")).mappings().one()
    return {k: (float(v) if k.endswith("_s") else int(v)) for k, v in row.items()}


def activity_timeline(engine: Engine) -> list[dict[str, Any]]:
    """Every change of a worker's activity or role, in order (the `worker_roles_history` view)."""
    from sqlalchemy import text

    with transaction(engine) as session:
        rows = session.execute(text(
            "SELECT at, worker_id, zone, role, activity FROM worker_roles_history ORDER BY event_id")).mappings()
        return [dict(r) for r in rows]
