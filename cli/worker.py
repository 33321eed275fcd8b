"""`pearlctl worker --node NAME`: the node's weight-sync Celery worker (agents/celery_app.py).

It consumes the queue `node.<NAME>` (broker: PEARL_BROKER_URL, else the embedded Redis, started if
needed), one task per thread at a time. SIGTERM: it finishes the tasks it runs, then exits 0; a
SIGKILL loses nothing (the tasks are acknowledged after they ran, and the rows say what is done).
A worker whose consumer stalls (its queue holds work, a thread stays free for `--stall-s`), or whose
Celery worker stops on an error it was not asked to stop for, starts itself again in place, keeping
its PID.
"""

from __future__ import annotations

import socket
import time
from typing import Annotated

import typer

from .common import handle_errors, setup_logging
from .metrics import MetricsPort, start_metrics


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)


@handle_errors
def worker(
    node: Annotated[str, typer.Option("--node", help="The node whose queue (node.NAME) it consumes.")],
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="Syncs run at once (threads).")] = 4,
    resend_s: Annotated[float, typer.Option("--resend-s", min=1.0,
                                            help="Send the node's unfinished syncs again this often.")] = 30.0,
    stall_s: Annotated[float, typer.Option("--stall-s", min=1.0,
                                           help="Start again in place when the queue holds work and a thread "
                                                "stays free this long.")] = 60.0,
    json_logs: Annotated[bool, typer.Option("--json-logs", help="Log JSON lines.")] = False,
    metrics_port: MetricsPort = None,
) -> None:
    """Run a node's weight-sync worker until SIGTERM."""
    from pearl.agents import celery_app
    from pearl.controlplane.core.inventory import check_node_name
    from pearl.controlplane.services import embedded
    from pearl.controlplane.store.db import require_schema
    from pearl.controlplane.weights.dispatch import queue_name

    check_node_name("--node", node)
    setup_logging(json_logs)
    broker = embedded.broker_url()
    require_schema(celery_app.engine())
    stop_metrics = start_metrics(celery_app.engine(), "worker", metrics_port, node=node)
    app = celery_app.create_app(broker, node)
    celery_app.resend_pending(app, broker, node)
    resender = celery_app.Resender(app, broker, node, resend_s, concurrency=concurrency, stall_s=stall_s)
    resender.start()
    w = app.Worker(queues=[queue_name(node)], pool="threads", concurrency=concurrency,
                   hostname=f"pearl-{node}@{socket.gethostname()}", loglevel="INFO", without_gossip=True,
                   without_mingle=True, without_heartbeat=True, optimization="fair")
    try:
        w.start()
    finally:
        resender.stopped.set()
        if not w.exitcode or celery_app.shutting_down():  # a restart in place keeps the row (same PID)
            stop_metrics()
    if w.exitcode and not celery_app.shutting_down():
        # Celery gave up on an error nobody asked for (a broker connection lost mid-acknowledgement can
        # end it as "unrecoverable"): start again in place, as a service manager would
        celery_app.log.error("the worker of %s stopped on an error (exit %s): starting it again", node, w.exitcode)
        time.sleep(2.0)
        celery_app.restart_in_place()
    raise typer.Exit(w.exitcode or 0)
