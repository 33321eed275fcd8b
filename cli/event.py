"""`pearlctl event ...`: what the trainer and the provider report. `event telemetry FILE.json` ingests
one rollout step's telemetry and refits the profile."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from pearl.controlplane.core.telemetry import load_telemetry
from pearl.controlplane.errors import BadInput
from pearl.controlplane.store.db import make_engine, require_schema
from pearl.controlplane.store.telemetry_store import ingest_telemetry

from .common import emit_json, handle_errors, out

event_app = typer.Typer(help="Events from the trainer, the provider and the rollout.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(event_app, name="event")


@event_app.command("telemetry")
@handle_errors
def telemetry(
    file: Annotated[Path, typer.Argument(help="One rollout step's telemetry (JSON, docs/formats.md).")],
    makespan_s: Annotated[float | None, typer.Option(
        "--makespan-s", help="The step's measured makespan: T_over is refit against the running configuration.")]
    = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Store one step's telemetry and refit the fleet's profile (a step already ingested: no-op if identical)."""
    step = load_telemetry(file)  # bad telemetry is refused before the database is touched
    if makespan_s is not None and not (math.isfinite(makespan_s) and makespan_s > 0):
        raise BadInput(f"--makespan-s: must be a finite number > 0, got {makespan_s}")
    engine = make_engine()
    try:
        require_schema(engine)
        result = ingest_telemetry(engine, step, makespan_s=makespan_s, actor="pearlctl event telemetry")
    finally:
        engine.dispose()
    if as_json:
        emit_json(result.as_dict())
    elif result.outcome == "unchanged":
        out.print(f"{file}: step {result.step} was already ingested (telemetry row {result.telemetry_id}); "
                  "nothing changed")
    else:
        sym = result.symbols
        out.print(f"{file}: step {result.step} ingested (telemetry row {result.telemetry_id}); fitted profile row "
                  f"{result.profile_id} from row {result.based_on}: S={sym['S']:.1f} r={sym['r']:.0f} "
                  f"dL={sym['dL']:.0f} f={sym['f']:.2f} T_over={sym['T_over']:.3f}s", highlight=False)
