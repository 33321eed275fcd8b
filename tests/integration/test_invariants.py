"""The state machine and invariant 1 in the database: raw SQL is refused as surely as pearl's own code."""

from __future__ import annotations

import pytest
from pearl.controlplane.core.domain import Activity, GPUState, NodeZone, Role
from pearl.controlplane.errors import IllegalTransition, PearlError
from pearl.controlplane.store.db import STATE_CONSTRAINTS, transaction
from pearl.controlplane.store.transitions import (
    StateConflict,
    admit_worker,
    begin_release,
    finish_release,
    gpu_edges,
    set_gpu_states,
    start_worker,
    worker_edges,
)
from sqlalchemy import Engine, text

pytestmark = pytest.mark.integration


def slot(engine: Engine, node: str, index: int = 0) -> tuple[int, list[int]]:
    """(worker id, its GPU ids) of a node's slot."""
    with engine.connect() as conn:
        worker = conn.execute(text("SELECT w.id FROM workers w JOIN nodes n ON n.id = w.node_id "
                                   "WHERE n.name = :n AND w.slot = :s"), {"n": node, "s": index}).scalar_one()
        gpus = conn.execute(text("SELECT id FROM gpus WHERE slot_id = :w ORDER BY device_index"),
                            {"w": worker}).scalars().all()
    return worker, list(gpus)


def run_sql(engine: Engine, *statements: str, **params: object) -> None:
    """Raw SQL in one transaction, errors mapped as pearl maps them."""
    with transaction(engine) as session:
        for statement in statements:
            session.execute(text(statement), params)


def gpu_state(engine: Engine, gpu_id: int) -> tuple[str, int | None]:
    with engine.connect() as conn:
        return tuple(conn.execute(text("SELECT state, worker_id FROM gpus WHERE id = :g"), {"g": gpu_id}).one())


