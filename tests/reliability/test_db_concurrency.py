"""Races and crashes against the control-plane database: exactly one winner, no deadlocks, no halves."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.inventory import parse_inventory
from pearl.controlplane.errors import DatabaseBusy, IllegalTransition
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.inventory_import import import_inventory
from pearl.controlplane.store.transitions import StateConflict, begin_release, finish_release, lock_fleet, start_worker
from plan_support import in_threads
from sqlalchemy import Engine, text

pytestmark = pytest.mark.reliability

PAPER = {
    "model": "qwen3-8b", "gpu": "h800", "tp": 2,
    "nodes": [{"name": f"train-{i}", "zone": "training", "gpus": 8, "address": "10.0.0.1"} for i in range(2)]
    + [{"name": "roll-0", "zone": "rollout", "gpus": 4, "address": "10.0.0.2"}],
}


def rollout_slot(engine: Engine) -> tuple[int, list[int]]:
    with engine.connect() as conn:
        worker = conn.execute(text("SELECT w.id FROM workers w JOIN nodes n ON n.id = w.node_id "
                                   "WHERE n.name = 'roll-0' AND w.slot = 0")).scalar_one()
        gpus = conn.execute(text("SELECT id FROM gpus WHERE slot_id = :w ORDER BY id"), {"w": worker}).scalars().all()
    return worker, list(gpus)


def test_two_transactions_starting_one_worker_exactly_one_wins(cluster_engine: Engine) -> None:
    worker, gpus = rollout_slot(cluster_engine)

    def start(role: Role) -> str:
        with transaction(cluster_engine, actor=f"racer-{role}") as session:
            start_worker(session, worker, role)
        return "won"

    for _ in range(5):
        results = in_threads(lambda: start(Role.PREFILL), lambda: start(Role.DECODE))
        assert sorted(type(r).__name__ if isinstance(r, Exception) else r for r in results) == [
            "StateConflict", "won"], results
        with cluster_engine.begin() as conn:  # reset for the next round
            conn.execute(text("UPDATE gpus SET state = 'draining' WHERE slot_id = :w"), {"w": worker})
            conn.execute(text("UPDATE gpus SET state = 'free', worker_id = NULL WHERE slot_id = :w"), {"w": worker})
            conn.execute(text("UPDATE workers SET activity = 'inactive' WHERE id = :w"), {"w": worker})


def test_two_transactions_binding_one_gpu_by_raw_sql_exactly_one_wins(cluster_engine: Engine) -> None:
    worker, gpus = rollout_slot(cluster_engine)
    bind = text("UPDATE gpus SET state = 'bound', worker_id = slot_id WHERE id = :g AND state = 'free' RETURNING id")
    first = cluster_engine.connect()
    first.begin()
    assert first.execute(bind, {"g": gpus[0]}).all()  # holds the GPU (and the fleet row) uncommitted
    second_result: list[object] = []

    def second() -> None:
        with cluster_engine.connect() as conn, conn.begin():
            rows = conn.execute(bind, {"g": gpus[0]}).all()  # waits for the first, then sees it bound
            second_result.append(len(rows))
            conn.rollback()

    t = threading.Thread(target=second)
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive(), "the second binder must wait for the first"
    first.execute(text("UPDATE gpus SET state = 'bound', worker_id = slot_id WHERE id = :g"), {"g": gpus[1]})
    first.execute(text("UPDATE workers SET activity = 'transitioning' WHERE id = :w"), {"w": worker})
    first.commit()
    first.close()
    t.join(timeout=30)
    assert second_result == [0]


def test_trainer_and_borrower_racing_for_an_overlap_gpu_by_raw_sql_exactly_one_wins(cluster_engine: Engine) -> None:
    # No compare-and-set in either writer: the transition trigger alone must refuse the loser, whichever
    # commits first (free -> training then training -> borrowed, or free -> borrowed then borrowed -> training).
    with cluster_engine.connect() as conn:
        worker = conn.execute(text("SELECT w.id FROM workers w JOIN nodes n ON n.id = w.node_id "
                                   "WHERE n.name = 'train-0' AND w.slot = 0")).scalar_one()

    def train() -> str:
        with transaction(cluster_engine, actor="trainer") as session:
            session.execute(text("UPDATE gpus SET state = 'training' WHERE slot_id = :w"), {"w": worker})
        return "training"

    def borrow() -> str:
        with transaction(cluster_engine, actor="borrower") as session:
            session.execute(text("UPDATE gpus SET state = 'borrowed', worker_id = slot_id WHERE slot_id = :w"),
                            {"w": worker})
            session.execute(text("UPDATE workers SET activity = 'transitioning', role = 'decode' WHERE id = :w"),
                            {"w": worker})
        return "borrowed"

    for _ in range(6):
        results = in_threads(train, borrow)
        won = [r for r in results if isinstance(r, str)]
        assert len(won) == 1 and any(isinstance(r, IllegalTransition) for r in results), results
        with cluster_engine.connect() as conn:
            held = conn.execute(text("SELECT state, worker_id FROM gpus WHERE slot_id = :w"), {"w": worker}).all()
            activity = conn.execute(text("SELECT activity FROM workers WHERE id = :w"), {"w": worker}).scalar_one()
        if won[0] == "training":
            assert [tuple(h) for h in held] == [("training", None)] * 2 and activity == "inactive"
            with transaction(cluster_engine) as session:  # reset: the optimizer step ends
                session.execute(text("UPDATE gpus SET state = 'free' WHERE slot_id = :w"), {"w": worker})
        else:
            assert [tuple(h) for h in held] == [("borrowed", worker)] * 2 and activity == "transitioning"
            with transaction(cluster_engine) as session:  # reset: the worker gives the GPUs back
                begin_release(session, worker)
            with transaction(cluster_engine) as session:
                finish_release(session, worker)


def _flipper(engine: Engine, first: int, second: int, lock_first: bool) -> Callable[[], str]:
    """20 transactions, each flipping two GPUs free <-> training with compare-and-set writes."""
    to_training = text("UPDATE gpus SET state = 'training' WHERE id = :g AND state = 'free'")
    to_free = text("UPDATE gpus SET state = 'free' WHERE id = :g AND state = 'training'")

    def run() -> str:
        done = 0
        while done < 20:
            try:
                with transaction(engine) as session:
                    if lock_first:
                        lock_fleet(session)
                    for g in (first, second):
                        if session.execute(to_training, {"g": g}).rowcount == 0:
                            session.execute(to_free, {"g": g})
            except DatabaseBusy:  # a deadlock broken by the database (never with the lock taken first)
                if lock_first:
                    raise
                continue
            done += 1
        return "done"

    return run


def _two_training_gpus(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        a, b = conn.execute(text("SELECT id FROM gpus WHERE zone = 'training' ORDER BY id LIMIT 2")).scalars().all()
    return a, b


def test_writers_of_different_gpus_in_opposite_orders_without_a_lock_first_end_in_a_retry_at_worst(
        cluster_engine: Engine) -> None:
    # Without the whole fleet or a node taken first (the statement trigger takes only the shared part
    # of the fleet lock), two writers locking two GPUs in opposite orders may deadlock: the database
    # breaks it (DatabaseBusy, which the callers retry) and the aborted one wrote nothing; so only
    # completion is asserted here. Every writer in pearl takes a lock first (the next test).
    a, b = _two_training_gpus(cluster_engine)
    assert in_threads(_flipper(cluster_engine, a, b, False), _flipper(cluster_engine, b, a, False)) == ["done"] * 2


def test_writers_that_take_the_fleet_row_first_see_every_committed_change(cluster_engine: Engine) -> None:
    a, b = _two_training_gpus(cluster_engine)
    with cluster_engine.connect() as conn:
        before = conn.execute(text("SELECT count(*) FROM events WHERE entity = 'gpus' AND op = 'update'")).scalar()
    assert in_threads(_flipper(cluster_engine, a, b, True), _flipper(cluster_engine, b, a, True)) == ["done"] * 2
    with cluster_engine.connect() as conn:
        after = conn.execute(text("SELECT count(*) FROM events WHERE entity = 'gpus' AND op = 'update'")).scalar()
    assert after - before == 80  # 2 writers x 20 transactions x 2 GPUs: no compare-and-set missed


def test_concurrent_imports_of_one_inventory_create_it_once(db_engine: Engine) -> None:
    inventory = parse_inventory(PAPER)

    def importer() -> str:
        with transaction(db_engine, actor="importer") as session:
            return import_inventory(session, inventory).outcome

    assert sorted(in_threads(importer, importer, importer)) == ["created", "unchanged", "unchanged"]
    with db_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM nodes")).scalar() == 3
        assert conn.execute(text("SELECT count(*) FROM gpus")).scalar() == 20


def test_an_importer_killed_mid_transaction_leaves_nothing_behind(database_url: str, db_engine: Engine) -> None:
    script = (
        "import sys, time\n"
        "from pearl.controlplane.store.inventory_import import import_inventory\n"
        "from pearl.controlplane.store.db import make_engine, transaction\n"
        "from pearl.controlplane.core.inventory import parse_inventory\n"
        f"inventory = parse_inventory({PAPER!r})\n"
        "with transaction(make_engine(sys.argv[1])) as session:\n"
        "    import_inventory(session, inventory)\n"
        "    session.flush()\n"
        "    print('written, not committed', flush=True)\n"
        "    time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, database_url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written, not committed"
    finally:
        proc.kill()  # SIGKILL: no cleanup in the process
        proc.wait(timeout=30)
        proc.stdout.close()
    with db_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM nodes")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM events")).scalar() == 0  # (its versions are a gap)
    # the whole-fleet lock it held is free again: a new import goes through
    with transaction(db_engine) as session:
        assert import_inventory(session, parse_inventory(PAPER)).outcome == "created"


def test_conflict_is_reported_not_silently_applied(cluster_engine: Engine) -> None:
    worker, _ = rollout_slot(cluster_engine)
    with transaction(cluster_engine) as session:
        start_worker(session, worker, Role.COLOCATED)
    with pytest.raises(StateConflict, match="0 of its 2 GPU"):
        with transaction(cluster_engine) as session:
            start_worker(session, worker, Role.COLOCATED)


def test_every_connection_bounds_its_statements_and_watches_its_peer(database_url: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A statement the server runs or waits on too long is cancelled and named as something to try
    again; every connection asks for TCP keepalives and a bound on unacknowledged data."""
    from pearl.controlplane.errors import DatabaseBusy
    from pearl.controlplane.store.db import make_engine, transaction

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SHOW statement_timeout")).scalar() == "1min"
            params = conn.connection.dbapi_connection.info.get_parameters()
        assert params["keepalives"] == "1" and params["tcp_user_timeout"] == "30000"
    finally:
        engine.dispose()
    monkeypatch.setenv("PEARL_STATEMENT_TIMEOUT_S", "0.2")
    engine = make_engine(database_url)
    try:
        with pytest.raises(DatabaseBusy, match="57014"):
            with transaction(engine) as session:
                session.execute(text("SELECT pg_sleep(2)"))
    finally:
        engine.dispose()


def test_a_managed_database_behind_several_hosts_is_reached_on_the_one_that_writes(database_url: str) -> None:
    """A managed PostgreSQL with a standby: several hosts in the URL (`host=` once each), libpq tries
    them in turn and keeps the one that takes writes (`target_session_attrs=read-write`); TLS when the
    server offers it (`sslmode=prefer`; `require` or `verify-full` in production). A failover is a
    restart to pearl."""
    from pearl.controlplane.services.settings import normalise_database_url
    from pearl.controlplane.store.db import make_engine
    from sqlalchemy.engine import make_url

    url = make_url(database_url)
    real = url.query.get("host") or f"{url.host}:{url.port or 5432}"
    dead = "/nonexistent-socket-dir" if str(real).startswith("/") else "127.0.0.1:1"
    several = url.set(host=None, port=None, query={"host": [dead, str(real)], "target_session_attrs": "read-write",
                                                   "sslmode": "prefer"})
    engine = make_engine(normalise_database_url(several.render_as_string(hide_password=False)))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT pg_is_in_recovery()")).scalar() is False
    finally:
        engine.dispose()
