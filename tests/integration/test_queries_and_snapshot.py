"""The named queries (claim, renew, finish, rescue) and the fleet snapshot, against real PostgreSQL."""

from __future__ import annotations

import threading
from datetime import datetime

import pytest
from pearl.controlplane.core.domain import (
    Activity,
    GPUState,
    LeaseKind,
    PlanStatus,
    Role,
    StepAction,
    StepStatus,
    WorkerZone,
)
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.notifications import step_channel
from pearl.controlplane.store.queries import load_queries, query
from pearl.controlplane.store.schema import Agent, Lease, Plan, PlanStep
from pearl.controlplane.store.snapshot import load_snapshot
from pearl.controlplane.store.transitions import admit_worker, set_gpu_states, start_worker
from plan_support import pin_clock
from sqlalchemy import Engine, select, text

pytestmark = pytest.mark.integration

LEASE_S = 30


def make_plan(engine: Engine, node: str, n_workers: int | None = None) -> tuple[int, list[int]]:
    """A plan with one ready step per worker slot of `node`; returns (agent id, step ids)."""
    with transaction(engine) as session:
        node_id, = session.execute(text("SELECT id FROM nodes WHERE name = :n"), {"n": node}).one()
        workers = session.execute(text("SELECT id FROM workers WHERE node_id = :n ORDER BY slot"),
                                  {"n": node_id}).scalars().all()[:n_workers]
        version = session.execute(text("SELECT pearl_state_version()")).scalar_one()
        plan = Plan(base_version=version, status=PlanStatus.APPLYING)  # only an applying plan's steps run
        agent = Agent(node_id=node_id, host="test", pid=1)
        session.add_all([plan, agent])
        session.flush()
        steps = [PlanStep(plan_id=plan.id, key=f"w{w}.start", worker_id=w, node_id=node_id, action=StepAction.START,
                          args={"role": "decode"}, status=StepStatus.READY) for w in workers]
        session.add_all(steps)
        session.flush()
        return agent.id, [s.id for s in steps]


def claim(engine: Engine, agent: int, node: str, now: datetime, limit: int = 10,
          busy: tuple[int, ...] = ()) -> list[dict]:
    with transaction(engine) as session:
        node_id = session.execute(text("SELECT id FROM nodes WHERE name = :n"), {"n": node}).scalar_one()
        pin_clock(session, now)
        return plan_store.claim_steps(session, node_id, agent, lease_s=LEASE_S, limit=limit, busy=busy)


def test_queries_file_has_the_documented_queries() -> None:
    assert {"claim_steps", "renew_step_lease", "finish_step", "rescue_expired_steps"} <= set(load_queries())
    assert "FOR UPDATE OF s SKIP LOCKED" in load_queries()["claim_steps"]
    with pytest.raises(KeyError, match="no query named 'nope'"):
        query("nope")


def test_claim_gives_each_step_once_with_increasing_fences(cluster_engine: Engine, clock) -> None:
    agent, steps = make_plan(cluster_engine, "train-0")
    first = claim(cluster_engine, agent, "train-0", clock(), limit=1)
    rest = claim(cluster_engine, agent, "train-0", clock())
    assert [r["id"] for r in first + rest] == steps
    assert first[0]["status"] == "running" and first[0]["attempts"] == 1
    assert (first[0]["lease_until"] - clock()).total_seconds() == LEASE_S
    assert first[0]["fence"] < rest[0]["fence"]
    assert claim(cluster_engine, agent, "train-0", clock()) == []
    assert claim(cluster_engine, agent, "roll-0", clock()) == []  # other nodes' steps only


def test_a_claim_passes_over_the_busy_workers_steps_only(cluster_engine: Engine, clock) -> None:
    agent, steps = make_plan(cluster_engine, "train-0")
    with transaction(cluster_engine) as session:
        workers = dict(session.execute(text("SELECT id, worker_id FROM plan_steps")).all())
    busy = workers[steps[0]]
    assert [r["id"] for r in claim(cluster_engine, agent, "train-0", clock(), busy=(busy,))] == steps[1:]
    assert [r["id"] for r in claim(cluster_engine, agent, "train-0", clock())] == steps[:1]  # no longer busy


