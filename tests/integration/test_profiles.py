"""The profile store against real PostgreSQL: history per key, what the fleet plans with (fitted, else
a measured engine over the workload prior, else the catalog prior), and keys that never mix devices."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pearl.controlplane.core.profile import EngineProfile, ProfileKey, Provenance, Rollout
from pearl.controlplane.core.workload import Workload
from pearl.controlplane.errors import BadInput
from pearl.controlplane.store import profile_store
from pearl.controlplane.store.schema import Profile as ProfileRow
from plan_support import paper_workload
from sqlalchemy.orm import Session

pytestmark = pytest.mark.integration

FLEET = ProfileKey("qwen3-8b", "h800", 2, profile_store.FLEET_DEVICE)
WORKLOAD = Workload.model_validate(paper_workload())


def engine_scaled(factor: float) -> EngineProfile:
    """The catalog engine with every time multiplied by `factor` (a stand-in for a measurement)."""
    e = profile_store.catalog_prior(FLEET, WORKLOAD).engine
    return replace(e, decode_base_s=tuple(x * factor for x in e.decode_base_s),
                   prefill_s_per_token=e.prefill_s_per_token * factor)


def test_without_rows_the_fleet_plans_with_the_catalog_prior(db_session: Session) -> None:
    loaded = profile_store.load_profile(db_session, FLEET, WORKLOAD)
    assert loaded.row_id is None and loaded.provenance is Provenance.CATALOG
    assert loaded.profile.key == ProfileKey("qwen3-8b", "h800", 2, "catalog")
    assert loaded.profile.batch_size == 64 and loaded.profile.max_context_tokens == 32768
    assert "catalog profile (qwen3-8b, h800, tp 2, catalog; computed)" == loaded.describe()


def test_the_inventorys_loop_reaches_the_prior(db_session: Session) -> None:
    """An inventory's `rollout` block: the fleet plans with asynchronous batches from the start."""
    loop = Rollout(batching="async", trajectories_per_slot=2, update_gap_s=93.0, update_pause_s=2.0,
                   abort_on_update=True)
    loaded = profile_store.load_profile(db_session, FLEET, WORKLOAD, rollout=loop)
    assert loaded.profile.rollout == loop
    assert profile_store.load_profile(db_session, FLEET, WORKLOAD).profile.rollout == Rollout()


def test_without_a_workload_block_or_telemetry_there_is_nothing_to_plan_with(db_session: Session) -> None:
    with pytest.raises(profile_store.NoWorkload, match=r"workload: the inventory has no `workload` block") as refused:
        profile_store.load_profile(db_session, FLEET, None)
    assert refused.value.exit_code == 2


def test_a_measured_engine_over_the_workload_prior(db_session: Session) -> None:
    row = profile_store.save_measured(db_session, FLEET, engine_scaled(2.0), {"device_name": "test"})
    loaded = profile_store.load_profile(db_session, FLEET, WORKLOAD)
    prior = profile_store.catalog_prior(FLEET, WORKLOAD)
    assert loaded.provenance is Provenance.MEASURED and loaded.measured_id == row and loaded.row_id is None
    assert loaded.profile.key == FLEET
    assert loaded.profile.engine == engine_scaled(2.0) and loaded.profile.workload == prior.workload
    assert loaded.profile.A > prior.A  # the measured engine is what the predictor now sees


def test_a_measurement_on_one_device_never_overrides_another(db_session: Session) -> None:
    on_gpu = profile_store.save_measured(db_session, FLEET, engine_scaled(2.0), {})
    # later measurements keyed to other devices, another tp, another GPU
    cpu = ProfileKey("qwen3-8b", "cpu", 2, "cpu")
    profile_store.save_measured(db_session, cpu, engine_scaled(50.0), {})
    profile_store.save_measured(db_session, ProfileKey("qwen3-8b", "h800", 2, "cpu"), engine_scaled(40.0), {})
    profile_store.save_measured(db_session, replace(FLEET, tp=1), engine_scaled(30.0), {})
    profile_store.save_measured(db_session, replace(FLEET, gpu="h100"), engine_scaled(20.0), {})
    loaded = profile_store.load_profile(db_session, FLEET, WORKLOAD)
    assert loaded.measured_id == on_gpu and loaded.profile.engine == engine_scaled(2.0)
    assert profile_store.measured_engine(profile_store.current_row(db_session, cpu)) == engine_scaled(50.0)
    # and a new measurement of the same key does take over
    newer = profile_store.save_measured(db_session, FLEET, engine_scaled(3.0), {})
    assert profile_store.load_profile(db_session, FLEET, WORKLOAD).measured_id == newer


