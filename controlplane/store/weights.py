"""Weight snapshots and weight syncs as rows (0007): the state of weight propagation lives here.

A snapshot row is a weights version the trainer produced: where its files are and its manifest
(tensor -> dtype, shape, checksum), registered with the training step's end once the files matched
it (`controlplane.weights.check_snapshot`). A sync row is bringing one worker's server to one
version, one per (worker, version): `queued` when the version is registered, `running` while a task
(or a retry of it) works on it, then `done`, `failed` (with the error) or `superseded` (a newer
version took over, or the worker left service: its next start loads the current version).

The worker's `weights_version` moves only by a fenced compare-and-set (`finish_sync`): up, never
down, and only if the server the task worked on is still the worker's server (same generation and
endpoint as when the task began). A sync that finds its worker already at (or past) its version
changes nothing, so a redelivered or repeated task takes effect once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pearl.controlplane.core.domain import Activity
from pearl.controlplane.errors import BadInput, PearlError
from pearl.controlplane.store.schema import Node, WeightSnapshot, WeightSync, Worker
from pearl.controlplane.store.transitions import lock_fleet
from sqlalchemy import Engine, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

FINAL = ("done", "failed", "superseded")
LOCK_SPACE = 7007  # advisory locks (LOCK_SPACE, worker id): one sync attempt per worker at a time
SERVING = (Activity.ACTIVE, Activity.TRANSITIONING)


class SyncFenced(PearlError):
    """The worker's server changed (restarted, moved) while the sync ran: its result does not count."""


@dataclass(frozen=True)
class SyncTask:
    """A sync to hand to a node's queue."""

    sync_id: int
    worker_id: int
    node: str
    version: int


@dataclass(frozen=True)
class SyncJob:
    """A sync a task runs now: the worker's server as the task found it, and what to load."""

    sync_id: int
    worker_id: int
    version: int
    uri: str
    checksum: str
    tensors: int
    endpoint: str
    generation: int
    attempts: int
    fence: int = 0  # the worker's last fence: what the sync's commands to its server carry

@contextlib.contextmanager
def sync_lock(engine: Engine, worker_id: int, timeout_s: float, poll_s: float = 0.05,
              cancelled: threading.Event | None = None) -> Iterator[bool]:
    """Hold the worker's sync lock (True), or give up after `timeout_s` or once `cancelled` is set
    (False). A session-level advisory lock on a connection of its own: released when the block ends or
    the connection dies."""
    conn = engine.connect()
    held = False
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            held = bool(conn.execute(text("SELECT pg_try_advisory_lock(:space, :worker)"),
                                     {"space": LOCK_SPACE, "worker": worker_id}).scalar())
            conn.commit()
            if held or time.monotonic() >= deadline or (cancelled is not None and cancelled.is_set()):
                break
            if cancelled is not None:
                cancelled.wait(poll_s)
            else:
                time.sleep(poll_s)
        yield held
    finally:
        try:
            if held:
                conn.execute(text("SELECT pg_advisory_unlock(:space, :worker)"),
                             {"space": LOCK_SPACE, "worker": worker_id})
                conn.commit()
        except Exception:
            conn.invalidate()  # never back to the pool holding the lock
            raise
        finally:
            conn.close()


def _now(session: Session) -> Any:
    return session.scalar(select(func.pearl_now()))


def register_snapshot(session: Session, version: int, uri: str, manifest: dict[str, dict[str, Any]],
                      nbytes: int, checksum: str) -> WeightSnapshot:
    """Record weights `version` (idempotent: the same snapshot again is a no-op, another one refused)."""
    row = session.get(WeightSnapshot, version)
    if row is not None:
        if row.uri == uri and row.checksum == checksum:
            return row
        raise BadInput(f"weights_version: version {version} is registered already with {row.uri}")
    row = WeightSnapshot(version=version, uri=uri, manifest=manifest, tensors=len(manifest), bytes=nbytes,
                         checksum=checksum)
    session.add(row)
    session.flush()
    return row


