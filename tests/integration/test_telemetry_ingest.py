"""Telemetry ingestion against real PostgreSQL: the raw step and the refit profile in one transaction,
the provenance chain, duplicate steps, and `pearlctl event telemetry` refusing bad telemetry."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.inventory import parse_inventory
from pearl.controlplane.core.telemetry import parse_telemetry
from pearl.controlplane.errors import BadInput
from pearl.controlplane.store import profile_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.schema import Profile as ProfileRow
from pearl.controlplane.store.telemetry_store import ingest_telemetry
from pearl.controlplane.store.transitions import admit_worker, start_worker
from pearl.policies.live import policy_pass
from plan_support import import_cluster, small_inventory, telemetry, write_inventory
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

pytestmark = pytest.mark.integration

FLEET = profile_store.fleet_key(parse_inventory(small_inventory()))


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
        loaded = profile_store.load_profile(session, FLEET, None)
    # the chain: the computed catalog prior is stored, then each step's fit names its base and its step
    assert catalog.provenance.value == "catalog" and catalog.device == "catalog" and catalog.based_on is None
    assert [f.based_on for f in fitted] == [catalog.id, fitted[0].id]
    assert [f.telemetry_id for f in fitted] == [first.telemetry_id, second.telemetry_id]
    assert all((f.provenance.value, f.device) == ("fitted", profile_store.FLEET_DEVICE) for f in fitted)
    assert loaded.row_id == second.profile_id and loaded.profile.steps_observed == 2
    assert loaded.profile.fit["step"] == 1 and loaded.profile.fit["decode_points"] == 6
    # the first step replaces the prior's f, the second averages with it: both measured 0.6
    assert catalog.params["decode_fraction"] != pytest.approx(0.6)
    assert second.symbols["f"] == loaded.profile.decode_fraction == pytest.approx(0.6)
    assert counts(fleet_engine) == (2, 3)


def test_a_measured_engine_is_the_prior_of_the_first_fit(fleet_engine: Engine) -> None:
    with transaction(fleet_engine) as session:
        prior = profile_store.catalog_prior(FLEET, profile_store.fleet_inventory(session).workload)
        measured = profile_store.save_measured(session, FLEET, prior.engine, {"device_name": "test"})
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


def iterations(*workers: tuple[int | str, str]) -> list[dict]:
    """Decode iteration records of the given (worker, role)s, three each."""
    return [{"worker": w, "role": role, "batch": 4, "context_tokens_mean": 8000.0, "prefill_tokens": 0,
             "seconds": 0.0125} for w, role in workers for _ in range(3)]


def test_a_known_makespan_refits_t_over_against_the_configuration_the_step_ran_on(fleet_engine: Engine) -> None:
    bare = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(0)), makespan_s=400.0)
    assert "no `iterations`" in bare.fit["makespan_ignored"] and bare.symbols["T_over"] == 0.0
    # the fleet runs one colocated worker now, but the step ran on 1P2D: the step's own records decide
    with transaction(fleet_engine, actor="test") as session:
        start_worker(session, 3, Role.COLOCATED)
        admit_worker(session, 3)
    body = {**telemetry(1), "iterations": iterations((1, "prefill"), (2, "decode"), ("w3", "decode"))}
    busy = ingest_telemetry(fleet_engine, parse_telemetry(body), makespan_s=5000.0)
    assert busy.fit["config"] == "1P2D" and busy.fit["makespan_s"] == 5000.0 and "makespan_ignored" not in busy.fit
    assert busy.symbols["T_over"] > 0  # a step far slower than predicted: the per-turn overhead absorbs it


@pytest.mark.parametrize(("records", "why"), [
    (((1, "prefill"), (1, "decode"), (2, "decode")), "several roles"),
    (((1, "colocated"), (2, "decode"), (3, "prefill")), "form no configuration"),
    (((1, "prefill"), (2, "prefill")), "form no configuration"),
], ids=["worker-in-two-roles", "colocated-beside-split", "split-missing-decode"])
def test_a_makespan_over_mixed_roles_is_not_fitted(fleet_engine: Engine, records: tuple, why: str) -> None:
    body = {**telemetry(0), "iterations": iterations(*records)}
    result = ingest_telemetry(fleet_engine, parse_telemetry(body), makespan_s=400.0)
    assert why in result.fit["makespan_ignored"] and "config" not in result.fit
    assert result.symbols["T_over"] == 0.0


def test_without_a_workload_block_the_first_step_is_the_prior(db_engine: Engine) -> None:
    import_cluster(db_engine, small_inventory(workload=False))
    step0 = parse_telemetry(telemetry(0))
    first = ingest_telemetry(db_engine, step0)
    second = ingest_telemetry(db_engine, parse_telemetry(telemetry(1)))
    assert (first.outcome, second.outcome) == ("ingested", "ingested") and counts(db_engine) == (2, 3)
    with transaction(db_engine) as session:
        prior = session.get(ProfileRow, first.based_on)
        loaded = profile_store.load_profile(session, FLEET, None)
    # the step's own trajectories are the prior's workload, on the catalog engine of the fleet's key
    assert (prior.provenance.value, prior.device, prior.params["batch_size"]) == ("catalog", "catalog", 64)
    longest = max(t.prompt_tokens + sum(t.gen_tokens) + sum(t.obs_tokens) for t in step0.trajectories)
    assert prior.params["max_context_tokens"] == longest
    assert max(prior.params["workload"]["turns"]) == max(t.turns for t in step0.trajectories)
    assert loaded.row_id == second.profile_id and loaded.profile.steps_observed == 2
    # and the fleet can plan now, from the fitted profile
    planned = policy_pass.plan(db_engine, dry_run=True)
    assert planned.profile.row_id == second.profile_id and planned.target.members


def test_a_newer_measurement_rebases_the_fit_chain(fleet_engine: Engine) -> None:
    first = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(0)))
    with transaction(fleet_engine) as session:
        engine = profile_store.load_profile(session, FLEET, None).profile.engine
        slower = replace(engine, decode_base_s=tuple(3 * x for x in engine.decode_base_s))
        measured = profile_store.save_measured(session, FLEET, slower, {"device_name": "test", "scaled": False})
    second = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(1)))
    third = ingest_telemetry(fleet_engine, parse_telemetry(telemetry(2)))
    assert second.based_on == measured and third.based_on == second.profile_id
    with transaction(fleet_engine) as session:
        loaded = profile_store.load_profile(session, FLEET, None)
    assert loaded.row_id == third.profile_id and loaded.measured_id is None
    assert loaded.profile.engine.decode_base_s == slower.decode_base_s  # no iterations: the engine is kept
    assert loaded.profile.steps_observed == 3 and first.profile_id < measured


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


def test_a_fleet_without_a_workload_block_plans_once_telemetry_arrives(pearlctl: Callable, tmp_path: Path) -> None:
    inventory = write_inventory(tmp_path / "inv.yaml", small_inventory(workload=False))
    assert pearlctl("cluster", "import", str(inventory)).returncode == 0
    refused = pearlctl("plan", "--dry-run")
    assert refused.returncode == 2 and "workload: the inventory has no `workload` block" in refused.stderr
    path = tmp_path / "step0.json"
    path.write_text(json.dumps(telemetry(0)))
    done = pearlctl("event", "telemetry", str(path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["outcome"] == "ingested"
    planned = pearlctl("plan", "--dry-run", "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["profile"]["provenance"] == "fitted"
    # --explain ranks the candidates with the fitted profile and says why one won
    explained = pearlctl("plan", "--explain", "--dry-run", extra_env={"COLUMNS": "160"})
    assert explained.returncode == 0, explained.stderr
    assert "profile: fitted profile (qwen3-8b, h800, tp 2, cuda; row 2, 1 telemetry steps)" in explained.stdout
    ranking = [line.split()[1] for line in explained.stdout.splitlines() if line[:5].strip().rstrip("*=").isdigit()]
    assert ranking and set(ranking) <= {"colocated"} | {f"{p}P{len(ranking) - p}D" for p in range(1, len(ranking))}
    assert "decision: nothing running: start" in explained.stdout
