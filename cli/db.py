"""`pearlctl db url|start|stop|status`: the database and broker pearl uses.

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
