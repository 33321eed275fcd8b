"""The simulated SGLang server as real processes (launched by the sim driver): what the agent's steps
rely on. Memory release and resume, fencing, pause/abort with partial tokens, role switch only when
idle, weights from a checked snapshot, SIGTERM and SIGKILL, adoption of a running server by a new
driver, and a launch that dies reported with its log."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from pearl.agents.drivers.base import DriverError, WeightsRef
from pearl.agents.drivers.process import TAG, carries_tag
from pearl.agents.drivers.sim import SimDriver
from pearl.agents.server_client import ServerClient
from pearl.controlplane.core.catalog import default_catalog
from pearl.controlplane.core.domain import Role
from pearl.controlplane.core.perfmodel import PerfModel
from pearl.controlplane.weights.files import write_snapshot
from workers_support import SPEED, spec, wait_gone

pytestmark = pytest.mark.e2e


@pytest.fixture
def driver(tmp_path):
    d = SimDriver(tmp_path / "run", speed=SPEED, extra_args=("--weight-load-s", "1", "--role-switch-s", "1"))
    yield d
    for server in d.servers():
        d.stop(server.worker_id, grace_s=5)


def generate(server, tokens: int, prompt: int = 100) -> dict:
    resp = httpx.post(server.endpoint + "/generate", timeout=60,
                      json={"input_ids": list(range(1, prompt + 1)), "sampling_params": {"max_new_tokens": tokens}})
    return {"status": resp.status_code, **resp.json()}


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(result=fn(*args)), daemon=True)
    t.start()
    return t, box


def test_generation_is_timed_by_the_performance_model_and_loads_report_it(driver):
    server = driver.launch(spec(1, Role.COLOCATED))
    driver.wait_ready(server, 60)
    client = ServerClient(server.endpoint)
    assert client.model_info()["disaggregation_mode"] == "null"
    assert client.is_idle()
    t, box = in_background(generate, server, 2000)
    deadline = time.monotonic() + 10
    while client.loads()[0]["num_running_reqs"] == 0:  # /v1/loads sees it running
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not client.is_idle()
    t.join(60)
    answer = box["result"]
    assert answer["status"] == 200 and len(answer["output_ids"]) == 2000
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 2000}
    perf = PerfModel(default_catalog().model("qwen3-8b"), default_catalog().gpu("h100"), 1)
    floor = 2000 * perf.decode_step_time(1, 100) / SPEED  # at least the model's decode time, compressed
    assert answer["meta_info"]["e2e_latency"] >= 0.9 * floor
    assert client.is_idle()
    # the next turn of the same trajectory finds its prefix cached on this server
    ids = list(range(1, 101)) + answer["output_ids"] + [7, 7, 7]
    again = httpx.post(server.endpoint + "/generate", timeout=60,
                       json={"input_ids": ids, "sampling_params": {"max_new_tokens": 5}}).json()
    assert again["meta_info"]["cached_tokens"] >= 2000


def test_the_start_up_counts_from_the_launch_its_imports_included(tmp_path):
    startup = 2.0  # wall seconds
    driver = SimDriver(tmp_path / "run", speed=SPEED, extra_args=("--startup-s", repr(startup * SPEED)))
    launched = time.monotonic()
    server = driver.launch(spec(1, Role.COLOCATED))
    try:
        listening = ready = None
        with httpx.Client(timeout=1.0) as http:
            while ready is None and time.monotonic() < launched + 60:
                try:
                    status = http.get(server.endpoint + "/health").status_code
                except httpx.HTTPError:
                    time.sleep(0.01)
                    continue
                listening = listening or time.monotonic()
                assert status in (200, 503)
                ready = time.monotonic() if status == 200 else None
                time.sleep(0.01)
        assert ready is not None and listening is not None
        assert ready - launched >= startup - 0.05  # never before the start-up has run
        assert ready - listening < startup - 0.25  # it ran while the process started and imported
    finally:
        driver.stop(server.worker_id, grace_s=5)


def test_memory_release_refuses_work_and_resume_restores_it(driver):
    server = driver.launch(spec(2, Role.COLOCATED, overlap=True))
    driver.wait_ready(server, 60)
    client = ServerClient(server.endpoint, fence=3)
    client.release_memory_occupation()
    assert generate(server, 10)["status"] == 503
    assert not client.health()
    client.resume_memory_occupation()
    assert client.health()
    assert generate(server, 10)["status"] == 200


def test_release_needs_the_memory_saver_and_an_idle_server(driver):
    plain = driver.launch(spec(3, Role.COLOCATED))
    saver = driver.launch(spec(4, Role.COLOCATED, overlap=True))
    driver.wait_ready(plain, 60)
    driver.wait_ready(saver, 60)
    with pytest.raises(DriverError, match="enable-memory-saver"):
        ServerClient(plain.endpoint, fence=1).release_memory_occupation()
    t, _ = in_background(generate, saver, 3000)
    client = ServerClient(saver.endpoint, fence=1)
    while client.is_idle():
        time.sleep(0.01)
    with pytest.raises(DriverError, match="drain it"):
        client.release_memory_occupation()
    t.join(60)


def test_older_fences_are_refused_and_change_nothing(driver):
    server = driver.launch(spec(5, Role.PREFILL, fence=7))
    driver.wait_ready(server, 60)
    with pytest.raises(DriverError, match="409.*fence 6 is older than 7"):
        ServerClient(server.endpoint, fence=6).pd_role_switch("decode")
    assert ServerClient(server.endpoint).model_info()["disaggregation_mode"] == "prefill"
    ServerClient(server.endpoint, fence=8).pd_role_switch("decode", decode_cuda_graph_memory_gb=2.0)
    with pytest.raises(DriverError, match="409") as refused:
        ServerClient(server.endpoint, fence=7).pause_generation()
    assert refused.value.status == 409  # what a step reads to know a newer claim commands the server
    assert ServerClient(server.endpoint).model_info()["disaggregation_mode"] == "decode"


def test_pause_abort_returns_the_tokens_generated_so_far(driver):
    server = driver.launch(spec(6, Role.COLOCATED))
    driver.wait_ready(server, 60)
    client = ServerClient(server.endpoint, fence=1)
    t, box = in_background(generate, server, 50000)
    time.sleep(0.4)
    assert client.pause_generation("abort")["status"] == "ok"
    t.join(30)
    answer = box["result"]
    assert answer["status"] == 200
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(answer["output_ids"]) == answer["meta_info"]["completion_tokens"] < 50000
    t2, box2 = in_background(generate, server, 5)  # paused: held, not refused
    time.sleep(0.2)
    assert "result" not in box2
    client.continue_generation()
    t2.join(30)
    assert box2["result"]["status"] == 200 and len(box2["result"]["output_ids"]) == 5


def test_role_switch_only_when_idle_and_only_between_split_roles(driver):
    colocated = driver.launch(spec(7, Role.COLOCATED))
    decode = driver.launch(spec(8, Role.DECODE))
    driver.wait_ready(colocated, 60)
    driver.wait_ready(decode, 60)
    with pytest.raises(DriverError, match="enable-pd-role-switch is not set"):  # colocated: launched without it
        ServerClient(colocated.endpoint, fence=1).pd_role_switch("prefill")
    # a decode half waiting for its KV keeps the server busy: no switch (its prefill server never answers)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    t, box = in_background(lambda: httpx.post(decode.endpoint + "/generate", timeout=60, json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": silent.getsockname()[1], "bootstrap_room": 42}).json())
    client = ServerClient(decode.endpoint, fence=1)
    deadline = time.monotonic() + 10
    while client.is_idle():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(DriverError, match="not idle; drain all requests"):
        client.pd_role_switch("prefill")
    silent.close()  # the KV pull fails: the decode half is answered aborted
    t.join(30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert client.is_idle()
    started = time.monotonic()
    answer = client.pd_role_switch("prefill")
    assert answer["success"] and answer["old_role"] == "decode" and answer["new_role"] == "prefill"
    assert time.monotonic() - started >= 1 / SPEED * 0.9
    assert client.model_info()["disaggregation_mode"] == "prefill"
    assert client.loads()[0]["disaggregation"]["mode"] == "prefill"


def test_weights_from_a_checked_snapshot_and_a_corrupt_one_refused(driver, tmp_path):
    good = write_snapshot(tmp_path / "v2", {"model.embed": b"\x01" * 64, "model.layers.0.w": b"\x02" * 32})
    bad = write_snapshot(tmp_path / "v3", {"model.embed": b"\x01" * 64, "model.layers.0.w": b"\x02" * 32})
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-1] + b"\x00")  # last byte of model.layers.0.w flipped
    server = driver.launch(spec(9, Role.COLOCATED, weights=WeightsRef(1, str(good))))
    driver.wait_ready(server, 60)
    client = ServerClient(server.endpoint, fence=2)
    assert client.model_info()["weight_version"] == "1"
    client.update_weights_from_disk(str(good), weight_version=2)
    assert client.model_info()["weight_version"] == "2"
    with pytest.raises(DriverError, match="tensor model.layers.0.w: checksum mismatch"):
        client.update_weights_from_disk(str(bad), weight_version=3)
    info = client.model_info()
    assert info["weight_version"] == "2" and info["model_path"] == str(good)
    assert generate(server, 5)["meta_info"]["weight_version"] == "2"


def test_a_launch_that_dies_is_reported_with_its_last_log_lines(driver, tmp_path):
    bad = write_snapshot(tmp_path / "torn", {"model.embed": b"\x01" * 64})
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-10])
    server = driver.launch(spec(10, Role.COLOCATED, weights=WeightsRef(4, str(bad))))
    with pytest.raises(DriverError, match=r"exited before it was ready(.|\n)*tensor model.embed.*truncated"):
        driver.wait_ready(server, 60)
    assert driver.running(10) is None


def test_sigterm_answers_in_flight_requests_and_exits_cleanly(driver):
    server = driver.launch(spec(11, Role.COLOCATED))
    driver.wait_ready(server, 60)
    t, box = in_background(generate, server, 50000)
    time.sleep(0.3)
    assert driver.stop(11, grace_s=10)
    t.join(30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(box["result"]["output_ids"]) > 0
    assert "SIGTERM, 1 in-flight requests answered as aborted" in Path(server.log_path).read_text()
    assert driver.running(11) is None and not driver.stop(11)


def test_a_server_is_known_by_its_start_since_boot_not_by_the_wall_clock(driver):
    """A wall clock stepped under a running server (NTP, a migrated VM) must not turn it into an
    untracked orphan; a pid reused by another process is still not taken for the server."""
    import json

    server = driver.launch(spec(14, Role.COLOCATED))
    record = driver.run_dir / "worker-14.json"
    raw = json.loads(record.read_text())
    assert raw["start_ticks"] is not None
    raw["started"] -= 7.0  # what psutil's create_time reports once the clock stepped 7 s
    record.write_text(json.dumps(raw))
    assert driver.running(14) == server and [s.worker_id for s in driver.servers()] == [14]
    raw["start_ticks"] -= 1  # the same pid, another process
    record.write_text(json.dumps(raw))
    try:
        assert driver.running(14) is None
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        assert wait_gone([server.pid])


def test_a_server_whose_launcher_died_before_recording_it_is_killed_before_the_next_launch(driver):
    """SIGKILL between the launch and its record: the server runs untracked on the worker's GPUs; the
    worker's next launch finds it by its tag and kills it instead of starting a second one beside it."""
    first = driver.launch(spec(15, Role.COLOCATED))
    try:
        (driver.run_dir / "worker-15.json").unlink()  # the record never written
        assert driver.running(15) is None and psutil.pid_exists(first.pid)
        again = driver.launch(spec(15, Role.COLOCATED))
        assert wait_gone([first.pid]) and again.pid != first.pid
        driver.wait_ready(again, 60)
        assert driver.stop(15, grace_s=5)
    finally:
        _kill_group(first.pid)


