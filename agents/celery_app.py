"""The weight-sync Celery app of a node's worker (`pearlctl worker --node NAME`).

The configuration and the queues are `controlplane/weights/dispatch.py`'s; this module adds the task:
`pearl.weights.sync(worker_id, version)` runs `agents.weight_sync.run_sync` against the database
(PEARL_DATABASE_URL). Whatever a task does is in PostgreSQL; there is no result backend.

While it runs, the worker sends its node's unfinished syncs again every `resend_s` (and once at
start): a task lost with a broker's restart (Redis keeps nothing on disk here) is sent again, and a
duplicate changes nothing (the rows say what is done).

It also watches its own consumer. A Celery worker can come back from a lost broker connection alive
but taking nothing from its queue (a known failure of the Redis transport's reconnection). When the
node's queue holds messages while this worker has a free thread, continuously for `stall_s`, the
worker starts itself again in place (`os.execv`, same PID and command line): nothing is lost,
since every task is acknowledged only after it ran and the rows say what is done.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

from pearl.controlplane.services import metrics
from pearl.controlplane.store import weights as rows
from pearl.controlplane.store.db import make_engine, transaction
from pearl.controlplane.weights import dispatch as sync_dispatch

log = logging.getLogger("pearl.weights")

_engine: Any = None
_engine_lock = threading.Lock()


def engine() -> Any:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = make_engine(component="policy")
        return _engine


class Busy:
    """How many sync tasks this process runs now."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self._n += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._n -= 1

    @property
    def count(self) -> int:
        return self._n


busy = Busy()


def create_app(broker_url: str, node: str) -> Any:
    app = sync_dispatch.make_celery(broker_url, name=f"pearl-{node}")
    timeout_s = float(os.environ.get("PEARL_SYNC_TIMEOUT_S", "120"))

    @app.task(name=sync_dispatch.SYNC_TASK, bind=True)
    def sync(self: Any, worker_id: int, version: int) -> str:
        from pearl.agents.weight_sync import run_sync

        result, started = "error", time.monotonic()
        metrics.SYNCS_RUNNING.inc()
        try:
            with busy:
                outcome = run_sync(engine(), int(worker_id), int(version), timeout_s=timeout_s,
                                   actor=f"worker {node}")
            result = outcome.result
        finally:
            metrics.SYNCS_RUNNING.dec()
            metrics.SYNCS.labels(result).inc()
            metrics.SYNC_SECONDS.labels(result).observe(time.monotonic() - started)
        return result

    return app


def queue_depth(app: Any, node: str) -> int:
    """Messages waiting in the node's queue (not those a worker holds unacknowledged)."""
    with app.connection_for_read() as conn:
        conn.ensure_connection(max_retries=1, timeout=5)
        try:
            return int(conn.default_channel.queue_declare(sync_dispatch.queue_name(node), passive=True).message_count)
        except conn.channel_errors:  # the queue does not exist yet: nothing was ever sent to it
            return 0


def restart_in_place() -> None:
    """Replace this process with a fresh run of the same command (same PID: whoever started the
    worker keeps its handle; the file descriptors close on exec)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


def resend_pending(app: Any, broker_url: str, node: str) -> int:
    """Send the node's unfinished syncs that no live attempt is working on."""
    with transaction(engine()) as session:
        tasks = rows.pending_syncs(session, node=node, idle_only=True)
    return sync_dispatch.send(tasks, broker_url, app=app)


class Resender(threading.Thread):
    """Every `interval_s`, the node's unfinished syncs go to its queue again, and the consumer is
    checked: stalled for `stall_s`, the worker restarts in place (module docstring)."""

    def __init__(self, app: Any, broker_url: str, node: str, interval_s: float, *, concurrency: int,
                 stall_s: float, restart: Any = restart_in_place) -> None:
        super().__init__(name="pearl-resend", daemon=True)
        self.app, self.broker_url, self.node, self.interval_s = app, broker_url, node, interval_s
        self.concurrency, self.stall_s, self.restart = concurrency, stall_s, restart
        self.stopped = threading.Event()
        self.stalled_since: float | None = None

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                n = resend_pending(self.app, self.broker_url, self.node)
                if n:
                    log.info("%d unfinished sync(s) of %s sent again", n, self.node)
            except Exception as exc:  # the database or broker may be down a while: try again later
                log.warning("resending the unfinished syncs of %s: %s", self.node, exc)
            try:
                self.watch(queue_depth(self.app, self.node), busy.count, time.monotonic())
            except Exception as exc:  # the broker does not answer: the consumer cannot be judged now
                self.stalled_since = None
                log.debug("checking the queue of %s: %s", self.node, exc)

    def watch(self, depth: int, running: int, now: float) -> None:
        """A queue that holds messages while a thread is free, for `stall_s` in a row: a stalled consumer."""
        if depth == 0 or running >= self.concurrency:
            self.stalled_since = None
            return
        if self.stalled_since is None:
            self.stalled_since = now
            return
        if now - self.stalled_since >= self.stall_s and not self.stopped.is_set() and not shutting_down():
            log.error("the worker of %s took nothing from its queue for %.0f s (%d waiting, %d of %d threads "
                      "busy): starting it again", self.node, now - self.stalled_since, depth, running,
                      self.concurrency)
            self.restart()


def shutting_down() -> bool:
    from celery.worker import state

    stop, terminate = state.should_stop, state.should_terminate
    return (stop is not None and stop is not False) or (terminate is not None and terminate is not False)
