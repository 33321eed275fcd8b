"""`pearlctl dashboard [--port P] [--host H]`: the read-only web page over the database
(agents/dashboard.py) until SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Annotated

import typer
from pearl.controlplane.errors import BadInput

from .common import handle_errors


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)


@handle_errors
def dashboard(
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port (0: a free one).")] = 8600,
    host: Annotated[str, typer.Option(
        "--host", help="Address to bind; anything but localhost needs the control token on every request.")]
    = "127.0.0.1",
) -> None:
    """Serve the fleet's dashboard: GPUs by node and zone, workers, the applying plan's timeline, the
    policy's decisions, borrow cycles and preemptible grants, refreshed live from the database."""
    from pearl.agents.dashboard import LOOPBACK, build_app, serve
    from pearl.controlplane.store.dashboard import read_dashboard_state
    from pearl.controlplane.store.db import make_engine, require_schema
    from pearl.controlplane.store.secrets import token_matches

    engine = make_engine(component="audit")
    try:
        require_schema(engine)
        token = None if host in LOOPBACK else (lambda offered: token_matches(engine, offered))
        app = build_app(lambda: read_dashboard_state(engine), token)
        stop = asyncio.Event()

        def bound(chosen: int) -> None:
            shown = f"[{host}]" if ":" in host else host
            print(f"dashboard on http://{shown}:{chosen}/" + ("?token=<the control token>" if token else ""),
                  file=sys.stderr, flush=True)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await serve(app, host, port, stop, bound)

        try:
            asyncio.run(main())
        except OSError as exc:
            raise BadInput(f"--port: cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    finally:
        engine.dispose()
