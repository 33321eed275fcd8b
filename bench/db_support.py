"""PostgreSQL for the benchmarks that touch the database (step_claims, plan_graph, tick_latency).

`BenchServer` is an embedded server of the benchmark's own (pgserver, in a temporary directory, with
`max_connections` raised and restarted), or the server of `--database-url` (a maintenance database,
e.g. postgresql://postgres@127.0.0.1:5432/postgres). Pearl databases are migrated once into a
template and cloned (`CREATE DATABASE ... TEMPLATE`), so a fresh fleet costs a copy, not a migration.
Every database it creates is dropped on `close()`; an embedded server is stopped and removed.

Also the small statistics every benchmark prints: percentiles in milliseconds, and the machine.
"""

from __future__ import annotations

import itertools
import os
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np
import psycopg
from pearl.controlplane.services.embedded import start_postgres, stop_postgres
from pearl.controlplane.services.settings import normalise_database_url
from pearl.controlplane.store.db import make_engine, upgrade
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

REPO = Path(__file__).resolve().parents[1]


def psycopg_url(url: str) -> str:
    """A libpq URL (what psycopg.connect takes) for a SQLAlchemy URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class BenchServer:
    """One PostgreSQL server for a benchmark run (module docstring)."""

    def __init__(self, database_url: str | None = None, *, max_connections: int = 400) -> None:
        self.home: Path | None = None
        self._names = itertools.count()
        self._created: list[str] = []
        self._template: str | None = None
        if database_url:
            self.url = normalise_database_url(database_url)
        else:
            self.home = Path(tempfile.mkdtemp(prefix="pearl-bench-pg-"))
            os.chmod(self.home, 0o755)  # under root the server runs as another user and must reach its data
            self.url = start_postgres(self.home)
            with psycopg.connect(psycopg_url(self.url), autocommit=True) as conn:
                conn.execute(f"ALTER SYSTEM SET max_connections = {int(max_connections)}")
            stop_postgres(self.home)
            self.url = start_postgres(self.home)
        self.admin = create_engine(self.url, isolation_level="AUTOCOMMIT", poolclass=NullPool)

    def with_database(self, name: str) -> str:
        return make_url(self.url).set(database=name).render_as_string(hide_password=False)

    def settings(self) -> dict[str, str | bool]:
        with self.admin.connect() as conn:
            show = {k: conn.execute(text(f"SHOW {k}")).scalar() for k in (
                "server_version", "max_connections", "shared_buffers", "fsync", "synchronous_commit")}
        return {"embedded": self.home is not None, **show}

    def _new_name(self, prefix: str) -> str:
        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        self._created.append(name)
        return name

    def empty_database(self, prefix: str = "bench") -> str:
        """A new database with no schema; its URL."""
        name = self._new_name(prefix)
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        return self.with_database(name)

    def pearl_database(self, prefix: str = "bench_pearl") -> str:
        """A new database at pearl's schema head (a clone of the migrated template); its URL."""
        if self._template is None:
            url = self.empty_database("bench_template")
            engine = make_engine(url, poolclass=NullPool)
            upgrade(engine)
            engine.dispose()
            self._template = make_url(url).database
        name = self._new_name(prefix)
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{self._template}"'))
        return self.with_database(name)

    def clone(self, url: str, prefix: str = "bench_copy") -> str:
        """A copy of the database of `url` (no other connection may be open on it)."""
        source = make_url(url).database
        name = self._new_name(prefix)
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{source}"'))
        return self.with_database(name)

    def drop(self, url: str) -> None:
        name = make_url(url).database
        with self.admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        if name in self._created:
            self._created.remove(name)

    def engine(self, url: str, **kwargs) -> Engine:
        return make_engine(url, **kwargs)

    def close(self) -> None:
        try:
            with self.admin.connect() as conn:
                for name in reversed(self._created):
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            self._created.clear()
            self.admin.dispose()
            if self.home is not None:
                stop_postgres(self.home)
                shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> BenchServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def ms(xs: list[float] | np.ndarray) -> dict[str, float | int]:
    """p50, p99 and the spread (p10..p90, max) of durations in seconds, in milliseconds."""
    a = np.asarray(xs, dtype=float) * 1e3
    if a.size == 0:
        return {"n": 0}
    p10, p50, p90, p99 = np.percentile(a, [10, 50, 90, 99])
    return {"n": int(a.size), "p50_ms": round(float(p50), 3), "p99_ms": round(float(p99), 3),
            "p10_ms": round(float(p10), 3), "p90_ms": round(float(p90), 3), "max_ms": round(float(a.max()), 3)}


def machine() -> dict[str, object]:
    return {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
            "python": platform.python_version(), "psycopg": psycopg.__version__}
