"""Telemetry ingestion: store one rollout step's telemetry and refit the fleet's profile, in one transaction.

`pearlctl event telemetry FILE.json` (and the demo's trainer) call `ingest_telemetry`. The telemetry
is validated before anything is written (`controlplane/telemetry.py`: NaN, negative counts and
missing fields are refused with the field named). Then, in one transaction: the raw step is stored,
`tracker.fit_profile` folds it into the current profile (`profiles.load_profile`: fitted, else
measured engine over the workload prior, else the catalog prior) and the result is stored as a new
`fitted` row naming the row it was refit from (or the measured row whose engine the prior used) and
the telemetry row it folded in. A catalog prior computed on demand is stored first, so every fitted
chain starts at a stored row.

Duplicate step numbers: a step is folded in once. The same step again with the same content is a
no-op (a trainer that retries after a lost reply is safe); with different content it is refused
(BadInput, exit 2) and nothing is written. Refits are serialised (an advisory lock), so two
concurrent ingestions never both refit from the same row and lose one step.

When the step's makespan is known (`makespan_s`), T_over is refit against the prediction for the
configuration the fleet is running now (the tracker's residual); with nothing running it is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session

from .db import transaction
from .errors import BadInput
from .profiles import FLEET_DEVICE, fleet_inventory, fleet_key, load_profile, save_profile
from .schema import Profile as ProfileRow
from .schema import Telemetry
from .selector import current_config
from .state import load_snapshot
from .telemetry import StepTelemetry, parse_telemetry
from .tracker import fit_profile

PROFILE_FIT_LOCK = 0x7065_6172_6C01  # advisory lock key: one refit at a time


@dataclass(frozen=True)
class IngestResult:
    outcome: Literal["ingested", "unchanged"]
    step: int
    telemetry_id: int
    profile_id: int | None  # the fitted row that folded the step in
    based_on: int | None  # the row it was refit from
    symbols: dict[str, float]  # the fitted profile's method symbols (empty when unchanged)
    fit: dict[str, Any]  # how the refit went (tracker)

    def as_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "step": self.step,
            "telemetry_id": self.telemetry_id,
            "profile_id": self.profile_id,
            "based_on": self.based_on,
            "symbols": self.symbols,
            "fit": self.fit,
        }


def ingest_telemetry(
    engine: Engine, telemetry: StepTelemetry, *, makespan_s: float | None = None, actor: str = "telemetry"
) -> IngestResult:
    """Store the step and the refit profile in one transaction (module docstring)."""
    with transaction(engine, actor=actor, reason=f"telemetry step {telemetry.step}") as session:
        return ingest_in(session, telemetry, makespan_s=makespan_s)


def ingest_in(session: Session, telemetry: StepTelemetry, *, makespan_s: float | None = None) -> IngestResult:
    """`ingest_telemetry` inside the caller's transaction."""
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PROFILE_FIT_LOCK})
    existing = session.scalars(select(Telemetry).where(Telemetry.step == telemetry.step)).first()
    if existing is not None:
        return _already(session, existing, telemetry)
    inventory = fleet_inventory(session)
    key = fleet_key(inventory)
    current = load_profile(session, key, inventory.workload)
    row = Telemetry(step=telemetry.step, body=telemetry.model_dump(mode="json"))
    session.add(row)
    session.flush()
    based_on = current.row_id if current.row_id is not None else current.measured_id
    if based_on is None:
        based_on = save_profile(session, current.profile)  # the computed catalog prior starts the chain
    config = current_config(load_snapshot(session)) if makespan_s is not None else None
    fitted = fit_profile(
        current.profile, telemetry, makespan_s=makespan_s if config else None, config=config, device=FLEET_DEVICE
    )
    profile_id = save_profile(session, fitted, based_on=based_on, telemetry_id=row.id)
    fit = dict(fitted.fit)
    if makespan_s is not None and config is None:
        fit["makespan_ignored"] = "no worker is active: the configuration the makespan was measured on is unknown"
    return IngestResult("ingested", telemetry.step, row.id, profile_id, based_on, fitted.symbols(), fit)


def _already(session: Session, existing: Telemetry, telemetry: StepTelemetry) -> IngestResult:
    if parse_telemetry(existing.body, f"telemetry row {existing.id}") != telemetry:
        raise BadInput(
            f"step: step {telemetry.step} was already ingested (telemetry row {existing.id}) with different "
            "content; a step is folded into the profile once"
        )
    folded = session.scalars(select(ProfileRow).where(ProfileRow.telemetry_id == existing.id)).first()
    return IngestResult(
        "unchanged", telemetry.step, existing.id, folded.id if folded else None, folded.based_on if folded else None,
        {}, {},
    )
