"""The front door with its two real sglang-router children and simulated servers, all as processes.

A steady stream of multi-turn trajectories runs through the front door while the calls a plan's
steps make switch the fleet colocated -> 2P2D -> 1P3D -> colocated (drain = deregister and wait idle,
interrupt = pause abort, stop, start, register, role switch in place after a drain, mode switch):
no request fails, and each server's /model_info and /v1/loads follow its role."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from pearl.agents.drivers.sim import SimDriver
from pearl.agents.server_client import ServerClient
from pearl.controlplane.core.domain import Role
from workers_support import SPEED, Load, spec, start_front_door, wait_gone

pytestmark = pytest.mark.e2e


@pytest.fixture
def driver(tmp_path):
    d = SimDriver(tmp_path / "node", speed=SPEED)
    yield d
    for server in d.servers():
        d.stop(server.worker_id, grace_s=5)


@pytest.fixture
def door(tmp_path):
    fd = start_front_door(tmp_path / "frontdoor")
    yield fd
    children = fd.children()
    fd.stop()
    assert fd.proc.returncode == 0
    assert wait_gone(children), "a router outlived the front door"


def check_role(server, role: Role) -> None:
    client = ServerClient(server.endpoint)
    expected = "null" if role is Role.COLOCATED else role.value
    assert client.model_info()["disaggregation_mode"] == expected
    assert client.loads()[0]["disaggregation"]["mode"] == expected


def start(driver, worker: int, role: Role, generation: int):
    server = driver.launch(spec(worker, role, generation=generation, fence=generation))
    driver.wait_ready(server, 60)
    check_role(server, role)
    return server


def drain(front, server) -> None:
    front.deregister(server.endpoint)
    ServerClient(server.endpoint).wait_idle(60)


def interrupt(front, server, fence: int) -> None:
    front.deregister(server.endpoint)
    ServerClient(server.endpoint, fence=fence).pause_generation("abort")


@pytest.mark.slow  # ~25 s: eight restarts, a flip and two mode switches under load
def test_switching_colocated_2p2d_1p3d_colocated_fails_no_request(driver, door):
    front = door.client
    gen = {w: 1 for w in range(4)}
    servers = {w: start(driver, w, Role.COLOCATED, 1) for w in range(4)}
    for s in servers.values():
        front.register(s.endpoint, Role.COLOCATED)
    load = Load(door.url, trajectories=12).start()
    try:
        load.wait_turns(30)

        # colocated -> 2P2D: two workers restart split, the mode flips, then the other two follow
        for w in (2, 3):
            drain(front, servers[w])
            driver.stop(w, grace_s=5)
        gen[2] = gen[3] = 2
        servers[2] = start(driver, 2, Role.PREFILL, 2)
        servers[3] = start(driver, 3, Role.DECODE, 2)
        front.register(servers[2].endpoint, Role.PREFILL, servers[2].bootstrap_port)
        front.register(servers[3].endpoint, Role.DECODE)
        front.set_mode("split")
        interrupt(front, servers[0], fence=2)  # interrupted: its requests come back aborted and are resubmitted
        drain(front, servers[1])
        for w in (0, 1):
            driver.stop(w, grace_s=5)
        servers[0] = start(driver, 0, Role.PREFILL, 2)
        servers[1] = start(driver, 1, Role.DECODE, 2)
        front.register(servers[0].endpoint, Role.PREFILL, servers[0].bootstrap_port)
        front.register(servers[1].endpoint, Role.DECODE)
        state = front.state()
        assert state["mode"] == "split"
        assert sorted(w["worker_type"] for w in state["children"]["split"]["workers"]) == ["decode", "decode",
                                                                                            "prefill", "prefill"]
        assert state["children"]["colocated"]["workers"] == []
        load.wait_turns(30)

        # 2P2D -> 1P3D: prefill 2 drains and flips to decode in place
        drain(front, servers[2])
        assert ServerClient(servers[2].endpoint, fence=3).pd_role_switch(
            "decode", decode_cuda_graph_memory_gb=2.0)["new_role"] == "decode"
        check_role(servers[2], Role.DECODE)
        front.register(servers[2].endpoint, Role.DECODE)
        assert sorted(w["worker_type"] for w in front.state()["children"]["split"]["workers"]) == [
            "decode", "decode", "decode", "prefill"]
        load.wait_turns(30)

        # 1P3D -> colocated: two decode workers restart colocated, the mode flips back, the rest follow
        for w in (1, 3):
            drain(front, servers[w])
            driver.stop(w, grace_s=5)
            servers[w] = start(driver, w, Role.COLOCATED, 3)
            front.register(servers[w].endpoint, Role.COLOCATED)
        front.set_mode("colocated")
        for w in (0, 2):
            drain(front, servers[w])
            driver.stop(w, grace_s=5)
            servers[w] = start(driver, w, Role.COLOCATED, 3)
            front.register(servers[w].endpoint, Role.COLOCATED)
        load.wait_turns(30)
    finally:
        load.stop()
    assert load.failures == []
    assert load.routers.get("colocated", 0) > 0 and load.routers.get("split", 0) > 0
    state = front.state()
    assert state["mode"] == "colocated" and state["failed"] == 0
    assert len(state["children"]["colocated"]["workers"]) == 4 and state["children"]["split"]["workers"] == []
    for s in servers.values():
        assert ServerClient(s.endpoint).is_idle()


def test_requests_are_held_until_a_worker_serves_and_aborts_are_resubmitted(driver, door):
    front = door.client
    box: dict = {}

    def ask():
        box["r"] = httpx.post(door.url + "/generate", timeout=60,
                              json={"input_ids": list(range(1, 200)), "sampling_params": {"max_new_tokens": 20000}})

    t = threading.Thread(target=ask)
    t.start()
    deadline = time.monotonic() + 10  # the request's arrival, on a loaded machine
    while front.state()["held"] != 1 and time.monotonic() < deadline and t.is_alive():
        time.sleep(0.05)
    assert front.state()["held"] == 1 and t.is_alive()  # no worker yet: held, not failed
    first = start(driver, 0, Role.COLOCATED, 1)
    front.register(first.endpoint, Role.COLOCATED)
    client = ServerClient(first.endpoint, fence=1)
    while client.is_idle():
        time.sleep(0.01)
    second = start(driver, 1, Role.COLOCATED, 1)
    front.register(second.endpoint, Role.COLOCATED)
    interrupt(front, first, fence=1)  # the turn goes on on the other worker with what it generated
    t.join(60)
    answer = box["r"].json()
    assert box["r"].status_code == 200 and len(answer["output_ids"]) == 20000
    assert answer["meta_info"]["pearl"]["resubmitted"] >= 1 and answer["meta_info"]["pearl"]["kept_tokens"] > 0
    assert answer["meta_info"]["completion_tokens"] == 20000 and answer["meta_info"]["prompt_tokens"] == 199


@pytest.mark.slow  # ~12 s: two front doors, four routers
def test_a_restarted_front_door_registers_its_workers_again_and_sigkill_leaves_no_router(driver, tmp_path):
    fd = start_front_door(tmp_path / "fd2")
    server = start(driver, 0, Role.COLOCATED, 1)
    fd.client.register(server.endpoint, Role.COLOCATED)
    children = fd.children()
    assert len(children) >= 2
    os.kill(fd.proc.pid, signal.SIGKILL)
    fd.proc.wait()
    assert wait_gone(children), "a router outlived a SIGKILLed front door"
    again = start_front_door(tmp_path / "fd2", port=int(fd.url.rsplit(":", 1)[1]))
    try:
        state = again.client.state()
        assert [w["url"] for w in state["children"]["colocated"]["workers"]] == [server.endpoint]
        resp = httpx.post(again.url + "/generate", timeout=30,
                          json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 4
        # what an agent sends to bring it in line with the database: exactly these workers, this mode
        synced = again.client.sync("colocated", [])
        assert synced["children"]["colocated"]["workers"] == []
    finally:
        children = again.children()
        again.stop()
        assert again.proc.returncode == 0 and wait_gone(children)


def test_a_restarted_front_door_serves_the_mode_it_restored_or_the_one_recorded_not_its_command_line(
        tmp_path, database_url):
    from pearl.controlplane.store.db import make_engine, transaction
    from sqlalchemy import text

    engine = make_engine(database_url)
    env = {"PEARL_DATABASE_URL": database_url}

    def recorded() -> tuple[str | None, object]:
        with transaction(engine) as s:
            row = s.execute(text("SELECT mode, stopped_at FROM routers")).first()
            return (row.mode, row.stopped_at) if row is not None else (None, "no row yet")

    doors = []  # every front door started here is stopped, whatever fails
    try:
        doors.append(first := start_front_door(tmp_path / "fd", env=env))
        _wait(lambda: recorded()[0] == "colocated")
        with transaction(engine) as s:  # it heartbeats its row: agents tell it from a killed one
            _wait(lambda: s.scalar(text("SELECT heartbeat_at > started_at + interval '1 second' FROM routers")))
        first.client.set_mode("split")  # what a router_sync step does
        first.stop()
        assert first.proc.returncode == 0 and recorded()[1] is not None
        doors.append(again := start_front_door(tmp_path / "fd", env=env))  # the same run dir, --mode colocated
        _wait(lambda: recorded()[1] is None)
        assert again.client.state()["mode"] == "split" and recorded()[0] == "split"
        again.stop()
        # started on a new run directory with no --mode: the mode recorded for the fleet, not colocated
        doors.append(fresh := start_front_door(tmp_path / "fresh", mode=None, env=env))
        _wait(lambda: recorded()[1] is None)
        assert fresh.client.state()["mode"] == "split" and recorded()[0] == "split"
    finally:
        for door in doors:
            door.stop()
        engine.dispose()


def test_a_front_door_restarted_on_an_empty_run_directory_serves_the_fleets_workers_again(
        db_engine, database_url, broker_url, tmp_path, pearlctl_env, pearlctl):
    """Its state.json lost: the node agent's watch registers its serving workers again from the rows;
    `pearlctl router state` finds the fleet's front door and names the workers it does not list."""
    from pearl.agents.router_client import FleetFrontDoor
    from weights_support import bring_up

    fleet = bring_up(db_engine, database_url, broker_url, tmp_path, pearlctl_env)
    env = {"PEARL_DATABASE_URL": database_url}
    doors = []  # every front door started here is stopped, whatever fails
    try:
        doors.append(first := start_front_door(tmp_path / "fd", env=env))
        found = FleetFrontDoor(db_engine)
        fleet.start_agent("node-a", front_door=lambda: found)
        fleet.serve({1, 2})
        endpoints = sorted(fleet.endpoint(w) for w in (1, 2))
        assert _listed(first) == endpoints and _drift(pearlctl) == ([], [])
        agent, thread = fleet.agents.pop()  # no watch while the front door comes back
        agent.stop()
        thread.join(30)
        first.stop()
        stopped = pearlctl("router", "state")
        assert stopped.returncode == 1 and "front door" in stopped.stderr and "is stopped" in stopped.stderr
        doors.append(fresh := start_front_door(tmp_path / "fresh", mode=None, env=env))
        _wait(lambda: (found.started() is not None and
                       pearlctl("router", "state", "--json").stdout.startswith('{"url": "' + fresh.url)))
        missing, not_serving = _drift(pearlctl)
        assert sorted(w["endpoint"] for w in missing) == endpoints and not_serving == []
        shown = pearlctl("router", "state")
        assert shown.returncode == 0 and f"not listed: worker 1 at {fleet.endpoint(1)} (colocated)" in shown.stdout
        fleet.start_agent("node-a", front_door=lambda: found)  # the next agent's watch registers them again
        _wait(lambda: _listed(fresh) == endpoints)
        assert _drift(pearlctl) == ([], [])
        resp = httpx.post(fresh.url + "/generate", timeout=30,
                          json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        assert resp.status_code == 200 and len(resp.json()["output_ids"]) == 4
    finally:
        for door in doors:
            door.stop()
        fleet.stop()


def _drift(pearlctl) -> tuple[list, list]:
    import json

    result = pearlctl("router", "state", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    return rows["missing"], rows["not_serving"]


def _listed(door) -> list[str]:
    return sorted(w["url"] for w in door.client.state()["children"]["colocated"]["workers"])


def _wait(check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def test_a_router_that_dies_is_started_again_with_its_workers_and_no_request_fails(driver, door):
    servers = [start(driver, w, Role.COLOCATED, 1) for w in (0, 1)]
    joining = start(driver, 2, Role.COLOCATED, 1)
    for server in servers:
        door.client.register(server.endpoint, Role.COLOCATED)
    dead = door.client.state()["children"]["colocated"]
    load = Load(door.url, trajectories=4).start()
    streamed: dict = {}

    def stream() -> None:  # a streamed request sent while its router is dead
        streamed["r"] = httpx.post(door.url + "/generate", timeout=60, json={
            "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "stream": True})

    try:
        load.wait_turns(8)
        before = door.client.state()["resubmits"]
        os.kill(dead["pid"], signal.SIGKILL)  # the OOM killer, say
        streaming = threading.Thread(target=stream)
        streaming.start()
        # an agent's admit and drain while it is dead: recorded, and enacted once it is back
        _wait(lambda: door.client.state()["children"]["colocated"]["restarting"], 10)
        door.client.register(joining.endpoint, Role.COLOCATED)
        assert door.client.deregister(servers[1].endpoint)
        wanted = sorted([servers[0].endpoint, joining.endpoint])

        def back() -> bool:
            now = door.client.state()["children"]["colocated"]
            return now["pid"] != dead["pid"] and sorted(w["url"] for w in now["workers"]) == wanted

        _wait(back, 60)
        load.wait_turns(8)  # served by the new router
        streaming.join(60)
    finally:
        load.stop()
    assert not load.failures, load.failures[:3]
    assert door.client.state()["resubmits"] > before  # requests it dropped (or sent to it dead) were sent again
    assert streamed["r"].status_code == 200 and len(streamed["r"].json()["output_ids"]) == 4
    assert dead["pid"] not in door.children()
    assert "router colocated started again" in door.log.read_text()


def test_the_admin_api_has_a_port_of_its_own_and_needs_the_control_token(database_url: str, tmp_path) -> None:
    """Clients reach generation and the state, never the admin API: a mode change or a worker
    registered on the clients' port is not found there; on the admin port it needs the token (401)."""
    from pearl.controlplane.store.db import make_engine, transaction
    from sqlalchemy import text

    env = {"PEARL_DATABASE_URL": database_url}
    fd = start_front_door(tmp_path / "fd", env=env)
    try:
        for method, body in (("PUT", {"mode": "split"}), ("POST", {"url": "http://127.0.0.1:1", "role": "decode"})):
            path = "/pearl/mode" if method == "PUT" else "/pearl/workers"
            assert httpx.request(method, fd.url + path, json=body, timeout=10).status_code in (404, 405)
            refused = httpx.request(method, fd.admin_url + path, json=body, timeout=10)
            assert refused.status_code == 401
            wrong = httpx.request(method, fd.admin_url + path, json=body, timeout=10,
                                  headers={"Authorization": "Bearer " + "0" * 64})
            assert wrong.status_code == 401
        assert httpx.get(fd.url + "/pearl/state", timeout=10).json()["mode"] == "colocated"
        fd.client.set_mode("split")  # with the token
        assert fd.client.state()["mode"] == "split"
        engine = make_engine(database_url)
        try:
            with transaction(engine) as s:
                row = s.execute(text("SELECT url, admin_url FROM routers")).one()
        finally:
            engine.dispose()
        assert (row.url, row.admin_url) == (fd.url, fd.admin_url)
    finally:
        fd.stop()


def test_a_router_that_hangs_is_killed_and_started_again_and_its_requests_are_answered(driver, door):
    """A child router stopped (SIGSTOP: alive, answering nothing) is found out by its missed probes,
    killed and started again with its workers; a request sent to it meanwhile is answered."""
    server = start(driver, 0, Role.COLOCATED, 1)
    door.client.register(server.endpoint, Role.COLOCATED)
    hung = door.client.state()["children"]["colocated"]
    answer: dict = {}

    def request() -> None:
        answer["r"] = httpx.post(door.url + "/generate", timeout=90,
                                 json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})

    os.kill(hung["pid"], signal.SIGSTOP)
    try:
        sender = threading.Thread(target=request)
        sender.start()
        _wait(lambda: not psutil.pid_exists(hung["pid"]) or psutil.Process(hung["pid"]).status() == "zombie", 30)
        sender.join(60)
        assert answer["r"].status_code == 200 and len(answer["r"].json()["output_ids"]) == 4
        now = door.client.state()["children"]["colocated"]
        assert now["pid"] != hung["pid"] and [w["url"] for w in now["workers"]] == [server.endpoint]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung["pid"], signal.SIGCONT)


def test_sigterm_lets_the_requests_in_flight_finish_and_takes_no_new_ones(driver, tmp_path):
    """They used to be cut 5 s after SIGTERM, their tokens lost."""
    fd = start_front_door(tmp_path / "fd")
    server = start(driver, 0, Role.COLOCATED, 1)
    fd.client.register(server.endpoint, Role.COLOCATED)
    answer: dict = {}

    def request() -> None:
        answer["r"] = httpx.post(fd.url + "/generate", timeout=120,
                                 json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 30000}})

    sender = threading.Thread(target=request)
    sender.start()
    _wait(lambda: fd.client.state()["inflight"] == 1, 10)
    started = time.monotonic()
    fd.proc.send_signal(signal.SIGTERM)
    with pytest.raises(httpx.TransportError):  # no new request once it stops
        _wait(lambda: httpx.post(fd.url + "/generate", timeout=5, json={"input_ids": [1]}).status_code < 0, 10)
    sender.join(120)
    fd.proc.wait(60)
    assert answer["r"].status_code == 200 and len(answer["r"].json()["output_ids"]) == 30000
    assert time.monotonic() - started > 5 and fd.proc.returncode == 0