def test_a_server_without_a_record_is_found_under_a_pid_psutil_has_seen_reused(driver):
    """psutil's process_iter keeps the Process objects of its last call; once a check finds a cached
    object's pid taken by a newer process, its next call skips that pid. A server started under such a
    recycled pid must still be found and killed before the worker's next launch."""
    first = driver.launch(spec(16, Role.COLOCATED))
    try:
        (driver.run_dir / "worker-16.json").unlink()
        list(psutil.process_iter(["pid"]))  # psutil's cache: an older process once ran under the server's pid
        older = psutil._pmap[first.pid]
        older._create_time = older.create_time() - 100.0
        older._ident = (older.pid, older._create_time)
        assert not older.is_running()  # and a check has seen the pid reused
        again = driver.launch(spec(16, Role.COLOCATED))
        assert wait_gone([first.pid]) and again.pid != first.pid
        assert driver.stop(16, grace_s=5)
    finally:
        _kill_group(first.pid)


def test_the_wait_for_a_tag_sees_a_late_environment_and_gives_up_on_an_exit_or_a_timeout():
    """What a launch waits on before it returns (`carries_tag`): Popen returns once the exec has begun,
    and the new program's environment, which carries the tag a scan finds a server by, is set up a
    moment later."""
    tag = "/run/node:1"
    late = subprocess.Popen(["/bin/sh", "-c", f"sleep 0.3; exec env {TAG}={tag} sleep 30"])
    try:  # a program whose environment shows the tag only 0.3 s after it started
        started = time.monotonic()
        assert carries_tag(late.pid, tag, 10.0)
        assert time.monotonic() - started >= 0.25
    finally:
        late.kill()
        late.wait()
    exits = subprocess.Popen(["/bin/sh", "-c", "sleep 0.2"])
    started = time.monotonic()
    assert not carries_tag(exits.pid, tag, 10.0) and time.monotonic() - started < 5.0  # it exited first
    exits.wait()
    never = subprocess.Popen(["sleep", "30"])
    try:
        assert not carries_tag(never.pid, tag, 0.3)
    finally:
        never.kill()
        never.wait()


