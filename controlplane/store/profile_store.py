"""The profile store: performance profiles as rows of `profiles`, one row per fit, history kept.

A profile is keyed by (model, gpu, tp, device) and says where its figures come from (`catalog`,
`measured`, `fitted`). The current row of a key is its latest (highest id); older rows are its
history, and a fitted row names the row it was refit from (`based_on`) and the telemetry it folded in.

What the fleet plans with (`load_profile`), for the inventory's (model, gpu, tp) on FLEET_DEVICE:
1. the latest `fitted` row (refit from the fleet's telemetry, `telemetry_store`); when a `measured`
   row is newer than the engine its fit chain started from (the chain's first row that is not
   fitted), that row's workload part with the newer measured engine (the next fit is based on it);
2. else the inventory's `workload:` block as the prior with the engine of the latest `measured`
   row (`pearlctl profile --device cuda`);
3. else the catalog prior: the workload block with the catalog performance model.
Without a fitted row and without a workload block, the first telemetry step is the prior when one
is being ingested (`telemetry_prior`: its trajectories as the workload pools); otherwise there is
nothing to plan with and NoWorkload names the missing block. A measurement keyed to another device
(a CPU run is keyed (model, "cpu", tp, "cpu")) is never read for the fleet: a measurement on one
device never overrides another's. A scaled-down measurement (`--scale` below 1) times a smaller
shape than the model's, so it is kept as history and never planned with.

Rows hold `profile_to_dict(profile)`, except measured rows: a measurement times the engine only,
so they hold {"engine": EngineProfile as a dict, "measurement": how it was measured}.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import numpy as np
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Provenance as RowProvenance
from pearl.controlplane.core.inventory import Inventory, parse_inventory
from pearl.controlplane.core.perfmodel import AGENTIC_LOAD, PerfModel
from pearl.controlplane.core.profile import (
    BATCH_HINT_WORKERS,
    EngineProfile,
    Profile,
    ProfileKey,
    Provenance,
    Rollout,
    WorkloadPools,
    engine_from_perf,
    pool_levels,
    profile_from_dict,
    profile_from_workload,
    profile_to_dict,
    quantile_pool,
)
from pearl.controlplane.core.telemetry import StepTelemetry
from pearl.controlplane.core.workload import Workload
from pearl.controlplane.errors import BadInput, PearlError
from pearl.controlplane.store.schema import Fleet
from pearl.controlplane.store.schema import Profile as ProfileRow
from pydantic import TypeAdapter, ValidationError
from sqlalchemy import literal, select, text
from sqlalchemy.orm import Session, aliased

FLEET_DEVICE = "cuda"  # the device class of the fleet's GPUs: the key its fitted and measured profiles carry
PROFILE_FIT_LOCK = 0x7065_6172_6C01  # advisory lock key: refits and measurements of profiles, one at a time
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


def _latest_measured(session: Session, key: ProfileKey) -> ProfileRow | None:
    """The latest measured row of `key` that timed the model's own shape (scaled ones are history only)."""
    stmt = _of_key(key).where(
        ProfileRow.provenance == RowProvenance.MEASURED,
        ProfileRow.params[("measurement", "scaled")].astext.is_distinct_from("true"),
    )
    return session.scalars(stmt.limit(1)).first()


def _chain_start(session: Session, fitted_id: int) -> int:
    """The id of the first row of a fit chain that is not fitted (the engine the chain started
    from), walking `based_on` back from `fitted_id`; the oldest row reached when the chain is cut."""
    walk = select(ProfileRow.id, ProfileRow.based_on, ProfileRow.provenance, literal(0).label("depth")).where(
        ProfileRow.id == fitted_id).cte("chain", recursive=True)
    parent = aliased(ProfileRow)
    walk = walk.union_all(
        select(parent.id, parent.based_on, parent.provenance, walk.c.depth + 1)
        .join(walk, parent.id == walk.c.based_on)
        .where(walk.c.provenance == RowProvenance.FITTED, parent.id < walk.c.id)  # older rows only: it ends
    )
    return session.scalars(select(walk.c.id).order_by(walk.c.depth.desc()).limit(1)).one()


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


def lock_profiles(session: Session) -> None:
    """Take the profiles' advisory lock for the rest of the transaction: a measurement and a refit
    never interleave, so a row's id tells which of them came first."""
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": PROFILE_FIT_LOCK})


def save_measured(session: Session, key: ProfileKey, engine: EngineProfile, measurement: dict[str, Any]) -> int:
    """Store a measured engine as the newest row of `key` (provenance `measured`); returns the row id."""
    lock_profiles(session)
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


# Profiles built from the same parameters are the same object: a profile caches its synthetic
# trajectories and symbols, which a planning pass would otherwise draw again on every pass.
_BUILT: dict[str, Profile] = {}
_BUILT_MAX = 32


