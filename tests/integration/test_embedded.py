"""With no service URLs, `pearlctl` runs a real PostgreSQL and Redis under PEARL_HOME, reused across
invocations; with the URLs set, nothing embedded starts."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from plan_support import PEARLCTL, REPO

pytestmark = pytest.mark.integration

PAPER = REPO / "sim" / "inventories" / "paper-32-h800.yaml"


@pytest.fixture
def embedded_home() -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh PEARL_HOME (outside pytest's temp root, which pytest may make unreadable) and an
    environment with no service URLs; its servers are stopped afterwards."""
    home = Path(tempfile.mkdtemp(prefix="pearl-test-home-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEARL_")}
    env["PEARL_HOME"] = str(home)
    try:
        yield home, env
    finally:
        subprocess.run([str(PEARLCTL), "db", "stop"], env=env, capture_output=True, timeout=60)
        shutil.rmtree(home, ignore_errors=True)


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PEARLCTL), *args], env=env, capture_output=True, text=True, timeout=120)


def test_embedded_servers_start_once_and_serve_the_whole_workflow(embedded_home) -> None:
    home, env = embedded_home
    assert json.loads(run(env, "db", "status", "--json").stdout)["postgresql"]["running"] is False

    assert run(env, "init").returncode == 0
    first = json.loads(run(env, "db", "status", "--json").stdout)["postgresql"]
    assert first["running"] and first["embedded"] and first["data_dir"] == str(home / "pg")

    imported = run(env, "cluster", "import", str(PAPER), "--json")
    assert imported.returncode == 0, imported.stderr
    status = json.loads(run(env, "status", "--json").stdout)
    assert status["gpus"]["by_zone"] == {"preemptible": 12, "rollout": 4, "training": 16}
    # reused, not restarted
    assert json.loads(run(env, "db", "status", "--json").stdout)["postgresql"]["pid"] == first["pid"]

    url = run(env, "db", "url")
    assert url.stdout.strip() == f"postgresql://postgres@/pearl?host={home / 'pg'}"
    broker = run(env, "db", "url", "--broker")
    assert broker.stdout.strip() == f"redis+socket://{home / 'redis' / 'redis.sock'}"
    both = json.loads(run(env, "db", "status", "--json").stdout)
    assert both["redis"]["running"] and both["redis"]["embedded"]

    stopped = json.loads(run(env, "db", "stop", "--json").stdout)
    assert stopped == {"stopped": {"postgresql": True, "redis": True}}
    after = json.loads(run(env, "db", "status", "--json").stdout)
    assert not after["postgresql"]["running"] and not after["redis"]["running"]
    # `db start` brings both back, and the data outlived the server
    started = json.loads(run(env, "db", "start", "--json").stdout)
    assert started["postgresql"]["running"] and started["postgresql"]["embedded"]
    assert started["redis"]["running"] and started["redis"]["embedded"]
    again = json.loads(run(env, "status", "--json").stdout)
    assert again["state_version"] == status["state_version"]
    assert json.loads(run(env, "db", "status", "--json").stdout)["postgresql"]["pid"] == started["postgresql"]["pid"]


def test_configured_urls_start_nothing_embedded(embedded_home, database_url: str, broker_url: str) -> None:
    home, env = embedded_home
    env = {**env, "PEARL_DATABASE_URL": database_url, "PEARL_BROKER_URL": broker_url}
    assert run(env, "init").returncode == 0
    assert run(env, "cluster", "import", str(PAPER)).returncode == 0
    status = json.loads(run(env, "db", "status", "--json").stdout)
    assert status["postgresql"]["embedded"] is False and status["postgresql"]["running"] is True
    assert status["redis"]["embedded"] is False and status["redis"]["running"] is True
    assert run(env, "db", "url", "--broker").stdout.strip() == broker_url
    assert not (home / "pg").exists() and not (home / "redis").exists()


def test_broker_fixture_is_a_real_redis(broker_url: str) -> None:
    import redis
    from pearl.controlplane.services.embedded import broker_answers

    assert broker_answers(broker_url)
    parts = urlsplit(broker_url)
    client = (redis.Redis(unix_socket_path=parts.path) if parts.scheme == "redis+socket"
              else redis.Redis.from_url(broker_url))
    client.set("pearl-test", "ok")
    assert client.get("pearl-test") == b"ok"
    client.close()


def test_embedded_servers_restart_within_one_process(embedded_home) -> None:
    from pearl.controlplane.services.embedded import (
        broker_answers,
        start_postgres,
        start_redis,
        stop_postgres,
        stop_redis,
    )
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    home, _ = embedded_home
    for _ in range(2):
        url = start_postgres(home)
        assert start_postgres(home) == url  # reused
        engine = create_engine(url, poolclass=NullPool)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_database()")).scalar() == "pearl"
        engine.dispose()
        broker = start_redis(home)
        assert broker_answers(broker)
        assert stop_postgres(home) and stop_redis(home)
        assert not stop_postgres(home) and not stop_redis(home)


def test_concurrent_inits_on_a_fresh_home_all_succeed(embedded_home) -> None:
    """Three `pearlctl init --json` at once on a fresh PEARL_HOME: one starts the embedded servers
    (under a file lock), the others wait and reuse them; each prints its JSON and exits 0."""
    home, env = embedded_home
    for round_ in range(2):
        if round_:  # a fresh home again: initdb and the first start race the hardest
            assert run(env, "db", "stop").returncode == 0
            shutil.rmtree(home / "pg")
        procs = [subprocess.Popen([str(PEARLCTL), "init", "--json"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(3)]
        outcomes = []
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=180)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            outcomes.append((proc.returncode, out, err))
        for code, out, err in outcomes:
            assert code == 0, err
            assert "Traceback" not in err
            assert json.loads(out)["revision"] is not None
        assert len({json.loads(out)["revision"] for _, out, _ in outcomes}) == 1  # all at the head
        assert json.loads(run(env, "db", "status", "--json").stdout)["postgresql"]["running"]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root creates the server's system user")
def test_servers_starting_together_as_root_create_the_system_user_once() -> None:
    """Six starts released at once each ensure the user the embedded server runs as, on a machine
    without it (a fresh name stands in for `pgserver`): all see the one uid the user ends with and
    none fails. Unlocked, they raced `useradd`: errors, and uids the user no longer had. (Threads
    race as processes do: each opens the lock file, and a flock excludes other open files.)"""
    from concurrent.futures import ThreadPoolExecutor

    from pearl.controlplane.services.embedded import ensure_server_user

    name = f"pearl-t{os.getpid() % 100000}"
    go = threading.Barrier(6)

    def start(_: int) -> int | None:
        go.wait()
        return ensure_server_user(name)

    try:
        with ThreadPoolExecutor(6) as pool:
            uids = list(pool.map(start, range(6)))
        assert set(uids) == {pwd.getpwnam(name).pw_uid}
    finally:
        subprocess.run(["userdel", name], capture_output=True)