def _kill_group(pid: int) -> None:
    """Whatever a failed assertion left running, gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    wait_gone([pid])


def test_sigkill_leaves_nothing_and_a_new_driver_adopts_running_servers(driver, tmp_path):
    a = driver.launch(spec(12, Role.COLOCATED))
    b = driver.launch(spec(13, Role.PREFILL))
    driver.wait_ready(a, 60)
    driver.wait_ready(b, 60)
    assert driver.launch(spec(12, Role.COLOCATED)) == a  # idempotent for the same generation
    again = SimDriver(driver.run_dir, speed=SPEED)  # a restarted agent on the node
    assert {s.worker_id for s in again.servers()} == {12, 13}
    os.kill(a.pid, signal.SIGKILL)
    assert wait_gone([a.pid])
    assert again.running(12) is None
    assert not psutil.pid_exists(a.pid) or psutil.Process(a.pid).status() == psutil.STATUS_ZOMBIE
    newer = again.launch(spec(13, Role.DECODE, generation=2))  # a newer generation replaces the old server
    assert wait_gone([b.pid])
    again.wait_ready(newer, 60)
    assert ServerClient(newer.endpoint).model_info()["disaggregation_mode"] == "decode"
    assert again.stop(13, grace_s=5)


def test_a_cache_flush_needs_an_idle_scheduler_as_sglangs_does(driver, tmp_path):
    """SGLang flushes only a fully idle scheduler: a request paused in place still counts (the update
    is applied, the call fails), a retracted one waiting does not; a bare flush while one runs fails."""
    snap = write_snapshot(tmp_path / "v2", {"model.embed": b"\x01" * 64})
    server = driver.launch(spec(10, Role.COLOCATED))
    driver.wait_ready(server, 60)
    client = ServerClient(server.endpoint, fence=1)
    t, box = in_background(generate, server, 50000)
    deadline = time.monotonic() + 10
    while client.is_idle():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(DriverError, match="400: Flush cache failed"):
        client.flush_cache()
    client.pause_generation("in_place")
    with pytest.raises(DriverError, match="Weights were updated, but the cache was not flushed"):
        client.update_weights_from_disk(str(snap), weight_version=2)
    assert client.model_info()["weight_version"] == "2"  # as SGLang: the weights moved, the flush did not
    client.continue_generation()
    client.pause_generation("retract")
    assert client.update_weights_from_disk(str(snap), weight_version=3)["success"]
    assert client.flush_cache().startswith("Cache flushed")
    client.pause_generation("abort")
    client.continue_generation()
    t.join(30)
    assert box["result"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_flip_to_decode_is_told_the_memory_of_the_decode_graphs_it_will_capture(driver):
    """As SGLang: a server that never captured decode graphs needs `decode_cuda_graph_memory_gb` (what a
    decode peer reports) and room for it; once captured, a flip back needs nothing."""
    prefill = driver.launch(spec(11, Role.PREFILL))
    decode = driver.launch(spec(12, Role.DECODE))
    driver.wait_ready(prefill, 60)
    driver.wait_ready(decode, 60)
    client = ServerClient(prefill.endpoint, fence=1)
    assert client.graph_memory_gb() == 0.0 and ServerClient(decode.endpoint).graph_memory_gb() == 2.0
    with pytest.raises(DriverError, match="400: decode_cuda_graph_memory_gb is required"):
        client.pd_role_switch("decode")
    with pytest.raises(DriverError, match="400: insufficient decode CUDA graph headroom"):
        client.pd_role_switch("decode", decode_cuda_graph_memory_gb=80.0)
    assert client.model_info()["disaggregation_mode"] == "prefill"
    client.pd_role_switch("decode", decode_cuda_graph_memory_gb=ServerClient(decode.endpoint).graph_memory_gb())
    assert client.graph_memory_gb() == 2.0
    client.pd_role_switch("prefill")
    client.pd_role_switch("decode")  # its graphs were captured on the first flip
    assert client.model_info()["disaggregation_mode"] == "decode"


def test_weights_released_without_a_cpu_backup_come_back_uninitialised(tmp_path):
    """As SGLang's memory saver: without `--enable-weights-cpu-backup` a release and resume of the
    weights leaves their memory uninitialised (the reported checksum says so); pearl's drivers always
    ask for the backup."""
    snap = write_snapshot(tmp_path / "v1", {"model.embed": b"\x01" * 64})
    plain = SimDriver(tmp_path / "run", speed=SPEED, extra_args=("--enable-memory-saver",))
    try:
        server = plain.launch(spec(13, Role.COLOCATED, weights=WeightsRef(1, str(snap))))
        plain.wait_ready(server, 60)
        client = ServerClient(server.endpoint, fence=1)
        before = client.model_info()["weights_checksum"]
        client.release_memory_occupation()
        client.resume_memory_occupation()
        assert before is not None and client.model_info()["weights_checksum"] == "uninitialised"
    finally:
        plain.stop(13, grace_s=5)
    backed = SimDriver(tmp_path / "run2", speed=SPEED)
    try:
        server = backed.launch(spec(14, Role.COLOCATED, overlap=True, weights=WeightsRef(1, str(snap))))
        backed.wait_ready(server, 60)
        client = ServerClient(server.endpoint, fence=1)
        before = client.model_info()["weights_checksum"]
        client.release_memory_occupation()
        client.resume_memory_occupation()
        assert client.model_info()["weights_checksum"] == before
    finally:
        backed.stop(14, grace_s=5)


def test_with_an_admin_key_commands_need_it_and_reads_and_generation_do_not(tmp_path):
    """As SGLang with `--admin-api-key`: every command without the bearer token is refused (401) and
    changes nothing; reads, health and generation stay open; the key reaches the server from a file."""
    key = "k" * 64
    guarded = SimDriver(tmp_path / "run", speed=SPEED, admin_api_key=key)
    assert key not in " ".join(guarded.command(spec(15, Role.PREFILL), 1, 2)[0])
    try:
        server = guarded.launch(spec(15, Role.PREFILL))
        guarded.wait_ready(server, 60)
        with pytest.raises(DriverError, match="401: Unauthorized"):
            ServerClient(server.endpoint, fence=1).pause_generation("abort")
        with pytest.raises(DriverError, match="401: Unauthorized"):
            ServerClient(server.endpoint, fence=1, token="x" * 64).pd_role_switch("decode", 2.0)
        reader = ServerClient(server.endpoint)
        assert reader.model_info()["disaggregation_mode"] == "prefill" and reader.health() and reader.is_idle()
        assert generate(server, 3)["status"] != 401  # (a prefill server alone refuses it for want of a decode half)
        owner = ServerClient(server.endpoint, fence=1, token=key)
        owner.pd_role_switch("decode", decode_cuda_graph_memory_gb=2.0)
        assert reader.model_info()["disaggregation_mode"] == "decode"
    finally:
        guarded.stop(15, grace_s=5)


def test_a_command_needs_a_fence_and_one_beyond_any_step_is_refused(driver):
    """A command without `X-Pearl-Fence`, or with one no database sequence gave (2^63-1 used to raise the
    floor so that every later claim got 409), is refused and changes nothing."""
    server = driver.launch(spec(16, Role.PREFILL, fence=3))
    driver.wait_ready(server, 60)
    with pytest.raises(DriverError, match="400: X-Pearl-Fence: required"):
        ServerClient(server.endpoint).pd_role_switch("decode", 2.0)
    with pytest.raises(DriverError, match="400: X-Pearl-Fence: between 0 and 2\\^53"):
        ServerClient(server.endpoint, fence=2**63 - 1).pd_role_switch("decode", 2.0)
    assert ServerClient(server.endpoint).model_info()["disaggregation_mode"] == "prefill"
    ServerClient(server.endpoint, fence=4).pd_role_switch("decode", decode_cuda_graph_memory_gb=2.0)  # a claim's
    assert ServerClient(server.endpoint).model_info()["disaggregation_mode"] == "decode"
