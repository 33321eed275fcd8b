"""The metrics over the database: the fleet's series agree with `pearlctl status --json` and move when a
plan runs; each process's endpoint is listed while it is alive and only then; database errors are
counted by kind."""

from __future__ import annotations

import json
import re
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from metrics_support import check_conventions, scrape, value
from pearl.cli.metrics import start_metrics
from pearl.controlplane.errors import IllegalTransition
from pearl.controlplane.services import metrics
from pearl.controlplane.store import db, metrics_endpoints, plan_store
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.fleet_metrics import DatabaseErrorsCollector, FleetCollector
from pearl.controlplane.store.fleet_status import read_fleet_status
from plan_support import import_cluster, propose, run_plan, small_inventory
from sqlalchemy import Engine, text

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_the_fleet_series_agree_with_status_and_a_plan_moves_them(db_engine: Engine) -> None:
    import_cluster(db_engine, small_inventory())
    server = metrics.serve("loop", 0, extra=(FleetCollector(db_engine),))
    try:
        before = scrape(server.url)
        assert check_conventions(before) == []
        assert value(before, "pearl_fleet_scrape_ok") == 1
        status = read_fleet_status(db_engine)
        for zone, states in status["gpus"]["by_zone_state"].items():
            for state, count in states.items():
                assert value(before, "pearl_gpus", zone=zone, state=state) == count, (zone, state)
        assert value(before, "pearl_gpus") == status["gpus"]["total"]
        assert value(before, "pearl_workers", activity="active") == 0

        plan_id = propose(db_engine)  # three colocated workers
        plan_store.apply(db_engine, plan_id)
        assert value(scrape(server.url), "pearl_plans", status="applying") == 1
        run_plan(db_engine, datetime.now(UTC))
        after = scrape(server.url)
        assert value(after, "pearl_plans", status="succeeded") == value(before, "pearl_plans", status="succeeded") + 1
        assert value(after, "pearl_plan_duration_seconds_count", outcome="succeeded") == 1
        status = read_fleet_status(db_engine)
        active = [w for w in status["workers"] if w["activity"] == "active"]
        assert value(after, "pearl_workers", role="colocated", activity="active") == len(active) == 3
        assert {state: value(after, "pearl_gpus", state=state) for state in status["gpus"]["by_state"]} == \
            status["gpus"]["by_state"]
        assert value(after, "pearl_gpus", state="free") < value(before, "pearl_gpus", state="free")
    finally:
        server.stop()


def test_a_scrape_while_the_database_is_away_says_so(database_url: str) -> None:
    from sqlalchemy.engine import make_url

    engine = db.make_engine(make_url(database_url).set(host="127.0.0.1", port=1))  # nothing listens on port 1
    server = metrics.serve("loop", 0, extra=(FleetCollector(engine),))
    try:
        families = scrape(server.url)
        assert value(families, "pearl_fleet_scrape_ok") == 0 and "pearl_gpus" not in families
    finally:
        server.stop()
        engine.dispose()


def test_an_endpoint_is_listed_while_its_process_lives_and_removed_when_it_stops(db_engine: Engine) -> None:
    stop = start_metrics(db_engine, "agent", 0, node="node-a")
    try:
        keeper_listed = _wait_listed(db_engine)
        assert [(m["component"], m["node"]) for m in keeper_listed] == [("agent", "node-a")]
        assert "pearl_step_claims" in scrape(keeper_listed[0]["url"])
        assert json.loads(json.dumps(read_fleet_status(db_engine)))["metrics"] == keeper_listed
    finally:
        stop()
    assert read_fleet_status(db_engine)["metrics"] == []


def test_a_silent_endpoint_is_not_listed_and_an_old_one_is_pruned(db_engine: Engine) -> None:
    metrics_endpoints.register(db_engine, component="loop", node=None, url="http://127.0.0.1:9/metrics",
                               host="h", pid=1)
    metrics_endpoints.register(db_engine, component="agent", node="n", url="http://127.0.0.1:8/metrics",
                               host="h", pid=2)
    with transaction(db_engine) as session:  # a SIGKILL: its heartbeat stopped
        session.execute(text("UPDATE metrics_endpoints SET heartbeat_at = now() - interval '1 minute' WHERE pid = 1"))
        session.execute(text("UPDATE metrics_endpoints SET heartbeat_at = now() - interval '2 hours' WHERE pid = 2"))
        assert metrics_endpoints.live(session) == []
    metrics_endpoints.register(db_engine, component="worker", node="n", url="http://127.0.0.1:7/metrics",
                               host="h", pid=3)
    with transaction(db_engine) as session:
        assert sorted(session.scalars(text("SELECT pid FROM metrics_endpoints"))) == [1, 3]
        assert [m["component"] for m in metrics_endpoints.live(session)] == ["worker"]


def test_a_bad_endpoint_row_is_refused(db_engine: Engine) -> None:
    with pytest.raises(Exception, match="known_component"):
        metrics_endpoints.register(db_engine, component="scheduler", node=None, url="http://127.0.0.1:9/metrics",
                                   host="h", pid=1)
    with pytest.raises(Exception, match="metrics_url"):
        metrics_endpoints.register(db_engine, component="loop", node=None, url="http://127.0.0.1:9/evil?x",
                                   host="h", pid=1)


def test_database_errors_are_counted_by_kind(db_engine: Engine) -> None:
    import_cluster(db_engine, small_inventory())
    before = db.database_errors().get("illegal_transition", 0)
    with pytest.raises(IllegalTransition), transaction(db_engine) as session:
        session.execute(text("UPDATE gpus SET state = 'borrowed' WHERE id = (SELECT min(id) FROM gpus "
                             "WHERE state = 'unavailable')"))
    assert db.database_errors().get("illegal_transition", 0) == before + 1
    server = metrics.serve("agent", 0, extra=(DatabaseErrorsCollector(),))
    try:
        assert value(scrape(server.url), "pearl_database_errors_total", kind="illegal_transition") == before + 1
    finally:
        server.stop()


def _wait_listed(engine: Engine, timeout_s: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = read_fleet_status(engine)["metrics"]
        if listed:
            return listed
        time.sleep(0.05)
    raise AssertionError("never listed")


def _sample_names(families) -> set[str]:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {f.name + s for f in families for s in suffixes.get(f.type, ("",))}


def test_the_grafana_dashboard_reads_only_series_pearl_serves(db_engine: Engine, tmp_path: Path) -> None:
    """Every series docs/grafana-dashboard.json queries is one a pearl process serves."""
    from pearl.agents.frontdoor_metrics import FrontDoorCollector
    from pearl.agents.router import FrontDoor, FrontDoorConfig

    import_cluster(db_engine, small_inventory())
    families = [f for c in ("agent", "loop", "worker") for f in metrics.registry_for(c).collect()]
    families += [*FleetCollector(db_engine).collect(), *DatabaseErrorsCollector().collect()]
    families += FrontDoorCollector(FrontDoor(FrontDoorConfig(port=1, run_dir=str(tmp_path / "door")))).collect()
    served = _sample_names(families)
    board = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    referenced = {name for e in exprs for name in re.findall(r"\bpearl_[a-z0-9_]+", e)}
    assert len(exprs) >= 20 and referenced and referenced <= served, sorted(referenced - served)
    titles = " ".join(p["title"] for p in board["panels"]).lower()
    for what in ("gpus", "workers", "plan", "step", "policy", "decisions", "makespan", "borrow", "weight",
                 "front door", "database errors"):
        assert what in titles, what
