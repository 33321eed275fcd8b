"""`pearlctl db url|start|stop|status|roles`: the database and broker pearl uses, and its database roles.

With `PEARL_DATABASE_URL` / `PEARL_BROKER_URL` unset these are embedded servers under `PEARL_HOME`,
started on first use and left running for the next invocation; `db stop` stops them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer

from .common import emit_json, handle_errors, out

if TYPE_CHECKING:
    from pearl.controlplane.services.embedded import ServiceStatus

db_app = typer.Typer(help="The database and broker: embedded servers under PEARL_HOME, or the configured ones.",
                     no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def register(app: typer.Typer) -> None:
    app.add_typer(db_app, name="db")


def _render(statuses: list[ServiceStatus], as_json: bool) -> None:
    if as_json:
        emit_json({s.service: asdict(s) for s in statuses})
        return
    from rich.table import Table

    table = Table("service", "where", "running", "pid")
    table.add_column("url", overflow="fold")
    for s in statuses:
        table.add_row(s.service, "embedded" if s.embedded else "configured", "yes" if s.running else "no",
                      str(s.pid or ""), s.url)
    out.print(table)


@db_app.command("url")
@handle_errors
def url(broker: Annotated[bool, typer.Option("--broker", help="The broker URL instead.")] = False) -> None:
    """Print the database URL (for psql; without any password), starting the embedded server if needed."""
    from pearl.controlplane.services.embedded import broker_url, database_url
    from pearl.controlplane.services.settings import get_settings, redact_url

    settings = get_settings()
    value = broker_url(settings) if broker else database_url(settings)
    typer.echo(redact_url(value))


@db_app.command("start")
@handle_errors
def start(as_json: JsonOption = False) -> None:
    """Start the embedded PostgreSQL and Redis (nothing starts for a configured URL)."""
    from pearl.controlplane.services.embedded import broker_url, database_url, postgres_status, redis_status
    from pearl.controlplane.services.settings import get_settings

    settings = get_settings()
    database_url(settings)
    broker_url(settings)
    _render([postgres_status(settings), redis_status(settings)], as_json)


@db_app.command("stop")
@handle_errors
def stop(as_json: JsonOption = False) -> None:
    """Stop the embedded servers under PEARL_HOME (configured servers are not touched)."""
    from pearl.controlplane.services.embedded import stop_postgres, stop_redis
    from pearl.controlplane.services.settings import get_settings

    home = get_settings().home
    stopped = {"postgresql": stop_postgres(home), "redis": stop_redis(home)}
    if as_json:
        emit_json({"stopped": stopped})
        return
    for service, was_running in stopped.items():
        out.print(f"{service}: {'stopped' if was_running else 'was not running'}")


@db_app.command("status")
@handle_errors
def status(as_json: JsonOption = False) -> None:
    """Whether the database and the broker run, where, and their URLs."""
    from pearl.controlplane.services.embedded import postgres_status, redis_status
    from pearl.controlplane.services.settings import get_settings

    settings = get_settings()
    _render([postgres_status(settings), redis_status(settings)], as_json)


@db_app.command("roles")
@handle_errors
def roles_command(
    node: Annotated[list[str] | None, typer.Option("--node", help="Create this node's agent role (repeat); "
                                                                  "default: every node of the inventory.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Create the agents' database roles (one login per node, in pearl_agent) and list the role each
    component connects as under PEARL_DATABASE_ROLES=component. Run as the owner (the URL's user),
    after `pearlctl cluster import`; give each login a password on a managed server."""
    from pearl.controlplane.core.inventory import check_node_name
    from pearl.controlplane.store import roles
    from pearl.controlplane.store.db import make_engine, require_schema

    engine = make_engine()
    try:
        require_schema(engine)
        known = roles.node_names(engine)
        for name in node or []:
            check_node_name("--node", name)
        made = {name: roles.ensure_node_role(engine, name) for name in (node or known)}
    finally:
        engine.dispose()
    listing = {"components": {c: roles.role_for(c) if c != "agent" else None for c in roles.COMPONENTS
                              if c not in ("owner", "agent")}, "agents": made}
    if as_json:
        emit_json(listing)
        return
    for component, role in listing["components"].items():
        out.print(f"{component:10s} {role}", highlight=False)
    for name, role in made.items():
        out.print(f"agent      {role}  (node {name})", highlight=False)