def _built(key: str, build: Callable[[], Profile]) -> Profile:
    profile = _BUILT.get(key)
    if profile is None:
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.clear()
        profile = _BUILT[key] = build()
    return profile


def stored(row: ProfileRow) -> StoredProfile:
    """A catalog or fitted row as a profile."""
    try:
        profile = _built(json.dumps(row.params, sort_keys=True), lambda: profile_from_dict(row.params))
    except BadInput as exc:
        raise BadInput(f"profiles row {row.id}: {exc}") from None
    return StoredProfile(profile, row.id, row.created_at)


def catalog_prior(key: ProfileKey, workload: Workload, rollout: Rollout | None = None) -> Profile:
    """The workload prior with the catalog performance model as an engine under agentic rollout
    delivers it (keyed device "catalog"; the simulator's prior too)."""
    def build() -> Profile:
        catalog = default_catalog()
        perf = PerfModel(catalog.model(key.model), catalog.gpu(key.gpu), key.tp, AGENTIC_LOAD)
        return profile_from_workload(workload, perf, rollout=rollout)

    return _built(json.dumps([repr(key), workload.model_dump(mode="json"), repr(rollout)], sort_keys=True), build)


def telemetry_prior(key: ProfileKey, step: StepTelemetry) -> Profile:
    """The prior of a fleet whose inventory has no workload block: the first telemetry step's own
    trajectories as the workload pools, with the catalog performance model (keyed device "catalog").

    The context cap is the longest context a trajectory of the step reached (a truncated one reached
    the cap); f, when the step does not report it, starts as `profile_from_workload` starts it.
    """
    ran = [t for t in step.trajectories if t.turns > 0]
    if not ran:
        raise BadInput("telemetry.trajectories: no trajectory ran a turn")
    levels = pool_levels()

    def pool(values: list[float]) -> tuple[float, ...]:
        return quantile_pool(values or [0.0], levels)

    pools = WorkloadPools(
        prompt_tokens=pool([t.prompt_tokens for t in ran]),
        turns=pool([t.turns for t in ran]),
        gen_tokens=pool([x for t in ran for x in t.gen_tokens]),
        obs_tokens=pool([x for t in ran for x in t.obs_tokens[: t.turns - 1]]),
        env_s=pool([x for t in ran for x in t.env_s[: t.turns - 1]]),
        levels=levels,
    )
    catalog = default_catalog()
    perf = PerfModel(catalog.model(key.model), catalog.gpu(key.gpu), key.tp, AGENTIC_LOAD)
    engine = engine_from_perf(perf)
    cap = max(t.prompt_tokens + sum(t.gen_tokens) + sum(t.obs_tokens[: t.turns - 1]) for t in ran)
    draft = Profile(ProfileKey(key.model, key.gpu, key.tp, "catalog"), Provenance.CATALOG, step.batch_size,
                    max(1, cap), engine, pools, 1.0)
    f = step.decode_fraction
    if f is None:
        decode = draft.r * float(engine.decode_iteration_s(step.batch_size / BATCH_HINT_WORKERS,
                                                            draft.mean_context_tokens))
        f = float(np.clip(decode / (decode + draft.env_per_turn_s), 1e-3, 1.0)) if decode > 0 else 1.0
    return replace(draft, decode_fraction=f)


def load_profile(
    session: Session, key: ProfileKey, workload: Workload | None, *, first_step: StepTelemetry | None = None,
    rollout: Rollout | None = None,
) -> StoredProfile:
    """What to plan with for `key` (module docstring): fitted (on a newer measured engine when there
    is one), else measured engine over the workload prior, else the catalog prior. Without a workload
    block the telemetry step `first_step` (being ingested) is the prior; NoWorkload when there is none."""
    fitted = _latest(session, key, Provenance.FITTED)
    measured = _latest_measured(session, key)
    if fitted is not None:
        current = stored(fitted)
        if measured is None or measured.id <= _chain_start(session, fitted.id):
            return current
        rebased = replace(current.profile, engine=measured_engine(measured))
        return StoredProfile(rebased, fitted.id, fitted.created_at, measured_id=measured.id)
    if workload is not None:
        prior = catalog_prior(key, workload, rollout)
    elif first_step is not None:
        prior = replace(telemetry_prior(key, first_step), rollout=rollout or Rollout())
    else:
        raise NoWorkload(
            f"workload: the inventory has no `workload` block and no telemetry has been fitted for "
            f"({key.model}, {key.gpu}, tp {key.tp}, {key.device}); add a `workload:` block (the scenario "
            "workload format) to the inventory and import it again with --replace, or send the first "
            "step's telemetry (`pearlctl event telemetry FILE.json`)"
        )
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

