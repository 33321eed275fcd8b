"""Weight sync end to end: training-end brings every serving worker (simulated servers launched by
real agents through the sim driver) to the new version through the nodes' Celery workers, on the
embedded Redis, the machine's Redis (PEARL_TEST_BROKER_URL) and RabbitMQ (PEARL_TEST_AMQP_URL)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from metrics_support import check_conventions, scrape, value
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.fleet import Target
from pearl.controlplane.errors import BadInput
from pearl.controlplane.store import plan_store
from pearl.controlplane.store import weights as rows
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.fleet_status import read_fleet_status
from plan_support import propose
from sqlalchemy import Engine, text
from weights_support import LiveFleet, bring_up, snapshot, sync_rows, version_moves, wait_for

pytestmark = pytest.mark.integration


# The RabbitMQ tests share one xdist worker: queues are named after the nodes, the same in every test.
@pytest.fixture(params=["redis", pytest.param("amqp", marks=pytest.mark.xdist_group("rabbitmq"))])
def broker(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("broker_url" if request.param == "redis" else "amqp_url")


@pytest.fixture
def live(db_engine: Engine, database_url: str, broker: str, tmp_path: Path,
         pearlctl_env: dict[str, str]) -> Iterator[LiveFleet]:
    fleet = bring_up(db_engine, database_url, broker, tmp_path, pearlctl_env)
    try:
        yield fleet
    finally:
        fleet.stop()


def test_training_end_brings_every_serving_worker_to_the_new_version_once(live: LiveFleet) -> None:
    for node in ("node-a", "node-b"):
        live.start_agent(node)
        live.start_worker(node, metrics=node == "node-a")
    live.serve({1, 2, 3})
    assert live.versions() == {1: 0, 2: 0, 3: 0}
    live.train(1, 1)
    live.wait_versions({1, 2, 3}, 1)
    # node-a's worker synced its node's servers, and says so on its /metrics
    listed = [m for m in read_fleet_status(live.engine)["metrics"] if m["component"] == "worker"]
    assert [m["node"] for m in listed] == ["node-a"]
    page = scrape(listed[0]["url"])
    assert check_conventions(page) == []
    with live.engine.connect() as conn:
        done = conn.execute(text("SELECT count(*) FROM workers w JOIN nodes n ON n.id = w.node_id "
                                 "WHERE n.name = 'node-a' AND w.id IN (1, 2, 3)")).scalar()
    assert done and value(page, "pearl_weight_syncs_total", outcome="done") == done
    assert value(page, "pearl_weight_sync_duration_seconds_count", outcome="done") == done
    assert value(page, "pearl_weight_syncs_running") == 0
    rows = sync_rows(live.engine)
    assert [(r["worker_id"], r["version"], r["state"], r["method"]) for r in rows] == [
        (w, 1, "done", "snapshot") for w in (1, 2, 3)]
    for w in (1, 2, 3):
        served = live.served(w)
        assert served["version"] == "1" and served["loads"] == 1 and served["paused"] is None
        assert version_moves(live.engine, w, 1) == 1
    live.train(2, 2)  # and the next version after it
    live.wait_versions({1, 2, 3}, 2)
    assert all(version_moves(live.engine, w, 2) == 1 and live.served(w)["loads"] == 2 for w in (1, 2, 3))
    for node in ("node-a", "node-b"):  # SIGTERM: a clean stop
        assert live.stop_worker(node) == 0, live.worker_log(node)
    assert read_fleet_status(live.engine)["metrics"] == []  # its endpoint went with it


@pytest.mark.reliability
def test_a_sync_across_a_server_restart_takes_effect_once(live: LiveFleet, tmp_path: Path) -> None:
    live.start_agent("node-a")
    live.start_worker("node-a")
    live.serve({1, 2})
    endpoint = live.endpoint(2)
    port = int(endpoint.rsplit(":", 1)[1])
    live.drivers["node-a"].stop(2, grace_s=5.0)  # worker 2's server goes down before the version is out
    live.train(1, 1)
    wait_for(lambda: live.versions().get(1) == 1, 30, "worker 1 at version 1")
    time.sleep(1.0)  # meanwhile the sync of worker 2 retries against a server that does not answer
    assert live.versions()[2] == 0
    with transaction(live.engine) as s:
        generation = s.scalar(text("SELECT generation FROM workers WHERE id = 2"))
    log = (tmp_path / "restarted.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "pearl.cli.simworker", "--port", str(port), "--worker-id", "2",
                               "--generation", str(generation), "--speed", "20", "--weight-load-s", "2"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        live.wait_versions({1, 2}, 1)
        assert version_moves(live.engine, 2, 1) == 1
        assert live.served(2) | {"checksum": None} == {"version": "1", "checksum": None, "loads": 1, "paused": None}
        row = [r for r in sync_rows(live.engine) if r["worker_id"] == 2][0]
        assert row["state"] == "done" and row["method"] == "snapshot"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(20)
        log.close()


@pytest.mark.reliability
def test_a_celery_worker_killed_mid_task_is_redelivered_and_takes_effect_once(
        db_engine: Engine, database_url: str, broker: str, tmp_path: Path, pearlctl_env: dict[str, str]) -> None:
    # a slow load (4 s of wall time), so the worker is killed while the server loads
    live = bring_up(db_engine, database_url, broker, tmp_path, pearlctl_env, sim_args=("--weight-load-s", "80"))
    try:
        live.start_agent("node-a")
        live.serve({1})
        live.start_worker("node-a")
        live.train(1, 1)
        wait_for(lambda: live.served(1)["paused"] is not None, 30, "worker 1 paused by its sync")
        assert live.stop_worker("node-a", signal.SIGKILL) == -signal.SIGKILL
        assert sync_rows(live.engine)[0]["state"] == "running"  # the task died with its worker
        live.start_worker("node-a")
        live.wait_versions({1}, 1, timeout_s=60)
        row = sync_rows(live.engine)[0]
        assert row["state"] == "done" and row["attempts"] == 2
        assert version_moves(live.engine, 1, 1) == 1
        served = live.served(1)
        assert served["version"] == "1" and served["paused"] is None and served["loads"] in (1, 2)
    finally:
        live.stop()


def _corrupt(path: Path) -> None:
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF  # a byte of the last tensor, lm_head.weight
    (path / "model.safetensors").write_bytes(bytes(data))


def test_a_corrupted_snapshot_is_refused_naming_the_tensor_and_the_server_keeps_its_version(
        live: LiveFleet) -> None:
    live.start_agent("node-a")
    live.start_worker("node-a")
    live.serve({1})
    live.train(1, 1)
    live.wait_versions({1}, 1)
    # at registration: the files do not match the manifest -> refused, nothing written
    torn = snapshot(live.run_dir / "snapshots" / "torn", 2)
    _corrupt(torn)
    live.cp.training_begin(2, wait_s=0)
    with pytest.raises(BadInput, match="tensor lm_head.weight: checksum mismatch"):
        live.cp.training_end(2, weights_version=2, snapshot=str(torn))
    with transaction(live.engine) as s:
        assert s.scalar(text("SELECT count(*) FROM weight_snapshots WHERE version = 2")) == 0
        assert s.scalar(text("SELECT ended_at FROM training_steps WHERE step = 2")) is None
    # registered whole, torn on the shared storage before the server loads it: the server refuses it
    assert live.stop_worker("node-a") == 0
    path = snapshot(live.run_dir / "snapshots" / "v2", 2)
    live.cp.training_end(2, weights_version=2, snapshot=str(path))
    _corrupt(path)
    live.start_worker("node-a")
    row = wait_for(lambda: next((r for r in sync_rows(live.engine) if r["version"] == 2 and r["state"] == "failed"),
                                None), 30, "the sync of version 2 failed")
    assert "tensor lm_head.weight: checksum mismatch" in row["error"] and "kept version 1" in row["error"]
    assert row["attempts"] == 1  # the server's 4xx is a refusal: not tried again
    assert live.versions() == {1: 1}
    assert live.served(1)["version"] == "1" and live.served(1)["paused"] is None


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_in_pd_mode_the_prefill_and_the_decode_servers_both_get_the_version(live: LiveFleet) -> None:
    for node in ("node-a", "node-b"):
        live.start_agent(node)
        live.start_worker(node)
    plan_id = propose(live.engine, Target(frozenset({1, 3}), {Role.PREFILL: 1, Role.DECODE: 1}, reason="test"))
    plan_store.apply(live.engine, plan_id)
    live.wait_plan(plan_id, 60)
    with transaction(live.engine) as s:
        roles = dict(s.execute(text("SELECT id, role FROM workers WHERE activity = 'active'")).all())
    assert sorted(roles.values()) == ["decode", "prefill"]
    live.train(1, 1)
    live.wait_versions(set(roles), 1)
    for w in roles:
        assert live.served(w)["version"] == "1" and version_moves(live.engine, w, 1) == 1


@pytest.mark.reliability
def test_a_broker_restart_loses_no_sync(db_engine: Engine, database_url: str, tmp_path: Path,
                                        pearlctl_env: dict[str, str]) -> None:
    from pearl.controlplane.services.embedded import start_redis, stop_redis

    home = tmp_path / "redis-home"
    broker = start_redis(home)
    live = bring_up(db_engine, database_url, broker, tmp_path, pearlctl_env)
    try:
        live.start_agent("node-a")
        live.serve({1, 2})
        live.start_worker("node-a", stall_s=10)  # a consumer that does not come back is started again
        live.train(1, 1)
        live.wait_versions({1, 2}, 1)
        stop_redis(home)  # the broker goes away (no persistence: its queues are gone)
        live.train(2, 2)  # the syncs are queued in the rows; sending them fails
        assert {r["state"] for r in sync_rows(live.engine) if r["version"] == 2} == {"queued"}
        assert start_redis(home) == broker
        live.wait_versions({1, 2}, 2, timeout_s=60)  # the node's worker reconnects and sends them again
        assert all(version_moves(live.engine, w, 2) == 1 for w in (1, 2))
        live.assert_running("node-a")
    finally:
        live.stop()
        stop_redis(home)


@pytest.mark.reliability
@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_worker_whose_consumer_stalls_starts_again_in_place_and_loses_no_sync(live: LiveFleet) -> None:
    from pearl.controlplane.weights.dispatch import make_celery, queue_name

    live.start_agent("node-a")
    live.serve({1, 2})
    proc = live.start_worker("node-a", stall_s=3)
    live.train(1, 1)
    live.wait_versions({1, 2}, 1)
    # the consumer stops taking from its queue while the process lives on: what a broken broker
    # reconnection leaves behind
    app = make_celery(live.broker)
    try:
        replies = app.control.cancel_consumer(queue_name("node-a"), reply=True, timeout=10, limit=1)
    finally:
        app.close()
    assert replies, "the worker did not answer the remote control"
    live.train(2, 2)
    live.wait_versions({1, 2}, 2, timeout_s=60)
    log = (live.run_dir / "worker-node-a.log").read_text(errors="replace")
    assert "took nothing from its queue" in log and proc.poll() is None  # the same process, started again
    assert all(version_moves(live.engine, w, 2) == 1 for w in (1, 2))
    assert live.stop_worker("node-a") == 0, live.worker_log("node-a")  # and it still stops cleanly


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_a_newer_version_supersedes_one_not_yet_loaded_and_no_worker_goes_back(live: LiveFleet) -> None:
    live.start_agent("node-a")
    live.serve({1, 2})
    live.train(1, 1)  # no worker for node-a yet: the syncs of version 1 wait in the rows
    live.train(2, 2)
    states = {(r["worker_id"], r["version"]): r["state"] for r in sync_rows(live.engine)}
    assert states == {(1, 1): "superseded", (2, 1): "superseded", (1, 2): "queued", (2, 2): "queued"}
    live.start_worker("node-a")
    live.wait_versions({1, 2}, 2)
    for w in (1, 2):
        assert version_moves(live.engine, w, 1) == 0 and version_moves(live.engine, w, 2) == 1
        assert live.served(w)["version"] == "2" and live.served(w)["loads"] == 1  # version 1 never loaded
    with transaction(live.engine) as s:  # a late report of the older version changes nothing
        sync_id, generation = s.execute(text(
            "SELECT s.id, w.generation FROM weight_syncs s JOIN workers w ON w.id = s.worker_id "
            "WHERE s.worker_id = 1 AND s.version = 1")).one()
        late = rows.SyncJob(sync_id, 1, 1, "", "", 0, live.endpoint(1), generation, 1)
        assert rows.finish_sync(s, late, method="snapshot") is False
    assert live.versions() == {1: 2, 2: 2}
