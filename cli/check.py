"""`pearlctl check`: the invariant checker (controlplane/store/invariants.py) over the tables and the log."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import emit_json, handle_errors, out


def register(app: typer.Typer) -> None:
    app.command("check")(check)


@handle_errors
def check(as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Check every invariant against the rows and the audit log (read-only): exit 0 when none is
    violated, 1 naming each violation."""
    from pearl.controlplane.store import invariants
    from pearl.controlplane.store.db import make_engine, require_schema

    engine = make_engine(component="audit")
    try:
        require_schema(engine)
        report = invariants.check(engine)
    finally:
        engine.dispose()
    if as_json:
        emit_json(report.to_dict())
    elif report.ok:
        out.print(f"{len(report.checks)} checks, no violation (state_version {report.state_version})",
                  highlight=False)
    else:
        for v in report.violations:
            out.print(f"invariant {v.invariant} [{v.check}] {v.detail}", highlight=False, markup=False)
        out.print(f"{len(report.violations)} violation(s) in {len(report.checks)} checks", highlight=False)
    if not report.ok:
        raise typer.Exit(1)
