"""The weight-sync queues: the Celery app's configuration, and handing syncs to the nodes' queues.

One queue per node, `node.<name>`, consumed by that node's `pearlctl worker --node NAME`. Tasks are
acknowledged late (after they ran), a task whose worker process is lost is rejected back to the queue
(`task_reject_on_worker_lost`), and a worker takes one task at a time per thread (prefetch 1): a
Celery worker killed mid-task loses nothing, the broker hands the task to the next worker. With Redis,
an unacknowledged task comes back after the visibility timeout (`PEARL_SYNC_VISIBILITY_S`, default
300 s); with RabbitMQ, as soon as the killed worker's connection closes.

The task carries (worker id, version) only: what to do and whether it is done is in PostgreSQL
(`controlplane/store/weights.py`), never only in the broker or a result backend (there is none).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from pearl.controlplane.services import embedded
from pearl.controlplane.services.settings import Settings, check_broker_url, get_settings, redact_url
from pearl.controlplane.store.weights import SyncTask

log = logging.getLogger("pearl.weights")

SYNC_TASK = "pearl.weights.sync"


def queue_name(node: str) -> str:
    return f"node.{node}"


def celery_config(broker_url: str) -> dict[str, Any]:
    visibility = float(os.environ.get("PEARL_SYNC_VISIBILITY_S", "300"))
    return {
        "broker_url": broker_url,
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": "node.default",
        "task_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": visibility},
        "worker_hijack_root_logger": False,
        "worker_send_task_events": False,
        "task_send_sent_event": False,
    }


def make_celery(broker_url: str, name: str = "pearl") -> Any:
    from celery import Celery

    app = Celery(name, set_as_current=False)
    app.conf.update(celery_config(broker_url))
    return app


def dispatch_broker(settings: Settings | None = None) -> str | None:
    """Where to send syncs: PEARL_BROKER_URL, else the embedded Redis if it runs (None: nowhere; the
    syncs stay queued in the rows, and each node's worker sends its node's when it starts)."""
    settings = settings or get_settings()
    if settings.broker_url:
        return check_broker_url(settings.broker_url)
    status = embedded.redis_status(settings)
    return status.url if status.running else None


def send(tasks: Iterable[SyncTask], broker_url: str | None, app: Any = None) -> int:
    """Send one task per sync to its node's queue; how many were sent (0 when the broker does not
    answer: the rows keep them, and they are sent again when the node's worker starts)."""
    tasks = list(tasks)
    if not tasks or broker_url is None:
        return 0
    own = app is None
    app = app or make_celery(broker_url)
    sent = 0
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=2, interval_start=0.1, interval_step=0.2, timeout=5)
            with app.producer_pool.acquire(block=True) as producer:
                for t in tasks:
                    app.send_task(SYNC_TASK, args=(t.worker_id, t.version), queue=queue_name(t.node),
                                  producer=producer, retry=True,
                                  retry_policy={"max_retries": 2, "interval_start": 0.1, "interval_step": 0.2})
                    sent += 1
    except Exception as exc:  # the errors vary by transport; the rows keep the syncs
        log.warning("weight syncs not sent to %s (%d of %d sent): %s", redact_url(broker_url), sent, len(tasks), exc)
    finally:
        if own:
            app.close()
    return sent
