"""The one place that maps the database's worker and GPU rows to the decision core's `FleetSnapshot`.

A slot whose server failed to start is not offered again at once: after n consecutive failed `start`
steps (since its last successful one, over the plans of the last hour) it is unavailable for
min(30 s x 2^(n-1), 600 s) from the latest failure, so a server that cannot start (a bad image, a
GPU that fails) is retried with growing pauses instead of by every pass.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from pearl.controlplane.core.domain import Activity, GPUState, LeaseKind, StepAction, StepStatus, WorkerZone
from pearl.controlplane.core.fleet import FleetSnapshot, WorkerSlot
from pearl.controlplane.store import transitions
from pearl.controlplane.store.schema import GPU, Agent, Fleet, Lease, Node, Plan, PlanStep, Worker
from sqlalchemy import func, select
from sqlalchemy.orm import Session

START_BACKOFF_FIRST_S = 30.0  # the pause after a slot's first failed start; it doubles with each next one
START_BACKOFF_MAX_S = 600.0
START_BACKOFF_WINDOW_S = 3600.0  # failed starts are counted over the plans created this recently


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


def launched_overlap_slots(session: Session) -> set[int]:
    """Overlap slots whose server was launched since their node's agent started (a succeeded start):
    it sleeps between loans, so a loan wakes it (`WorkerSlot.warm`). A new agent launches its own, so
    slots launched under an earlier one count as cold; a server that died since is found at its next
    loan, which launches another."""
    agent_start = (select(func.max(Agent.started_at)).where(Agent.node_id == PlanStep.node_id)
                   .correlate(PlanStep).scalar_subquery())
    rows = session.scalars(
        select(PlanStep.worker_id).distinct()
        .join(Worker, Worker.id == PlanStep.worker_id)
        .where(Worker.zone == WorkerZone.OVERLAP, PlanStep.action == StepAction.START,
               PlanStep.status == StepStatus.SUCCEEDED,
               PlanStep.finished_at >= func.coalesce(agent_start, PlanStep.finished_at)))
    return set(rows)


def start_backoffs(session: Session) -> dict[int, datetime]:
    """Worker slots backing off after failed starts (module docstring): slot -> when it may start again."""
    now = session.scalar(select(func.pearl_now()))
    first_plan = (select(func.min(Plan.id))
                  .where(Plan.created_at > now - timedelta(seconds=START_BACKOFF_WINDOW_S)).scalar_subquery())
    rows = session.execute(
        select(PlanStep.worker_id, PlanStep.status, PlanStep.finished_at)
        .where(PlanStep.plan_id >= first_plan, PlanStep.action == StepAction.START,
               PlanStep.status.in_([StepStatus.SUCCEEDED, StepStatus.FAILED]), PlanStep.finished_at.is_not(None))
        .order_by(PlanStep.worker_id, PlanStep.finished_at, PlanStep.id))
    failed: dict[int, list[datetime]] = {}
    for worker, status, finished in rows:
        if status is StepStatus.SUCCEEDED:
            failed.pop(worker, None)
        else:
            failed.setdefault(worker, []).append(finished)
    out = {}
    for worker, times in failed.items():
        pause = min(START_BACKOFF_FIRST_S * 2 ** (len(times) - 1), START_BACKOFF_MAX_S)
        until = times[-1] + timedelta(seconds=pause)
        if until > now:
            out[worker] = until
    return out


def load_snapshot(session: Session) -> FleetSnapshot:
    """Every worker slot at the current `state_version`, read in the session's transaction.

    The version matches the rows only when the transaction holds the whole fleet, taken first
    (`transaction(..., whole_fleet=True)`; REPEATABLE READ for reads beside it that should agree):
    what a plan is computed against. Otherwise it is the last version taken, which a writer still
    in flight may hold.
    """
    version = transitions.state_version(session)
    fleet = session.execute(select(Fleet).where(Fleet.id == 1)).scalar_one()
    gpus_by_slot: dict[int, list[GPU]] = defaultdict(list)
    for gpu in session.scalars(select(GPU).order_by(GPU.slot_id, GPU.device_index)):
        gpus_by_slot[gpu.slot_id].append(gpu)
    under_notice = set(revocation_notices(session))
    backing_off = start_backoffs(session)
    launched = launched_overlap_slots(session)
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
                available=_available(worker.zone, worker.id, gpus, under_notice) and not (
                    worker.activity is Activity.INACTIVE and worker.id in backing_off),
                warm=worker.zone is not WorkerZone.OVERLAP or worker.id in launched,
            )
        )
    return FleetSnapshot(state_version=version, workers=tuple(slots), tp=fleet.tp or 1)