def version(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(text("SELECT pearl_state_version()")).scalar_one()


def test_transition_tables_are_seeded_with_a_comment_per_edge(cluster_engine: Engine) -> None:
    with transaction(cluster_engine) as session:
        edges = gpu_edges(session)
        activity = worker_edges(session)
    assert (GPUState.FREE, GPUState.BORROWED) in {(a, b) for a, b, _ in edges[NodeZone.TRAINING]}
    assert (GPUState.FREE, GPUState.BORROWED) not in {(a, b) for a, b, _ in edges[NodeZone.ROLLOUT]}
    assert (GPUState.UNAVAILABLE, GPUState.FREE) in {(a, b) for a, b, _ in edges[NodeZone.PREEMPTIBLE]}
    assert all(comment for zone in edges.values() for _, _, comment in zone)
    assert (Activity.INACTIVE, Activity.ACTIVE) not in {(a, b) for a, b, _ in activity}


def test_illegal_gpu_edge_is_refused_even_by_raw_sql(cluster_engine: Engine) -> None:
    _, (gpu, _) = slot(cluster_engine, "roll-0")
    with pytest.raises(IllegalTransition, match=r"illegal GPU transition: gpu \d+ \(roll-0:0, rollout zone\) "
                                                r"free -> training"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'training' WHERE id = :g", g=gpu)
    _, (spot, _) = slot(cluster_engine, "spot-0")
    with pytest.raises(IllegalTransition, match="unavailable -> bound"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'bound', worker_id = slot_id WHERE id = :g", g=spot)
    assert gpu_state(cluster_engine, gpu) == ("free", None)


def test_gpu_node_slot_and_zone_never_change(cluster_engine: Engine) -> None:
    _, (gpu, _) = slot(cluster_engine, "roll-0")
    with pytest.raises(IllegalTransition, match="never change"):
        run_sql(cluster_engine, "UPDATE gpus SET device_index = 7 WHERE id = :g", g=gpu)


def test_training_gpu_cannot_be_given_to_a_worker_while_training(cluster_engine: Engine) -> None:
    worker, gpus = slot(cluster_engine, "train-0")
    run_sql(cluster_engine, "UPDATE gpus SET state = 'training' WHERE slot_id = :w", w=worker)
    # the overlap worker takes the training GPUs by raw SQL: no edge training -> borrowed
    with pytest.raises(IllegalTransition, match="training -> borrowed"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'borrowed', worker_id = slot_id WHERE slot_id = :w",
                "UPDATE workers SET activity = 'transitioning', role = 'decode' WHERE id = :w", w=worker)
    # ... or holds them while they stay in training: the held-iff-in-use constraint
    with pytest.raises(IllegalTransition, match="ck_gpus_held_iff_in_use"):
        run_sql(cluster_engine, "UPDATE gpus SET worker_id = slot_id WHERE slot_id = :w", w=worker)
    # ... or is marked active without holding them: the deferred check at commit
    with pytest.raises(IllegalTransition, match=rf"worker {worker} \(train-0\) is transitioning but holds 0 of its 2"):
        run_sql(cluster_engine, "UPDATE workers SET activity = 'transitioning', role = 'decode' WHERE id = :w",
                w=worker)
    assert [gpu_state(cluster_engine, g) for g in gpus] == [("training", None)] * 2


def test_borrowed_gpu_cannot_start_training_before_it_is_returned(cluster_engine: Engine) -> None:
    worker, gpus = slot(cluster_engine, "train-0")
    with transaction(cluster_engine) as session:
        start_worker(session, worker, Role.DECODE)
    with pytest.raises(IllegalTransition, match="borrowed -> training"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'training', worker_id = NULL WHERE slot_id = :w", w=worker)
    with pytest.raises(IllegalTransition, match="draining -> training"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'draining' WHERE slot_id = :w",
                "UPDATE gpus SET state = 'training', worker_id = NULL WHERE slot_id = :w", w=worker)


def test_a_gpu_is_held_only_by_its_own_slot(cluster_engine: Engine) -> None:
    first, _ = slot(cluster_engine, "train-0", 0)
    _, other_gpus = slot(cluster_engine, "train-0", 1)
    with pytest.raises(IllegalTransition, match="ck_gpus_held_by_its_slot"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'borrowed', worker_id = :w WHERE id = :g",
                w=first, g=other_gpus[0])


def test_serving_worker_must_hold_all_of_its_gpus(cluster_engine: Engine) -> None:
    worker, gpus = slot(cluster_engine, "roll-0")
    with pytest.raises(IllegalTransition, match="holds 1 of its 2"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'bound', worker_id = slot_id WHERE id = :g",
                "UPDATE workers SET activity = 'transitioning' WHERE id = :w", g=gpus[0], w=worker)
    with pytest.raises(IllegalTransition, match="inactive but holds 2"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'bound', worker_id = slot_id WHERE slot_id = :w", w=worker)


def test_illegal_worker_edges_are_refused(cluster_engine: Engine) -> None:
    worker, _ = slot(cluster_engine, "roll-0")
    with pytest.raises(IllegalTransition, match="illegal worker transition: worker \\d+ inactive -> active"):
        run_sql(cluster_engine, "UPDATE workers SET activity = 'active' WHERE id = :w", w=worker)
    with pytest.raises(IllegalTransition, match="ck_workers_training_role_is_overlap"):
        run_sql(cluster_engine, "UPDATE workers SET role = 'training' WHERE id = :w", w=worker)
    with pytest.raises(IllegalTransition, match="never change"):
        run_sql(cluster_engine, "UPDATE workers SET slot = 5 WHERE id = :w", w=worker)


def test_the_state_constraints_are_checks_of_the_schema(cluster_engine: Engine) -> None:
    with cluster_engine.connect() as conn:
        checks = set(conn.execute(text("SELECT conname FROM pg_constraint WHERE contype = 'c'")).scalars())
    assert STATE_CONSTRAINTS < checks


@pytest.mark.parametrize(("statement", "constraint"), [
    ("UPDATE nodes SET gpu_count = 0 WHERE name = 'roll-0'", "ck_nodes_gpu_count_positive"),
    ("UPDATE workers SET weights_version = -1 WHERE slot = 0", "ck_workers_counters_non_negative"),
    ("INSERT INTO plans (base_version, d_worker) VALUES (0, -1)", "ck_plans_distances_non_negative"),
], ids=["gpu-count", "weights-version", "plan-distance"])
def test_a_check_unrelated_to_the_state_machine_is_not_an_illegal_transition(
    cluster_engine: Engine, statement: str, constraint: str
) -> None:
    with pytest.raises(PearlError, match=f"refused by constraint {constraint}") as refused:
        run_sql(cluster_engine, statement)
    assert not isinstance(refused.value, IllegalTransition)


def test_role_changes_only_while_transitioning(cluster_engine: Engine) -> None:
    worker, _ = slot(cluster_engine, "roll-0")
    with transaction(cluster_engine) as session:
        start_worker(session, worker, Role.PREFILL)
        admit_worker(session, worker)
    with pytest.raises(IllegalTransition, match="changes role prefill -> decode while active"):
        run_sql(cluster_engine, "UPDATE workers SET role = 'decode' WHERE id = :w", w=worker)
    run_sql(cluster_engine, "UPDATE workers SET activity = 'transitioning', role = 'decode' WHERE id = :w",
            "UPDATE workers SET activity = 'active' WHERE id = :w", w=worker)


def test_worker_lifecycle_through_the_compare_and_set_helpers(cluster_engine: Engine) -> None:
    worker, gpus = slot(cluster_engine, "train-0")
    with transaction(cluster_engine, actor="agent train-0") as session:
        started = start_worker(session, worker, Role.DECODE, endpoint="http://127.0.0.1:30000")
        assert started.generation == 1
    assert [gpu_state(cluster_engine, g) for g in gpus] == [("borrowed", worker)] * 2
    with transaction(cluster_engine) as session:
        admit_worker(session, worker)
        with pytest.raises(StateConflict, match="is active, expected transitioning"):
            admit_worker(session, worker)
    with transaction(cluster_engine) as session:
        begin_release(session, worker)
    assert [gpu_state(cluster_engine, g) for g in gpus] == [("draining", worker)] * 2
    with transaction(cluster_engine) as session:
        finish_release(session, worker)
    assert [gpu_state(cluster_engine, g) for g in gpus] == [("free", None)] * 2
    with cluster_engine.connect() as conn:
        row = conn.execute(text("SELECT role, activity, endpoint FROM workers WHERE id = :w"), {"w": worker}).one()
        history = conn.execute(text("SELECT old_activity, activity, role FROM worker_roles_history "
                                    "WHERE worker_id = :w ORDER BY event_id"), {"w": worker}).all()
    assert tuple(row) == ("training", "inactive", None)
    assert [tuple(h) for h in history] == [
        (None, "inactive", "training"), ("inactive", "transitioning", "decode"), ("transitioning", "active", "decode"),
        ("active", "transitioning", "decode"), ("transitioning", "inactive", "training")]


def test_start_refuses_gpus_that_are_not_free(cluster_engine: Engine) -> None:
    worker, gpus = slot(cluster_engine, "spot-0")
    with pytest.raises(StateConflict, match="0 of its 2 GPU\\(s\\) were free"):
        with transaction(cluster_engine) as session:
            start_worker(session, worker, Role.COLOCATED)
    with transaction(cluster_engine) as session:
        set_gpu_states(session, gpus, [GPUState.UNAVAILABLE], GPUState.FREE)  # granted
        start_worker(session, worker, Role.COLOCATED)
    with pytest.raises(StateConflict, match="not in \\['free'\\]"):
        with transaction(cluster_engine) as session:
            set_gpu_states(session, gpus, [GPUState.FREE], GPUState.REVOKED)


def test_revoked_gpu_takes_its_worker_down_in_the_same_transaction(cluster_engine: Engine) -> None:
    worker, gpus = slot(cluster_engine, "spot-0")
    with transaction(cluster_engine) as session:
        set_gpu_states(session, gpus, [GPUState.UNAVAILABLE], GPUState.FREE)
        start_worker(session, worker, Role.COLOCATED)
        admit_worker(session, worker)
    with pytest.raises(IllegalTransition, match="is active but holds 0 of its 2"):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'revoked', worker_id = NULL WHERE slot_id = :w", w=worker)
    run_sql(cluster_engine, "UPDATE gpus SET state = 'revoked', worker_id = NULL WHERE slot_id = :w",
            "UPDATE workers SET activity = 'inactive' WHERE id = :w", w=worker)
    assert [gpu_state(cluster_engine, g) for g in gpus] == [("revoked", None)] * 2


def test_state_version_counts_changes_in_the_same_transaction(cluster_engine: Engine) -> None:
    worker, gpus = slot(cluster_engine, "train-0")
    before = version(cluster_engine)
    run_sql(cluster_engine, "UPDATE gpus SET state = state WHERE slot_id = :w", w=worker)  # no change: no bump
    assert version(cluster_engine) == before
    with pytest.raises(IllegalTransition):
        run_sql(cluster_engine, "UPDATE gpus SET state = 'training' WHERE slot_id = :w",
                "UPDATE gpus SET state = 'bound' WHERE slot_id = :w", w=worker)
    gap = version(cluster_engine)  # the versions the rolled-back change took are a gap: no event has them
    with cluster_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM events WHERE state_version > :v"), {"v": before}).scalar() == 0
    run_sql(cluster_engine, "UPDATE gpus SET state = 'training' WHERE slot_id = :w", w=worker)
    assert version(cluster_engine) == gap + len(gpus)
    run_sql(cluster_engine, "INSERT INTO leases (gpu_id, kind) VALUES (:g, 'preemptible')", g=slot(
        cluster_engine, "spot-0")[1][0])
    assert version(cluster_engine) == gap + len(gpus) + 1


def test_every_change_is_in_the_events_table_with_actor_and_reason(cluster_engine: Engine) -> None:
    worker, gpus = slot(cluster_engine, "train-0")
    with transaction(cluster_engine, actor="trainer", reason="step 7") as session:
        session.execute(text("UPDATE gpus SET state = 'training' WHERE id = :g"), {"g": gpus[0]})
    with cluster_engine.connect() as conn:
        event = conn.execute(text("SELECT entity, entity_id, op, old ->> 'state', new ->> 'state', actor, reason, "
                                  "state_version = (SELECT pearl_state_version()) FROM events "
                                  "ORDER BY id DESC LIMIT 1")).one()
        flat = conn.execute(text("SELECT field, old_value, new_value FROM transitions WHERE entity = 'gpus' "
                                 "AND op = 'update' ORDER BY event_id DESC LIMIT 1")).one()
        nodes = conn.execute(text("SELECT count(*) FROM events WHERE entity = 'nodes' AND op = 'insert'")).scalar()
    assert tuple(event) == ("gpus", str(gpus[0]), "update", "free", "training", "trainer", "step 7", True)
    assert tuple(flat) == ("state", "free", "training")
    assert nodes == 3


def test_events_are_append_only(cluster_engine: Engine) -> None:
    for statement in ("UPDATE events SET actor = 'x'", "DELETE FROM events", "TRUNCATE events"):
        with pytest.raises(Exception, match="events is append-only"):
            run_sql(cluster_engine, statement)
    with cluster_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM events")).scalar() > 0


def test_views_answer(cluster_engine: Engine) -> None:
    with cluster_engine.connect() as conn:
        by_zone = conn.execute(text("SELECT zone, state, gpus FROM gpu_state_by_zone ORDER BY zone, state")).all()
        detail = conn.execute(text("SELECT count(*) FROM gpu_detail WHERE lease_id IS NULL")).scalar()
        timeline = conn.execute(text("SELECT count(*) FROM plan_timeline")).scalar()
    assert [tuple(r) for r in by_zone] == [("training", "free", 4), ("rollout", "free", 2),
                                           ("preemptible", "unavailable", 2)]
    assert detail == 8
    assert timeline == 0


def test_db_session_fixture_checks_deferred_constraints_on_demand(db_session) -> None:
    from pearl.controlplane.core.inventory import parse_inventory
    from pearl.controlplane.store.inventory_import import import_inventory
    from sqlalchemy.exc import DBAPIError

    import_inventory(db_session, parse_inventory({"model": "qwen3-8b", "gpu": "h800", "tp": 1, "nodes": [
        {"name": "r", "zone": "rollout", "gpus": 1, "address": "h"}]}))
    db_session.execute(text("UPDATE workers SET activity = 'transitioning', role = 'decode'"))
    with pytest.raises(DBAPIError, match="is transitioning but holds 0 of its 1 GPU"):
        db_session.execute(text("SET CONSTRAINTS ALL IMMEDIATE"))
