"""State changes of GPUs and workers as compare-and-set writes.

Each write names the state it expects and checks how many rows it changed; a mismatch raises
StateConflict (someone else moved the state first). The database refuses illegal edges
(`gpu_transitions`, `worker_transitions`) and, at commit, a serving worker that does not hold
exactly its slot's GPUs; `controlplane.store.db.transaction` maps both to IllegalTransition.

Call these inside one transaction per logical change (`db.transaction`): a worker and its GPUs
change together or not at all.
"""

from __future__ import annotations

from collections.abc import Iterable

from pearl.controlplane.core.domain import Activity, GPUState, NodeZone, Role, WorkerZone
from pearl.controlplane.errors import PearlError
from pearl.controlplane.store.schema import GPU, GPUTransition, Worker, WorkerTransition
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session


class StateConflict(PearlError):
    """The state moved on: a compare-and-set found something other than it expected."""


def lock_fleet(session: Session) -> int:
    """Take the fleet row for the rest of the transaction and return the current `state_version`.

    Every state writer queues on this row (a trigger takes it at the first write anyway). Taking it
    first matters under READ COMMITTED: a statement's snapshot is taken before it waits, so a
    compare-and-set that waited inside its own trigger may judge rows by a state already replaced.
    After this call each statement sees the latest committed state.

    Taken once per transaction: a second call in the same transaction returns the version read by the
    first (writes of this transaction may have moved it since) without a round trip.
    """
    tx = session.get_transaction()
    if tx is not None and session.info.get("fleet_locked_by") is tx:
        return session.info["fleet_version"]
    version = session.execute(select(func.pearl_take_fleet())).scalar_one()  # as the owner: no role writes it
    session.info["fleet_locked_by"], session.info["fleet_version"] = tx, version
    return version


def gpu_edges(session: Session) -> dict[NodeZone, list[tuple[GPUState, GPUState, str]]]:
    """The allowed GPU transitions per zone, with why each edge exists."""
    edges: dict[NodeZone, list[tuple[GPUState, GPUState, str]]] = {}
    for t in session.scalars(select(GPUTransition).order_by(GPUTransition.zone, GPUTransition.from_state)):
        edges.setdefault(t.zone, []).append((t.from_state, t.to_state, t.comment))
    return edges


def worker_edges(session: Session) -> list[tuple[Activity, Activity, str]]:
    return [(t.from_activity, t.to_activity, t.comment) for t in session.scalars(select(WorkerTransition))]


def _worker(session: Session, worker_id: int) -> Worker:
    worker = session.get(Worker, worker_id, populate_existing=True)
    if worker is None:
        raise StateConflict(f"worker {worker_id} does not exist")
    return worker


def set_gpu_states(session: Session, gpu_ids: Iterable[int], expected: Iterable[GPUState], new: GPUState) -> None:
    """Move GPUs that no worker holds (training begin/end, grant, revoke, lost) from `expected` to `new`."""
    lock_fleet(session)
    ids = sorted(set(gpu_ids))
    allowed = list(expected)
    changed = (
        session.execute(
            update(GPU)
            .where(GPU.id.in_(ids), GPU.state.in_(allowed), GPU.worker_id.is_(None))
            .values(state=new)
            .returning(GPU.id)
            .execution_options(synchronize_session=False)
        )
        .scalars()
        .all()
    )
    if len(changed) != len(ids):
        found = {g.id: g.state.value for g in session.scalars(select(GPU).where(GPU.id.in_(ids)))}
        missed = {i: found.get(i, "missing") for i in ids if i not in set(changed)}
        raise StateConflict(f"gpus {missed} are not in {[s.value for s in allowed]} (unheld); cannot make them {new}")


