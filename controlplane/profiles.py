"""The profile store: performance profiles as rows of `profiles`, one row per fit, history kept.

A profile is keyed by (model, gpu, tp, device) and says where its figures come from (`catalog`,
`measured`, `fitted`). The current row of a key is its latest (highest id); older rows are its
history, and a fitted row names the row it was refit from (`based_on`) and the telemetry it folded in.

What the fleet plans with (`load_profile`), for the inventory's (model, gpu, tp) on FLEET_DEVICE:
1. the latest `fitted` row (refit from the fleet's telemetry, `telemetry_ingest`);
2. else the inventory's `workload:` block as the prior with the engine of the latest `measured`
   row (`pearlctl profile --device cuda`);
3. else the catalog prior: the workload block with the catalog performance model.
Without a fitted row and without a workload block there is nothing to plan with: NoWorkload names
the missing block. A measurement keyed to another device (a CPU run is keyed (model, "cpu", tp,
"cpu")) is never read for the fleet: a measurement on one device never overrides another's.

Rows hold `profile_to_dict(profile)`, except measured rows: a measurement times the engine only,
so they hold {"engine": EngineProfile as a dict, "measurement": how it was measured}.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from .catalog import default_catalog
from .domain import Provenance as RowProvenance
from .errors import BadInput, PearlError
from .inventory import Inventory, parse_inventory
from .perfmodel import PerfModel
from .profile import (
    EngineProfile,
    Profile,
    ProfileKey,
    Provenance,
    profile_from_dict,
    profile_from_workload,
    profile_to_dict,
)
from .schema import Fleet
from .schema import Profile as ProfileRow
from .workload import Workload

FLEET_DEVICE = "cuda"  # the device class of the fleet's GPUs: the key its fitted and measured profiles carry
_ENGINE = TypeAdapter(EngineProfile)


class NoInventory(PearlError):
    """No inventory has been imported: run `pearlctl cluster import FILE.yaml`."""


class NoWorkload(BadInput):
    """Nothing to plan with: the inventory has no `workload` block and no telemetry was ingested."""


@dataclass(frozen=True)
class StoredProfile:
    """A profile and the row it came from (None for the catalog prior, computed on demand)."""

    profile: Profile
    row_id: int | None
    created_at: datetime | None = None
    measured_id: int | None = None  # the measured row whose engine a workload prior uses

    @property
    def provenance(self) -> Provenance:
        return self.profile.provenance

    def describe(self) -> str:
        k = self.profile.key
        where = f"row {self.row_id}" if self.row_id is not None else "computed"
        extra = f", engine from measured row {self.measured_id}" if self.measured_id is not None else ""
        steps = f", {self.profile.steps_observed} telemetry steps" if self.profile.steps_observed else ""
        return f"{self.provenance.value} profile ({k.model}, {k.gpu}, tp {k.tp}, {k.device}; {where}{extra}{steps})"


def fleet_inventory(session: Session) -> Inventory:
    """The inventory the fleet was imported from (its canonical form in the `fleet` row)."""
    raw = session.scalar(select(Fleet.inventory).where(Fleet.id == 1))
    if not raw:
        raise NoInventory()
    return parse_inventory(raw, "fleet.inventory")


def fleet_key(inventory: Inventory) -> ProfileKey:
    return ProfileKey(inventory.model, inventory.gpu, inventory.tp, FLEET_DEVICE)


def _of_key(key: ProfileKey) -> Any:
    same = (ProfileRow.model == key.model, ProfileRow.gpu == key.gpu, ProfileRow.tp == key.tp,
            ProfileRow.device == key.device)
    # newest = highest id: ids follow the order rows were written (refits write under one lock), while
    # created_at is when the writing transaction began, which concurrent writers do not order
    return select(ProfileRow).where(*same).order_by(ProfileRow.id.desc())


def _latest(session: Session, key: ProfileKey, provenance: Provenance | None = None) -> ProfileRow | None:
    stmt = _of_key(key)
    if provenance is not None:
        stmt = stmt.where(ProfileRow.provenance == RowProvenance(provenance.value))
    return session.scalars(stmt.limit(1)).first()


def current_row(session: Session, key: ProfileKey) -> ProfileRow | None:
    """The current row of a key: its latest, whatever its provenance."""
    return _latest(session, key)


def history(session: Session, key: ProfileKey, limit: int = 50) -> list[ProfileRow]:
    """The key's rows, newest first."""
    return list(session.scalars(_of_key(key).limit(limit)))


