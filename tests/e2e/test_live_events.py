"""The policy loop live: the trainer's and the provider's events go in through the control plane's API,
the loop decides and applies, one agent per node enacts with simulated SGLang servers, on a real
PostgreSQL. Borrowed GPUs come back at the tail of the step, before the trainer asks for them, and
a revoked GPU is drained before its notice runs out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from metrics_support import check_conventions, scrape, value
from pearl.agents.fleet import LocalFleet
from pearl.controlplane.api import ControlPlane
from pearl.controlplane.core.domain import Activity, WorkerZone
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.fleet_status import read_fleet_status
from pearl.controlplane.store.schema import Worker
from pearl.controlplane.weights import write_demo_snapshot
from plan_support import import_cluster, small_inventory
from sqlalchemy import Engine, select, text

pytestmark = pytest.mark.e2e

SPEED = 20.0  # the simulated servers' time compression, and the inventory's time scale


@pytest.fixture
def live(db_engine: Engine, database_url: str, tmp_path: Path) -> Iterator[tuple[LocalFleet, ControlPlane]]:
    import_cluster(db_engine, {**small_inventory(), "time_scale": SPEED})
    fleet = LocalFleet(tmp_path / "run", {"PEARL_DATABASE_URL": database_url, "PEARL_HOME": str(tmp_path)},
                       metrics=True)
    for node in ("train-0", "roll-0", "spot-0"):
        fleet.start_agent(node, speed=SPEED, sim_args=("--startup-s", "10"), lease_s=3.0, poll_s=0.1)
    fleet.start_loop(interval_s=0.5, lease_s=3.0)
    try:
        _wait(lambda: len([a for a in read_fleet_status(db_engine)["agents"] if a["stopped_at"] is None]) == 3,
              60, fleet)
        yield fleet, ControlPlane(engine=db_engine)
    finally:
        assert fleet.stop() == []  # everything stopped on SIGTERM
    assert read_fleet_status(db_engine)["metrics"] == []  # ... and took its metrics endpoint with it


def _wait(condition, timeout_s: float, fleet: LocalFleet) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if (dead := fleet.check()) is not None:
            raise AssertionError(f"{dead.name} died:\n{dead.tail()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _serving(engine: Engine, zone: WorkerZone | None = None, *, holding: bool = False) -> set[int]:
    """Workers active (or, with `holding`, not yet inactive: still holding their GPUs)."""
    with transaction(engine) as session:
        q = select(Worker.id).where(Worker.activity != Activity.INACTIVE if holding
                                    else Worker.activity == Activity.ACTIVE)
        if zone is not None:
            q = q.where(Worker.zone == zone)
        return set(session.scalars(q))


def test_events_through_the_loop_and_agents_return_every_gpu_in_time(live: tuple[LocalFleet, ControlPlane],
                                                                      db_engine: Engine, tmp_path: Path) -> None:
    fleet, cp = live
    # The rollout of step 0 begins; nothing trains yet, so the policy borrows the training GPUs.
    cp.rollout_progress(0, 0, batch_size=64)
    _wait(lambda: 3 in _serving(db_engine) and _serving(db_engine, WorkerZone.OVERLAP), 90, fleet)
    borrowed = _serving(db_engine, WorkerZone.OVERLAP)

    # The batch runs to its tail: the borrowed workers go back while the last trajectories finish.
    for finished in range(8, 65, 8):
        cp.rollout_progress(0, min(finished, 63))
        time.sleep(0.3)
    _wait(lambda: not _serving(db_engine, WorkerZone.OVERLAP, holding=True), 60, fleet)
    cp.rollout_progress(0, 64)
    began = cp.training_begin(0, wait_s=0)
    assert began.started and began.borrowed == () and not began.late_s  # nothing to wait for
    cp.training_end(0, weights_version=1, snapshot=write_demo_snapshot(tmp_path / "v1", 1))

    # Preemptible GPUs join, then leave with 30 s of notice: drained and released before it runs out.
    cp.rollout_progress(1, 0, batch_size=64)
    cp.gpus_granted("spot-0")
    _wait(lambda: 4 in _serving(db_engine), 90, fleet)
    cp.gpus_revoked("spot-0", notice_s=30.0)
    _wait(lambda: 4 not in _serving(db_engine, holding=True), 30, fleet)

    with db_engine.connect() as conn:
        cycles = conn.execute(text("SELECT worker_id, late_s FROM borrow_cycles")).all()
        assert {w for w, _ in cycles} >= borrowed and all(not late for _, late in cycles)
        late_steps = conn.execute(text("SELECT count(*) FROM training_steps WHERE late_s > 0")).scalar()
        assert late_steps == 0
        # no GPU was used after its revocation deadline: none is held, and the deadline is still ahead
        held, ahead = conn.execute(text(
            "SELECT count(g.worker_id), bool_and(l.deadline > clock_timestamp()) FROM gpus g "
            "JOIN leases l ON l.gpu_id = g.id AND l.returned_at IS NULL "
            "WHERE g.zone = 'preemptible' AND l.deadline IS NOT NULL")).one()
    assert held == 0 and ahead
    _check_loop_metrics(db_engine)


def _check_loop_metrics(engine: Engine) -> None:
    """The loop's page: its passes and decisions, and the fleet as the rows have it (late returns: none)."""
    status = read_fleet_status(engine)
    listed = {(m["component"], m["node"]): m["url"] for m in status["metrics"]}
    assert set(listed) == {("loop", None), ("agent", "train-0"), ("agent", "roll-0"), ("agent", "spot-0")}
    page = scrape(listed[("loop", None)])
    assert check_conventions(page) == []
    assert value(page, "pearl_policy_leading") == 1
    assert value(page, "pearl_policy_passes_total", outcome="decided") >= 3  # borrow, return, grant, revoke
    assert value(page, "pearl_policy_decisions_total") == value(page, "pearl_policy_passes_total", outcome="decided")
    assert value(page, "pearl_policy_pass_duration_seconds_count") >= value(page, "pearl_policy_passes_total",
                                                                            outcome="decided")
    assert value(page, "pearl_gpus") == status["gpus"]["total"]
    assert value(page, "pearl_borrow_returns_total", timeliness="on_time") >= 1
    assert value(page, "pearl_borrow_returns_total", timeliness="late") == 0
    assert value(page, "pearl_plans", status="succeeded") >= 3
    assert value(page, "pearl_plan_duration_seconds_count") >= 3
    assert value(page, "pearl_predicted_makespan_seconds", configuration="target") > 0
    claims = sum(value(scrape(listed[("agent", node)]), "pearl_step_claims_total")
                 for node in ("train-0", "roll-0", "spot-0"))
    assert claims >= 3