def latest_snapshot(session: Session) -> WeightSnapshot | None:
    return session.scalars(select(WeightSnapshot).order_by(WeightSnapshot.version.desc()).limit(1)).first()


def enqueue_syncs(session: Session, version: int) -> list[SyncTask]:
    """A sync of `version` for every worker whose server runs (active or being admitted) behind it; the
    unfinished syncs of older versions are superseded. The tasks to send (after commit)."""
    now = _now(session)
    session.execute(
        update(WeightSync).where(WeightSync.version < version, WeightSync.state.in_(("queued", "running")))
        .values(state="superseded", finished_at=now, error=f"version {version} supersedes it")
        .execution_options(synchronize_session=False))
    workers = session.execute(
        select(Worker.id).where(Worker.activity.in_(SERVING), Worker.endpoint.is_not(None),
                                Worker.weights_version < version).order_by(Worker.id)).scalars().all()
    if workers:
        session.execute(insert(WeightSync).values([{"worker_id": w, "version": version} for w in workers])
                        .on_conflict_do_nothing(index_elements=["worker_id", "version"]))
    return pending_syncs(session, version=version)


def pending_syncs(session: Session, *, node: str | None = None, version: int | None = None,
                  idle_only: bool = False) -> list[SyncTask]:
    """Unfinished syncs (queued, or running when a task died), oldest first: what a queue should hold.
    `idle_only`: leave out the workers a live attempt holds the sync lock of (it is at work on them)."""
    q = (select(WeightSync.id, WeightSync.worker_id, Node.name, WeightSync.version)
         .join(Worker, Worker.id == WeightSync.worker_id).join(Node, Node.id == Worker.node_id)
         .where(WeightSync.state.in_(("queued", "running"))).order_by(WeightSync.id))
    if node is not None:
        q = q.where(Node.name == node)
    if version is not None:
        q = q.where(WeightSync.version == version)
    tasks = [SyncTask(*row) for row in session.execute(q)]
    if idle_only and tasks:
        held = set(session.scalars(text(
            "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND classid = :space AND objsubid = 2 "
            "AND granted AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"),
            {"space": LOCK_SPACE}))
        tasks = [t for t in tasks if t.worker_id not in held]
    return tasks


def _finish(session: Session, sync: WeightSync, state: str, *, error: str | None = None,
            method: str | None = None) -> None:
    sync.state, sync.finished_at = state, _now(session)
    if error is not None:
        sync.error = error
    if method is not None:
        sync.method = method
    session.flush()


def begin_sync(session: Session, worker_id: int, version: int) -> SyncJob | str:
    """Start (or restart, after a lost task) the sync of `worker_id` to `version`: the job, or why there
    is nothing to do (the sync is final, the worker is there already, a newer version supersedes it,
    or the worker left service)."""
    lock_fleet(session)
    sync = session.scalars(select(WeightSync).where(WeightSync.worker_id == worker_id, WeightSync.version == version)
                           .with_for_update().execution_options(populate_existing=True)).first()
    if sync is None:
        return f"no sync of worker {worker_id} to version {version}"
    if sync.state in FINAL:
        return f"the sync of worker {worker_id} to version {version} is {sync.state}"
    w = session.get(Worker, worker_id, populate_existing=True)
    assert w is not None
    if w.weights_version >= version:
        _finish(session, sync, "done" if w.weights_version == version else "superseded", method=sync.method or "step",
                error=None if w.weights_version == version else f"worker at version {w.weights_version}")
        return f"worker {worker_id} is at version {w.weights_version} already"
    newer = session.scalar(select(func.max(WeightSnapshot.version)))
    if newer is not None and newer > version:
        _finish(session, sync, "superseded", error=f"version {newer} supersedes it")
        return f"version {newer} supersedes {version}"
    if w.activity not in SERVING or not w.endpoint:
        _finish(session, sync, "superseded", error=f"worker {worker_id} is {w.activity}: its next start loads "
                                                   "the current version")
        return f"worker {worker_id} is {w.activity}"
    snap = session.get(WeightSnapshot, version)
    assert snap is not None
    sync.state, sync.attempts, sync.started_at = "running", sync.attempts + 1, _now(session)
    session.flush()
    return SyncJob(sync.id, worker_id, version, snap.uri, snap.checksum, snap.tensors, w.endpoint, w.generation,
                   sync.attempts, w.last_fence or 0)