def test_a_fitted_row_wins_and_history_is_kept(db_session: Session) -> None:
    prior = profile_store.catalog_prior(FLEET, WORKLOAD)
    first = profile_store.save_profile(db_session, prior)
    fitted = replace(prior, key=FLEET, provenance=Provenance.FITTED, steps_observed=1, t_over_s=0.25)
    second = profile_store.save_profile(db_session, fitted, based_on=first)
    loaded = profile_store.load_profile(db_session, FLEET, None)  # a fitted profile needs no workload block
    assert loaded.row_id == second and loaded.provenance is Provenance.FITTED and loaded.measured_id is None
    assert loaded.profile == fitted and loaded.profile.t_over_s == 0.25
    # a measurement newer than the engine the chain started from: the fitted workload on the measured engine
    measured = profile_store.save_measured(db_session, FLEET, engine_scaled(2.0), {})
    rebased = profile_store.load_profile(db_session, FLEET, None)
    assert (rebased.row_id, rebased.measured_id, rebased.provenance) == (second, measured, Provenance.FITTED)
    assert rebased.profile.engine == engine_scaled(2.0)
    assert rebased.profile == replace(fitted, engine=engine_scaled(2.0))  # workload, T_over, steps kept
    assert f"row {second}, engine from measured row {measured}" in rebased.describe()
    # once a fit is based on that measurement, the chain starts there: the fit is used as it is
    refit = replace(rebased.profile, steps_observed=2)
    third = profile_store.save_profile(db_session, refit, based_on=measured)
    again = profile_store.load_profile(db_session, FLEET, None)
    assert (again.row_id, again.measured_id, again.profile) == (third, None, refit)
    assert [r.id for r in profile_store.history(db_session, FLEET)] == [third, measured, second]
    assert profile_store.current_row(db_session, FLEET).id == third
    summary = profile_store.row_summary(db_session.get(ProfileRow, second))
    assert summary["provenance"] == "fitted" and summary["based_on"] == first and summary["steps_observed"] == 1


def test_only_a_newer_measurement_of_the_same_key_rebases_a_fit(db_session: Session) -> None:
    older = profile_store.save_measured(db_session, FLEET, engine_scaled(2.0), {})
    prior = profile_store.load_profile(db_session, FLEET, WORKLOAD).profile
    fitted = replace(prior, provenance=Provenance.FITTED, steps_observed=1)
    row = profile_store.save_profile(db_session, fitted, based_on=older)
    # later measurements on another device, another tp: never applied to the fleet
    profile_store.save_measured(db_session, replace(FLEET, device="cpu"), engine_scaled(5.0), {})
    profile_store.save_measured(db_session, replace(FLEET, tp=1), engine_scaled(5.0), {})
    loaded = profile_store.load_profile(db_session, FLEET, WORKLOAD)
    assert (loaded.row_id, loaded.measured_id) == (row, None) and loaded.profile.engine == engine_scaled(2.0)


def test_a_scaled_measurement_is_never_planned_with(db_session: Session) -> None:
    full = profile_store.save_measured(db_session, FLEET, engine_scaled(2.0), {"scaled": False})
    profile_store.save_measured(db_session, FLEET, engine_scaled(0.1), {"scaled": True, "spec": {"scale": 0.5}})
    loaded = profile_store.load_profile(db_session, FLEET, WORKLOAD)
    assert loaded.measured_id == full and loaded.profile.engine == engine_scaled(2.0)
    refit = replace(loaded.profile, provenance=Provenance.FITTED)
    fitted = profile_store.save_profile(db_session, refit, based_on=full)
    profile_store.save_measured(db_session, FLEET, engine_scaled(0.2), {"scaled": True})  # newer, but scaled
    assert profile_store.load_profile(db_session, FLEET, WORKLOAD).measured_id is None
    assert profile_store.load_profile(db_session, FLEET, WORKLOAD).row_id == fitted


def test_only_scaled_measurements_leave_the_catalog_prior(db_session: Session) -> None:
    scaled = profile_store.save_measured(db_session, FLEET, engine_scaled(0.1), {"scaled": True})
    loaded = profile_store.load_profile(db_session, FLEET, WORKLOAD)
    assert loaded.provenance is Provenance.CATALOG and loaded.measured_id is None
    assert profile_store.current_row(db_session, FLEET).id == scaled  # kept as history


def test_a_damaged_row_is_refused_naming_the_field(db_session: Session) -> None:
    row = ProfileRow(model="qwen3-8b", gpu="h800", tp=2, device="cuda", provenance="fitted",
                     params={"batch_size": 64})
    db_session.add(row)
    db_session.flush()
    with pytest.raises(BadInput, match=f"profiles row {row.id}: profile: .*key"):
        profile_store.load_profile(db_session, FLEET, WORKLOAD)
    broken = ProfileRow(model="qwen3-8b", gpu="h800", tp=2, device="cpu", provenance="measured",
                        params={"engine": {"decode_batches": "x"}})
    db_session.add(broken)
    db_session.flush()
    with pytest.raises(BadInput, match=f"profiles row {broken.id}: params.engine: decode_batches"):
        profile_store.measured_engine(broken)
