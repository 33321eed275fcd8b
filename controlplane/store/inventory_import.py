"""Importing an inventory into the database: nodes, their GPUs, and the stable worker slots.

Each node's GPUs split into consecutive groups of `tp`, one worker slot per group (slot index within
the node). Training-node slots are overlap workers (role training, inactive); rollout and
preemptible slots are dedicated workers (role colocated, inactive). Training and rollout GPUs start
free, preemptible GPUs unavailable until granted. One transaction: all or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pearl.controlplane.core.domain import Activity, GPUState, NodeZone, PlanStatus, Role, WorkerZone
from pearl.controlplane.core.inventory import Inventory
from pearl.controlplane.errors import BadInput, PearlError
from pearl.controlplane.store.schema import GPU, Fleet, Node, Plan, Worker
from pearl.controlplane.store.transitions import lock_fleet, state_version
from sqlalchemy import delete, func, select, text
from sqlalchemy.orm import Session


class ClusterBusy(PearlError):
    """The cluster is in use: an inventory can be replaced only while every worker is inactive."""


@dataclass(frozen=True)
class ImportResult:
    outcome: Literal["created", "unchanged", "replaced"]
    nodes: int
    gpus: int
    workers: int
    state_version: int


def _initial_gpu_state(zone: NodeZone) -> GPUState:
    return GPUState.UNAVAILABLE if zone is NodeZone.PREEMPTIBLE else GPUState.FREE


def _slot_shape(zone: NodeZone) -> tuple[WorkerZone, Role]:
    if zone is NodeZone.TRAINING:
        return WorkerZone.OVERLAP, Role.TRAINING
    return WorkerZone.DEDICATED, Role.COLOCATED


def _refuse_replace_while_busy(session: Session) -> None:
    busy_workers = session.scalar(select(func.count()).select_from(Worker).where(Worker.activity != Activity.INACTIVE))
    # a lost or revoked GPU runs nothing: it does not keep an inventory from being replaced
    idle = [GPUState.FREE, GPUState.UNAVAILABLE, GPUState.LOST, GPUState.REVOKED]
    busy_gpus = session.scalar(select(func.count()).select_from(GPU).where(GPU.state.not_in(idle)))
    applying = session.scalar(select(func.count()).select_from(Plan).where(Plan.status == PlanStatus.APPLYING))
    if busy_workers or busy_gpus or applying:
        raise ClusterBusy(
            f"cannot replace the inventory: {busy_workers} worker(s) not inactive, {busy_gpus} GPU(s) "
            f"in use (not free, unavailable, lost or revoked), {applying} plan(s) applying"
        )


def _create(session: Session, inventory: Inventory) -> tuple[int, int]:
    n_gpus = n_workers = 0
    for spec in inventory.nodes:
        node = Node(name=spec.name, zone=spec.zone, address=spec.address, gpu_count=spec.gpus)
        session.add(node)
        session.flush()
        worker_zone, role = _slot_shape(spec.zone)
        workers = [
            Worker(node_id=node.id, slot=k, zone=worker_zone, role=role, activity=Activity.INACTIVE)
            for k in range(spec.gpus // inventory.tp)
        ]
        session.add_all(workers)
        session.flush()
        session.add_all(
            GPU(
                node_id=node.id,
                zone=spec.zone,
                device_index=w.slot * inventory.tp + j,
                slot_id=w.id,
                state=_initial_gpu_state(spec.zone),
            )
            for w in workers
            for j in range(inventory.tp)
        )
        n_workers += len(workers)
        n_gpus += spec.gpus
    session.flush()
    return n_gpus, n_workers


def import_inventory(session: Session, inventory: Inventory, *, replace: bool = False) -> ImportResult:
    """Write `inventory` in the session's transaction; the same inventory again changes nothing.

    A different inventory over an existing one is refused (BadInput) unless `replace`, which removes
    the old nodes with their GPUs, workers, leases and plan steps (the events table keeps their
    history) and is refused (ClusterBusy) while anything is in use.
    """
    lock_fleet(session)  # importers, and every state writer, out of the way
    fleet = session.execute(select(Fleet).where(Fleet.id == 1).with_for_update()).scalar_one()
    digest = inventory.digest()
    existing_nodes = session.scalar(select(func.count()).select_from(Node)) or 0
    if fleet.inventory_hash == digest and existing_nodes:
        return ImportResult(
            "unchanged",
            existing_nodes,
            inventory.total_gpus,
            session.scalar(select(func.count()).select_from(Worker)) or 0,
            state_version(session),
        )
    outcome: Literal["created", "replaced"] = "created"
    if existing_nodes:
        if not replace:
            raise BadInput(
                f"the cluster already holds a different inventory ({existing_nodes} nodes, imported "
                f"{fleet.imported_at:%Y-%m-%d %H:%M:%S %Z}); use --replace to change it"
                if fleet.imported_at
                else "the cluster already has nodes; use --replace to change them"
            )
        _refuse_replace_while_busy(session)
        session.execute(delete(Node))
        outcome = "replaced"
    n_gpus, n_workers = _create(session, inventory)
    fleet.inventory_hash = digest
    fleet.inventory = inventory.canonical()
    fleet.model, fleet.gpu, fleet.tp = inventory.model, inventory.gpu, inventory.tp
    fleet.imported_at = session.scalar(text("SELECT now()"))
    session.flush()
    session.refresh(fleet)
    return ImportResult(outcome, len(inventory.nodes), n_gpus, n_workers, state_version(session))
