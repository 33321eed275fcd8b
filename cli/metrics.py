"""`--metrics-port P` of the long-running commands (agent, loop, router serve, worker): serve the
process's Prometheus metrics on localhost:P (0: a free port; `PEARL_METRICS_HOST` binds elsewhere) and
record the URL in `metrics_endpoints`, where `pearlctl status --json` lists it under `metrics`."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import typer
from pearl.controlplane.errors import BadInput

MetricsPort = Annotated[int | None, typer.Option(
    "--metrics-port", min=0, max=65535,
    help="Serve Prometheus metrics at http://localhost:P/metrics (0: a free port); listed by `status --json`.")]


def start_metrics(engine: Any, component: str, port: int | None, *, node: str | None = None,
                  extra: Iterable[Any] = ()) -> Callable[[], None]:
    """Serve `component`'s metrics (and `extra` collectors) and keep its row (none without an engine:
    `router serve --no-register`); the function that stops both. With no port, nothing is served and
    the function does nothing."""
    if port is None:
        return lambda: None
    from pearl.controlplane.services.metrics import serve
    from pearl.controlplane.store.fleet_metrics import DatabaseErrorsCollector
    from pearl.controlplane.store.metrics_endpoints import Keeper

    try:
        server = serve(component, port, extra=(*extra, DatabaseErrorsCollector()))
    except OSError as exc:
        raise BadInput(f"--metrics-port: cannot serve metrics on port {port}: {exc.strerror or exc}") from None
    print(f"{component}: metrics on {server.url}", file=sys.stderr, flush=True)
    keeper = None if engine is None else Keeper(engine, component=component, node=node, url=server.url,
                                                host=socket.gethostname(), pid=os.getpid()).start()

    def stop() -> None:
        if keeper is not None:
            keeper.stop()
        server.stop()

    return stop
