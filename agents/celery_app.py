"""The weight-sync Celery app of a node's worker (`pearlctl worker --node NAME`).

The configuration and the queues are `controlplane/weights/dispatch.py`'s; this module adds the task:
`pearl.weights.sync(worker_id, version)` runs `agents.weight_sync.run_sync` against the database
(PEARL_DATABASE_URL). Whatever a task does is in PostgreSQL; there is no result backend.

While it runs, the worker sends its node's unfinished syncs again every `resend_s` (and once at
start): a task lost with a broker's restart (Redis keeps nothing on disk here) is sent again, and a
duplicate changes nothing (the rows say what is done).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

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
            _engine = make_engine()
        return _engine


def create_app(broker_url: str, node: str) -> Any:
    app = sync_dispatch.make_celery(broker_url, name=f"pearl-{node}")
    timeout_s = float(os.environ.get("PEARL_SYNC_TIMEOUT_S", "120"))

    @app.task(name=sync_dispatch.SYNC_TASK, bind=True)
    def sync(self: Any, worker_id: int, version: int) -> str:
        from pearl.agents.weight_sync import run_sync

        outcome = run_sync(engine(), int(worker_id), int(version), timeout_s=timeout_s, actor=f"worker {node}")
        return outcome.result

    return app


def resend_pending(app: Any, broker_url: str, node: str) -> int:
    """Send the node's unfinished syncs that no live attempt is working on."""
    with transaction(engine()) as session:
        tasks = rows.pending_syncs(session, node=node, idle_only=True)
    return sync_dispatch.send(tasks, broker_url, app=app)


class Resender(threading.Thread):
    """Every `interval_s`, the node's unfinished syncs go to its queue again (module docstring)."""

    def __init__(self, app: Any, broker_url: str, node: str, interval_s: float) -> None:
        super().__init__(name="pearl-resend", daemon=True)
        self.app, self.broker_url, self.node, self.interval_s = app, broker_url, node, interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                n = resend_pending(self.app, self.broker_url, self.node)
                if n:
                    log.info("%d unfinished sync(s) of %s sent again", n, self.node)
            except Exception as exc:  # the database or broker may be down a while: try again later
                log.warning("resending the unfinished syncs of %s: %s", self.node, exc)
