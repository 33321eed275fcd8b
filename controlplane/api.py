"""pearl's Python API for trainers, rollout drivers and GPU providers: the events of `pearlctl event ...`.

    from pearl.controlplane.api import ControlPlane

    cp = ControlPlane()                               # PEARL_DATABASE_URL, else the embedded server
    cp.rollout_progress(step=7, finished=0, batch_size=64)
    ...
    cp.training_begin(step=7)                         # waits (bounded) until every borrowed GPU is back
    cp.training_end(step=7, weights_version=8, snapshot="/shared/ckpt/8")   # every serving worker gets v8
    cp.gpus_revoked("spot-0", notice_s=30)

Each call is one transaction; bad input raises BadInput naming the field, and nothing is written.
A training step's end with a snapshot registers it (its files must match its manifest) and queues
one weight sync per serving worker, sent to the workers' node queues after the commit
(`controlplane/weights.py`, `controlplane/weights/dispatch.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pearl.controlplane.core.telemetry import parse_telemetry
from pearl.controlplane.errors import BadInput, PearlError
from pearl.controlplane.store import plan_store, signals
from pearl.controlplane.store import weights as weight_rows
from pearl.controlplane.store.db import make_engine, require_schema, transaction
from pearl.controlplane.store.schema import TrainingStep
from pearl.controlplane.store.telemetry_store import IngestResult, ingest_telemetry
from pearl.controlplane.weights import dispatch as sync_dispatch
from sqlalchemy import Engine


class ReturnsLate(PearlError):
    """Borrowed GPUs were not back in time for the training step."""


@dataclass(frozen=True)
class TrainingStarted:
    step: int
    started: bool  # the optimizer step may run now
    waited_s: float  # how long this call waited for borrowed GPUs
    late_s: float | None  # how long late returns delayed the step (recorded on the step)
    borrowed: tuple[int, ...]  # GPUs still lent when the call returned (empty once started)


class ControlPlane:
    """A connection to pearl's database for the events a trainer and a provider report."""

    def __init__(self, database_url: str | None = None, *, engine: Engine | None = None,
                 broker_url: str | None = None) -> None:
        self.engine = engine or make_engine(database_url)
        self.broker_url = broker_url  # where weight syncs go; None: PEARL_BROKER_URL or the embedded Redis
        require_schema(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def training_begin(self, step: int, *, wait_s: float = 60.0, poll_s: float = 0.05,
                       actor: str = "trainer") -> TrainingStarted:
        """The trainer wants step `step` to begin: borrowed GPUs must come back. Waits up to `wait_s`
        for them (0: do not wait); ReturnsLate when they are not all back by then (the step starts
        the moment they are)."""
        t0 = time.monotonic()
        with transaction(self.engine, actor=actor, reason=f"training step {step} begins") as session:
            began = signals.begin_training(session, step)
            if not began.started:  # borrowing the request overtook is called off (it may start at once then)
                plan_store.call_off_borrowing(session, f"training step {step} begins: its GPUs are not lent any more")
        borrowed = began.borrowed
        while not began.started:
            with transaction(self.engine) as session:
                row = session.get(TrainingStep, step)
                started = row is not None and row.started_at is not None
                borrowed = signals.borrowed_gpus(session)
            if started:
                break
            if time.monotonic() - t0 >= wait_s:
                raise ReturnsLate(f"training step {step}: {len(borrowed)} borrowed GPU(s) {list(borrowed)} not back "
                                  f"after {wait_s:g} s; the step starts as soon as they are")
            time.sleep(poll_s)
        with transaction(self.engine) as session:
            row = session.get(TrainingStep, step)
            late = row.late_s if row is not None else None
        return TrainingStarted(step, True, time.monotonic() - t0, late, ())

    def training_end(self, step: int, *, weights_version: int | None = None, snapshot: str | None = None,
                     actor: str = "trainer", delivered: dict[int, str] | None = None) -> list[weight_rows.SyncTask]:
        """Optimizer step `step` ended. With a snapshot: its files are checked against its manifest
        first (BadInput naming the tensor), it is registered as `weights_version`, and each serving
        worker's sync is queued. `delivered` (worker id -> endpoint): servers the trainer's broadcast
        brought to the version already; their syncs are recorded here (fenced as a task's), the others
        are sent to their nodes' queues. The syncs sent."""
        from pearl.controlplane.weights import absolute_uri, check_snapshot

        snap = None
        if snapshot is not None:
            if weights_version is None:
                raise BadInput("weights_version: required with a snapshot")
            snap = check_snapshot(snapshot)
            snapshot = absolute_uri(snapshot)  # every process on every node reads the same place
        with transaction(self.engine, actor=actor, reason=f"training step {step} ended") as session:
            signals.end_training(session, step, weights_version=weights_version, snapshot=snapshot)
            tasks: list[weight_rows.SyncTask] = []
            if snap is not None and weights_version is not None:
                from pearl.controlplane.weights.files import manifest_digest

                manifest = snap.manifest()
                weight_rows.register_snapshot(session, weights_version, snapshot, manifest, snap.bytes,
                                              manifest_digest(manifest))
                tasks = weight_rows.enqueue_syncs(session, weights_version)
        if delivered and weights_version is not None:
            tasks = [t for t in tasks if not self._record_broadcast(t, delivered.get(t.worker_id), actor)]
        if tasks:
            sync_dispatch.send(tasks, self.broker_url if self.broker_url is not None
                               else sync_dispatch.dispatch_broker())
        return tasks

    def _record_broadcast(self, task: weight_rows.SyncTask, endpoint: str | None, actor: str) -> bool:
        """The broadcast brought `task`'s worker to its version: record it (True), unless the worker's
        server is no longer the one reached (False: the snapshot path brings it)."""
        if endpoint is None:
            return False
        reason = f"weights version {task.version} to worker {task.worker_id} by broadcast"
        with transaction(self.engine, actor=actor, reason=reason) as session:
            job = weight_rows.begin_sync(session, task.worker_id, task.version)
        if isinstance(job, str):
            return True  # nothing left to do
        try:
            with transaction(self.engine, actor=actor, reason=reason) as session:
                if job.endpoint != endpoint:
                    raise weight_rows.SyncFenced(f"worker {task.worker_id} now serves at {job.endpoint}")
                weight_rows.finish_sync(session, job, method="broadcast")
            return True
        except weight_rows.SyncFenced as exc:
            with transaction(self.engine, actor=actor, reason=reason) as session:
                weight_rows.fail_sync(session, job, str(exc), final=False)
            return False

    def rollout_progress(self, step: int, finished: int, batch_size: int | None = None, *,
                         in_flight: int | None = None, actor: str = "rollout") -> None:
        with transaction(self.engine, actor=actor) as session:
            signals.report_progress(session, step, finished, batch_size, in_flight)

    def gpus_granted(self, node: str, gpus: list[int] | None = None, *, actor: str = "provider") -> list[int]:
        with transaction(self.engine, actor=actor, reason=f"grant {node}") as session:
            return signals.grant_gpus(session, node, gpus)

    def gpus_revoked(self, node: str, gpus: list[int] | None = None, *, notice_s: float = 0.0,
                     actor: str = "provider") -> list[int]:
        with transaction(self.engine, actor=actor, reason=f"revoke {node} in {notice_s:g} s") as session:
            return signals.revoke_gpus(session, node, gpus, notice_s)

    def telemetry(self, body: dict[str, Any], *, makespan_s: float | None = None,
                  actor: str = "rollout") -> IngestResult:
        return ingest_telemetry(self.engine, parse_telemetry(body), makespan_s=makespan_s, actor=actor)
