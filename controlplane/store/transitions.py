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


SCOPE = "pearl_fleet_scope"  # session.info: (transaction, None for the whole fleet or the nodes locked, version)


def lock_fleet(session: Session) -> int:
    """Take the whole fleet for the rest of the transaction (no other writer in flight, none starts
    until it ends) and return the current `state_version`: every version up to it is committed, so a
    plan computed at it is stale exactly when a later version was taken. Whole-fleet writers (applies,
    aborts, the reaper, signals, imports) and a decision's snapshot take it first.

    Taking it first matters under READ COMMITTED: a statement's snapshot is taken before it waits, so a
    compare-and-set that waited inside its own trigger may judge rows by a state already replaced.
    After this call each statement sees the latest committed state.

    Taken once per transaction: a second call returns the version read by the first (writes of this
    transaction may have moved it since) without a round trip. After `lock_node` in the same
    transaction it takes the whole fleet as well (a report that fails its plan).
    """
    tx = session.get_transaction()
    held = session.info.get(SCOPE)
    if held is not None and held[0] is tx and held[1] is None:
        return held[2]
    session.execute(text("LOCK TABLE fleet_lock IN EXCLUSIVE MODE"))  # no snapshot: one may follow it
    version = state_version(session)
    session.info[SCOPE] = (tx, None, version)
    return version


def lock_node(session: Session, node_id: int) -> None:
    """Take node `node_id` for the rest of the transaction: the writes an agent makes for its node's
    steps (effects, reports, hand-backs) wait for whole-fleet writers and for the writers of the same
    node, never for those of other nodes. Within it, change only that node's workers and GPUs (and
    plan steps of any node); the helpers of this module refuse a worker of another node."""
    tx = session.get_transaction()
    held = session.info.get(SCOPE)
    if held is not None and held[0] is tx and (held[1] is None or node_id in held[1]):
        return
    session.execute(select(func.pearl_take_node(node_id)))
    nodes = held[1] if held is not None and held[0] is tx else frozenset()
    session.info[SCOPE] = (tx, nodes | {node_id}, None)


def hold(session: Session) -> None:
    """What a state change needs: the lock this transaction already holds (the whole fleet or its
    nodes), else the whole fleet."""
    held = session.info.get(SCOPE)
    if held is None or held[0] is not session.get_transaction():
        lock_fleet(session)


def locked_nodes(session: Session) -> frozenset[int] | None:
    """The nodes this transaction holds (None: the whole fleet, or no lock yet)."""
    held = session.info.get(SCOPE)
    return held[1] if held is not None and held[0] is session.get_transaction() else None


def state_version(session: Session) -> int:
    """The last version taken: exact when this transaction holds the whole fleet (every version up
    to it is committed, or this transaction's own); otherwise a writer still in flight may hold it."""
    return int(session.execute(select(func.pearl_state_version())).scalar_one())


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
    nodes = locked_nodes(session)
    if nodes is not None and worker.node_id not in nodes:  # a node-scoped writer stays on its node
        raise PearlError(f"worker {worker_id} is on node {worker.node_id}, outside this transaction's nodes "
                         f"{sorted(nodes)}")
    return worker


def set_gpu_states(session: Session, gpu_ids: Iterable[int], expected: Iterable[GPUState], new: GPUState) -> None:
    """Move GPUs that no worker holds (training begin/end, grant, revoke, lost) from `expected` to `new`."""
    hold(session)
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
    hold(session)
    worker = _worker(session, worker_id)
    held = GPUState.BORROWED if worker.zone is WorkerZone.OVERLAP else GPUState.BOUND
    slot = session.scalars(select(GPU.id).where(GPU.slot_id == worker_id)).all()
    taken = session.scalar(text("SELECT pearl_hold_slot(:w, CAST(:hold AS gpu_state))"),  # GPUs change in functions
                           {"w": worker_id, "hold": held.value})
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
    hold(session)
    worker = _worker(session, worker_id)
    if worker.activity is Activity.ACTIVE:
        _cas_activity(session, worker_id, Activity.ACTIVE, Activity.TRANSITIONING)
    elif worker.activity is not Activity.TRANSITIONING:
        raise StateConflict(f"worker {worker_id} is {worker.activity}; nothing to release")
    session.execute(select(func.pearl_drain_held(worker_id)))


def finish_release(session: Session, worker_id: int) -> None:
    """Its draining GPUs -> free and unheld; the worker -> inactive (an overlap slot's role -> training)."""
    hold(session)
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
    hold(session)
    moved = session.execute(
        update(Worker).where(Worker.id == worker_id, Worker.activity != Activity.ACTIVE).values(role=role)
        .returning(Worker.id).execution_options(synchronize_session=False)
    ).scalars().all()
    if not moved:
        raise StateConflict(f"worker {worker_id} is active; its role changes only while it is not serving")


def set_weights_version(session: Session, worker_id: int, version: int) -> None:
    """The server now runs weights `version`; a worker never goes backwards (an older report is a no-op)."""
    hold(session)
    session.execute(
        update(Worker).where(Worker.id == worker_id, Worker.weights_version < version).values(weights_version=version)
        .execution_options(synchronize_session=False)
    )


def _cas_activity(session: Session, worker_id: int, expected: Activity, new: Activity, **values: object) -> None:
    hold(session)
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
