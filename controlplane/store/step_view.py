"""The worker as a plan step needs it: its slot, where it runs, and the weights it should serve."""

from __future__ import annotations

from dataclasses import dataclass

from pearl.controlplane.core.domain import Activity, Role, WorkerZone
from pearl.controlplane.store.schema import GPU, Fleet, Node, TrainingStep, Worker
from sqlalchemy import select
from sqlalchemy.orm import Session


@dataclass(frozen=True)
class WorkerView:
    id: int
    node: str
    zone: WorkerZone
    role: Role
    activity: Activity
    generation: int
    weights_version: int
    endpoint: str | None
    devices: tuple[int, ...]  # CUDA indices of its slot's GPUs on the node
    tp: int
    model: str
    gpu: str
    trainer_version: int  # the newest weights version the trainer produced (0: initial weights)
    snapshot: str | None  # where that version's weights are


def worker_view(session: Session, worker_id: int) -> WorkerView:
    w, node = session.execute(
        select(Worker, Node.name).join(Node, Node.id == Worker.node_id).where(Worker.id == worker_id)
        .execution_options(populate_existing=True)
    ).one()
    devices = tuple(session.scalars(select(GPU.device_index).where(GPU.slot_id == worker_id)
                                    .order_by(GPU.device_index)))
    fleet = session.execute(select(Fleet.model, Fleet.gpu, Fleet.tp).where(Fleet.id == 1)).one()
    latest = session.execute(
        select(TrainingStep.weights_version, TrainingStep.snapshot).where(TrainingStep.weights_version.is_not(None))
        .order_by(TrainingStep.weights_version.desc()).limit(1)
    ).first()
    return WorkerView(
        id=w.id, node=node, zone=w.zone, role=w.role, activity=w.activity, generation=w.generation,
        weights_version=w.weights_version, endpoint=w.endpoint, devices=devices, tp=fleet.tp or len(devices),
        model=fleet.model or "", gpu=fleet.gpu or "",
        trainer_version=int(latest.weights_version) if latest else 0, snapshot=latest.snapshot if latest else None,
    )


def decode_peer_endpoints(session: Session, worker_id: int, limit: int = 3) -> list[str]:
    """Endpoints of serving decode workers other than `worker_id` (one fleet: one model, GPU and TP):
    where a flip to decode reads the memory its decode graphs will take."""
    return list(session.scalars(select(Worker.endpoint).where(
        Worker.role == Role.DECODE, Worker.activity == Activity.ACTIVE, Worker.endpoint.is_not(None),
        Worker.id != worker_id).order_by(Worker.id).limit(limit)))