def still_wanted(session: Session, job: SyncJob) -> str | None:
    """Why the job should stop now (superseded, final, the server changed), or None."""
    sync = session.get(WeightSync, job.sync_id, populate_existing=True)
    if sync is None or sync.state != "running":
        return f"the sync is {sync.state if sync else 'gone'}"
    w = session.get(Worker, job.worker_id, populate_existing=True)
    if w is None or w.generation != job.generation or w.endpoint != job.endpoint:
        return f"worker {job.worker_id}'s server changed"
    return None


def finish_sync(session: Session, job: SyncJob, *, method: str) -> bool:
    """The server runs `job.version`: set the worker's weights version by a fenced compare-and-set and
    the sync done. True when this call moved the version (False: it was there already). SyncFenced
    when the worker's server is no longer the one the job loaded."""
    lock_fleet(session)
    sync = session.scalars(select(WeightSync).where(WeightSync.id == job.sync_id).with_for_update()
                           .execution_options(populate_existing=True)).one()
    moved = session.execute(
        update(Worker).where(Worker.id == job.worker_id, Worker.weights_version < job.version,
                             Worker.generation == job.generation, Worker.endpoint == job.endpoint)
        .values(weights_version=job.version).execution_options(synchronize_session=False)).rowcount == 1
    if not moved:
        w = session.get(Worker, job.worker_id, populate_existing=True)
        assert w is not None
        if w.weights_version < job.version:
            raise SyncFenced(f"worker {job.worker_id}: its server changed during the sync (generation "
                             f"{w.generation}, {w.endpoint}; the sync loaded generation {job.generation}, "
                             f"{job.endpoint})")
    if sync.state not in FINAL:
        _finish(session, sync, "done", method=method)
    return moved


def fail_sync(session: Session, job: SyncJob, error: str, *, final: bool) -> None:
    """The attempt failed: back to `queued` for a retry, or `failed` for good."""
    sync = session.scalars(select(WeightSync).where(WeightSync.id == job.sync_id).with_for_update()
                           .execution_options(populate_existing=True)).one()
    if sync.state in FINAL:
        return
    if final:
        _finish(session, sync, "failed", error=error[:2000])
    else:
        sync.state, sync.error = "queued", error[:2000]
        session.flush()


def sync_rows(session: Session, worker_id: int | None = None) -> list[dict[str, Any]]:
    q = select(WeightSync).order_by(WeightSync.id)
    if worker_id is not None:
        q = q.where(WeightSync.worker_id == worker_id)
    return [{"id": s.id, "worker_id": s.worker_id, "version": s.version, "state": s.state, "method": s.method,
             "attempts": s.attempts, "error": s.error} for s in session.scalars(q)]


def last_sync_states(session: Session) -> dict[int, dict[str, Any]]:
    """worker id -> its newest sync (version, state, error), for `pearlctl status`."""
    newest = (select(WeightSync.worker_id, func.max(WeightSync.version).label("v"))
              .group_by(WeightSync.worker_id).subquery())
    rows = session.execute(select(WeightSync).join(newest, (newest.c.worker_id == WeightSync.worker_id)
                                                   & (newest.c.v == WeightSync.version))).scalars()
    return {s.worker_id: {"version": s.version, "state": s.state, "error": s.error} for s in rows}
