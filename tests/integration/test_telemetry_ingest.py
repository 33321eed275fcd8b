"""Telemetry ingestion against real PostgreSQL: the raw step and the refit profile in one transaction,
the provenance chain, duplicate steps, and `pearlctl event telemetry` refusing bad telemetry."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from pearl.controlplane import profiles
from pearl.controlplane.db import transaction
from pearl.controlplane.domain import Role
from pearl.controlplane.errors import BadInput
from pearl.controlplane.inventory import parse_inventory
from pearl.controlplane.schema import Profile as ProfileRow
from pearl.controlplane.telemetry import parse_telemetry
from pearl.controlplane.telemetry_ingest import ingest_telemetry
from pearl.controlplane.transitions import admit_worker, start_worker
from plan_support import import_cluster, small_inventory, telemetry, write_inventory
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

pytestmark = pytest.mark.integration

FLEET = profiles.fleet_key(parse_inventory(small_inventory()))


@pytest.fixture
def fleet_engine(db_engine: Engine) -> Engine:
    import_cluster(db_engine, small_inventory())
    return db_engine


def counts(engine: Engine) -> tuple[int, int]:
    """(telemetry rows, profile rows)."""
    with engine.connect() as conn:
        row = conn.execute(text("SELECT (SELECT count(*) FROM telemetry), (SELECT count(*) FROM profiles)")).one()
    return tuple(row)


def test_each_step_is_stored_and_refits_the_profile_with_its_provenance(fleet_engine: Engine) -> None:
    first = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(0)))
    second = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(1, iterations=True)))
    assert (first.outcome, second.outcome) == ("ingested", "ingested")
    with transaction(fleet_engine) as session:
        catalog = session.get(ProfileRow, first.based_on)
        fitted = [session.get(ProfileRow, r.profile_id) for r in (first, second)]
        loaded = profiles.load_profile(session, FLEET, None)
    # the chain: the computed catalog prior is stored, then each step's fit names its base and its step
    assert catalog.provenance.value == "catalog" and catalog.device == "catalog" and catalog.based_on is None
    assert [f.based_on for f in fitted] == [catalog.id, fitted[0].id]
    assert [f.telemetry_id for f in fitted] == [first.telemetry_id, second.telemetry_id]
    assert all((f.provenance.value, f.device) == ("fitted", profiles.FLEET_DEVICE) for f in fitted)
    assert loaded.row_id == second.profile_id and loaded.profile.steps_observed == 2
    assert loaded.profile.fit["step"] == 1 and loaded.profile.fit["decode_points"] == 6
    # the first step replaces the prior's f, the second averages with it: both measured 0.6
    assert catalog.params["decode_fraction"] != pytest.approx(0.6)
    assert second.symbols["f"] == loaded.profile.decode_fraction == pytest.approx(0.6)
    assert counts(fleet_engine) == (2, 3)


def test_a_measured_engine_is_the_prior_of_the_first_fit(fleet_engine: Engine) -> None:
    with transaction(fleet_engine) as session:
        prior = profiles.catalog_prior(FLEET, profiles.fleet_inventory(session).workload)
        measured = profiles.save_measured(session, FLEET, prior.engine, {"device_name": "test"})
    result = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(0)))
    assert result.based_on == measured
    assert counts(fleet_engine) == (1, 2)  # no catalog row: the measured row starts the chain


def test_the_same_step_again_is_a_no_op_and_different_content_is_refused(fleet_engine: Engine) -> None:
    first = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(3)))
    again = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(3)))
    assert again.outcome == "unchanged" and again.telemetry_id == first.telemetry_id
    assert again.profile_id == first.profile_id
    before = counts(fleet_engine)
    with pytest.raises(BadInput, match="step: step 3 was already ingested .* with different content"):
        ingest_telemetry(fleet_engine, parse_telemetry(telemetry(3, seed=7)))
    assert counts(fleet_engine) == before


def test_a_known_makespan_refits_t_over_against_the_running_configuration(fleet_engine: Engine) -> None:
    idle = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(0)), makespan_s=400.0)
    assert "makespan_ignored" in idle.fit and idle.symbols["T_over"] == 0.0
    with transaction(fleet_engine, actor="test") as session:
        start_worker(session, 3, Role.COLOCATED)
        admit_worker(session, 3)
    busy = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(1)), makespan_s=5000.0)
    assert busy.fit["config"] == "colocated" and busy.fit["makespan_s"] == 5000.0
    assert busy.symbols["T_over"] > 0  # a step far slower than predicted: the per-turn overhead absorbs it


def test_without_a_workload_block_telemetry_cannot_start_a_profile(db_engine: Engine) -> None:
    import_cluster(db_engine, small_inventory(workload=False))
    with pytest.raises(profiles.NoWorkload, match="workload"):
        ingest_telemetry(db_engine, parse_telemetry(telemetry(0)))
    assert counts(db_engine) == (0, 0)


# -- the command ---------------------------------------------------------------------------------------


def _rows(database_url: str) -> tuple[int, int]:
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        return counts(engine)
    finally:
        engine.dispose()


def _import(database_url: str) -> None:
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        import_cluster(engine, small_inventory())
    finally:
        engine.dispose()


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda t: t["trajectories"][2]["env_s"].__setitem__(0, float("nan")), "trajectories[2].env_s"),
    (lambda t: t["trajectories"][0]["gen_tokens"].__setitem__(1, -5), "trajectories[0].gen_tokens"),
    (lambda t: t["trajectories"][1].pop("prompt_tokens"), "trajectories[1].prompt_tokens"),
    (lambda t: t.pop("batch_size"), "batch_size"),
    (lambda t: t.__setitem__("step", -1), "step"),
], ids=["nan", "negative-count", "missing-field", "missing-batch-size", "negative-step"])
def test_bad_telemetry_is_refused_naming_the_field_and_nothing_is_written(
    pearlctl: Callable, database_url: str, tmp_path: Path, mutate: Callable, field: str
) -> None:
    _import(database_url)
    body = telemetry(0)
    mutate(body)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))  # NaN is written as the JSON extension `NaN`, as Python emits it
    result = pearlctl("event", "telemetry", str(path))
    assert result.returncode == 2, result.stderr
    assert field in result.stderr and str(path) in result.stderr
    assert _rows(database_url) == (0, 0)


def test_event_telemetry_ingests_a_step_and_reports_it(pearlctl: Callable, database_url: str, tmp_path: Path) -> None:
    assert pearlctl("cluster", "import", str(write_inventory(tmp_path / "inv.yaml", small_inventory()))).returncode == 0
    path = tmp_path / "step0.json"
    path.write_text(json.dumps(telemetry(0)))
    done = pearlctl("event", "telemetry", str(path), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["outcome"] == "ingested" and out["step"] == 0 and out["profile_id"] and out["symbols"]["S"] > 1
    again = pearlctl("event", "telemetry", str(path))
    assert again.returncode == 0 and "already ingested" in again.stdout
    refused = pearlctl("event", "telemetry", str(path), "--makespan-s", "nan")
    assert refused.returncode == 2 and "--makespan-s" in refused.stderr
    assert _rows(database_url) == (1, 2)
