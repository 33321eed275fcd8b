"""How an agent finds the front door: a fleet that never had one goes without; a stopped one (a restart)
is waited for, and never gone around: a worker admitted or drained meanwhile would be missing from, or
left in, its routers once it is back."""

from __future__ import annotations

import threading
import time

import pytest
from pearl.agents.drivers.base import DriverError
from pearl.agents.router_client import FrontDoorClient, front_door_for
from pearl.agents.steps import NoFrontDoor
from pearl.controlplane.store.routers import register_router, router_stopped
from sqlalchemy import Engine

pytestmark = pytest.mark.integration


def _register(engine: Engine, pid: int, port: int) -> None:
    register_router(engine, url=f"http://127.0.0.1:{port}", admin_url=f"http://127.0.0.1:{port + 1}",
                    host="127.0.0.1", pid=pid, mode="colocated")


def test_no_front_door_at_all_is_gone_without(db_engine: Engine) -> None:
    assert isinstance(front_door_for(db_engine, wait_s=0), NoFrontDoor)


def test_a_live_front_door_is_used(db_engine: Engine) -> None:
    _register(db_engine, 101, 18000)
    door = front_door_for(db_engine, wait_s=0)
    assert isinstance(door, FrontDoorClient) and door.url == "http://127.0.0.1:18001"


def test_a_stopped_front_door_is_waited_for_then_refused_not_gone_around(db_engine: Engine) -> None:
    _register(db_engine, 101, 18000)
    router_stopped(db_engine, pid=101)
    t0 = time.monotonic()
    with pytest.raises(DriverError, match="the front door is stopped"):
        front_door_for(db_engine, wait_s=0.5, poll_s=0.05)
    assert time.monotonic() - t0 >= 0.5
    back = threading.Timer(0.3, _register, (db_engine, 102, 18010))  # the restarted front door registers
    back.start()
    door = front_door_for(db_engine, wait_s=10, poll_s=0.05)
    back.join()
    assert isinstance(door, FrontDoorClient) and door.url == "http://127.0.0.1:18011"
