"""What `pearlctl status` shows: the fleet at one state_version, as one JSON-ready dict.

Keys (docs/formats.md): `state_version`, `gpus` {`total`, `by_zone`, `by_state`}, `workers` [ {`id`, `node`,
`gpus`, `role`, `activity`, `zone`, `weights_version`} ], `plan` (latest or null), `leases` [].
Also `cluster` (model, gpu, tp, imported_at) and `gpus.by_zone_state` (zone -> state -> count).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import GPU, Fleet, Lease, Node, Plan, PlanStep, Worker
from sqlalchemy import Engine, func, select
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
    }


def fleet_status(session: Session) -> dict[str, Any]:
    """The fleet as `pearlctl status --json` prints it (one consistent snapshot if the session's
    transaction is REPEATABLE READ)."""
    fleet = session.execute(select(Fleet).where(Fleet.id == 1)).scalar_one()
    nodes = {n.id: n for n in session.scalars(select(Node).order_by(Node.id))}
    gpus = session.scalars(select(GPU).order_by(GPU.node_id, GPU.device_index)).all()
    by_slot: dict[int, list[GPU]] = defaultdict(list)
    for g in gpus:
        by_slot[g.slot_id].append(g)
    by_zone_state: dict[str, Counter[str]] = defaultdict(Counter)
    for g in gpus:
        by_zone_state[g.zone.value][g.state.value] += 1
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
            "endpoint": w.endpoint,
            "generation": w.generation,
        }
        for w in session.scalars(select(Worker).order_by(Worker.id))
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
        "state_version": fleet.state_version,
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
        "workers": workers,
        "plan": _latest_plan(session),
        "leases": leases,
    }


def read_fleet_status(engine: Engine) -> dict[str, Any]:
    """`fleet_status` in a REPEATABLE READ transaction of its own: every figure at one state_version."""
    with transaction(engine, isolation_level="REPEATABLE READ") as session:
        return fleet_status(session)
