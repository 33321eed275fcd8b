"""What the trainer, the rollout and the GPU provider report, as rows: training begin and end, rollout
progress, preemptible GPUs granted and revoked with a notice.

Each function runs in the caller's transaction and takes the fleet row first; bad input is refused
naming the field (BadInput), before anything is written. The database checks the same things when
the rows are written by hand (0005: CHECK constraints and triggers, SQLSTATE PX005), and every
insert or update wakes the policy loop (NOTIFY `pearl_signals`).

Training. `begin_training` records that the trainer wants step N to begin (`requested_at`) and sets
the deadline of every borrowed GPU's lease to that moment: returning them is mandatory and urgent.
The step starts (`started_at`, its GPUs `training`) the moment no training GPU is borrowed or
draining any more and no applying plan is still to start a server on them (a borrowing the trainer's
request overtook: `plan_store.call_off_borrowing` cancels those starts with the request, an amendment
releases one already under way), in the transaction of the last return (`start_training_if_returned`,
called by the release step's effect and by an amendment), or at once when nothing was borrowed.
`late_s` is how long the returns delayed it. `end_training` frees the GPUs for the next loan.

Preemptible GPUs. A grant makes the node's GPUs (or the listed devices) free and opens a lease; a
revocation sets the lease's deadline to now + notice: the policy drains and releases the workers on
them before it. When the deadline passes (`enforce_deadlines`, run by the reaper) the GPUs are
revoked whatever holds them: a worker still on them is out of service at once, so no GPU is used
after its deadline even when the release was late (its lease records by how much).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from pearl.controlplane.core.domain import (
    Activity,
    GPUState,
    LeaseKind,
    NodeZone,
    PlanStatus,
    StepAction,
    StepStatus,
    WorkerZone,
)
from pearl.controlplane.errors import BadInput
from pearl.controlplane.store.schema import (
    GPU,
    Event,
    Lease,
    Node,
    Plan,
    PlanStep,
    RolloutProgress,
    TrainingStep,
    Worker,
)
from pearl.controlplane.store.transitions import hold, lock_fleet, set_gpu_states
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

MAX_NOTICE_S = 7 * 24 * 3600.0
INT_MAX = 2**31 - 1  # the counts' columns are PostgreSQL integers


@dataclass(frozen=True)
class TrainingBegin:
    step: int
    started: bool  # the optimizer step may run now (no borrowed GPU was out)
    borrowed: tuple[int, ...]  # GPUs still lent to rollout workers; their return is under way


def _now(session: Session):
    return session.scalar(select(func.pearl_now()))


def _check_step(step: int, name: str = "step") -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise BadInput(f"{name}: must be an integer >= 0, got {step!r}")


# -- training -------------------------------------------------------------------------------------


def begin_training(session: Session, step: int) -> TrainingBegin:
    """The trainer wants optimizer step `step` to begin (module docstring)."""
    _check_step(step)
    lock_fleet(session)
    latest = session.scalars(select(TrainingStep).order_by(TrainingStep.step.desc()).limit(1)).first()
    if latest is not None and latest.step == step and latest.ended_at is None:
        started = latest.started_at is not None  # the same request again: nothing new
    else:
        if latest is not None and step <= latest.step:
            raise BadInput(f"step: training step {step} is not after step {latest.step}, the latest")
        if latest is not None and latest.ended_at is None:
            raise BadInput(f"step: training step {step} cannot begin while step {latest.step} has not ended")
        now = _now(session)
        session.add(TrainingStep(step=step, requested_at=now))
        session.flush()
        session.execute(
            update(Lease).where(Lease.kind == LeaseKind.BORROWED, Lease.returned_at.is_(None))
            .values(deadline=now, training_step=step).execution_options(synchronize_session=False)
        )
        started = start_training_if_returned(session) == step
    return TrainingBegin(step, started, borrowed_gpus(session))


def borrowed_gpus(session: Session) -> tuple[int, ...]:
    return tuple(session.scalars(select(GPU.id).where(
        GPU.zone == NodeZone.TRAINING, GPU.state.in_([GPUState.BORROWED, GPUState.DRAINING])).order_by(GPU.id)))


def start_training_if_returned(session: Session) -> int | None:
    """Start the requested training step once no training GPU is borrowed or draining; its step number.
    The agent whose release returned the last borrowed GPU starts it, through the owner's function
    (`pearl_start_training_if_returned`, 0012; under a lock of its own since 0014, taken after the
    caller's writes, so of two releases at once the later sees the earlier's GPUs): no agent writes GPUs
    of another node itself. It does not start while an applying plan is still to start a server on the
    training GPUs (a start of an overlap worker not yet finished): that start would find them training
    and fail its plan."""
    hold(session)
    if borrowing_under_way(session):
        return None
    started = session.scalar(select(func.pearl_start_training_if_returned()))
    for obj in list(session.identity_map.values()):  # the function wrote these rows behind the session
        if isinstance(obj, (TrainingStep, GPU)):
            session.expire(obj)
    return started


def borrowing_under_way(session: Session) -> list[int]:
    """The overlap workers an applying plan is still to start (their start blocked, ready or running)."""
    return list(session.scalars(
        select(PlanStep.worker_id).distinct().join(Plan, Plan.id == PlanStep.plan_id)
        .join(Worker, Worker.id == PlanStep.worker_id)
        .where(Plan.status == PlanStatus.APPLYING, PlanStep.action == StepAction.START,
               PlanStep.status.in_([StepStatus.BLOCKED, StepStatus.READY, StepStatus.RUNNING]),
               Worker.zone == WorkerZone.OVERLAP)
        .order_by(PlanStep.worker_id)))


def end_training(session: Session, step: int, *, weights_version: int | None = None,
                 snapshot: str | None = None) -> TrainingStep:
    """Optimizer step `step` ended (with the weights version it produced): its GPUs may be lent again."""
    _check_step(step)
    if weights_version is not None:
        _check_step(weights_version, "weights_version")
    lock_fleet(session)
    row = session.get(TrainingStep, step, populate_existing=True)
    if row is None:
        raise BadInput(f"step: training step {step} never began (`pearlctl event training-begin --step {step}`)")
    if row.ended_at is not None:
        if (weights_version, snapshot) in ((row.weights_version, row.snapshot), (None, None)):
            return row  # the same report again
        raise BadInput(f"step: training step {step} already ended with weights version {row.weights_version}")
    if row.started_at is None:
        raise BadInput(f"step: training step {step} has not started: borrowed GPUs are still being returned")
    if weights_version is not None:
        newest = session.scalar(select(func.max(TrainingStep.weights_version)))
        if newest is not None and weights_version <= newest:
            raise BadInput(f"weights_version: {weights_version} is not newer than {newest}")
    row.ended_at, row.weights_version, row.snapshot = _now(session), weights_version, snapshot
    training = session.scalars(select(GPU.id).where(GPU.zone == NodeZone.TRAINING,
                                                    GPU.state == GPUState.TRAINING)).all()
    if training:
        set_gpu_states(session, training, [GPUState.TRAINING], GPUState.FREE)
    session.flush()
    return row


# -- borrowed GPUs (the step effects of overlap workers) --------------------------------------------


def open_borrow_leases(session: Session, worker_id: int) -> None:
    """An overlap worker took its training GPUs: a lease per GPU, until it gives them back."""
    now = _now(session)
    for gpu in session.scalars(select(GPU.id).where(GPU.worker_id == worker_id, GPU.zone == NodeZone.TRAINING)):
        if session.scalar(select(Lease.id).where(Lease.gpu_id == gpu, Lease.returned_at.is_(None))) is None:
            session.add(Lease(gpu_id=gpu, kind=LeaseKind.BORROWED, granted_at=now))
    session.flush()


def borrowed_worker_launched(session: Session, worker_id: int) -> None:
    """The worker launched a server on its borrowed GPUs (no sleeping one to wake): a cold start."""
    _leases_of(session, worker_id, Lease.kind == LeaseKind.BORROWED, cold_start=True)


def borrowed_worker_admitted(session: Session, worker_id: int) -> None:
    _leases_of(session, worker_id, Lease.active_at.is_(None), active_at=_now(session))


def borrowed_return_decided(session: Session, worker_ids: set[int], at: datetime) -> None:
    """The policy decided at `at` to give these workers' borrowed GPUs back: their return is measured
    from then (the decision's own latency is part of what a return costs live)."""
    slot = select(GPU.id).where(GPU.slot_id.in_(worker_ids), GPU.zone == NodeZone.TRAINING)
    session.execute(
        update(Lease).where(Lease.gpu_id.in_(slot), Lease.kind == LeaseKind.BORROWED, Lease.returned_at.is_(None))
        .values(return_began_at=func.least(Lease.return_began_at, at))
        .execution_options(synchronize_session=False)
    )


def borrowed_worker_returned(session: Session, worker_id: int, plan_id: int | None) -> None:
    """Its GPUs are back: close the leases (when the return began: when the policy decided it, else
    the first step of this plan on the worker, a drain usually, or now with no plan (its server
    crashed); how late: past the trainer's request), and start a training step that waited for them."""
    now = _now(session)
    began = session.scalar(select(func.min(PlanStep.started_at)).where(
        PlanStep.plan_id == plan_id, PlanStep.worker_id == worker_id, PlanStep.started_at.is_not(None))) or now
    slot = select(GPU.id).where(GPU.slot_id == worker_id, GPU.zone == NodeZone.TRAINING)
    session.execute(
        update(Lease).where(Lease.gpu_id.in_(slot), Lease.kind == LeaseKind.BORROWED, Lease.returned_at.is_(None))
        .values(returned_at=now, return_began_at=func.least(Lease.return_began_at, began, now),
                late_s=func.greatest(0.0, func.coalesce(func.extract("epoch", now - Lease.deadline), 0.0)))
        .execution_options(synchronize_session=False)
    )
    start_training_if_returned(session)


def _leases_of(session: Session, worker_id: int, *where: object, **values: object) -> None:
    slot = select(GPU.id).where(GPU.slot_id == worker_id)
    session.execute(update(Lease).where(Lease.gpu_id.in_(slot), Lease.returned_at.is_(None), *where)
                    .values(**values).execution_options(synchronize_session=False))


# -- rollout progress -----------------------------------------------------------------------------


def rollout_position(session: Session) -> tuple[int, int] | None:
    """The latest rollout step reported and how many of its trajectories remain (None: no report)."""
    row = session.execute(select(RolloutProgress.step, RolloutProgress.batch_size - RolloutProgress.finished)
                          .order_by(RolloutProgress.step.desc()).limit(1)).first()
    return (int(row[0]), int(row[1])) if row is not None else None


def step_tails(session: Session, steps: int) -> list[tuple[float, ...]]:
    """For the latest `steps` complete rollout steps (oldest first), how long before the step's last
    trajectory finished each of its trajectories did (wall seconds, ascending), read from the audit
    log of the progress reports (a report of several at once counts each at its time)."""
    done = session.scalars(select(RolloutProgress.step).where(RolloutProgress.ended_at.is_not(None))
                           .order_by(RolloutProgress.step.desc()).limit(steps)).all()
    if not done:
        return []
    rows = session.execute(
        select(Event.entity_id, Event.at, Event.new["finished"].as_integer())
        .where(Event.entity == "rollout_progress", Event.entity_id.in_([str(s) for s in done]))
        .order_by(Event.id)).all()
    finishes: dict[str, list[datetime]] = {str(s): [] for s in done}
    for step, at, finished in rows:
        times = finishes[step]
        times.extend([at] * max(0, (finished or 0) - len(times)))
    tails = []
    for step in sorted(done):
        times = finishes[str(step)]
        if times:
            tails.append(tuple(sorted((times[-1] - t).total_seconds() for t in times)))
    return tails


def report_progress(session: Session, step: int, finished: int, batch_size: int | None = None,
                    in_flight: int | None = None) -> RolloutProgress:
    """`finished` trajectories of rollout step `step` are done (the first report names the batch size);
    `in_flight`: the trajectories of every batch the rollout runs now (kept as last reported)."""
    _check_step(step)
    if isinstance(finished, bool) or not isinstance(finished, int) or not 0 <= finished <= INT_MAX:
        raise BadInput(f"finished: must be an integer between 0 and {INT_MAX}, got {finished!r}")
    if in_flight is not None and (isinstance(in_flight, bool) or not isinstance(in_flight, int)
                                  or not 0 <= in_flight <= INT_MAX):
        raise BadInput(f"in_flight: must be an integer between 0 and {INT_MAX}, got {in_flight!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or not 0 < batch_size <= INT_MAX):
        raise BadInput(f"batch_size: must be an integer between 1 and {INT_MAX}, got {batch_size!r}")
    row = session.get(RolloutProgress, step, with_for_update=True, populate_existing=True)
    if row is None:
        if batch_size is None:
            raise BadInput(f"batch_size: the first report of rollout step {step} names its batch size")
        latest = session.scalar(select(func.max(RolloutProgress.step)))
        if latest is not None and step < latest:
            raise BadInput(f"step: rollout step {step} is older than step {latest}, already reported")
        row = RolloutProgress(step=step, batch_size=batch_size, finished=0)
        session.add(row)
    elif batch_size is not None and batch_size != row.batch_size:
        raise BadInput(f"batch_size: rollout step {step} has {row.batch_size} trajectories, not {batch_size}")
    if finished > row.batch_size:
        raise BadInput(f"finished: {finished} is more than the step's {row.batch_size} trajectories")
    if finished < row.finished:
        raise BadInput(f"finished: rollout step {step} had {row.finished} trajectories finished; "
                       f"the count never goes down (got {finished})")
    now = _now(session)
    row.finished, row.updated_at = finished, now
    if in_flight is not None:
        row.in_flight = in_flight
    if finished == row.batch_size and row.ended_at is None:
        row.ended_at = now
    session.flush()
    return row


# -- preemptible GPUs -----------------------------------------------------------------------------


def _node_gpus(session: Session, node: str, devices: list[int] | None) -> tuple[Node, list[GPU]]:
    row = session.scalars(select(Node).where(Node.name == node)).first()
    if row is None:
        known = sorted(session.scalars(select(Node.name).where(Node.zone == NodeZone.PREEMPTIBLE)))
        raise BadInput(f"--node: no node named {node!r} (preemptible nodes: {', '.join(known) or 'none'})")
    if row.zone is not NodeZone.PREEMPTIBLE:
        raise BadInput(f"--node: {node} is a {row.zone} node; only preemptible GPUs are granted and revoked")
    gpus = session.scalars(select(GPU).where(GPU.node_id == row.id).order_by(GPU.device_index)
                           .with_for_update().execution_options(populate_existing=True)).all()
    if devices is not None:
        index = {g.device_index: g for g in gpus}
        unknown = sorted(set(devices) - index.keys())
        if unknown:
            raise BadInput(f"--gpus: {node} has no device {unknown} (devices 0..{len(gpus) - 1})")
        gpus = [index[d] for d in sorted(set(devices))]
    return row, list(gpus)


def grant_gpus(session: Session, node: str, devices: list[int] | None = None) -> list[int]:
    """The provider granted the node's GPUs (or `devices`): free, each under an open lease. GPUs
    already granted are left as they are, and a revocation notice still running on one of them is
    withdrawn (the provider keeps them with us: a trace whose GPUs come back within the notice); a
    notice that ran out is enforced first, so its GPUs are revoked and granted anew. The ids newly
    granted or kept are returned."""
    lock_fleet(session)
    enforce_deadlines(session)
    _, gpus = _node_gpus(session, node, devices)
    granted = [g for g in gpus if g.state in (GPUState.UNAVAILABLE, GPUState.REVOKED)]
    ids = [g.id for g in gpus if g not in granted]
    kept = session.scalars(
        update(Lease).where(Lease.gpu_id.in_(ids), Lease.kind == LeaseKind.PREEMPTIBLE, Lease.returned_at.is_(None),
                            Lease.deadline.is_not(None))
        .values(deadline=None).returning(Lease.gpu_id).execution_options(synchronize_session=False)).all()
    if devices is not None:
        held = [g.device_index for g in gpus if g not in granted and g.id not in kept
                and g.state not in (GPUState.FREE, GPUState.BOUND)]
        if held:
            raise BadInput(f"--gpus: devices {held} of {node} are {sorted({g.state.value for g in gpus})}, "
                           "not unavailable or revoked")
    for state in (GPUState.UNAVAILABLE, GPUState.REVOKED):
        ids = [g.id for g in granted if g.state is state]
        if ids:
            set_gpu_states(session, ids, [state], GPUState.FREE)
    now = _now(session)
    for g in granted:
        session.add(Lease(gpu_id=g.id, kind=LeaseKind.PREEMPTIBLE, granted_at=now))
    session.flush()
    return sorted([g.id for g in granted] + list(kept))


def revoke_gpus(session: Session, node: str, devices: list[int] | None = None, notice_s: float = 0.0) -> list[int]:
    """The provider takes the GPUs back `notice_s` seconds from now: their leases get that deadline
    (the policy drains the workers on them before it); with no notice they are revoked at once."""
    if not (isinstance(notice_s, int | float) and math.isfinite(notice_s) and 0 <= notice_s <= MAX_NOTICE_S):
        raise BadInput(f"--notice-s: must be a number of seconds in [0, {MAX_NOTICE_S:g}], got {notice_s!r}")
    lock_fleet(session)
    _, gpus = _node_gpus(session, node, devices)
    ours = [g for g in gpus if g.state in (GPUState.FREE, GPUState.BOUND, GPUState.DRAINING)]
    # GPUs already revoked: the same revocation again (a provider whose report's answer was lost tries
    # again), nothing to do
    stray = [g for g in gpus if g not in ours and g.state is not GPUState.REVOKED]
    if devices is not None and stray:
        raise BadInput(f"--gpus: devices {[g.device_index for g in stray]} of {node} are not granted")
    now = _now(session)
    deadline = session.scalar(select(func.pearl_now() + func.make_interval(0, 0, 0, 0, 0, 0, notice_s)))
    for g in ours:
        lease = session.scalars(select(Lease).where(Lease.gpu_id == g.id, Lease.returned_at.is_(None))).first()
        if lease is None:  # granted before leases were kept: open one now
            lease = Lease(gpu_id=g.id, kind=LeaseKind.PREEMPTIBLE, granted_at=now)
            session.add(lease)
        if lease.deadline is None or lease.deadline > deadline:
            lease.deadline = deadline
    session.flush()
    if notice_s == 0:
        enforce_deadlines(session)
    return [g.id for g in ours]


def enforce_deadlines(session: Session) -> list[int]:
    """Revoke every preemptible GPU whose notice ran out, whatever holds it (module docstring)."""
    lock_fleet(session)
    now = _now(session)
    due = session.execute(
        select(GPU, Lease).join(Lease, Lease.gpu_id == GPU.id)
        .where(Lease.kind == LeaseKind.PREEMPTIBLE, Lease.returned_at.is_(None), Lease.deadline <= now)
        .order_by(GPU.id).execution_options(populate_existing=True)
    ).all()
    if not due:
        return []
    holders = sorted({g.worker_id for g, _ in due if g.worker_id is not None})
    due_ids = {g.id for g, _ in due}
    if holders:  # out of service now: active or transitioning -> inactive, giving up all their GPUs
        session.execute(update(Worker).where(Worker.id.in_(holders))
                        .values(activity=Activity.INACTIVE, endpoint=None).execution_options(synchronize_session=False))
        others = [g.id for g in session.scalars(select(GPU).where(GPU.worker_id.in_(holders)))
                  if g.id not in due_ids]
        if others:  # a worker's GPUs not under this notice go back to free through draining
            session.execute(update(GPU).where(GPU.id.in_(others), GPU.state == GPUState.BOUND)
                            .values(state=GPUState.DRAINING).execution_options(synchronize_session=False))
            session.execute(update(GPU).where(GPU.id.in_(others))
                            .values(state=GPUState.FREE, worker_id=None).execution_options(synchronize_session=False))
    for gpu, lease in due:
        late = max(0.0, (now - lease.deadline).total_seconds()) if gpu.state in (
            GPUState.BOUND, GPUState.DRAINING) else 0.0
        session.execute(update(GPU).where(GPU.id == gpu.id).values(state=GPUState.REVOKED, worker_id=None)
                        .execution_options(synchronize_session=False))
        lease.returned_at, lease.late_s = now, late
    session.flush()
    return [g.id for g, _ in due]