def save_profile(
    session: Session, profile: Profile, *, based_on: int | None = None, telemetry_id: int | None = None
) -> int:
    """Store `profile` as the newest row of its key; returns the row id."""
    k = profile.key
    row = ProfileRow(
        model=k.model, gpu=k.gpu, tp=k.tp, device=k.device, provenance=RowProvenance(profile.provenance.value),
        params=profile_to_dict(profile), based_on=based_on, telemetry_id=telemetry_id,
    )
    session.add(row)
    session.flush()
    return row.id


def save_measured(session: Session, key: ProfileKey, engine: EngineProfile, measurement: dict[str, Any]) -> int:
    """Store a measured engine as the newest row of `key` (provenance `measured`); returns the row id."""
    row = ProfileRow(
        model=key.model, gpu=key.gpu, tp=key.tp, device=key.device, provenance=RowProvenance.MEASURED,
        params={"engine": _ENGINE.dump_python(engine, mode="json"), "measurement": measurement},
    )
    session.add(row)
    session.flush()
    return row.id


def measured_engine(row: ProfileRow) -> EngineProfile:
    """The engine a measured row holds; BadInput names the faulty field of a damaged row."""
    try:
        return _ENGINE.validate_python((row.params or {}).get("engine"))
    except ValidationError as exc:
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'engine'}: {e['msg']}" for e in exc.errors())
        raise BadInput(f"profiles row {row.id}: params.engine: {where}") from None


def stored(row: ProfileRow) -> StoredProfile:
    """A catalog or fitted row as a profile."""
    try:
        profile = profile_from_dict(row.params)
    except BadInput as exc:
        raise BadInput(f"profiles row {row.id}: {exc}") from None
    return StoredProfile(profile, row.id, row.created_at)


def catalog_prior(key: ProfileKey, workload: Workload) -> Profile:
    """The workload prior with the catalog performance model (keyed device "catalog")."""
    catalog = default_catalog()
    perf = PerfModel(catalog.model(key.model), catalog.gpu(key.gpu), key.tp)
    return profile_from_workload(workload, perf)


def load_profile(session: Session, key: ProfileKey, workload: Workload | None) -> StoredProfile:
    """What to plan with for `key` (module docstring): fitted, else measured engine over the workload
    prior, else the catalog prior. NoWorkload when only a workload block could help."""
    fitted = _latest(session, key, Provenance.FITTED)
    if fitted is not None:
        return stored(fitted)
    if workload is None:
        raise NoWorkload(
            f"workload: the inventory has no `workload` block and no telemetry has been fitted for "
            f"({key.model}, {key.gpu}, tp {key.tp}, {key.device}); add a `workload:` block (the scenario "
            "workload format) to the inventory and import it again with --replace"
        )
    prior = catalog_prior(key, workload)
    measured = _latest(session, key, Provenance.MEASURED)
    if measured is None:
        return StoredProfile(prior, None)
    profile = replace(prior, key=key, provenance=Provenance.MEASURED, engine=measured_engine(measured))
    return StoredProfile(profile, None, measured.created_at, measured_id=measured.id)


def row_summary(row: ProfileRow) -> dict[str, Any]:
    """A row as `pearlctl` prints it (without the bulky pools)."""
    out: dict[str, Any] = {
        "id": row.id,
        "key": {"model": row.model, "gpu": row.gpu, "tp": row.tp, "device": row.device},
        "provenance": row.provenance.value,
        "created_at": row.created_at.isoformat() if row.created_at else None,
        "based_on": row.based_on,
        "telemetry_id": row.telemetry_id,
    }
    if row.provenance is RowProvenance.MEASURED:
        out["measurement"] = (row.params or {}).get("measurement", {})
    else:
        out["steps_observed"] = (row.params or {}).get("steps_observed", 0)
    return out

