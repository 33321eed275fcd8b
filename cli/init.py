"""`pearlctl init`: create or upgrade the schema (Alembic, head revision)."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import emit_json, handle_errors, out


def register(app: typer.Typer) -> None:
    app.command("init")(init)


@handle_errors
def init(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Create or upgrade pearl's schema in the database (safe to run again, and concurrently)."""
    from pearl.controlplane.services.settings import redact_url
    from pearl.controlplane.store.db import current_revision, make_engine, upgrade

    engine = make_engine()
    try:
        before = current_revision(engine)
        after = upgrade(engine)
    finally:
        engine.dispose()
    where = redact_url(engine.url)
    if as_json:
        emit_json({"database": where, "revision": after, "previous": before, "upgraded": before != after})
    else:
        out.print(f"schema at {after} in {where}" + ("" if before == after else f" (was {before or 'empty'})"))
