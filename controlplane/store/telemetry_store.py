"""Telemetry ingestion: store one rollout step's telemetry and refit the fleet's profile, in one transaction.

`pearlctl event telemetry FILE.json` (and the demo's trainer) call `ingest_telemetry`. The telemetry
is validated before anything is written (`controlplane/core/telemetry.py`: NaN, negative counts and
missing fields are refused with the field named). Then, in one transaction: the raw step is stored,
`tracker.fit_profile` folds it into the current profile (`profile_store.load_profile`: fitted, else
measured engine over the workload prior, else the catalog prior; with no workload block and nothing
fitted yet, this very step is the prior) and the result is stored as a new `fitted` row naming the
row it was refit from (the measured row whose engine the profile uses, when it uses one; else the
fitted row) and the telemetry row it folded in. A prior computed on demand is stored first, so every
fitted chain starts at a stored row.

Duplicate step numbers: a step is folded in once. The same step again with the same content is a
no-op (a trainer that retries after a lost reply is safe); with different content it is refused
(BadInput, exit 2) and nothing is written. Refits are serialised (an advisory lock), so two
concurrent ingestions never both refit from the same row and lose one step.

When the step's makespan is known (`makespan_s`), T_over is refit against the prediction for the
configuration the step itself ran on: the distinct workers of its `iterations` records and their
roles. Without iteration records, or when they do not form one configuration (a worker in two
roles, colocated beside prefill or decode, a split missing one side), the makespan is not fitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pearl.controlplane.core.domain import ROLLOUT_ROLES, Role
from pearl.controlplane.core.predictor import Config
from pearl.controlplane.core.telemetry import StepTelemetry, parse_telemetry
from pearl.controlplane.core.tracker import fit_profile
from pearl.controlplane.errors import BadInput
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.profile_store import (
    FLEET_DEVICE,
    fleet_inventory,
    fleet_key,
    load_profile,
    lock_profiles,
    save_profile,
)
from pearl.controlplane.store.schema import Profile as ProfileRow
from pearl.controlplane.store.schema import Telemetry
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session


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
    lock_profiles(session)
    existing = session.scalars(select(Telemetry).where(Telemetry.step == telemetry.step)).first()
    if existing is not None:
        return _already(session, existing, telemetry)
    inventory = fleet_inventory(session)
    key = fleet_key(inventory)
    current = load_profile(session, key, inventory.workload, first_step=telemetry,
                           rollout=inventory.rollout.rollout() if inventory.rollout else None)
    row = Telemetry(step=telemetry.step, body=telemetry.model_dump(mode="json"))
    session.add(row)
    session.flush()
    based_on = current.measured_id if current.measured_id is not None else current.row_id
    if based_on is None:
        based_on = save_profile(session, current.profile)  # the computed prior starts the chain
    config, unknown = step_config(telemetry) if makespan_s is not None else (None, None)
    fitted = fit_profile(
        current.profile, telemetry, makespan_s=makespan_s if config else None, config=config, device=FLEET_DEVICE
    )
    profile_id = save_profile(session, fitted, based_on=based_on, telemetry_id=row.id)
    fit = dict(fitted.fit)
    if unknown:
        fit["makespan_ignored"] = unknown
    return IngestResult("ingested", telemetry.step, row.id, profile_id, based_on, fitted.symbols(), fit)


def step_config(telemetry: StepTelemetry) -> tuple[Config | None, str | None]:
    """The configuration the step ran on, from its own iteration records, or None and why not."""
    if not telemetry.iterations:
        return None, "the step has no `iterations` records: the configuration its makespan was measured on is unknown"
    roles: dict[str, set[Role]] = {}
    for it in telemetry.iterations:
        roles.setdefault(str(it.worker), set()).add(it.role)
    if any(len(r) != 1 or not r <= set(ROLLOUT_ROLES) for r in roles.values()):
        return None, "a worker of the step's `iterations` served in several roles (or none of the rollout roles)"
    counts: dict[Role, int] = {}
    for (role,) in roles.values():
        counts[role] = counts.get(role, 0) + 1
    config = Config.from_counts(counts)
    if config is None:
        return None, f"the step's `iterations` mix roles that form no configuration ({sorted(map(str, counts))})"
    return config, None


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
