"""`pearlctl router`: the front door (agents/router.py) over two real sglang-router processes."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from pearl.controlplane.errors import BadInput, PearlError

from .common import emit_json, handle_errors, out
from .metrics import MetricsPort, start_metrics

router_app = typer.Typer(help="The front door: one client address over the sglang routers.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(router_app, name="router")


@router_app.command("serve")
@handle_errors
def serve(
    port: Annotated[int, typer.Option(help="The clients' address (port).")] = 30000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    mode: Annotated[str | None, typer.Option(help="Initial mode: colocated or split (default: the mode recorded for "
                                                  "the fleet's front door, else colocated).")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="State and router logs (default ./frontdoor).")] = None,
    hold_s: Annotated[float, typer.Option(help="How long a request may wait for workers of the mode.")] = 120.0,
    max_held: Annotated[int, typer.Option(help="Requests held at once before refusing.")] = 4096,
    drain_s: Annotated[float, typer.Option(help="At SIGTERM, how long the requests in flight may take to finish "
                                                "(a second SIGTERM ends the wait).")] = 60.0,
    register_in_db: Annotated[bool, typer.Option(
        "--register/--no-register", help="Record it in pearl's database, where the agents find it.")] = True,
    admin_port: Annotated[int, typer.Option(help="The admin API's port (the agents'; 0: any free one).")] = 0,
    admin_host: Annotated[str, typer.Option(help="Address the admin API binds (localhost unless agents on other "
                                                 "nodes need it).")] = "127.0.0.1",
    advertise_url: Annotated[str | None, typer.Option(
        help="The clients' URL other nodes reach it at, as recorded (default http://HOST:PORT; required when "
             "HOST is a wildcard such as 0.0.0.0).")] = None,
    advertise_admin_url: Annotated[str | None, typer.Option(
        help="The admin API's URL the agents reach it at (default http://ADMIN_HOST:ADMIN_PORT; required when "
             "ADMIN_HOST is a wildcard).")] = None,
    metrics_port: MetricsPort = None,
) -> None:
    """Run the front door and its routers until SIGTERM. The admin API (the agents' registrations and
    mode changes) has a port of its own and, with a database (or PEARL_TOKEN_FILE), needs the
    control token."""
    from pearl.agents.router import MODES, FrontDoorConfig
    from pearl.agents.router import serve as run
    from pearl.controlplane.services.token import token_from_file

    if mode is not None and mode not in MODES:
        raise BadInput(f"--mode: one of {', '.join(MODES)}, not {mode!r}")
    if not 0 < port < 65536:
        raise BadInput(f"--port: a TCP port (1-65535), not {port}")
    if not 0 <= admin_port < 65536 or admin_port == port:
        raise BadInput(f"--admin-port: a TCP port (0-65535) other than --port, not {admin_port}")
    url = _advertised("--advertise-url", advertise_url, host, port)
    # with --admin-port 0 the port is known once bound: the registration reads it from the state
    admin_url = _advertised("--advertise-admin-url", advertise_admin_url, admin_host, admin_port or None)
    if hold_s < 0 or max_held < 0 or drain_s < 0:
        raise BadInput("--hold-s, --max-held, --drain-s: not negative")
    engine = None
    token = token_from_file()
    if register_in_db:
        from pearl.controlplane.store.db import make_engine, require_schema
        from pearl.controlplane.store.routers import recorded_mode
        from pearl.controlplane.store.secrets import control_token

        engine = make_engine(component="frontdoor")
        require_schema(engine)
        token = control_token(engine)
        if mode is None:  # a front door started again on a new run directory serves the fleet's mode
            mode = recorded_mode(engine)
    # a state.json in the run directory overrides this: the mode it served before a restart
    cfg = FrontDoorConfig(port=port, host=host, mode=mode or "colocated", run_dir=str(run_dir) if run_dir else None,
                          hold_s=hold_s, max_held=max_held, drain_s=drain_s, admin_port=admin_port,
                          admin_host=admin_host, token=token)
    if engine is not None:
        threading.Thread(target=_register_then_beat, args=(engine, cfg, url, admin_url), daemon=True).start()
    try:
        import asyncio

        asyncio.run(run(cfg, started=lambda door: _metrics(engine, metrics_port, door)))
    except RuntimeError as exc:
        raise PearlError(str(exc)) from None
    finally:
        if engine is not None:
            from pearl.controlplane.store.routers import router_stopped

            router_stopped(engine, pid=os.getpid())
            engine.dispose()


def _metrics(engine: Any, port: int | None, door: Any) -> Callable[[], None]:
    from pearl.agents.frontdoor_metrics import FrontDoorCollector

    return start_metrics(engine, "frontdoor", port, extra=(FrontDoorCollector(door),))


WILDCARDS = ("0.0.0.0", "::", "")


def _advertised(option: str, given: str | None, host: str, port: int | None) -> str | None:
    """The URL recorded for other processes: the one given, else the bound address (never a wildcard,
    which names no host another node can reach)."""
    from urllib.parse import urlsplit

    if given is None:
        if host in WILDCARDS:
            raise BadInput(f"{option}: required when binding {host or 'every address'!r} (the URL other nodes "
                           "reach it at)")
        if port is None:  # bound to a port of the system's choosing: known once it listens
            return None
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    parts = urlsplit(given)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.hostname in WILDCARDS \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BadInput(f"{option}: an http(s)://HOST[:PORT] URL other nodes can reach, not {given!r}")
    return given.rstrip("/")


def _register_then_beat(engine: object, cfg: object, url: str, admin_url: str | None) -> None:
    if _register_when_listening(engine, cfg, url=url, admin_url=admin_url):
        _heartbeat(engine)


def _register_when_listening(engine: object, cfg: object, timeout_s: float = 120.0,
                             retry_max_s: float = 5.0, url: str | None = None, admin_url: str | None = None) -> bool:
    """Record the front door in pearl's database (`routers`), where the agents find it, once it
    answers: an agent never registers a worker with a front door that is not listening yet. A database
    that does not answer (or gives up on the statement) is tried again until it does: the front door
    is no use to the agents until its row is there."""
    import time

    import httpx
    from pearl.controlplane.store.routers import register_router

    host = cfg.host if cfg.host not in WILDCARDS else "127.0.0.1"  # type: ignore[attr-defined]
    local = f"http://{host}:{cfg.port}"  # type: ignore[attr-defined]
    url = url or local
    deadline = time.monotonic() + timeout_s
    wait_s = 0.1
    while time.monotonic() < deadline:
        try:
            resp = httpx.get(local + "/pearl/state", timeout=2.0)
        except httpx.HTTPError:
            time.sleep(0.1)
            continue
        if resp.status_code != 200:
            time.sleep(0.1)
            continue
        try:  # the mode it serves (a restart restores it from its run dir) and its admin port
            state = resp.json()
        except ValueError:
            state = {}
        mode = state.get("mode") or cfg.mode  # type: ignore[attr-defined]
        if admin_url is None and state.get("admin_port"):
            admin_url = _advertised("--advertise-admin-url", None, cfg.admin_host,  # type: ignore[attr-defined]
                                    int(state["admin_port"]))
        try:
            register_router(engine, url=url, admin_url=admin_url or url, host=cfg.host,  # type: ignore[arg-type,attr-defined]
                            pid=os.getpid(), mode=mode)
        except PearlError as exc:  # the database away or busy: no deadline, the agents need the row
            print(f"front door: registering: {exc}; trying again in {wait_s:.1f} s", file=sys.stderr, flush=True)
            time.sleep(wait_s)
            wait_s = min(wait_s * 2, retry_max_s)
            deadline = max(deadline, time.monotonic() + retry_max_s)
            continue
        return True
    return False


def _heartbeat(engine: object) -> None:
    """Until the process ends (a daemon thread): its row stays fresh, so that agents tell a killed front
    door from a running one."""
    import time

    from pearl.controlplane.store.routers import HEARTBEAT_S, heartbeat

    while True:
        time.sleep(HEARTBEAT_S)
        try:
            if not heartbeat(engine, pid=os.getpid()):  # type: ignore[arg-type]
                return  # stopped, or another front door took the row over
        except PearlError as exc:  # the database away a while: the next beat tries again
            print(f"front door: heartbeat: {exc}", file=sys.stderr, flush=True)


@router_app.command("state")
@handle_errors
def state(
    url: Annotated[str | None, typer.Option(
        help="The front door (default: the fleet's, found in pearl's database, and compared with its rows).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The front door's mode and the workers each router lists; for the fleet's front door, also the
    serving workers no router lists (the node agents' watches register them again) and the workers
    listed that do not serve."""
    from pearl.agents.router_client import FrontDoorClient
    from pearl.controlplane.services.token import token_from_file

    engine = None
    token = token_from_file()
    if url is None:
        from pearl.controlplane.store.db import make_engine, require_schema
        from pearl.controlplane.store.routers import front_door

        engine = make_engine(component="frontdoor")
    try:
        if engine is not None:
            require_schema(engine)
            found = front_door(engine)
            if found is None:
                raise PearlError("no front door is recorded in pearl's database (is `pearlctl router serve` "
                                 "running with --register?); name one with --url")
            if not found.running:
                raise PearlError(f"the fleet's front door ({found.admin_url}) is stopped: restarting, or stopped "
                                 f"on purpose; name another with --url")
            from pearl.controlplane.store.secrets import control_token

            url, token = found.admin_url, control_token(engine)
        with FrontDoorClient(url, token=token) as client:
            st = client.state()
        if engine is not None:
            st["rows"] = _compared_with_rows(engine, st)
    finally:
        if engine is not None:
            engine.dispose()
    if as_json:
        emit_json(st)
        return
    out.print(f"front door {st['url']}: mode {st['mode']}, {st['inflight']} in flight, {st['held']} held")
    for mode, child in st["children"].items():
        workers = ", ".join(f"{w['url']} ({w['worker_type']})" for w in child["workers"]) or "none"
        out.print(f"  {mode} router {child['url']} (pid {child['pid']}): {workers}")
    rows = st.get("rows")
    if rows is None:
        return
    if rows["listed"] is None:
        out.print("  a router could not say what it lists: not compared with the rows")
    elif not rows["missing"] and not rows["not_serving"]:
        out.print("  lists every serving worker of the rows, and no other")
    for w in rows["missing"] or []:
        out.print(f"  not listed: worker {w['worker_id']} at {w['endpoint']} ({w['role']}), serving in the rows")
    for listed_url in rows["not_serving"] or []:
        out.print(f"  listed but serving no worker in the rows: {listed_url}")


def _compared_with_rows(engine: object, st: dict) -> dict:
    from pearl.agents.router_client import listed_workers
    from pearl.controlplane.core.routing import routing_drift
    from pearl.controlplane.store.routers import serving_workers

    listed = listed_workers(st)
    if listed is None:
        return {"listed": None, "missing": None, "not_serving": None}
    missing, unknown = routing_drift(listed, serving_workers(engine))  # type: ignore[arg-type]
    return {"listed": len(listed),
            "missing": [{"worker_id": w, "endpoint": e, "role": r.value} for w, e, r in missing],
            "not_serving": unknown}


if __name__ == "__main__":  # `python -m pearl.cli.router serve ...` is `pearlctl router serve ...`, faster to start
    router_app()
