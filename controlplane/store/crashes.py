"""Servers that died under an active worker: out of service in the rows, their GPUs free again; and
servers left running under a worker that is out of service.

The node agent watches the servers of its node's active workers (`agents/server_watch.py`) and
reports one it finds dead. `mark_crashed` writes it as one compare-and-set on what the agent saw
(the worker still active, at that endpoint and generation, with no plan step running on it: a step
in hand is left to find the dead server itself): the worker goes out of service (active ->
transitioning -> inactive, its endpoint cleared; an overlap slot back to role training) and its GPUs
go through draining to free, all in one transaction that the audit log records with its reason. A
borrowed training GPU's loan is closed there too: its server is gone, so is its memory. The fleet's
state version moves, so the policy sees the capacity gone and plans it back into service.

The other way round, a server can outlive its worker's service: a revocation whose notice ran out
takes the worker out of service in the rows alone (`signals.enforce_deadlines`), and a start that
failed after its launch leaves a process behind. `out_of_service` names the node's workers that are
inactive, not an overlap slot (whose released server sleeps until its next loan) and not being
stepped on; the agent stops their servers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pearl.controlplane.core.domain import Activity, StepStatus, WorkerZone
from pearl.controlplane.store import signals, transitions
from pearl.controlplane.store.schema import Node, PlanStep, WeightSync, Worker
from sqlalchemy import exists, select
from sqlalchemy.orm import Session


@dataclass(frozen=True)
class Serving:
    """An active worker of the node, as the watch saw it."""

    worker_id: int
    endpoint: str
    generation: int
    weights_version: int = 0  # what the rows say it serves


def _step_running(worker_id: object) -> object:
    return exists().where(PlanStep.worker_id == worker_id, PlanStep.status == StepStatus.RUNNING)


def _sync_running(worker_id: object) -> object:
    return exists().where(WeightSync.worker_id == worker_id, WeightSync.state == "running")


def serving(session: Session, node: str) -> list[Serving]:
    """The node's active workers with a server, but none a plan step or a weight sync is at work on
    (a paused server loading weights is not a crashed one)."""
    rows = session.execute(
        select(Worker.id, Worker.endpoint, Worker.generation, Worker.weights_version)
        .join(Node, Node.id == Worker.node_id)
        .where(Node.name == node, Worker.activity == Activity.ACTIVE, Worker.endpoint.is_not(None),
               ~_step_running(Worker.id), ~_sync_running(Worker.id))
        .order_by(Worker.id))
    return [Serving(int(i), str(e), int(g), int(v)) for i, e, g, v in rows]


def mark_crashed(session: Session, seen: Serving) -> bool:
    """The server of `seen` died: the worker out of service and its GPUs free, if the rows still show
    what the watch saw (module docstring). False, changing nothing, when they moved on."""
    transitions.lock_fleet(session)
    worker = session.scalars(
        select(Worker).where(Worker.id == seen.worker_id, Worker.activity == Activity.ACTIVE,
                             Worker.endpoint == seen.endpoint, Worker.generation == seen.generation,
                             ~_step_running(Worker.id))
        .with_for_update().execution_options(populate_existing=True)).first()
    if worker is None:
        return False
    transitions.begin_release(session, worker.id)
    transitions.finish_release(session, worker.id)
    if worker.zone is WorkerZone.OVERLAP:
        signals.borrowed_worker_returned(session, worker.id, plan_id=None)
    return True


def _out_of_service(node: str) -> object:
    return (select(Worker.id).join(Node, Node.id == Worker.node_id)
            .where(Node.name == node, Worker.activity == Activity.INACTIVE, Worker.zone != WorkerZone.OVERLAP,
                   ~_step_running(Worker.id)))


def out_of_service(session: Session, node: str, worker_ids: list[int]) -> list[int]:
    """Of `worker_ids` (those the node's driver runs a server for), the workers out of service whose
    server should not run (module docstring)."""
    if not worker_ids:
        return []
    return list(session.scalars(_out_of_service(node).where(Worker.id.in_(worker_ids)).order_by(Worker.id)))


def still_active(session: Session, seen: Serving) -> bool:
    """The worker is still in service at the endpoint and generation seen (a weight sync or a step
    may be at work on it)."""
    return session.scalar(select(Worker.id).where(
        Worker.id == seen.worker_id, Worker.activity == Activity.ACTIVE, Worker.endpoint == seen.endpoint,
        Worker.generation == seen.generation)) is not None