def test_an_agent_replaced_by_a_newer_one_of_its_node_claims_nothing(cluster_engine: Engine, clock) -> None:
    agent, steps = make_plan(cluster_engine, "train-0")
    with transaction(cluster_engine) as session:
        newer = session.execute(text("INSERT INTO agents (node_id, host, pid) SELECT id, 'test', 2 FROM nodes "
                                     "WHERE name = 'train-0' RETURNING id")).scalar_one()
    assert claim(cluster_engine, agent, "train-0", clock()) == []
    assert [r["id"] for r in claim(cluster_engine, newer, "train-0", clock(), limit=1)] == steps[:1]
    with transaction(cluster_engine) as session:  # the newer one stopped: the older may claim again
        session.execute(text("UPDATE agents SET stopped_at = pearl_now() WHERE id = :a"), {"a": newer})
    assert [r["id"] for r in claim(cluster_engine, agent, "train-0", clock())] == steps[1:]


def test_concurrent_claimers_never_take_a_step_twice(cluster_engine: Engine, clock) -> None:
    agent, steps = make_plan(cluster_engine, "train-0")
    taken: list[int] = []
    lock = threading.Lock()
    barrier = threading.Barrier(4)

    def claimer() -> None:
        barrier.wait()
        for _ in range(3):
            rows = claim(cluster_engine, agent, "train-0", clock(), limit=1)
            with lock:
                taken.extend(r["id"] for r in rows)

    threads = [threading.Thread(target=claimer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(taken) == sorted(steps)


def test_one_running_step_per_worker(cluster_engine: Engine, clock) -> None:
    agent, steps = make_plan(cluster_engine, "roll-0")
    with transaction(cluster_engine) as session:
        worker, node = session.execute(text("SELECT worker_id, node_id FROM plan_steps WHERE id = :s"),
                                       {"s": steps[0]}).one()
        plan = session.execute(text("SELECT plan_id FROM plan_steps WHERE id = :s"), {"s": steps[0]}).scalar_one()
        session.add(PlanStep(plan_id=plan, key="second", worker_id=worker, node_id=node,
                             action=StepAction.LOAD_WEIGHTS, status=StepStatus.READY))
    claimed = claim(cluster_engine, agent, "roll-0", clock())
    assert [r["key"] for r in claimed] == [f"w{worker}.start"]  # the other step of that worker waits
    with pytest.raises(Exception, match="uq_plan_steps_one_running_per_worker"):
        with cluster_engine.begin() as conn:
            conn.execute(text("UPDATE plan_steps SET status = 'running', fence = 1, lease_until = now() "
                              "WHERE key = 'second'"))


def test_expired_claims_are_rescued_and_late_reports_change_nothing(cluster_engine: Engine, clock) -> None:
    agent, (step,) = make_plan(cluster_engine, "roll-0", n_workers=1)
    (claimed,) = claim(cluster_engine, agent, "roll-0", clock())
    with transaction(cluster_engine) as session:
        pin_clock(session, clock.advance(20))
        renewed = session.execute(query("renew_step_lease"), {"step_id": step, "fence": claimed["fence"],
                                                              "lease_s": LEASE_S}).all()
    assert len(renewed) == 1 and renewed[0].plan_status == "applying"
    assert (renewed[0].lease_until - clock()).total_seconds() == LEASE_S  # the database's clock
    with transaction(cluster_engine) as session:  # not expired yet
        pin_clock(session, clock.advance(LEASE_S - 1))
        assert session.execute(query("rescue_expired_steps"), {"max_attempts": 3}).all() == []
    with transaction(cluster_engine) as session:  # the agent went silent past its lease
        pin_clock(session, clock.advance(2))
        rescued = session.execute(query("rescue_expired_steps"), {"max_attempts": 3}).all()
    assert [(r.id, r.status, r.attempts) for r in rescued] == [(step, "ready", 1)]
    (again,) = claim(cluster_engine, agent, "roll-0", clock())
    assert again["fence"] > claimed["fence"] and again["attempts"] == 2
    finish = {"step_id": step, "status": "succeeded", "error": None}
    with transaction(cluster_engine) as session:  # the first claimer wakes up: fenced out
        assert session.execute(query("finish_step"), {**finish, "fence": claimed["fence"]}).all() == []
    with transaction(cluster_engine) as session:
        assert len(session.execute(query("finish_step"), {**finish, "fence": again["fence"]}).all()) == 1
        status = session.scalar(select(PlanStep.status).where(PlanStep.id == step))
    assert status is StepStatus.SUCCEEDED


def test_a_step_whose_claims_keep_expiring_fails(cluster_engine: Engine, clock) -> None:
    agent, (step,) = make_plan(cluster_engine, "roll-0", n_workers=1)
    for attempt in (1, 2):
        claim(cluster_engine, agent, "roll-0", clock())
        with transaction(cluster_engine) as session:
            pin_clock(session, clock.advance(LEASE_S + 1))
            rows = session.execute(query("rescue_expired_steps"), {"max_attempts": 2}).all()
        assert [(r.status, r.attempts) for r in rows] == [("ready" if attempt == 1 else "failed", attempt)]


def test_ready_steps_wake_their_node(cluster_engine: Engine) -> None:
    import psycopg

    url = cluster_engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with cluster_engine.connect() as conn:
        ids = {name: id_ for name, id_ in conn.execute(text("SELECT name, id FROM nodes"))}
    with psycopg.connect(url, autocommit=True) as listener:
        for other in ids.values():
            listener.execute(f"LISTEN {step_channel(other)}")
        make_plan(cluster_engine, "roll-0", n_workers=1)
        notes = list(listener.notifies(timeout=1))
    assert [(n.channel, n.payload) for n in notes] == [(f"pearl_steps_{ids['roll-0']}", str(ids["roll-0"]))]


def test_snapshot_maps_rows_and_availability(cluster_engine: Engine) -> None:
    with transaction(cluster_engine) as session:
        snap = load_snapshot(session)
    assert snap.tp == 2 and len(snap.workers) == 4
    by_node = {w.node: w for w in snap.workers}
    assert by_node["train-0"].zone is WorkerZone.OVERLAP and by_node["train-0"].role is Role.TRAINING
    assert [w.available for w in snap.workers] == [True, True, True, False]  # spot-0 not granted
    train = [w for w in snap.workers if w.node == "train-0"]
    spot = by_node["spot-0"]
    with transaction(cluster_engine) as session:
        set_gpu_states(session, train[0].gpus, [GPUState.FREE], GPUState.TRAINING)  # an optimizer step
        start_worker(session, train[1].id, Role.DECODE)  # borrowed by its own worker
        admit_worker(session, train[1].id)
        set_gpu_states(session, spot.gpus, [GPUState.UNAVAILABLE], GPUState.FREE)  # granted ...
        session.add_all(Lease(gpu_id=g, kind=LeaseKind.PREEMPTIBLE) for g in spot.gpus)
    with transaction(cluster_engine) as session:
        snap = load_snapshot(session)
    avail = {w.id: w.available for w in snap.workers}
    assert avail[train[0].id] is False and avail[train[1].id] is True and avail[spot.id] is True
    assert snap.by_id()[train[1].id].activity is Activity.ACTIVE
    with transaction(cluster_engine) as session:  # ... then a revocation notice
        session.execute(text("UPDATE leases SET deadline = now() + interval '30 seconds' WHERE returned_at IS NULL"))
        assert {w.id: w.available for w in load_snapshot(session).workers}[spot.id] is False
        version = session.execute(text("SELECT pearl_state_version()")).scalar_one()
        assert load_snapshot(session).state_version == version


def test_status_shows_the_latest_plan_and_open_leases(cluster_engine: Engine) -> None:
    from pearl.controlplane.store.fleet_status import fleet_status

    _, steps = make_plan(cluster_engine, "train-0")
    with transaction(cluster_engine) as session:
        spot = session.execute(text("SELECT id FROM gpus WHERE zone = 'preemptible' ORDER BY id")).scalars().all()
        set_gpu_states(session, spot, [GPUState.UNAVAILABLE], GPUState.FREE)
        session.add(Lease(gpu_id=spot[0], kind=LeaseKind.PREEMPTIBLE))
    with transaction(cluster_engine, isolation_level="REPEATABLE READ") as session:
        status = fleet_status(session)
    assert status["plan"]["steps"] == {"ready": len(steps)} and status["plan"]["status"] == "applying"
    assert [(lease["kind"], lease["node"], lease["device"]) for lease in status["leases"]] == [
        ("preemptible", "spot-0", 0)]
    assert status["gpus"]["by_zone_state"]["preemptible"] == {"free": 2}
