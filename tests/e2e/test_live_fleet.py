"""pearl live, as processes: the front door over the real sglang-router, one `pearlctl agent` per node
with the `sim` driver launching simulated SGLang servers, on a real PostgreSQL; plans applied through
the store, a steady stream of multi-turn requests through the front door."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from metrics_support import check_conventions, scrape, value
from pearl.agents.drivers.process import free_port
from pearl.agents.fleet import LocalFleet
from pearl.controlplane.core.domain import Activity, Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.store import plan_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.fleet_status import read_fleet_status
from pearl.controlplane.store.schema import Worker
from plan_support import import_cluster, propose
from sqlalchemy import Engine, select, text
from workers_support import Load

pytestmark = pytest.mark.e2e

TWO_NODES = {
    "model": "qwen3-8b", "gpu": "h100", "tp": 2, "time_scale": 50.0,
    "nodes": [
        {"name": "node-a", "zone": "rollout", "gpus": 4, "address": "127.0.0.1"},  # workers 1, 2
        {"name": "node-b", "zone": "rollout", "gpus": 4, "address": "127.0.0.1"},  # workers 3, 4
    ],
}
ALL = frozenset({1, 2, 3, 4})


@pytest.fixture
def live(db_engine: Engine, database_url: str, tmp_path: Path) -> Iterator[tuple[LocalFleet, str]]:
    import_cluster(db_engine, TWO_NODES)
    fleet = LocalFleet(tmp_path / "run", {"PEARL_DATABASE_URL": database_url, "PEARL_HOME": str(tmp_path)},
                       metrics=True)
    port = free_port()
    fleet.start_front_door(port)
    for node in ("node-a", "node-b"):
        fleet.start_agent(node, speed=50.0, sim_args=("--startup-s", "5"), lease_s=3.0, poll_s=0.1, crash_after_s=2.0)
    try:
        _wait(lambda: _ready(db_engine), 90, fleet)
        yield fleet, f"http://127.0.0.1:{port}"
    finally:
        fleet.stop()


def _ready(engine: Engine) -> bool:
    status = read_fleet_status(engine)
    return (status["router"] is not None and status["router"]["running"]
            and len([a for a in status["agents"] if a["stopped_at"] is None]) == 2)


def _wait(condition, timeout_s: float, fleet: LocalFleet | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if fleet is not None and (dead := fleet.check()) is not None:
            raise AssertionError(f"{dead.name} died:\n{dead.tail()}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _apply(engine: Engine, target: Target, timeout_s: float = 120) -> dict:
    plan_id = propose(engine, target)
    plan_store.apply(engine, plan_id)
    return plan_store.wait_plan(engine, plan_id, timeout_s=timeout_s, poll_s=0.1)


def _roles(engine: Engine) -> dict[int, tuple[Activity, Role, str | None]]:
    with transaction(engine) as session:
        return {w.id: (w.activity, w.role, w.endpoint) for w in session.scalars(select(Worker).order_by(Worker.id))}


@pytest.mark.slow
def test_plans_switch_colocated_2p2d_1p3d_colocated_under_load_with_no_failed_request(
        live: tuple[LocalFleet, str], db_engine: Engine) -> None:
    fleet, url = live
    assert _apply(db_engine, Target(ALL, {Role.COLOCATED: 4}))["status"] == "succeeded"
    agents_before = _agent_steps(db_engine)
    load = Load(url, trajectories=6).start()
    try:
        load.wait_turns(10, timeout_s=60)
        for counts, mode in (({Role.PREFILL: 2, Role.DECODE: 2}, "split"), ({Role.PREFILL: 1, Role.DECODE: 3}, "split"),
                             ({Role.COLOCATED: 4}, "colocated")):
            summary = _apply(db_engine, Target(ALL, counts))
            assert summary["status"] == "succeeded", summary["error"]
            now = _roles(db_engine)
            assert Counter(r for _, r, _ in now.values()) == counts
            for _, role, endpoint in now.values():  # each server says what the rows say
                info = httpx.get(endpoint + "/model_info", timeout=10).json()
                expected = "null" if role is Role.COLOCATED else role.value
                assert str(info.get("disaggregation_mode") or "null") == expected, info
                assert httpx.get(endpoint + "/v1/loads", timeout=10).status_code == 200
            state = httpx.get(url + "/pearl/state", timeout=10).json()
            assert state["mode"] == mode
            load.wait_turns(10, timeout_s=60)
    finally:
        load.stop()
    assert load.failures == [] and load.turns > 40
    assert fleet.check() is None
    _check_metrics(db_engine, agents_before, load.turns)


def _endpoints(engine: Engine) -> dict[tuple[str, str | None], str]:
    return {(m["component"], m["node"]): m["url"] for m in read_fleet_status(engine)["metrics"]}


def _agent_steps(engine: Engine) -> dict[str, float]:
    """Steps each agent ended, by action (its /metrics)."""
    steps: Counter[str] = Counter()
    for (component, _), where in _endpoints(engine).items():
        if component == "agent":
            family = scrape(where)["pearl_steps"]
            steps.update({s.labels["action"]: s.value for s in family.samples if s.labels["outcome"] == "succeeded"})
    return dict(steps)


def _check_metrics(engine: Engine, agents_before: dict[str, float], turns: int) -> None:
    """Every process of the fleet is listed with its /metrics, and what the switches did shows there."""
    listed = _endpoints(engine)
    assert set(listed) == {("frontdoor", None), ("agent", "node-a"), ("agent", "node-b")}
    door = scrape(listed[("frontdoor", None)])
    assert check_conventions(door) == []
    assert value(door, "pearl_frontdoor_requests_total", outcome="served") >= turns
    assert value(door, "pearl_frontdoor_requests_total", outcome="failed") == 0
    assert value(door, "pearl_frontdoor_mode", mode="colocated") == 1
    for mode in ("colocated", "split"):  # each child router's own series, re-exported
        assert value(door, "pearl_frontdoor_router_scrape_ok", router_mode=mode) == 1
    own = [f for name, f in door.items() if not name.startswith(("pearl_", "process_", "python_"))]
    assert {s.labels.get("router_mode") for f in own for s in f.samples} >= {"colocated", "split"}
    after = _agent_steps(engine)
    for action in ("flip_role", "router_sync"):  # the switches' steps, counted by the agents that ran them
        assert after.get(action, 0) > agents_before.get(action, 0), (action, agents_before, after)
    for (component, _), where in listed.items():
        if component == "agent":
            assert check_conventions(scrape(where)) == []


def test_an_agent_killed_mid_step_is_rescued_and_the_step_takes_effect_once(
        live: tuple[LocalFleet, str], db_engine: Engine) -> None:
    fleet, _ = live
    plan_id = propose(db_engine, Target(frozenset({1, 2}), {Role.COLOCATED: 2}))
    plan_store.apply(db_engine, plan_id)

    def step(key: str) -> Any:
        with db_engine.connect() as conn:  # closed here: a connection left to the collector fails a later test
            return conn.execute(text("SELECT status, attempts, fence FROM plan_steps WHERE plan_id = :p AND key = :k"),
                                {"p": plan_id, "k": key}).one()

    _wait(lambda: step("w1.start").status == "running", 30, fleet)
    agent = next(p for p in fleet.procs if p.name == "agent node-a")
    os.killpg(agent.popen.pid, signal.SIGKILL)  # mid-start: the server may be launching
    agent.popen.wait(10)
    fleet.procs.remove(agent)
    fleet.start_agent("node-a", speed=50.0, sim_args=("--startup-s", "5"), lease_s=3.0, poll_s=0.1)
    summary = plan_store.wait_plan(db_engine, plan_id, timeout_s=120, poll_s=0.1)
    assert summary["status"] == "succeeded", summary["error"]
    assert step("w1.start").attempts >= 1
    with transaction(db_engine) as session:
        w1 = session.get(Worker, 1)
        assert w1.activity is Activity.ACTIVE and w1.generation == 1  # started once, whoever ran the step
    servers = fleet.run_dir / "servers" / "node-a"
    assert len(list(servers.glob("worker-1.json"))) == 1  # one server serves it


def test_a_server_killed_under_load_loses_no_request_and_a_plan_brings_its_worker_back(
        live: tuple[LocalFleet, str], db_engine: Engine) -> None:
    fleet, url = live
    assert _apply(db_engine, Target(ALL, {Role.COLOCATED: 4}))["status"] == "succeeded"
    load = Load(url, trajectories=6).start()
    try:
        load.wait_turns(5, timeout_s=60)
        endpoint = _roles(db_engine)[2][2]
        record = json.loads((fleet.run_dir / "servers" / "node-a" / "worker-2.json").read_text())
        pid = int(record["server"]["pid"])
        os.kill(pid, signal.SIGKILL)  # worker 2's server dies between plans, requests in flight
        _wait(lambda: _roles(db_engine)[2][0] is Activity.INACTIVE, 60, fleet)  # out of service, by its agent
        routed = httpx.get(url + "/pearl/state", timeout=10).json()["children"]
        assert endpoint not in {w["url"] for child in routed.values() for w in child["workers"]}  # off the front door
        turns = load.turns
        load.wait_turns(turns + 5, timeout_s=60)  # the others carry the load
        assert _apply(db_engine, Target(ALL, {Role.COLOCATED: 4}))["status"] == "succeeded"  # and it comes back
        assert _roles(db_engine)[2][0] is Activity.ACTIVE
        load.wait_turns(load.turns + 5, timeout_s=60)
    finally:
        load.stop()
    assert load.failures == []  # every request of a killed server was finished by another
    assert fleet.check() is None
