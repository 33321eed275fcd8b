"""Bringing one worker's server to one weights version: the body of the weight-sync task.

    begin      the sync row -> running (or nothing to do: done, superseded, the worker left service)
    check      the snapshot's manifest on disk is the one registered (a checksum per tensor)
    pause      `pause_generation` (retract: requests in flight run again on the new weights)
    load       `update_weights_from_disk` with the version (the server checks every tensor against the
               manifest and refuses a corrupt snapshot naming the tensor, keeping its old weights);
               or, when a broadcast group is set up, the tensors from the trainer's rank
    continue   `continue_generation`, whatever the load did (if it fails after a good load, the
               attempt fails: the next one finds the version and continues the server)
    verify     `/model_info` reports the version (and the manifest's checksum when the server gives it)
    record     the worker's `weights_version` by the fenced compare-and-set (`store.weights.finish_sync`)

One attempt at a time per worker: an attempt holds the worker's sync lock (a PostgreSQL advisory lock
on a connection of its own, `store.weights.sync_lock`) while it works, so a duplicate task (sent again
by the resender, redelivered by the broker) waits, then finds the sync done; a newer version waits
for the older one to notice it is superseded. The lock goes with the connection: a task killed with
its worker holds nothing, and the next delivery starts over.

Idempotent: a server already at the version is not loaded again (it is still continued: a task killed
after its pause leaves the server paused), and the row changes once. A server that does not answer
(restarting) is retried until `timeout_s`; a refused snapshot fails the sync at once; a server that
changed under the sync (new generation or endpoint) makes it start over against the new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pearl.agents.drivers.base import DriverError
from pearl.agents.server_client import ServerClient
from pearl.agents.steps import served_version
from pearl.controlplane.errors import DatabaseUnavailable, PearlError
from pearl.controlplane.store import weights as rows
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.secrets import control_token
from pearl.controlplane.weights import snapshot_path
from pearl.controlplane.weights.files import SnapshotError, disk_digest, read_manifest

log = logging.getLogger("pearl.weights")


class SyncRefused(PearlError):
    """The sync cannot succeed by retrying: the snapshot is refused or does not match its registration."""


@dataclass(frozen=True)
class SyncOutcome:
    worker_id: int
    version: int
    result: str  # "done", "skipped", "failed"
    detail: str = ""
    attempts: int = 0


def _check_files(job: rows.SyncJob) -> None:
    """The snapshot on disk is the one registered: each tensor's checksum (the manifest), dtype and shape
    (the safetensors headers), without reading the tensors (the server reads and checks them)."""
    path = snapshot_path(job.uri)
    try:
        if read_manifest(path) is None:
            raise SyncRefused(f"snapshot {job.uri}: its manifest is gone")
        digest = disk_digest(path)
    except SnapshotError as exc:
        raise SyncRefused(f"snapshot {job.uri}: {exc}") from None
    if digest != job.checksum:
        raise SyncRefused(f"snapshot {job.uri}: its manifest or its tensors' dtypes or shapes changed since version "
                          f"{job.version} was registered")


def _refusal(exc: DriverError) -> bool:
    """The server answered and refused (4xx other than a fence conflict): retrying will not help."""
    return exc.status in (400, 404, 422)


def bring_to_version(api: Any, job: rows.SyncJob, load: Callable[[Any, rows.SyncJob], str] | None = None) -> str:
    """The server calls of one attempt (module docstring); how the weights got there."""
    info = api.model_info()
    method = "present"
    if served_version(info) != job.version:
        _check_files(job)
        api.pause_generation("retract")
        paused: DriverError | None = None
        try:
            if load is not None:
                method = load(api, job)
            else:
                api.update_weights_from_disk(job.uri, job.version)
                method = "snapshot"
        except DriverError as exc:
            if _refusal(exc):
                raise SyncRefused(str(exc)) from None
            raise
        finally:
            try:
                api.continue_generation()
            except DriverError as exc:
                log.warning("worker %d: continue_generation after the load: %s", job.worker_id, exc)
                paused = exc
        if paused is not None:  # loaded but still paused: not done; the next attempt finds the version and resumes
            raise DriverError(f"worker {job.worker_id}: generation not resumed after the load: {paused}")
        info = api.model_info()
    else:
        api.continue_generation()  # a killed attempt may have left it paused
    if served_version(info) != job.version:
        raise DriverError(f"worker {job.worker_id} reports weights version {info.get('weight_version')} "
                          f"after loading {job.version}")
    checksum = info.get("weights_checksum")
    if checksum is not None and checksum != job.checksum:
        raise SyncRefused(f"worker {job.worker_id} serves version {job.version} with checksum {str(checksum)[:12]}..., "
                          f"registered {job.checksum[:12]}...")
    return method


def run_sync(engine: Any, worker_id: int, version: int, *, timeout_s: float = 120.0, retry_s: float = 0.5,
             client: Callable[[str, int], Any] | None = None, actor: str = "weight sync",
             load: Callable[[Any, rows.SyncJob], str] | None = None) -> SyncOutcome:
    """One task: bring `worker_id` to `version` and record it (module docstring)."""
    deadline = time.monotonic() + timeout_s
    reason = f"weights version {version} to worker {worker_id}"
    with rows.sync_lock(engine, worker_id, timeout_s) as held:
        if not held:
            log.warning("%s: another sync of worker %d held its lock for %.0f s", reason, worker_id, timeout_s)
            return SyncOutcome(worker_id, version, "skipped", "another sync of the worker is in flight")
        return _attempts(engine, worker_id, version, deadline, timeout_s, retry_s, client, actor, load, reason)


def _attempts(engine: Any, worker_id: int, version: int, deadline: float, timeout_s: float, retry_s: float,
              client: Callable[[str, int], Any] | None, actor: str, load: Callable[[Any, rows.SyncJob], str] | None,
              reason: str) -> SyncOutcome:
    if client is None:
        token = control_token(engine)
        client = lambda endpoint, fence: ServerClient(endpoint, timeout_s=60.0, fence=fence, token=token)  # noqa: E731
    make = client
    while True:
        try:
            with transaction(engine, actor=actor, reason=reason) as session:
                job = rows.begin_sync(session, worker_id, version)
            if isinstance(job, str):
                log.info("%s: nothing to do (%s)", reason, job)
                return SyncOutcome(worker_id, version, "skipped", job)
            api = make(job.endpoint, job.fence)
            try:
                method = bring_to_version(api, job, load)
                with transaction(engine) as session:
                    stop = rows.still_wanted(session, job)
                if stop is not None and "server changed" in stop:
                    raise rows.SyncFenced(stop)
                with transaction(engine, actor=actor, reason=reason) as session:
                    moved = rows.finish_sync(session, job, method=method)
                log.info("%s: done by %s (attempt %d%s)", reason, method, job.attempts,
                         "" if moved else ", already there")
                return SyncOutcome(worker_id, version, "done", method, job.attempts)
            except SyncRefused as exc:
                with transaction(engine, actor=actor, reason=reason) as session:
                    rows.fail_sync(session, job, str(exc), final=True)
                log.error("%s: failed: %s", reason, exc)
                return SyncOutcome(worker_id, version, "failed", str(exc), job.attempts)
            except (DriverError, rows.SyncFenced) as exc:
                final = time.monotonic() >= deadline
                with transaction(engine, actor=actor, reason=reason) as session:
                    rows.fail_sync(session, job, str(exc), final=final)
                if final:
                    log.error("%s: failed after %.0f s: %s", reason, timeout_s, exc)
                    return SyncOutcome(worker_id, version, "failed", str(exc), job.attempts)
                log.warning("%s: attempt %d: %s; retrying", reason, job.attempts, exc)
                time.sleep(retry_s)
            finally:
                close = getattr(api, "close", None)
                if close is not None:
                    close()
        except DatabaseUnavailable as exc:  # a restart or a failover: what the server did is found again
            if time.monotonic() >= deadline:
                raise
            log.warning("%s: the database is away (%s); trying again", reason, exc)
            time.sleep(max(retry_s, 0.5))