def start_worker(session: Session, worker_id: int, role: Role, *, endpoint: str | None = None) -> Worker:
    """inactive -> transitioning in `role`, taking every GPU of its slot (bound, or borrowed if overlap)."""
    lock_fleet(session)
    worker = _worker(session, worker_id)
    hold = GPUState.BORROWED if worker.zone is WorkerZone.OVERLAP else GPUState.BOUND
    slot = session.scalars(select(GPU.id).where(GPU.slot_id == worker_id)).all()
    taken = session.scalar(text("SELECT pearl_hold_slot(:w, CAST(:hold AS gpu_state))"),  # GPUs change in functions
                           {"w": worker_id, "hold": hold.value})
    if not slot or taken != len(slot):
        raise StateConflict(f"worker {worker_id}: {taken} of its {len(slot)} GPU(s) were free to take")
    moved = (
        session.execute(
            update(Worker)
            .where(Worker.id == worker_id, Worker.activity == Activity.INACTIVE)
            .values(activity=Activity.TRANSITIONING, role=role, endpoint=endpoint, generation=Worker.generation + 1)
            .returning(Worker.id)
            .execution_options(synchronize_session=False)
        )
        .scalars()
        .all()
    )
    if not moved:
        raise StateConflict(f"worker {worker_id} is {worker.activity}, not inactive")
    return _worker(session, worker_id)


def admit_worker(session: Session, worker_id: int) -> None:
    """transitioning -> active: the router may send it requests."""
    _cas_activity(session, worker_id, Activity.TRANSITIONING, Activity.ACTIVE)


def begin_release(session: Session, worker_id: int) -> None:
    """active -> transitioning, its GPUs -> draining (the server drains, then releases them)."""
    lock_fleet(session)
    worker = _worker(session, worker_id)
    if worker.activity is Activity.ACTIVE:
        _cas_activity(session, worker_id, Activity.ACTIVE, Activity.TRANSITIONING)
    elif worker.activity is not Activity.TRANSITIONING:
        raise StateConflict(f"worker {worker_id} is {worker.activity}; nothing to release")
    session.execute(select(func.pearl_drain_held(worker_id)))


def finish_release(session: Session, worker_id: int) -> None:
    """Its draining GPUs -> free and unheld; the worker -> inactive (an overlap slot's role -> training)."""
    lock_fleet(session)
    worker = _worker(session, worker_id)
    held = session.scalars(select(GPU).where(GPU.worker_id == worker_id)).all()
    not_drained = [g.id for g in held if g.state is not GPUState.DRAINING]
    if not_drained:
        raise StateConflict(f"worker {worker_id}: gpus {not_drained} are not draining; call begin_release first")
    session.execute(select(func.pearl_free_held(worker_id)))
    values: dict[str, object] = {"activity": Activity.INACTIVE, "endpoint": None}
    if worker.zone is WorkerZone.OVERLAP:
        values["role"] = Role.TRAINING
    _cas_activity(session, worker_id, Activity.TRANSITIONING, Activity.INACTIVE, **values)


def set_activity(session: Session, worker_id: int, expected: Activity, new: Activity) -> None:
    """`expected` -> `new`, nothing else (a drain, an admit)."""
    _cas_activity(session, worker_id, expected, new)


def set_role(session: Session, worker_id: int, role: Role) -> None:
    """A new role for a worker that is not serving (a prefill <-> decode flip while transitioning)."""
    lock_fleet(session)
    moved = session.execute(
        update(Worker).where(Worker.id == worker_id, Worker.activity != Activity.ACTIVE).values(role=role)
        .returning(Worker.id).execution_options(synchronize_session=False)
    ).scalars().all()
    if not moved:
        raise StateConflict(f"worker {worker_id} is active; its role changes only while it is not serving")


def set_weights_version(session: Session, worker_id: int, version: int) -> None:
    """The server now runs weights `version`; a worker never goes backwards (an older report is a no-op)."""
    lock_fleet(session)
    session.execute(
        update(Worker).where(Worker.id == worker_id, Worker.weights_version < version).values(weights_version=version)
        .execution_options(synchronize_session=False)
    )


def _cas_activity(session: Session, worker_id: int, expected: Activity, new: Activity, **values: object) -> None:
    lock_fleet(session)
    values.setdefault("activity", new)
    moved = (
        session.execute(
            update(Worker)
            .where(Worker.id == worker_id, Worker.activity == expected)
            .values(**values)
            .returning(Worker.id)
            .execution_options(synchronize_session=False)
        )
        .scalars()
        .all()
    )
    if not moved:
        actual = session.scalar(select(Worker.activity).where(Worker.id == worker_id))
        raise StateConflict(f"worker {worker_id} is {actual}, expected {expected}")
