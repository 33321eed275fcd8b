"""How an agent finds the front door: a fleet that never had one goes without; a stopped one (a restart)
is waited for before a worker is registered, never gone around (a worker admitted meanwhile would be
missing from its routers once it is back), while a worker leaving service does not wait for it."""

from __future__ import annotations

import json
import threading
import time

import pytest
from db_faults import refuse_first
from pearl.agents.drivers.base import DriverError
from pearl.agents.router_client import FleetFrontDoor, FrontDoorClient
from pearl.controlplane.store.db import transaction
from pearl.controlplane.store.routers import SILENT_S, heartbeat, register_router, router_stopped
from sqlalchemy import Engine, text

pytestmark = pytest.mark.integration


def _register(engine: Engine, pid: int, port: int) -> None:
    register_router(engine, url=f"http://127.0.0.1:{port}", admin_url=f"http://127.0.0.1:{port + 1}",
                    host="127.0.0.1", pid=pid, mode="colocated")


def test_no_front_door_at_all_is_gone_without(db_engine: Engine) -> None:
    door = FleetFrontDoor(db_engine, wait_s=5)
    t0 = time.monotonic()
    assert door.live(wait=True) is None
    assert door.register("http://127.0.0.1:1", "colocated") is None and door.set_mode("split") is None
    assert door.deregister("http://127.0.0.1:1") is None
    assert time.monotonic() - t0 < 2  # nothing waited for


def test_a_live_front_door_is_used(db_engine: Engine) -> None:
    _register(db_engine, 101, 18000)
    client = FleetFrontDoor(db_engine, wait_s=0).live(wait=False)
    assert isinstance(client, FrontDoorClient) and client.url == "http://127.0.0.1:18001"
    client.close()


def test_a_stopped_front_door_is_waited_for_before_a_registration_not_before_a_deregistration(
        db_engine: Engine) -> None:
    _register(db_engine, 101, 18000)
    router_stopped(db_engine, pid=101)
    door = FleetFrontDoor(db_engine, wait_s=0.5, poll_s=0.05)
    t0 = time.monotonic()
    assert door.deregister("http://127.0.0.1:1") is None  # leaving service: not waited for
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(DriverError, match="the front door is stopped"):
        door.register("http://127.0.0.1:1", "colocated")
    assert time.monotonic() - t0 >= 0.5
    back = threading.Timer(0.3, _register, (db_engine, 102, 18010))  # the restarted front door registers
    back.start()
    client = FleetFrontDoor(db_engine, wait_s=10, poll_s=0.05).live(wait=True)
    back.join()
    assert isinstance(client, FrontDoorClient) and client.url == "http://127.0.0.1:18011"
    client.close()


def test_a_new_start_of_the_front_door_is_told_apart_and_pearlctl_router_state_names_what_it_cannot_reach(
        db_engine: Engine, pearlctl) -> None:
    door = FleetFrontDoor(db_engine)
    none = pearlctl("router", "state")
    assert none.returncode == 1 and "no front door is recorded" in none.stderr and none.stdout == ""
    assert door.started() is None and door.listed() is None
    _register(db_engine, pid=11, port=40010)
    first = door.started()
    assert first is not None
    assert door.listed(timeout_s=1) is None  # recorded as running, but nothing answers there
    router_stopped(db_engine, pid=11)
    assert door.started() is None
    stopped = pearlctl("router", "state", "--json")
    assert stopped.returncode == 1 and "is stopped" in stopped.stderr and '"error"' in stopped.stdout
    shown = json.loads(pearlctl("status", "--json").stdout)["router"]  # status shows it stopped, not nothing
    assert shown["url"] == "http://127.0.0.1:40010" and shown["stopped_at"] is not None
    assert "stopped at" in pearlctl("status").stdout
    _register(db_engine, pid=12, port=40010)  # started again: a start of its own
    assert door.started() not in (None, first)
    shown = json.loads(pearlctl("status", "--json").stdout)["router"]
    assert shown["stopped_at"] is None and shown["running"]


def test_a_front_door_silent_past_its_heartbeat_counts_as_stopped_until_it_beats_again(
        db_engine: Engine, pearlctl) -> None:
    """Killed (SIGKILL, its machine lost) before it could say so: agents wait for it instead of failing
    their steps against it, and status says it is silent."""
    door = FleetFrontDoor(db_engine, wait_s=0.5, poll_s=0.05)
    _register(db_engine, pid=21, port=40020)
    assert door.started() is not None and heartbeat(db_engine, pid=21)
    with transaction(db_engine) as s:
        s.execute(text("UPDATE routers SET heartbeat_at = pearl_now() - make_interval(secs => :s)"),
                  {"s": SILENT_S + 1})
    assert door.started() is None and door.live(wait=False) is None
    with pytest.raises(DriverError, match="did not come back"):
        door.register("http://127.0.0.1:1", "colocated")
    shown = json.loads(pearlctl("status", "--json").stdout)["router"]
    assert not shown["running"] and shown["stopped_at"] is None and shown["heartbeat_age_s"] > SILENT_S
    assert "silent for" in pearlctl("status").stdout
    assert heartbeat(db_engine, pid=21)  # it was only slow: running again
    assert door.started() is not None
    assert not heartbeat(db_engine, pid=22)  # another process's beat does not keep this row alive
    router_stopped(db_engine, pid=21)
    assert not heartbeat(db_engine, pid=21)  # a stopped front door's late beat does not revive it
    assert door.started() is None


def test_a_database_that_refuses_the_front_doors_registration_a_while_does_not_leave_it_unregistered(
        db_engine: Engine) -> None:
    """The front door listens, the database gives up on its registration twice (as a statement timeout
    would, then a dropped connection): it is registered all the same, not left out for good."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from pearl.cli.router import _register_when_listening

    class State(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"mode": "split"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    refuse_first(db_engine, "refuse_router", "routers", "INSERT OR UPDATE", ["57014", "08006"])
    server = ThreadingHTTPServer(("127.0.0.1", 0), State)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = SimpleNamespace(host="127.0.0.1", port=server.server_address[1], mode="colocated")
        assert _register_when_listening(db_engine, cfg, timeout_s=10, retry_max_s=0.2)
    finally:
        server.shutdown()
        server.server_close()
    with db_engine.begin() as conn:
        row = conn.execute(text("SELECT url, mode FROM routers WHERE stopped_at IS NULL")).one()
    assert row.url == f"http://127.0.0.1:{cfg.port}" and row.mode == "split"
