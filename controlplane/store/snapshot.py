"""The one place that maps the database's worker and GPU rows to the decision core's `FleetSnapshot`."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from pearl.controlplane.core.domain import GPUState, LeaseKind, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot
from pearl.controlplane.store.schema import GPU, Fleet, Lease, Node, Worker
from sqlalchemy import select
from sqlalchemy.orm import Session


def _available(zone: WorkerZone, worker_id: int, gpus: list[GPU], under_notice: set[int]) -> bool:
    """Whether the slot's GPUs can host an active rollout worker now.

    Dedicated: every GPU free or bound to this worker, none under a revocation notice. Overlap: every
    GPU free (not training) or borrowed by this worker (not being returned).
    """
    if not gpus:
        return False
    held = GPUState.BORROWED if zone is WorkerZone.OVERLAP else GPUState.BOUND
    for g in gpus:
        if g.id in under_notice:
            return False
        if not (g.state is GPUState.FREE or (g.state is held and g.worker_id == worker_id)):
            return False
    return True


def revocation_notices(session: Session) -> dict[int, tuple[int, datetime]]:
    """GPUs under a revocation notice (a preemptible GPU whose open lease has a deadline):
    gpu id -> (its worker slot, the deadline)."""
    rows = session.execute(
        select(GPU.id, GPU.slot_id, Lease.deadline)
        .join(Lease, Lease.gpu_id == GPU.id)
        .where(Lease.returned_at.is_(None), Lease.kind == LeaseKind.PREEMPTIBLE, Lease.deadline.is_not(None))
    )
    return {gpu: (slot, deadline) for gpu, slot, deadline in rows}


def load_snapshot(session: Session) -> FleetSnapshot:
    """Every worker slot at the current `state_version`, read in the session's transaction.

    Use a REPEATABLE READ transaction (or hold the fleet row) when the version must match the rows.
    """
    fleet = session.execute(select(Fleet).where(Fleet.id == 1)).scalar_one()
    gpus_by_slot: dict[int, list[GPU]] = defaultdict(list)
    for gpu in session.scalars(select(GPU).order_by(GPU.slot_id, GPU.device_index)):
        gpus_by_slot[gpu.slot_id].append(gpu)
    under_notice = set(revocation_notices(session))
    rows = session.execute(select(Worker, Node.name).join(Node, Node.id == Worker.node_id).order_by(Worker.id))
    slots = []
    for worker, node_name in rows:
        gpus = gpus_by_slot.get(worker.id, [])
        slots.append(
            WorkerSlot(
                id=worker.id,
                node=node_name,
                gpus=tuple(g.id for g in gpus),
                zone=worker.zone,
                role=worker.role,
                activity=worker.activity,
                weights_version=worker.weights_version,
                available=_available(worker.zone, worker.id, gpus, under_notice),
            )
        )
    return FleetSnapshot(state_version=fleet.state_version, workers=tuple(slots), tp=fleet.tp or 1)
